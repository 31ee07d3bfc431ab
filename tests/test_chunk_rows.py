"""A rank's chunk rows under context parallelism, without starting ranks.

``build_chunk_rows`` learns the other CP ranks' chunk counts from one all-gather; here each CP
rank's call is made in turn with that all-gather answered from the full sequence (each rank's
positions in Megatron's 2*CP layout), and every field is compared with what the full sequence
says: which chunks a rank holds, the CP-global counts, which chunks are split over ranks and which
rank (the lowest holding one) owns each, and each block's rows held whole or split.
"""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.loss.blocks import chunk_rows as chunk_rows_module
from megatron_xdistill.loss.blocks.chunk_rows import build_chunk_rows
from megatron_xdistill.parallel.context_parallel import local_positions


def _case(seed: int, batch: int = 3, length: int = 48):
    """Predicting chunk ids [B, T] (each chunk one run of 1+ positions, as the runtime's are;
    dropped chunks, padding) and an include mask [B, C]."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.cumsum(torch.randint(0, 2, (batch, length), generator=gen), 1) // 2
    num_chunks = int(ids.max()) + 2
    dropped = torch.rand(num_chunks, generator=gen) < 0.1  # chunks no position predicts
    ids[dropped[ids]] = -1
    ids[0, length - 7:] = -1  # padding
    include = torch.rand(batch, num_chunks, generator=gen) < 0.8
    return ids, num_chunks, include


@pytest.mark.parametrize("cp,seed", [(2, 0), (2, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("with_include", [True, False], ids=["include", "all"])
def test_rows_of_each_cp_rank_match_the_full_sequence(monkeypatch, cp, seed, with_include):
    ids, num_chunks, include = _case(seed, length=24 * cp)
    if not with_include:
        include = None
    batch = ids.shape[0]
    ok = torch.ones(batch, num_chunks, dtype=torch.bool) if include is None else include
    local = [ids[:, local_positions(ids.shape[1], r, cp)] for r in range(cp)]
    # per rank and slot b * C + c: its predicting positions of an included chunk
    counts = torch.zeros(cp, batch * num_chunks, dtype=torch.float64)
    for r in range(cp):
        for b in range(batch):
            for c in local[r][b].tolist():
                if c >= 0 and ok[b, c]:
                    counts[r, b * num_chunks + c] += 1
    total = counts.sum(0)
    holders = [torch.nonzero(counts[:, k]).flatten().tolist() for k in range(batch * num_chunks)]
    owner = torch.tensor([h[0] if h else -1 for h in holders])
    split = [k for k, h in enumerate(holders) if len(h) > 1]
    assert split, "the case must have chunks split over CP ranks"
    owned_once = torch.zeros(batch * num_chunks, dtype=torch.int64)

    for r in range(cp):
        gathered = []

        def fake_all_gather(tensor, group, r=r, gathered=gathered):
            torch.testing.assert_close(tensor, counts[r], rtol=0, atol=0)  # this rank's counts
            gathered.append(group)
            return [counts[k].clone() for k in range(cp)]

        monkeypatch.setattr(chunk_rows_module, "all_gather", fake_all_gather)
        monkeypatch.setattr(chunk_rows_module, "group_rank", lambda group, r=r: r)
        rows = build_chunk_rows(local[r], num_chunks, include, "cp-group", block_tokens=5)
        assert gathered == ["cp-group"]

        keys = [k for k in range(batch * num_chunks) if counts[r, k] > 0]
        assert rows.keys.tolist() == keys and rows.num_rows == len(keys)
        flat = local[r].reshape(-1)
        sample = torch.arange(batch).repeat_interleave(local[r].shape[1])
        want_pos_row = [keys.index(int(b) * num_chunks + c) if c >= 0 and ok[b, c] else -1
                        for b, c in zip(sample.tolist(), flat.tolist())]
        assert rows.pos_row.tolist() == want_pos_row
        assert rows.count.tolist() == [total[k].item() for k in keys]
        assert rows.owned.tolist() == [owner[k].item() == r for k in keys]
        assert rows.split_keys.tolist() == split
        assert rows.split_owner.tolist() == [owner[k].item() for k in split]
        assert rows.split_slot.tolist() == [split.index(k) if k in split else -1 for k in keys]
        assert rows.key_count.tolist() == total.tolist()
        assert rows.key_owner.tolist() == owner.tolist()
        assert rows.local_rows.tolist() == [i for i, k in enumerate(keys) if k not in split]
        assert rows.split_rows.tolist() == [i for i, k in enumerate(keys) if k in split]
        owned_once[rows.keys[rows.owned]] += 1

        # blocks: consecutive, whole rows, and their block-relative views
        assert rows.blocks[0].start == 0 and rows.blocks[-1].end == flat.numel()
        assert rows.blocks[-1].row_end == len(keys)
        for i, blk in enumerate(rows.blocks):
            if i:
                prev = rows.blocks[i - 1]
                assert (blk.start, blk.row_start) == (prev.end, prev.row_end)
            held = rows.pos_row[blk.start: blk.end]
            assert sorted(set(held[held >= 0].tolist())) == list(range(blk.row_start,
                                                                       blk.row_end))
            seg = rows.block_seg[blk.start: blk.end]
            assert seg.tolist() == [p - blk.row_start if p >= 0 else -1 for p in held.tolist()]
            dummy = rows.block_seg_dummy[blk.start: blk.end]
            n_rows = blk.row_end - blk.row_start
            assert dummy.tolist() == [s if s >= 0 else n_rows for s in seg.tolist()]
            rel = range(blk.row_start, blk.row_end)
            want_local = [j - blk.row_start for j in rel if keys[j] not in split]
            want_split = [j - blk.row_start for j in rel if keys[j] in split]
            assert rows.local_of_block(i).tolist() == want_local
            assert rows.split_of_block(i).tolist() == want_split
            assert rows.all_local(i) == (not want_split)
    # every chunk with a position is counted by exactly one CP rank
    assert owned_once.tolist() == [1 if h else 0 for h in holders]


def test_single_rank_rows_and_refusals():
    """Without a CP group every chunk is held whole and owned; bad ids are refused by name."""
    ids = torch.tensor([[0, 0, 1, -1, 3, 3], [0, 2, 2, 2, -1, -1]])
    rows = build_chunk_rows(ids, 4, None, None, 3)
    assert rows.keys.tolist() == [0, 1, 3, 4, 6]
    assert rows.count.tolist() == [2.0, 1.0, 2.0, 1.0, 3.0]
    assert rows.owned.all() and (rows.split_slot == -1).all() and rows.split_keys.numel() == 0
    assert rows.key_owner.tolist() == [0, 0, -1, 0, 0, -1, 0, -1]
    assert [(b.start, b.end, b.row_start, b.row_end) for b in rows.blocks] == [
        (0, 3, 0, 2), (3, 6, 2, 3), (6, 10, 3, 5), (10, 12, 5, 5)]
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        build_chunk_rows(ids[0], 4, None, None, 3)
    with pytest.raises(ValueError, match="chunk id 4 out of range for 4"):
        build_chunk_rows(torch.tensor([[0, 4]]), 4, None, None, 3)
    with pytest.raises(ValueError, match="must not decrease"):
        build_chunk_rows(torch.tensor([[1, 0]]), 4, None, None, 3)
    # the last id may equal num_chunks - 1; a batch without any chunk gives no rows
    assert build_chunk_rows(torch.tensor([[3]]), 4, None, None, 1).keys.tolist() == [3]
    empty = build_chunk_rows(torch.full((2, 3), -1), 4, None, None, 2)
    assert empty.num_rows == 0 and all(b.row_end == 0 for b in empty.blocks)


def test_blocks_of_one_position_still_end_where_a_chunks_run_ends():
    """The smallest block size: each block runs to the end of the chunk run it reaches, the
    first (a three-position chunk at position 0) included, and holds that chunk's row whole."""
    ids = torch.tensor([[0, 0, 0, 1, 2, 2]])
    rows = build_chunk_rows(ids, 3, None, None, 1)
    assert [(b.start, b.end, b.row_start, b.row_end) for b in rows.blocks] == [
        (0, 3, 0, 1), (3, 4, 1, 2), (4, 6, 2, 3)]


def test_include_drops_the_first_chunk_of_the_first_sample_too():
    """An include mask that leaves out chunk 0 of sample 0 (the key 0) drops its row like any
    other chunk's."""
    ids = torch.tensor([[0, 0, 1, 2], [0, 1, 1, -1]])
    include = torch.tensor([[False, True, True], [True, False, True]])
    rows = build_chunk_rows(ids, 3, include, None, 4)
    assert rows.keys.tolist() == [1, 2, 3]
    assert rows.count.tolist() == [1.0, 1.0, 1.0]
