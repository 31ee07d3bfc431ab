"""The loss's two fast building blocks against plain dense computations.

``ImageProjection`` (the exact P-KL's projection onto the image of W; Numba on CPU, torch on other
devices: both paths run here) against a dense [V_s, V_t] product; ``sorted_top`` (gold's sorted
uncommon values; NumPy on CPU) against ``torch.topk``, values and gradients.
"""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.loss.image_projection import ImageProjection
from megatron_xdistill.loss.shard import ProjectionShard
from megatron_xdistill.loss.sorted_top import sorted_top

VS, VT = 40, 90


def _shard(seed: int = 0) -> tuple[ProjectionShard, torch.Tensor]:
    """A W with up to 3 entries per row, some empty rows, and its dense form."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, VT, (VS, 3), generator=gen)
    w = torch.rand(VS, 3, generator=gen, dtype=torch.float64)
    idx[torch.rand(VS, 3, generator=gen) < 0.3] = -1
    idx[:3] = -1
    dense = torch.zeros(VS, VT, dtype=torch.float64)
    for s in range(VS):
        for j in range(3):
            if idx[s, j] >= 0:
                dense[s, idx[s, j]] += w[s, j].float().double()
    return ProjectionShard(idx, w.float(), 0, VT), dense


def _block(seed: int, dtype: torch.dtype):
    """Positions of 5 rows (runs of 1-3 positions, some positions in no row)."""
    gen = torch.Generator().manual_seed(seed)
    seg = torch.tensor([-1, 0, 0, 1, -1, 2, 2, 2, 3, 4, -1, 4])
    probs = torch.softmax(torch.randn(seg.numel(), VS, generator=gen, dtype=torch.float64), 1)
    factor = torch.rand(seg.numel(), generator=gen, dtype=torch.float64) + 0.5
    return probs.to(dtype), factor.to(dtype), seg


@pytest.mark.parametrize("use_numba", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_image_projection_equals_the_dense_product(use_numba, dtype):
    shard, dense = _shard()
    proj = ImageProjection.build(shard, VS, None)
    assert torch.equal(proj.image, torch.nonzero(dense.sum(0) > 0, as_tuple=True)[0])
    probs, factor, seg = _block(1, dtype)
    got = proj.project(probs, factor, seg, 5, use_numba=use_numba)
    p = probs.double() * factor.double()[:, None]
    rows = torch.stack([p[seg == r].sum(0) for r in range(5)])
    want = (rows @ dense)[:, proj.image]
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("use_numba", [True, False])
def test_image_projection_backward_equals_autograd_of_the_dense_product(use_numba):
    """backward_into leaves the gradient on logits / T of sum <g, q_I> (x inv_t) plus coef * p,
    where p = softmax over the whole vocabulary = probs_local * factor (one TP rank here)."""
    shard, dense = _shard(2)
    proj = ImageProjection.build(shard, VS, None)
    gen = torch.Generator().manual_seed(3)
    seg = torch.tensor([-1, 0, 0, 1, -1, 2, 2, 2, 3, 4, -1, 4])
    x = torch.randn(seg.numel(), VS, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(5, proj.size, generator=gen, dtype=torch.float64)
    coef = torch.randn(seg.numel(), generator=gen, dtype=torch.float64)
    inv_t = 0.5
    p = torch.softmax(x, 1)
    rows = torch.stack([p[seg == r].sum(0) for r in range(5)])
    (inv_t * ((rows @ dense)[:, proj.image] * g).sum()).backward()
    want = x.grad + coef[:, None] * p.detach()
    out = p.detach().clone()
    proj.backward_into(out, torch.ones(seg.numel(), dtype=torch.float64), seg, g, inv_t, coef,
                       None, use_numba=use_numba)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("n", [1, 7, 50])
def test_sorted_top_equals_topk_with_its_gradient(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    x[0, :10] = float("-inf")  # a short shard's padding
    weight = torch.randn(6, n, generator=gen, dtype=torch.float64)
    mine = x.clone().requires_grad_(True)
    (sorted_top(mine, n) * weight).sum().backward()
    ref = x.clone().requires_grad_(True)
    (ref.topk(n, dim=1).values * weight).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(sorted_top(x, n), x.topk(n, dim=1).values)
    finite = torch.isfinite(x)  # tied -inf pads may be taken in any order (exp(-inf) = 0 in gold)
    torch.testing.assert_close(mine.grad[finite], ref.grad[finite])


@pytest.mark.parametrize("block_tokens", [1, 3, 7, 50, 10_000])
def test_blocks_end_where_chunks_end_and_hold_their_rows_whole(block_tokens):
    """Blocks cover the positions in order, each at least ``block_tokens`` long (but the
    last), ending where a chunk's run of positions ends; each holds its rows whole."""
    from megatron_xdistill.loss.chunk_rows import build_chunk_rows

    gen = torch.Generator().manual_seed(block_tokens)
    steps = torch.randint(0, 3, (2, 60), generator=gen)  # chunk ids: runs of 1+ positions
    ids = torch.cumsum(steps, 1) // 2
    dropped = torch.rand(int(ids.max()) + 1, generator=gen) < 0.2  # chunks no position predicts
    ids[dropped[ids]] = -1
    ids[1, 50:] = -1  # padding
    rows = build_chunk_rows(ids, int(ids.max()) + 1, None, None, block_tokens)
    pos_row = rows.pos_row
    start, row = 0, 0
    for blk in rows.blocks:
        assert blk.start == start and blk.row_start == row
        assert blk.end - blk.start >= block_tokens or blk.end == 120
        if blk.end < 120:  # not inside a run of one chunk's positions
            assert pos_row[blk.end] < 0 or pos_row[blk.end] != pos_row[blk.end - 1]
        held = pos_row[blk.start: blk.end]
        held = held[held >= 0]
        assert held.unique().tolist() == list(range(blk.row_start, blk.row_end))
        start, row = blk.end, blk.row_end
    assert start == 120 and row == rows.num_rows


@pytest.mark.parametrize("seed", range(4))
def test_each_blocks_rows_held_whole_or_split_are_found_once(seed):
    """The per-block row selections found once per call (concatenated, with offsets) equal a
    per-block search, relative to each block's first row; blocks without rows, or without
    selected rows, get none."""
    from megatron_xdistill.loss.chunk_rows import Block, _rows_by_block

    gen = torch.Generator().manual_seed(seed)
    num_rows = 40
    cuts = sorted({0, num_rows, *torch.randint(0, num_rows, (6,), generator=gen).tolist()})
    cuts = [0, 0, *cuts[1:]]  # a first block without rows
    blocks = [Block(3 * a, 3 * b, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    selected = torch.rand(num_rows, generator=gen) < (0.1 if seed == 0 else 0.6)
    flat, off = _rows_by_block(selected, blocks)
    assert len(off) == len(blocks) + 1 and off[0] == 0 and off[-1] == int(selected.sum())
    for i, blk in enumerate(blocks):
        want = torch.nonzero(selected[blk.row_start: blk.row_end], as_tuple=True)[0]
        assert flat[off[i]: off[i + 1]].tolist() == want.tolist()


def test_default_blocks_on_an_accelerator_fill_the_memory_share_and_cpu_keeps_its_rule():
    """Accelerators: the per-block kernels (exact and gold forms) take the largest block whose
    temporaries (``block_buffers`` fp32 [block, V] buffers) stay within BLOCK_MEMORY_SHARE of the
    logits, never smaller than the CPU rule; CPU and the column forms keep 64 MiB / 16 MiB
    blocks and their share of the positions."""
    from megatron_xdistill.loss.block_size import BLOCK_MEMORY_SHARE, block_positions
    from megatron_xdistill.loss.kernel_choice import NoKernel
    from megatron_xdistill.loss.kernels import ColumnsKernel, DenseKernel, GoldKernel

    n, v = 16384, 49152
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for kernel in (GoldKernel, DenseKernel):
        assert block_positions(kernel, n, v, 4, cpu) == (64 << 20) // (4 * v * 4) == 85
        for itemsize in (4, 2):  # fp32 and bf16 logits
            p = block_positions(kernel, n, v, itemsize, cuda)
            budget = BLOCK_MEMORY_SHARE * n * v * itemsize
            fits = int(budget // (4 * v * kernel.block_buffers))  # largest block in the share
            assert fits * 4 * v * kernel.block_buffers <= budget
            assert budget < (fits + 1) * 4 * v * kernel.block_buffers
            assert p == max(85, fits)
        assert block_positions(kernel, 100, v, 4, cuda) == 1  # the CPU rule's 1/128 share
    assert block_positions(GoldKernel, n, v, 4, cuda) == 264
    assert block_positions(DenseKernel, n, v, 4, cuda) == 133
    assert block_positions(GoldKernel, n, v, 4, cuda, 512 << 20) == 682  # as asked, a quarter
    for kernel in (ColumnsKernel, NoKernel):
        assert block_positions(kernel, n, v, 4, cuda) == block_positions(kernel, n, v, 4, cpu) \
            == (64 << 20) // (4 * v)
