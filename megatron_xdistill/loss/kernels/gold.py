"""Gold / H-KL's student-side kernel: the KL on the common vocabulary plus the L1 of the
sorted uncommon remainders (ULD), from the block's summed logits / T and log-partitions.

raw = per chunk row, the summed logits / T [r, V_local] and summed TP-wide log-partitions [r].
On CPU with one TP rank the forward KL's rows take :mod:`cpu.gold_rows`' passes and the L1
:mod:`cpu.sorted_l1`'s sign runs (gradient written directly); where the forward writes the
gradient, a block goes from its logits to its gradient without raw sums (:mod:`cpu.gold_block`);
elsewhere torch's operations under autograd. The other kernels are in :mod:`kernels.pkl` and
:mod:`kernels.image`.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import (
    BlockData,
    Raw,
    row_table,
    rows_of,
    with_zero_row,
)
from megatron_xdistill.loss.collectives import (
    Group,
    all_reduce,
    group_size,
    replicated_gather,
    replicated_sum,
)
from megatron_xdistill.loss.cpu import gold_block, gold_rows, sorted_l1
from megatron_xdistill.loss.cpu import rows as cpu_rows
from megatron_xdistill.loss.cpu.sorted_top import sorted_top, sorted_top_columns
from megatron_xdistill.loss.cpu.threads import numba_takes
from megatron_xdistill.loss.definitions.formulas import divergence
from megatron_xdistill.loss.definitions.payload import TeacherPayload


class GoldKernel:
    """Gold / H-KL: KL on the common vocabulary + L1 of the sorted uncommon remainders."""

    per_block = True
    reads_logits = True
    #: fp32 [block, V_local] temporaries at a block's peak (measured as DenseKernel's; 6.4 at 85)
    block_buffers = 6.2

    def __init__(self, payload: TeacherPayload, common_student: torch.Tensor, vocab_start: int,
                 num_real: int, num_uncommon: int, beta: float, tp_group: Group) -> None:
        self.payload, self.beta, self.tp_group = payload, beta, tp_group
        self.num_real = num_real
        self.num_common = int(common_student.numel())
        local = (common_student >= vocab_start) & (common_student < vocab_start + num_real)
        self.pair_local = torch.nonzero(local, as_tuple=True)[0]
        self.col_common = common_student[local] - vocab_start
        uncommon = torch.ones(num_real, dtype=torch.bool, device=common_student.device)
        uncommon[self.col_common] = False
        self.col_uncommon = torch.nonzero(uncommon, as_tuple=True)[0]
        self.num_uncommon = num_uncommon
        self.runs: sorted_l1.RunMemo | None = None  # the forward's sign runs (CPU, TP 1)

    @staticmethod
    def needs_softmax(like: torch.Tensor) -> bool:
        """Whether the blocks need their softmax in a buffer. The raw sums read the logits
        and log-partitions only, so on CPU none: the backward writes the gradient from the
        logits (:func:`cpu.rows.exp_spread_`)."""
        return not numba_takes(like)

    def empty_raw(self, n: int, like: torch.Tensor) -> Raw:
        return {"x": like.new_zeros(n, self.num_real), "lz": like.new_zeros(n)}

    def raw(self, blk: BlockData) -> Raw:
        seg = blk.seg_dummy
        xsum = blk.x.new_zeros(blk.num_rows + 1, blk.x.shape[1]).index_add_(0, seg, blk.x)
        lz = blk.x.new_zeros(blk.num_rows + 1).index_add_(0, seg, blk.logz)
        return {"x": xsum[:-1], "lz": lz[:-1]}

    @staticmethod
    def _means(raw: Raw, counts: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Chunk means of this shard's log-probs, (x - lz) / count, on columns ``cols``."""
        x = raw["x"]
        return (x.index_select(1, cols) - raw["lz"][:, None]) / counts.to(x.dtype)[:, None]

    def _by_runs(self, like: torch.Tensor) -> bool:
        """Whether the uncommon L1 takes :mod:`cpu.sorted_l1`'s sign runs (one TP rank, CPU)."""
        return group_size(self.tp_group) == 1 and sorted_l1.supported(like)

    def _by_rows(self, x: torch.Tensor) -> bool:
        """Whether :mod:`cpu.gold_rows`' CPU passes take these rows (forward KL, one TP rank, CPU,
        every uncommon column a candidate); else torch's operations."""
        return (self.beta == 0.0 and self._by_runs(x)
                and self.col_uncommon.numel() >= self.num_uncommon)

    def _by_torch(self, x: torch.Tensor) -> bool:
        """Whether the forward KL's value and gradient come from :meth:`_forward_kl` (one TP
        rank, torch's sort: a GPU), made together instead of by autograd through :meth:`kl`
        (which took the KL a second time for the gradient)."""
        return self.beta == 0.0 and group_size(self.tp_group) == 1 and not self._by_runs(x)

    def _forward_kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                    weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, Raw | None]:
        """(KL, top-1, d(sum_r weight_r KL_r) / d raw or None) of the forward KL with one TP
        rank by torch operations: the quantities of :meth:`kl` and of autograd through it.
        With a = (x - lz) / count: dKL/da is -P on the common pairs and sign(e^a - t) e^a on
        the n largest uncommon means (0 where they tie, as autograd's abs); dKL/dx =
        dKL/da / count on each column, dKL/dlz = -(their sum)."""
        x = raw["x"]
        rows = x.shape[0]
        b_common = rows_of(self.payload.logprobs, keys)
        p_common = b_common.exp()
        a_common, top, at = self._forward_means(raw, counts)
        kl = (p_common * (b_common - a_common)).sum(-1)
        e = top.exp()
        diff = e - self._teacher_sorted(keys)
        kl = kl + diff.abs().sum(-1)
        top1 = (a_common.argmax(-1) == b_common.argmax(-1) if self.num_common
                else torch.zeros(rows, dtype=torch.bool, device=x.device))
        if weight is None:
            return kl, top1, None
        scale = (weight.to(x.dtype).expand(rows) / counts.to(x.dtype))[:, None]
        return kl, top1, self._grad_from_means(x, p_common.mul_(scale).neg_(),
                                               diff.sign_().mul_(e).mul_(scale), at)

    def _forward_means(self, raw: Raw, counts: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The torch forward's chunk means a = (x - lz) / count at one TP rank: (a on the common
        columns [r, M]; the n largest uncommon ones [r, n], descending, -inf past the uncommon
        columns; their places among the uncommon columns, pads after them)."""
        x = raw["x"]
        rows, n, num_unc = x.shape[0], self.num_uncommon, self.col_uncommon.numel()
        means = (x - raw["lz"][:, None]).div_(counts.to(x.dtype)[:, None])  # all columns
        a_unc = means.index_select(1, self.col_uncommon)
        if num_unc < n:  # fewer uncommon columns than candidates: -inf pads (e^a = 0)
            a_unc = torch.cat([a_unc, x.new_full((rows, n - num_unc), float("-inf"))], 1)
        top, at = sorted_top_columns(a_unc, n)
        return means.index_select(1, self.col_common), top, at

    def _grad_from_means(self, x: torch.Tensor, g_common: torch.Tensor,
                         g_sorted: torch.Tensor, at: torch.Tensor) -> Raw:
        """d / d raw from the gradients (already times weight / count) on the common means and
        on the sorted uncommon ones at places ``at`` (:meth:`_forward_means`): each column's
        gradient, the pads dropped, and dKL/dlz = -(the row's sum)."""
        num_unc = self.col_uncommon.numel()
        g_unc = x.new_zeros(x.shape[0], max(num_unc, self.num_uncommon)).scatter_(
            1, at, g_sorted)[:, :num_unc]
        g = x.new_empty(x.shape[0], x.shape[1])  # the common and uncommon columns are all of it
        g.index_copy_(1, self.col_common, g_common)
        g.index_copy_(1, self.col_uncommon, g_unc)
        return {"x": g, "lz": g.sum(-1).neg_()}

    def kl_with_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Raw] | None:
        """(:meth:`kl`, top-1, :meth:`raw_grad`) made together, for a forward that writes the
        gradient: by :meth:`_forward_kl` (a GPU), or on CPU by :mod:`cpu.gold_rows` with the
        gradient's pass reading the forward's uncommon means and sign runs (no second means
        pass: 0.38 of 7.4 s at 16k tokens, one thread); None elsewhere."""
        x = raw["x"]
        if self._by_torch(x):
            return self._forward_kl(raw, keys, counts, weight)
        if not self._by_rows(x):
            return None
        kl, agree, a_unc, runs, table, b_keys = self._rows_kl(raw, keys, counts)
        return kl, agree, self._rows_grad(x, counts, weight, a_unc, runs, table, b_keys)

    def fuses_block(self, x: torch.Tensor) -> bool:
        """Whether :meth:`forward_from_logits` takes a block with logits / T ``x``: where
        :mod:`cpu.gold_rows`' passes run (CPU, one TP rank, forward KL)."""
        return self._by_rows(x)

    def forward_from_logits(self, blk: BlockData, keys: torch.Tensor, counts: torch.Tensor,
                            weight: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, gold_block.GoldRowsGrad]:
        """(:meth:`kl`, top-1, the raw gradient to spread) of a block whose chunk rows are all
        held whole here, straight from its logits (:func:`cpu.gold_block.forward_block`): each
        position's log-partition is written into ``blk.lz_local`` (one TP rank: the TP-wide
        one) and no [rows, V] raw sums are made. For a forward that writes the gradient
        (:meth:`backward_block` spreads it): the sign runs are not kept for a recompute."""
        x = blk.x
        table, b_keys = row_table(self.payload.logprobs, keys, x.dtype)
        a_unc, checksum, kl, agree = gold_block.forward_block(
            x, blk.seg, blk.num_rows, counts, self.col_common, self.col_uncommon, table, b_keys,
            blk.lz_local)
        runs = sorted_l1.sign_runs(a_unc, self._teacher_sorted(keys), checksum=checksum)
        scale = weight.to(x.dtype).expand(blk.num_rows) / counts.to(x.dtype)
        return kl + runs.value, agree, gold_block.GoldRowsGrad(a_unc, runs, table, b_keys, scale)

    def _rows_kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor):
        """:mod:`cpu.gold_rows`' forward pass and the L1's sign runs (kept for a backward): (KL,
        student / teacher argmax agreement, the uncommon means, the runs, the teacher's
        log-prob table and its rows for ``keys``)."""
        x = raw["x"]
        table, b_keys = row_table(self.payload.logprobs, keys, x.dtype)
        a_unc, checksum, kl, agree = gold_rows.forward_rows(
            x, raw["lz"], counts, self.col_common, self.col_uncommon, table, b_keys)
        runs = sorted_l1.sign_runs(a_unc, self._teacher_sorted(keys), self._memo(), keys,
                                   checksum, keep=True)
        return kl + runs.value, agree, a_unc, runs, table, b_keys

    def _rows_grad(self, x: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor,
                   a_unc: torch.Tensor, runs: sorted_l1.SignRuns, table: torch.Tensor,
                   b_keys: torch.Tensor) -> Raw:
        """:mod:`cpu.gold_rows`' gradient pass on the raw sums, from the uncommon means and their
        sign runs."""
        scale = weight.to(x.dtype).expand(x.shape[0]) / counts.to(x.dtype)
        g, g_lz = gold_rows.gradient_rows(a_unc, runs, self.col_common, self.col_uncommon,
                                          table, b_keys, scale, x.shape[1])
        return {"x": g, "lz": g_lz}

    def _teacher_sorted(self, keys: torch.Tensor) -> torch.Tensor:
        """The teacher's sorted uncommon probabilities of the rows ``keys`` [r, n]."""
        return rows_of(self.payload.uncommon_probs, keys)[:, : self.num_uncommon]

    def _memo(self) -> sorted_l1.RunMemo:
        """The forward's sign runs, kept for the backward (one table per call, made once)."""
        if self.runs is None:
            part = self.payload.uncommon_probs
            self.runs = sorted_l1.RunMemo(part.shape[0] * part.shape[1])
        return self.runs

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = raw["x"]
        rows = x.shape[0]
        if self._by_rows(x) and not any(v.requires_grad for v in raw.values()):
            kl, agree = self._rows_kl(raw, keys, counts)[:2]
            return kl, (agree if top1 else None)
        if self._by_torch(x) and not any(v.requires_grad for v in raw.values()):
            kl, agree, _ = self._forward_kl(raw, keys, counts)
            return kl, (agree if top1 else None)
        t_sorted = self._teacher_sorted(keys)
        b_common = rows_of(self.payload.logprobs, keys)
        a_common = self.common_means(raw, counts)
        a_unc = self._uncommon_candidates(raw, counts)
        kl = divergence(b_common, None, a_common, self.beta)
        if self._by_runs(a_unc):
            kl = kl + sorted_l1.sorted_l1(a_unc, t_sorted, self._memo(), keys)
        else:
            kl = kl + (self._merged_top(a_unc).exp() - t_sorted).abs().sum(-1)
        if not top1:
            return kl, None
        if self.num_common:
            return kl, a_common.argmax(-1) == b_common.argmax(-1)
        return kl, torch.zeros(rows, dtype=torch.bool, device=x.device)

    def common_means(self, raw: Raw, counts: torch.Tensor) -> torch.Tensor:
        """The student's chunk-mean log-probs a on all M common pairs [r, M], in the pairs'
        order, the same on every TP rank (each rank's pairs summed over TP)."""
        a_common = self._means(raw, counts, self.col_common)
        if self.pair_local.numel() < self.num_common:  # TP > 1: this shard's pairs only
            a_common = a_common.new_zeros(a_common.shape[0], self.num_common).index_copy(
                1, self.pair_local, a_common)
        return replicated_sum(a_common, self.tp_group)

    def _uncommon_candidates(self, raw: Raw, counts: torch.Tensor) -> torch.Tensor:
        """This shard's uncommon chunk means, -inf padded to at least n columns."""
        x, n = raw["x"], self.num_uncommon
        a_unc = self._means(raw, counts, self.col_uncommon)
        if a_unc.shape[1] < n:  # every rank offers n candidates; -inf pads a short shard
            a_unc = torch.cat([a_unc, x.new_full((x.shape[0], n - a_unc.shape[1]),
                                                 float("-inf"))], 1)
        return a_unc

    def _merged_top(self, a_unc: torch.Tensor) -> torch.Tensor:
        """The n largest uncommon means over all of V_s [r, n], descending (differentiable)."""
        n = self.num_uncommon
        merged = sorted_top(a_unc, n)  # descending
        if group_size(self.tp_group) > 1:  # the n largest of every rank's n largest
            merged = sorted_top(replicated_gather(merged, self.tp_group, dim=1), n)
        return merged

    def sorted_uncommon(self, raw: Raw, counts: torch.Tensor) -> torch.Tensor:
        """The student's n largest uncommon chunk-mean log-probs over all of V_s [r, n],
        descending (-inf where V_s has fewer), the same on every TP rank."""
        return self._merged_top(self._uncommon_candidates(raw, counts))

    def raw_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                 weight: torch.Tensor) -> Raw | None:
        """d(sum_r weight_r KL_r) / d raw written directly where :mod:`cpu.gold_rows` runs
        (forward KL, one TP rank, CPU): the common part's is -p_teacher (no recompute of the
        student's common means), the uncommon part's the L1's sign times exp(a); by
        :meth:`_forward_kl` where it runs (a GPU). None elsewhere (the caller differentiates
        :meth:`kl`). Same quantities as autograd's through ``kl``."""
        x = raw["x"]
        if self._by_torch(x):
            return self._forward_kl(raw, keys, counts, weight)[2]
        if not self._by_rows(x):
            return None
        a_unc, checksum = gold_rows.uncommon_means(x, raw["lz"], counts, self.col_uncommon)
        runs = sorted_l1.sign_runs(a_unc, self._teacher_sorted(keys), self._memo(), keys,
                                   checksum)
        table, b_keys = row_table(self.payload.logprobs, keys, x.dtype)
        return self._rows_grad(x, counts, weight, a_unc, runs, table, b_keys)

    def backward_block(self, blk: BlockData, grad: Raw | gold_block.GoldRowsGrad, inv_t: float,
                       coef: torch.Tensor, out: torch.Tensor) -> None:
        if isinstance(grad, gold_block.GoldRowsGrad):  # from forward_from_logits (one TP rank)
            gold_block.spread_block(out, blk.x, blk.lz_local, coef, blk.seg, grad,
                                    self.col_common, self.col_uncommon, inv_t)
            return
        seg = blk.seg_dummy
        # lz (the TP-wide log-partition) feeds every rank's columns: sum their gradients.
        g_lz = grad["lz"]
        if group_size(self.tp_group) > 1:
            g_lz = all_reduce(g_lz.clone(), self.tp_group)
        scale = torch.add(coef, with_zero_row(g_lz)[seg], alpha=inv_t)
        if not blk.unit_factor:
            scale.mul_(blk.factor)
        if blk.probs_local is None:  # out from the logits: exp(x - lz_local) scale + g / T
            cpu_rows.exp_spread_(out, blk.x, blk.lz_local, scale, seg, grad["x"], inv_t)
            return
        out.mul_(scale[:, None])
        out.add_(with_zero_row(grad["x"])[seg], alpha=inv_t)


__all__ = ["GoldKernel"]
