"""Every W entry that the column P-KL kernel reads, expanded once per call and cut per block.

The column kernels (``topk`` / ``chunk_topk`` payloads) gather, for each position, the student
probabilities that W maps onto its chunk's teacher columns. Expanding those (position, student
column, weight, row slot) entries block by block costs a few dozen small operations and several
host synchronisations per block, twice (forward and the recomputing backward); on a GPU that
launch and sync overhead, not the arithmetic, was the loss's time. Here the expansion runs once
for all blocks (one synchronisation), and each block takes contiguous slices of it, with indices
already relative to the block, so a block's forward and backward issue no index arithmetic and
never wait on the device.

Memory: 28 bytes per entry kept (k columns x W's entries per teacher column per position: about
1% of fp32 logits at k = 64, 5% at k = 256 with bench_loss.py's synthetic W at V_s 49,152), and
while expanding, the column entries (20 bytes each) and two [E] index temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows
from megatron_xdistill.loss.blocks.shard import ColumnEntries


@dataclass(frozen=True)
class BlockSlice:
    """One block's entries: ``pos`` (position within the block), ``lin`` (flat index into the
    block's contiguous [n, V_real] buffer), ``weight`` (W's value) and ``flat`` (row within the
    block * k + slot), all [E_block]."""

    pos: torch.Tensor
    lin: torch.Tensor
    weight: torch.Tensor
    flat: torch.Tensor


def expand_block_entries(rows: ChunkRows, entries: ColumnEntries, num_real: int, k: int,
                         device: torch.device) -> list[BlockSlice]:
    """Slices of every block of ``rows`` (``entries`` grouped by row, as
    :meth:`ProjectionShard.column_entries` returns them for the rows' column sets)."""
    blocks = rows.blocks
    if not blocks:
        return []
    pos_row = rows.pos_row.to(device)
    pos = torch.nonzero(pos_row >= 0, as_tuple=True)[0]
    row = pos_row.index_select(0, pos)
    length = entries.length.index_select(0, row)
    starts = torch.tensor([b.start for b in blocks], dtype=torch.int64, device=device)
    block_of_pos = torch.searchsorted(starts, pos, right=True) - 1
    counts = torch.zeros(len(blocks), dtype=torch.int64, device=device).index_add_(
        0, block_of_pos, length)
    sizes = counts.tolist()  # the call's one synchronisation
    total = sum(sizes)
    # Per position first (small arrays), then each [E] array by one expansion: no [E] block or
    # position index alongside the outputs.
    in_block = pos - starts.index_select(0, block_of_pos)
    row_starts = torch.tensor([b.row_start for b in blocks], dtype=torch.int64, device=device)
    first = torch.cumsum(length, 0) - length
    ent = torch.repeat_interleave(entries.offset.index_select(0, row) - first, length,
                                  output_size=total)
    ent += torch.arange(total, device=device)
    flat = entries.pair.index_select(0, ent)  # row * k + slot, made relative to the block
    flat -= torch.repeat_interleave(row_starts.index_select(0, block_of_pos) * k, length,
                                    output_size=total)
    lin = entries.student.index_select(0, ent)
    lin += torch.repeat_interleave(in_block * num_real, length, output_size=total)
    weight = entries.weight.index_select(0, ent)
    del ent
    pos_rel = torch.repeat_interleave(in_block, length, output_size=total)
    out, lo = [], 0
    for size in sizes:
        hi = lo + size
        out.append(BlockSlice(pos_rel[lo:hi], lin[lo:hi], weight[lo:hi], flat[lo:hi]))
        lo = hi
    return out


__all__ = ["BlockSlice", "expand_block_entries"]
