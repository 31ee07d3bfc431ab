"""One fused call's layout on the device: its chunk rows' positions, the groups of rows each
pass takes at once, and the per-position log-partitions and CE inputs.

A chunk row's local positions are one run (:mod:`blocks.chunk_rows`), so a row is its first
position and its length. Rows go through the passes in groups whose [rows, V] buffers fit a
memory budget: the rows held whole by this rank in key order (their positions ascend), then the
rows split over CP as one group indexed by split slot (every CP rank runs it, zeros where it
holds none of a row's positions, and sums over CP before the divergence). Every rank of a TP
group holds the same rows, so every collective is taken by all of them alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows
from megatron_xdistill.loss.collectives import Group, all_reduce, group_rank, group_size
from megatron_xdistill.loss.gpu import row_softmax


@dataclass
class RowGroup:
    """Rows taken by one pass of the form's kernels (device tensors unless said)."""

    rows: torch.Tensor    # [g] int64, index into the row layout (the empty row R: none here)
    keys: torch.Tensor    # [g] int64, payload row (b * C + c)
    count: torch.Tensor   # [g] float32, CP-global predicting positions
    counted: torch.Tensor  # [g] bool, this rank counts the row's KL
    weight: torch.Tensor  # [g] float32, the row's weight in the KD sum (sample weights)
    split: bool           # rows split over CP: sums all-reduced over CP
    lo: int               # positions [lo, hi) hold this group's (host ints; split: all)
    hi: int

    @property
    def size(self) -> int:
        return int(self.rows.numel())


@dataclass
class RowLayout:
    """Where each chunk row's positions are; the row groups."""

    first: torch.Tensor   # [R + 1] int64, first local position (row R: an empty row)
    length: torch.Tensor  # [R + 1] int64
    pos_row: torch.Tensor  # [N] int64, -1 for none
    groups: list[RowGroup]
    owned_count: torch.Tensor  # float64 scalar, rows this rank counts


def row_layout(rows_cpu: ChunkRows, rows: ChunkRows, n_positions: int, group_rows: int,
               sample_weights: torch.Tensor | None, cp_group: Group,
               device: torch.device) -> RowLayout:
    """The layout of one call from its chunk rows (``rows_cpu`` on the host, ``rows`` the same
    on ``device``), groups of at most ``group_rows`` rows."""
    num = rows_cpu.num_rows
    pos_row = rows_cpu.pos_row
    has = pos_row >= 0
    positions = torch.arange(n_positions, dtype=torch.int64)
    length = torch.zeros(num + 1, dtype=torch.int64).index_add_(
        0, pos_row[has], torch.ones(int(has.sum()), dtype=torch.int64))
    first = torch.full((num + 1,), n_positions, dtype=torch.int64).scatter_reduce_(
        0, pos_row[has], positions[has], "amin")
    first[num] = 0
    weights = (None if sample_weights is None
               else sample_weights.detach().to("cpu", torch.float32))
    num_chunks = max(rows_cpu.num_chunks, 1)

    def weight_of(keys: torch.Tensor) -> torch.Tensor:
        if weights is None:
            return torch.ones(keys.numel(), dtype=torch.float32)
        return weights.index_select(0, torch.div(keys, num_chunks, rounding_mode="floor"))

    groups: list[RowGroup] = []
    local = torch.nonzero(rows_cpu.split_slot < 0, as_tuple=True)[0]
    step = max(int(group_rows), 1)
    for start in range(0, local.numel(), step):
        sel = local[start: start + step]
        keys = rows_cpu.keys[sel]
        lo = int(first[sel[0]])
        hi = int(first[sel[-1]] + length[sel[-1]])
        groups.append(RowGroup(sel, keys, rows_cpu.count[sel].float(),
                               torch.ones(sel.numel(), dtype=torch.bool), weight_of(keys),
                               False, lo, hi))
    n_split = rows_cpu.split_keys.numel()
    if n_split:  # the same on every CP rank (the split keys are CP-global)
        slot_row = torch.full((n_split,), num, dtype=torch.int64)
        held = torch.nonzero(rows_cpu.split_slot >= 0, as_tuple=True)[0]
        slot_row[rows_cpu.split_slot[held]] = held
        keys = rows_cpu.split_keys
        owner = rows_cpu.split_owner == group_rank(cp_group)
        groups.append(RowGroup(slot_row, keys, rows_cpu.key_count[keys].float(), owner,
                               weight_of(keys), True, 0, n_positions))
    moved = [RowGroup(g.rows.to(device), g.keys.to(device), g.count.to(device),
                      g.counted.to(device), g.weight.to(device), g.split, g.lo, g.hi)
             for g in groups]
    return RowLayout(first.to(device), length.to(device), rows.pos_row, moved,
                     rows.owned.sum().double())


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (a kernel's tile)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def column_tile(width: int) -> int:
    """Columns a kernel's tile takes of a row ``width`` wide."""
    return min(2048, next_pow2(max(width, 16)))


def beta_kind(beta: float) -> int:
    """The divergence as the kernels' BETA_KIND: 0 forward KL, 1 reverse KL, 2 the JSD."""
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


def whole_row_programs(device: torch.device, n_rows: int) -> int:
    """Programs of a whole-row kernel (each with scratch rows of its own): 4 per SM on CUDA,
    8 elsewhere (Triton's interpreter runs them one by one: scratch rows only)."""
    if device.type == "cuda":
        return min(n_rows, 4 * torch.cuda.get_device_properties(device).multi_processor_count)
    return min(n_rows, 8)


def log_partition(x: torch.Tensor, scale: float, tp_group: Group) -> torch.Tensor:
    """Per row of ``x`` [N, V_real] (this shard's real columns): the TP-wide log sum exp of
    scale * x, fp32 (one fused pass; with TP a max and a sum all-reduce, as Megatron's CE)."""
    lse, _ = row_softmax.row_partition(x, scale)
    if group_size(tp_group) == 1:
        return lse
    top = all_reduce(lse.clone(), tp_group, "max")
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = all_reduce(torch.exp(lse - top), tp_group)
    return top + total.log()


@dataclass
class CrossEntropy:
    """CE's per-position inputs (T = 1): the TP-wide log-partition, the label's local column
    (-1 where another shard or no label), which positions have a label, and its logit."""

    lse: torch.Tensor
    label_col: torch.Tensor
    has_label: torch.Tensor
    picked: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        """The CE summed over the labelled positions (float64)."""
        return ((self.lse - self.picked).double() * self.has_label).sum()


def cross_entropy_inputs(x: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                         lse: torch.Tensor, tp_group: Group) -> CrossEntropy:
    """:class:`CrossEntropy` of the real columns ``x`` [N, V_real] (``lse``: their T = 1
    log-partition) and the flat labels [N] (< 0: none)."""
    col = labels - vocab_start
    local = (labels >= 0) & (col >= 0) & (col < x.shape[1])
    label_col = torch.where(local, col, -1)
    picked = x.gather(1, label_col.clamp_min(0)[:, None])[:, 0].float() * local
    picked = all_reduce(picked, tp_group)
    return CrossEntropy(lse, label_col, (labels >= 0).to(torch.float32), picked)


@dataclass
class GradientTarget:
    """Where a call's gradient goes and what every writer of it reads: ``out`` [N, V_local]
    (the logits' dtype), the logits, T, the TP-wide log-partitions, the loss's weight on the KD
    sum ``kd_weight`` (a scalar tensor), CE's per-position weight, label column and T = 1
    log-partition (``has_ce``; ``ce_own``: T != 1), and [N] scratch for the exact form's
    <p, h> per position."""

    out: torch.Tensor
    logits: torch.Tensor
    num_real: int
    temperature: float
    lse: torch.Tensor
    layout: RowLayout
    kd_weight: torch.Tensor
    ce_coef: torch.Tensor
    label: torch.Tensor
    lse1: torch.Tensor
    has_ce: bool
    ce_own: bool
    dot: torch.Tensor

    @property
    def block(self) -> int:
        return column_tile(self.logits.shape[1])

    def write(self, group: RowGroup, h: torch.Tensor, coef: torch.Tensor, *,
              image: bool, hsum: torch.Tensor | None = None) -> None:
        """The gradient of ``group``'s rows' positions from their h (:mod:`gpu.triton_rows`'
        ``chunk_gradient``): KD (``coef`` a row) and CE together, one write."""
        from megatron_xdistill.loss.gpu import triton_rows

        x = self.logits
        triton_rows.chunk_gradient[(group.size,)](
            self.out, self.out.stride(0), x, x.stride(0), x.shape[1], self.num_real,
            1.0 / self.temperature, self.lse, self.layout.first, self.layout.length,
            group.rows, h, h.stride(0), coef, self.dot, coef if hsum is None else hsum,
            self.ce_coef, self.label, self.lse1, IMAGE=image, CE=self.has_ce,
            CE_OWN=self.ce_own, BLOCK=self.block)


__all__ = ["CrossEntropy", "GradientTarget", "RowGroup", "RowLayout", "cross_entropy_inputs",
           "beta_kind", "column_tile", "log_partition", "next_pow2", "row_layout",
           "whole_row_programs"]
