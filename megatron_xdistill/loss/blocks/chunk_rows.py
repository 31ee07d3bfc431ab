"""Which chunks a rank works on, and how its positions are cut into blocks.

Input: the *predicting* chunk id of each local position ([B, T_local]; the runtime shifts the ids
on the full sequence, then slices them for its CP rank), and which chunk slots count. A "row" is a
chunk with at least one local predicting position. Rows are ordered by flat key ``b * C + c``,
which is also the order of their positions (ids never decrease along a sample, and Megatron's 2*CP
layout keeps each rank's two sequence pieces in order), so every chunk's local positions form one
run and a block of positions can always end on a chunk boundary.

Context parallelism: a chunk can have predicting positions on several CP ranks ("split" chunks;
at most a few per sample, at the edges of the 2*CP pieces). Their per-chunk sums are all-reduced
over CP before use; the lowest CP rank holding a split chunk "owns" it (counts it in the loss).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from megatron_xdistill.loss.collectives import Group, all_gather, group_rank


@dataclass(frozen=True)
class Block:
    """Flat positions [start, end) and the rows [row_start, row_end) they hold, whole."""

    start: int
    end: int
    row_start: int
    row_end: int


@dataclass
class ChunkRows:
    """Rows of one rank (see the module docstring). Counts are CP-global."""

    num_chunks: int
    keys: torch.Tensor        # [R] int64, ascending flat keys b * C + c
    pos_row: torch.Tensor     # [N] int64, row of each flat position, -1 for none
    count: torch.Tensor       # [R] float64, predicting positions of the chunk over the CP group
    owned: torch.Tensor       # [R] bool, this rank counts the chunk
    split_slot: torch.Tensor  # [R] int64, index into split_keys, -1 for chunks held whole
    split_keys: torch.Tensor  # [S] int64, every split chunk of the CP group (same on its ranks)
    split_owner: torch.Tensor  # [S] int64, CP rank that owns each split chunk
    key_count: torch.Tensor   # [B * C] float64, CP-global count of every chunk slot
    key_owner: torch.Tensor   # [B * C] int64, owning CP rank of every slot (-1: no position)
    blocks: list[Block]
    # Per position, relative to its block (so a block's work takes slices, not index arithmetic):
    block_seg: torch.Tensor | None = None        # [N] row within the block, -1 for none
    block_seg_dummy: torch.Tensor | None = None  # [N] the same, 'none' = the block's row count
    # Per block, its rows held whole / split over CP (block-relative indices, all blocks'
    # concatenated; block i's are [off[i], off[i + 1])), found once on the CPU and moved in one
    # copy each: the per-block loss then never waits on the device to select them.
    block_local: torch.Tensor | None = None
    block_split: torch.Tensor | None = None
    block_local_off: list[int] | None = None
    block_split_off: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return int(self.keys.numel())

    def to(self, device: torch.device) -> ChunkRows:
        """These rows with every tensor on ``device``: moved once per loss call, so that the
        loss indexes the logits' device with indices on that device (CUDA refuses a mix)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    def local_of_block(self, index: int) -> torch.Tensor:
        """Block ``index``'s rows held whole by this rank, relative to its first row."""
        off = self.block_local_off
        return self.block_local[off[index]: off[index + 1]]

    def all_local(self, index: int) -> bool:
        """Whether every row of block ``index`` is held whole by this rank (then
        :meth:`local_of_block` is all its rows in order: no selection needed). Known on the
        host: no device wait."""
        off, blk = self.block_local_off, self.blocks[index]
        return off[index + 1] - off[index] == blk.row_end - blk.row_start

    def split_of_block(self, index: int) -> torch.Tensor:
        """Block ``index``'s rows split over CP, relative to its first row."""
        off = self.block_split_off
        return self.block_split[off[index]: off[index + 1]]

    @property
    def local_rows(self) -> torch.Tensor:
        """Indices of rows held whole by this rank."""
        return torch.nonzero(self.split_slot < 0, as_tuple=True)[0]

    @property
    def split_rows(self) -> torch.Tensor:
        """Indices of this rank's rows that are split over CP."""
        return torch.nonzero(self.split_slot >= 0, as_tuple=True)[0]


def build_chunk_rows(
    pred_chunk_id: torch.Tensor,
    num_chunks: int,
    include: torch.Tensor | None,
    cp_group: Group,
    block_tokens: int,
) -> ChunkRows:
    """Rows, CP split/ownership and position blocks of at least ``block_tokens`` positions."""
    if pred_chunk_id.dim() != 2:
        raise ValueError(f"chunk ids must be [B, T], got {tuple(pred_chunk_id.shape)}")
    ids = pred_chunk_id.detach().to("cpu", torch.int64)
    batch, _ = ids.shape
    if ids.numel() and int(ids.max()) >= num_chunks:
        raise ValueError(f"chunk id {int(ids.max())} out of range for {num_chunks} chunk slots")
    sample = torch.arange(batch).unsqueeze(1).expand_as(ids)
    key = torch.where(ids >= 0, sample * num_chunks + ids, torch.full_like(ids, -1)).reshape(-1)
    if include is not None:
        ok = include.detach().to("cpu", torch.bool).reshape(-1)
        key = torch.where(key >= 0, torch.where(ok[key.clamp_min(0)], key, -1), key)
    valid = key >= 0
    vkeys = key[valid]
    if vkeys.numel() > 1 and bool((vkeys[1:] < vkeys[:-1]).any()):
        raise ValueError("predicting chunk ids must not decrease along a sample")
    keys, counts = torch.unique_consecutive(vkeys, return_counts=True)
    pos_row = torch.full_like(key, -1)
    pos_row[valid] = torch.repeat_interleave(torch.arange(keys.numel()), counts)

    slots = batch * num_chunks
    local_counts = torch.zeros(slots, dtype=torch.float64)
    local_counts[keys] = counts.double()
    per_rank = torch.stack(all_gather(local_counts, cp_group))  # [CP, B*C]
    key_count = per_rank.sum(0)
    held = per_rank > 0
    key_owner = torch.where(held.any(0), held.to(torch.int64).argmax(0), -1)
    split_all = held.sum(0) > 1
    split_keys = torch.nonzero(split_all, as_tuple=True)[0]
    cp_rank = group_rank(cp_group)
    is_split = split_all[keys]
    split_slot = torch.where(
        is_split, torch.searchsorted(split_keys, keys), torch.full_like(keys, -1)
    )
    owned = key_owner[keys] == cp_rank
    rows = ChunkRows(
        num_chunks=num_chunks, keys=keys, pos_row=pos_row, count=key_count[keys], owned=owned,
        split_slot=split_slot, split_keys=split_keys, split_owner=key_owner[split_keys],
        key_count=key_count, key_owner=key_owner, blocks=[],
    )
    rows.blocks = _cut_blocks(key, valid, counts, block_tokens)
    rows.block_seg, rows.block_seg_dummy = _block_relative(pos_row, rows.blocks)
    rows.block_local, rows.block_local_off = _rows_by_block(split_slot < 0, rows.blocks)
    rows.block_split, rows.block_split_off = _rows_by_block(split_slot >= 0, rows.blocks)
    return rows


def _rows_by_block(selected: torch.Tensor, blocks: list[Block]
                   ) -> tuple[torch.Tensor, list[int]]:
    """(indices of the ``selected`` rows relative to their block's first row, all blocks'
    concatenated; offsets per block) on the CPU."""
    rows = torch.nonzero(selected, as_tuple=True)[0]
    starts = np.array([blk.row_start for blk in blocks] + [selected.numel()], dtype=np.int64)
    off = np.searchsorted(rows.numpy(), starts).tolist()
    first = torch.repeat_interleave(torch.as_tensor(starts[:-1]),
                                    torch.as_tensor(np.diff(off), dtype=torch.int64))
    return rows - first, off


def _block_relative(pos_row: torch.Tensor, blocks: list[Block]
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(row within the block or -1, row within the block or the block's row count) per
    position."""
    lengths = torch.tensor([b.end - b.start for b in blocks], dtype=torch.int64)
    first_row = torch.repeat_interleave(
        torch.tensor([b.row_start for b in blocks], dtype=torch.int64), lengths)
    num_rows = torch.repeat_interleave(
        torch.tensor([b.row_end - b.row_start for b in blocks], dtype=torch.int64), lengths)
    has = pos_row >= 0
    seg = torch.where(has, pos_row - first_row, -1)
    return seg, torch.where(has, seg, num_rows)


def _cut_blocks(key: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor,
                block_tokens: int) -> list[Block]:
    """Blocks of about ``block_tokens`` positions that end where a chunk's run of positions
    ends (searches over the run ends: the cost grows with the blocks, not the chunks)."""
    n = key.numel()
    same = (valid[1:] & valid[:-1] & (key[1:] == key[:-1])).numpy()
    cuts = np.concatenate([[0], np.nonzero(~same)[0] + 1, [n]])  # strictly increasing
    counts = counts.numpy()
    first_pos = np.nonzero(valid.numpy())[0]
    row_pos = first_pos[np.cumsum(counts) - counts] if len(counts) else first_pos[:0]
    blocks, start, row = [], 0, 0
    step = max(int(block_tokens), 1)
    while start < n:
        end = int(cuts[np.searchsorted(cuts, min(start + step, n))])
        row_end = int(np.searchsorted(row_pos, end))
        blocks.append(Block(start, end, row, row_end))
        start, row = end, row_end
    return blocks
