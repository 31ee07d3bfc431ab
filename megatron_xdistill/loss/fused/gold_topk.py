"""Compact gold / H-KL (payload form ``gold_topk``) of a row group by :mod:`gpu.triton_gold`'s
kernels: :class:`fused.gold.GoldPass`'s passes with the common and uncommon parts of
:func:`definitions.formulas.gold_topk_kl`.

Common part, per chunk row with a = (s - sum lse) / count on the student's common columns: the
divergence on the teacher's top k pairs (each held by one TP rank, summed over TP) plus, where k
< M, the bucket's: the student's a_rest = logsumexp of a over the other pairs (each rank's
(max, sum of exp(a - max)) over its pairs, combined over TP) against the teacher's log-mass
there. Its gradient on a: the divergence's slope on each top pair, and on each bucket pair the
bucket's slope times d a_rest / d a = exp(a - a_rest). The top pairs are marked per row in an
[M] scratch (the whole-row kernel stamps them with the row's number, so it is never cleared).

Uncommon part: the full form's radix select of the student's n largest uncommon probabilities,
the list sorted, then |s_j - t_j| on ranks j < k' and |sum_{k' <= j < n} s_j - t_tail| for the
tail; its gradient sign(s_j - t_j) s_j in the head and sign(tail difference) s_j in the tail.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.collectives import Group, all_reduce
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.fused.gold import GoldPass
from megatron_xdistill.loss.fused.layout import beta_kind


class CompactGoldPass(GoldPass):
    """Gold / H-KL from the compact payload (see the module docstring)."""

    def __init__(self, payload: TeacherPayload, pair: torch.Tensor, pair_col: torch.Tensor,
                 num_common: int, num_real: int, num_uncommon: int, beta: float,
                 tp_group: Group, cp_group: Group) -> None:
        """As :class:`GoldPass`; ``num_uncommon`` is the payload's span n (the student's
        sorted uncommon ranks), of which the payload carries the teacher's first k'."""
        spec = payload.spec
        if spec.form != "gold_topk":
            raise ValueError(f"CompactGoldPass takes a gold_topk payload, not {spec.form!r}")
        super().__init__(payload, pair, pair_col, num_common, num_real, num_uncommon, beta,
                         tp_group, cp_group)
        dev, rows = pair_col.device, payload.has_teacher.numel()
        self.k = spec.width
        self.bucket = self.k < self.num_common
        # at least one column: a pointer for the kernels where k or k' is 0
        self.top = torch.zeros(rows, max(self.k, 1), dtype=torch.int32, device=dev)
        self.top[:, : self.k] = payload.columns.reshape(rows, self.k)
        if self.k == 0:
            self.logprobs = torch.zeros(rows, 1, dtype=torch.float32, device=dev)
        self.rest = payload.tail_logprob.reshape(rows).float().contiguous()
        self.head = spec.uncommon
        head = torch.zeros(rows, max(self.head, 1), dtype=torch.float32, device=dev)
        head[:, : self.head] = payload.uncommon_probs.reshape(rows, self.head)
        self.teacher_sorted = head
        self.teacher_tail = payload.uncommon_tail.reshape(rows).float().contiguous()
        self.pair_at = torch.full((max(self.num_common, 1),), -1, dtype=torch.int32, device=dev)
        self.pair_at[self.pair] = self.pair_col.to(torch.int32)
        self.teacher_best = self.top[:, 0].long()  # the teacher's first column is its argmax

    def row_bytes(self) -> int:
        """:meth:`GoldPass.row_bytes` and the [M] marks of the teacher's top pairs."""
        return super().row_bytes() + 4 * self.num_common

    def _marks(self, n_rows: int, dev: torch.device) -> torch.Tensor:
        return torch.zeros(n_rows, max(self.num_common, 1), dtype=torch.int32, device=dev)

    def _compact_args(self, programs: int, like: torch.Tensor) -> tuple[tuple, dict]:
        stamp = self._marks(programs, like.device)
        return ((self.top, self.top.stride(0), self.k, self.rest, self.pair_at, stamp,
                 stamp.stride(0), self.head, self.teacher_tail),
                {"COMPACT": True, "BUCKET": self.bucket})

    def _common_step(self, s, lsum, count, keys, h, grad: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The top pairs' divergence and the bucket's, summed over TP as the module docstring
        says; the first pair holding the student's largest common mean."""
        from megatron_xdistill.loss.gpu import triton_gold

        n_rows, dev = s.shape[0], s.device
        value = torch.empty(n_rows, dtype=torch.float64, device=dev)
        best = torch.empty(n_rows, dtype=torch.float32, device=dev)
        best_at = torch.empty(n_rows, dtype=torch.int32, device=dev)
        high = torch.empty(n_rows, dtype=torch.float32, device=dev)
        acc = torch.empty(n_rows, dtype=torch.float32, device=dev)
        stamp = self._marks(n_rows, dev)
        n_pairs, kind = int(self.pair.numel()), beta_kind(self.beta)
        triton_gold.top_pairs[(n_rows,)](
            s, s.stride(0), lsum, count, keys, self.top, self.top.stride(0), self.k,
            self.logprobs, self.logprobs.stride(0), self.pair_at, self.pair_col, self.pair,
            n_pairs, stamp, stamp.stride(0), h, h.stride(0), value, best, best_at, high, acc,
            float(self.beta), BETA_KIND=kind, GRAD=grad, BLOCK=self._pair_block())
        all_reduce(value, self.tp_group)
        best_at = self._first_best(best, best_at)
        if self.bucket:  # logsumexp over TP of each rank's (max, sum of exp(a - max))
            top = all_reduce(high.clone(), self.tp_group, "max")
            part = torch.where(high > float("-inf"), acc * torch.exp(high - top),
                               torch.zeros_like(acc))
            a_rest = (top + all_reduce(part, self.tp_group).log()).contiguous()
            bucket = torch.empty(n_rows, dtype=torch.float64, device=dev)
            triton_gold.bucket_terms[(n_rows,)](
                s, s.stride(0), lsum, count, keys, self.rest, a_rest, self.pair_col, self.pair,
                n_pairs, stamp, stamp.stride(0), h, h.stride(0), bucket, float(self.beta),
                BETA_KIND=kind, GRAD=grad, BLOCK=self._pair_block())
            value += bucket  # the same on every TP rank
        return value, best_at


__all__ = ["CompactGoldPass"]
