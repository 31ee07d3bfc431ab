"""Gold / H-KL of a row group by :mod:`gpu.triton_gold`'s kernels.

Per chunk row: the summed logits / T of its positions on this shard, s [V_real], and the sum of
their log-partitions; the chunk-mean log-probs are a = (s - sum lse) / count. The divergence on
the common pairs is summed over TP. The uncommon term needs the n largest of exp(a) over the
uncommon columns of every TP shard: a radix select finds the n-th largest value with four
histograms of 256 bins (each summed over TP), each shard compacts its values above it (and its
share of the ties, in rank order) into its slots of a list of n, the lists are summed over TP, and
every rank sorts the same list against the teacher's sorted probabilities. The gradient on a,
h, is the divergence's on the common columns and sign(s_k - t_k) s_k on the selected ones;
:func:`gpu.triton_rows.chunk_gradient` writes (h - p sum h) / (T count) from it.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.collectives import (
    Group,
    all_gather,
    all_reduce,
    group_rank,
    group_size,
)
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.fused.layout import (
    GradientTarget,
    RowGroup,
    RowLayout,
    beta_kind,
    column_tile,
    next_pow2,
    whole_row_programs,
)

_INT_MAX = 2147483647


#: one TP rank, rows held whole: every step of a row in one persistent kernel (tests turn it
#: off to run the one-step kernels alike)
WHOLE_ROWS = True



class GoldPass:
    """Gold / H-KL's passes over row groups (see the module docstring)."""

    #: what :class:`fused.call.FusedCall` gives the passes: each row's summed log-partitions
    #: (the gold forms' chunk means), not the exact form's per-position ones and <p, h> scratch
    image = False

    def __init__(self, payload: TeacherPayload, pair: torch.Tensor, pair_col: torch.Tensor,
                 num_common: int, num_real: int, num_uncommon: int, beta: float,
                 tp_group: Group, cp_group: Group) -> None:
        """``pair`` / ``pair_col``: the common pairs whose student token is on this shard (pair
        index, local column), as :class:`kernels.gold.GoldKernel` finds them."""
        dev = pair_col.device
        self.payload, self.num_real, self.n = payload, num_real, int(num_uncommon)
        self.beta, self.tp_group, self.cp_group = beta, tp_group, cp_group
        self.num_common = int(num_common)
        self.pair = pair.contiguous()
        self.pair_col = pair_col.contiguous()
        self.is_common = torch.zeros(max(num_real, 1), dtype=torch.int8, device=dev)
        self.is_common[self.pair_col] = 1
        rows = payload.has_teacher.numel()
        self.logprobs = payload.logprobs.reshape(rows, payload.spec.width).float().contiguous()
        unc = payload.uncommon_probs.reshape(rows, payload.spec.uncommon)
        self.teacher_sorted = unc[:, : self.n].float().contiguous()
        #: the sorted uncommon probabilities the loss compares one by one (here all n); the
        #: teacher's sum of the others (None: none)
        self.head, self.teacher_tail = self.n, None
        self.teacher_best = (self.logprobs.argmax(1) if self.num_common
                             else torch.zeros(rows, dtype=torch.int64, device=dev))

    def row_bytes(self) -> int:
        """fp32 bytes a row of a group holds: s and h on V_real, the list of n with its
        columns and gradient."""
        return 4 * (2 * self.num_real + 3 * self.n + 512)

    def run(self, x: torch.Tensor, scale: float, lse_sum: torch.Tensor, layout: RowLayout,
            group: RowGroup, target: GradientTarget | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL [g] float64, top-1 [g] bool) of ``group``; with a ``target`` the gradient of its
        rows' positions written there. ``lse_sum`` [R + 1]: each row's summed TP-wide
        log-partitions. One TP rank and rows held whole: every step of a row in one persistent
        kernel (:func:`gpu.triton_gold.gold_rows`); else a kernel a step with the TP / CP sums
        between them."""
        if WHOLE_ROWS and group_size(self.tp_group) == 1 and not group.split:
            return self._whole_rows(x, scale, lse_sum, layout, group, target)
        return self._by_steps(x, scale, lse_sum, layout, group, target)

    def _whole_rows(self, x, scale, lse_sum, layout, group, target):
        from megatron_xdistill.loss.gpu import triton_gold

        n_rows, dev, n = group.size, x.device, self.n
        programs = whole_row_programs(dev, n_rows)
        s = torch.empty(programs, self.num_real, dtype=torch.float32, device=dev)
        grad = target is not None
        h = torch.empty_like(s) if grad else s
        values = torch.zeros(programs, max(n, 1), dtype=torch.float32, device=dev)
        cols = torch.zeros(programs, max(n, 1), dtype=torch.int32, device=dev)
        slots = torch.zeros(programs, max(n, 1), dtype=torch.float32, device=dev)
        kl = torch.empty(n_rows, dtype=torch.float64, device=dev)
        best_at = torch.empty(n_rows, dtype=torch.int32, device=dev)
        lsum = lse_sum.index_select(0, group.rows).float()
        count = group.count.float().contiguous()
        lse = target.lse if grad else lsum
        out = target.out if grad else x
        coef = self.coefficient(target.kd_weight, group, target.temperature) if grad else lsum
        ce = (target.ce_coef, target.label, target.lse1) if grad else (lsum, lsum, lsum)
        block = column_tile(self.num_real)
        compact, constants = self._compact_args(programs, lsum)
        triton_gold.gold_rows[(programs,)](
            x, x.stride(0), layout.first, layout.length, group.rows, group.keys, count, lsum,
            n_rows, self.num_real, float(scale), s, s.stride(0), h, h.stride(0), values, cols,
            slots, self.logprobs, self.logprobs.stride(0), self.pair_col, self.pair,
            int(self.pair.numel()), self.is_common, self.teacher_sorted,
            self.teacher_sorted.stride(0), n, kl, best_at, lse, out, out.stride(0),
            out.shape[1], coef, *ce, float(self.beta), *compact, BETA_KIND=beta_kind(self.beta),
            GRAD=grad, CE=grad and target.has_ce, CE_OWN=grad and target.ce_own, BLOCK=block,
            PAIR_BLOCK=self._pair_block(), LIST_BLOCK=next_pow2(max(n, 1)), **constants)
        return kl, self._top1(best_at, group.keys)

    def _compact_args(self, programs: int, like: torch.Tensor) -> tuple[tuple, dict]:
        """:func:`gpu.triton_gold.gold_rows`' arguments of the compact payload (here unused
        placeholders) and its constants."""
        return ((self.logprobs, 0, 0, like, self.pair_col, self.is_common, 0, self.n, like),
                {"COMPACT": False, "BUCKET": False})

    def _pair_block(self) -> int:
        return min(1024, next_pow2(max(int(self.pair.numel()), 16)))

    def _top1(self, best_at: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Whether the student's first largest common mean is at the teacher's best pair."""
        if not self.num_common:
            return torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        return best_at.long() == self.teacher_best.index_select(0, keys)

    def _first_best(self, best: torch.Tensor, best_at: torch.Tensor) -> torch.Tensor:
        """The first pair holding the largest common mean over TP (each rank's own given)."""
        top = all_reduce(best.clone(), self.tp_group, "max")
        best_at = torch.where(best == top, best_at, _INT_MAX).neg_()
        return all_reduce(best_at, self.tp_group, "max").neg_()

    def _by_steps(self, x, scale, lse_sum, layout, group, target):
        from megatron_xdistill.loss.gpu import triton_gold

        grad = target is not None
        n_rows, dev = group.size, x.device
        block = column_tile(self.num_real)
        s = torch.empty(n_rows, self.num_real, dtype=torch.float32, device=dev)
        triton_gold.chunk_logit_sums[(n_rows,)](
            x, x.stride(0), layout.first, layout.length, group.rows, self.num_real,
            float(scale), s, s.stride(0), BLOCK=block)
        lsum = lse_sum.index_select(0, group.rows).float()
        if group.split:  # the positions of the other CP ranks
            all_reduce(s, self.cp_group)
            all_reduce(lsum, self.cp_group)
        count = group.count.float().contiguous()
        keys = group.keys
        h = torch.zeros(n_rows, self.num_real + 1, dtype=torch.float32, device=dev) if grad \
            else s  # the last column takes the other ranks' slots' scatter
        kl, best_at = self._common_step(s, lsum, count, keys, h, grad)
        top1 = self._top1(best_at, keys)
        if self.n:
            l1, slots, cols = self._uncommon(s, lsum, count, keys, n_rows, block, grad)
            kl = kl + l1
            if grad:
                h.scatter_(1, torch.where(cols >= 0, cols, self.num_real).long(), slots)
        if grad:
            h = h[:, : self.num_real]
            hsum = all_reduce(h.sum(1), self.tp_group)
            coef = self.coefficient(target.kd_weight, group, target.temperature)
            target.write(group, h, coef, image=False, hsum=hsum)
        return kl, top1

    def _common_step(self, s, lsum, count, keys, h, grad: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the divergence on the common pairs [g] float64, summed over TP; the first pair
        holding the student's largest common mean), its gradient into ``h``."""
        from megatron_xdistill.loss.gpu import triton_gold

        n_rows, dev = s.shape[0], s.device
        common = torch.empty(n_rows, dtype=torch.float64, device=dev)
        best = torch.empty(n_rows, dtype=torch.float32, device=dev)
        best_at = torch.empty(n_rows, dtype=torch.int32, device=dev)
        n_pairs = int(self.pair.numel())
        if n_pairs:
            triton_gold.common_divergence[(n_rows,)](
                s, s.stride(0), lsum, count, keys, self.logprobs, self.logprobs.stride(0),
                self.pair_col, self.pair, n_pairs, h, h.stride(0), common, best, best_at,
                float(self.beta), BETA_KIND=beta_kind(self.beta), GRAD=grad,
                BLOCK=min(1024, next_pow2(n_pairs)))
        else:
            common.zero_()
            best.fill_(float("-inf"))
            best_at.fill_(_INT_MAX)
        return all_reduce(common, self.tp_group), self._first_best(best, best_at)

    def _uncommon(self, s, lsum, count, keys, n_rows: int, block: int, grad: bool):
        """(sorted L1 [g] float64, its gradient on a at each list slot [g, n], each slot's
        local column or -1) of the rows' n largest uncommon probabilities."""
        from megatron_xdistill.loss.gpu import triton_gold

        dev, n = s.device, self.n
        prefix = torch.zeros(n_rows, dtype=torch.int32, device=dev)
        left = torch.full((n_rows,), n, dtype=torch.int64, device=dev)
        gt_local = torch.zeros(n_rows, dtype=torch.int64, device=dev)
        hist = torch.empty(n_rows, 256, dtype=torch.int32, device=dev)
        for shift in (24, 16, 8, 0):
            triton_gold.radix_histogram[(n_rows,)](
                s, s.stride(0), lsum, count, self.is_common, self.num_real, prefix, hist,
                SHIFT=shift, BLOCK=block)
            local = hist.long()
            total = all_reduce(local.clone(), self.tp_group)
            at_least = total.flip(1).cumsum(1).flip(1)  # values with digit >= d
            digit = (at_least >= left[:, None]).sum(1) - 1
            above = (at_least - total).gather(1, digit[:, None])[:, 0]
            left -= above
            local_above = (local.flip(1).cumsum(1).flip(1) - local).gather(1, digit[:, None])
            gt_local += local_above[:, 0]
            eq_local = local.gather(1, digit[:, None])[:, 0]
            prefix |= (digit << shift).to(torch.int32)
        ranks = torch.stack(all_gather(torch.stack([gt_local, eq_local], 1), self.tp_group))
        me = group_rank(self.tp_group)
        gt_all, eq_all = ranks[..., 0], ranks[..., 1]  # [tp, g]
        take = torch.minimum(eq_all, (left[None, :] - (eq_all.cumsum(0) - eq_all)).clamp_min(0))
        gt_base = (gt_all.cumsum(0) - gt_all)[me]
        eq_base = (n - left) + (take.cumsum(0) - take)[me]
        values = torch.zeros(n_rows, n, dtype=torch.float32, device=dev)
        cols = torch.full((n_rows, n), -1, dtype=torch.int32, device=dev)
        triton_gold.compact_top[(n_rows,)](
            s, s.stride(0), lsum, count, self.is_common, self.num_real, prefix,
            gt_base.contiguous(), eq_base.contiguous(), take[me].contiguous(), values, cols, n,
            BLOCK=block)
        all_reduce(values, self.tp_group)
        l1 = torch.empty(n_rows, dtype=torch.float64, device=dev)
        slots = torch.zeros(n_rows, n, dtype=torch.float32, device=dev)
        width = next_pow2(n)
        per = max(1, min(16, 4096 // width))  # rows a program sorts: short lists go together
        tail = self.teacher_tail
        triton_gold.sorted_l1[(-(-n_rows // per),)](
            values, n, n_rows, keys, self.head, self.teacher_sorted,
            self.teacher_sorted.stride(0), l1 if tail is None else tail, l1, slots,
            TAIL=tail is not None, ROWS=per, BLOCK=width)
        return l1, slots, cols

    @staticmethod
    def coefficient(weight: torch.Tensor, group: RowGroup, temperature: float
                    ) -> torch.Tensor:
        """Each row's factor on (h - p sum h): d(T^2 KL) / d(logits) = T / count (h - p sum h)
        times the row's weight and the loss's weight on the KD sum."""
        return (weight * group.weight * temperature / group.count).float().contiguous()


__all__ = ["GoldPass"]
