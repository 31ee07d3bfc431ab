"""Compact gold / H-KL's student-side kernel (payload form ``gold_topk``): the loss of
:func:`definitions.formulas.gold_topk_kl` from the block's summed logits / T and
log-partitions, vocabulary-parallel like :class:`~kernels.gold.GoldKernel`, whose pieces it
takes: the chunk means on all M common pairs (summed over TP) and the n largest uncommon ones
(each rank's n largest merged over TP). The student's bucket (its mass on the common pairs off
the teacher's top k) and its uncommon tail (ranks k'..n-1) are computed exactly from them; the
gradient is written directly for the forward KL at one TP rank (:meth:`_forward_kl`: no autograd
graph over the [rows, V] means), autograd's through :meth:`kl` elsewhere (the plan
differentiates it).
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import Raw, rows_of
from megatron_xdistill.loss.collectives import Group, group_size
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
        """The forward KL at one TP rank: value and gradient from :meth:`_forward_kl`."""
        return self.beta == 0.0 and group_size(self.tp_group) == 1

    def _forward_kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                    weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, Raw | None]:
        """(KL, top-1, d(sum_r weight_r KL_r) / d raw or None) of the forward KL at one TP rank,
        the value by :func:`gold_topk_kl`. With a = (x - lz) / count the chunk means: dKL/da is
        -p_j on the teacher's top k pairs, -p_rest exp(a_j - a_rest) on each bucket pair (a_rest
        the bucket's logsumexp), sign(s_j - t_j) s_j on the uncommon ranks j < k' (s = e^a of the
        n largest uncommon means) and sign(sum_{j >= k'} s_j - t_tail) s_j on the ranks past k';
        dKL/dx = dKL/da / count, dKL/dlz = -(the row's sum)."""
        x, p = raw["x"], self.payload
        rows = x.shape[0]
        a_common, top, at = self._forward_means(raw, counts)
        s_sorted = top.exp()
        cols = rows_of(p.columns, keys)
        b_top = rows_of(p.logprobs, keys).to(x.dtype)
        b_rest = rows_of(p.tail_logprob, keys).to(x.dtype)
        t_head = rows_of(p.uncommon_probs, keys).to(x.dtype)
        t_tail = rows_of(p.uncommon_tail, keys).to(x.dtype)
        kl = gold_topk_kl(a_common, cols, b_top, b_rest, s_sorted, t_head, t_tail, 0.0)
        top1 = (a_common.argmax(-1) == cols[:, 0] if self.num_common and cols.shape[1]
                else torch.zeros(rows, dtype=torch.bool, device=x.device))
        if weight is None:
            return kl, top1, None
        scale = (weight.to(x.dtype).expand(rows) / counts.to(x.dtype))[:, None]
        g_common = torch.zeros_like(a_common)
        if cols.shape[1] < self.num_common:  # the bucket: softmax of a over its pairs
            off = a_common.scatter(1, cols, float("-inf"))
            g_common = off.sub_(off.logsumexp(-1, keepdim=True)).exp_().mul_(-b_rest.exp()[:, None])
        g_common.scatter_(1, cols, b_top.exp().neg_())
        head = t_head.shape[1]
        g_sorted = s_sorted.clone()
        g_sorted[:, :head].mul_((s_sorted[:, :head] - t_head).sign_())
        g_sorted[:, head:].mul_((s_sorted[:, head:].sum(-1) - t_tail).sign_()[:, None])
        return kl, top1, self._grad_from_means(x, g_common.mul_(scale), g_sorted.mul_(scale), at)

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._by_torch(raw["x"]) and not any(v.requires_grad for v in raw.values()):
            kl, agree, _ = self._forward_kl(raw, keys, counts)
            return kl, (agree if top1 else None)
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
