"""Compact gold / H-KL's student-side kernel (payload form ``gold_topk``): the loss of
:func:`definitions.formulas.gold_topk_kl` from the block's summed logits / T and
log-partitions, vocabulary-parallel like :class:`~kernels.gold.GoldKernel`, whose pieces it
takes: the chunk means on all M common pairs (summed over TP) and the n largest uncommon ones
(each rank's n largest merged over TP). The student's bucket (its mass on the common pairs off
the teacher's top k) and its uncommon tail (ranks k'..n-1) are computed exactly from them; the
gradient is autograd's through :meth:`kl` (the plan differentiates it), on every device and
layout alike.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import Raw, rows_of
from megatron_xdistill.loss.collectives import Group
from megatron_xdistill.loss.definitions.formulas import gold_topk_kl
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.kernels.gold import GoldKernel


class CompactGoldKernel(GoldKernel):
    """Gold / H-KL from the compact payload: the teacher's top k common pairs + a bucket, its
    top k' sorted uncommon probabilities + a tail, against the student's exact counterparts."""

    def __init__(self, payload: TeacherPayload, common_student: torch.Tensor, vocab_start: int,
                 num_real: int, beta: float, tp_group: Group) -> None:
        """``common_student``: the student side of the payload's ``spec.pairs`` common pairs;
        the student sorts its ``spec.span`` largest uncommon probabilities (-inf pads a
        vocabulary with fewer)."""
        super().__init__(payload, common_student, vocab_start, num_real, payload.spec.span,
                         beta, tp_group)

    # GoldKernel's CPU passes and direct gradients serve the full payload only.
    def _by_runs(self, like: torch.Tensor) -> bool:
        return False

    def _by_rows(self, x: torch.Tensor) -> bool:
        return False

    def _by_torch(self, x: torch.Tensor) -> bool:
        return False

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        p = self.payload
        a_common = self.common_means(raw, counts)
        s_sorted = self.sorted_uncommon(raw, counts).exp()
        cols = rows_of(p.columns, keys)
        kl = gold_topk_kl(a_common, cols, rows_of(p.logprobs, keys).to(a_common.dtype),
                          rows_of(p.tail_logprob, keys), s_sorted,
                          rows_of(p.uncommon_probs, keys).to(s_sorted.dtype),
                          rows_of(p.uncommon_tail, keys).to(s_sorted.dtype), self.beta)
        if not top1:
            return kl, None
        if self.num_common and cols.shape[1]:  # the teacher's first column is its argmax
            return kl, a_common.argmax(-1) == cols[:, 0]
        return kl, torch.zeros(kl.shape[0], dtype=torch.bool, device=kl.device)


__all__ = ["CompactGoldKernel"]
