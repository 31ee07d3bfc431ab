"""W on its image on CPU: the Numba kernels of :class:`kernels.image_projection.ImageProjection`'s
two maps (a block's positions -> the projected mass q_I per chunk row; a gradient on q_I -> the
gradient on the block's logits).

They take all of a block's rows at once, transposed ([V, rows]): each of W's nonzeros is read
once a block and adds one contiguous vector of all the rows, and each line of W (a column of I
forward, a student row backward) is written by one thread. Eight rows at a time with the rows
kept as they are (one strided store per row and entry) was 3x slower at the 90 rows of a
16k-token block.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from megatron_xdistill.loss.collectives import Group, all_reduce
from megatron_xdistill.loss.cpu.rows import prefetch
from megatron_xdistill.loss.cpu.threads import use_torch_threads
from megatron_xdistill.loss.workspace import scratch

#: W entries ahead whose row of the transposed operand :func:`_combine_lines` asks the CPU to
#: fetch while it adds the current one (the operand is 4-33 MiB, out of L2; at 85 rows x |I|
#: 87,607, one thread: 11.7-14.1 -> 10.8-11.3 ms forward, 8.8-9.7 -> 7.1-7.4 ms backward; 16 and
#: 32 ahead no better, 2 no gain; none at 22 rows)
_AHEAD = 8
#: Rows :func:`_row_sums_t` sums before writing them transposed (one row at a time, each
#: store a line of its own: 4.3 -> 2.9 ms at 85 positions, 8.8 -> 4.7 at 120; 16: 3.4 / 6.7)
_ROW_BLOCK = 32
#: Positions ahead whose tile :func:`_row_sums_t` asks the CPU to fetch while it adds the current
#: one (each tile of a position is its own 1 KiB run, a page away from the last)
_SUMS_AHEAD = 2
#: Lines of a tile: the Numba kernels below work on [tile, rows] pieces of the transposed
#: operands (~20-90 KiB at 22-90 rows, within L2), written out or read in the rows' order.
_TILE = 256


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_sums_t(p, factor, order, row_off, mass_t):  # pragma: no cover - numba
    """mass_t[s, r] = sum of p[i, s] * factor[i] over row r's positions
    order[row_off[r]:row_off[r + 1]]: the rows' sums transposed ([V, rows]), a tile of
    columns at a time (parallel over tiles), :data:`_ROW_BLOCK` rows summed into an L1 piece
    before they are written (each store then fills a run of a line of mass_t)."""
    n, rows = p.shape[1], row_off.shape[0] - 1
    step, last = max(1, 64 // p.itemsize), order.shape[0] - _SUMS_AHEAD  # elements a line
    for tile in prange((n + _TILE - 1) // _TILE):
        s0 = tile * _TILE
        width = min(_TILE, n - s0)
        acc = np.empty((_ROW_BLOCK, width), mass_t.dtype)
        for r0 in range(0, rows, _ROW_BLOCK):
            block = min(_ROW_BLOCK, rows - r0)
            for b in range(block):
                a = acc[b]
                a[:] = 0.0
                for j in range(row_off[r0 + b], row_off[r0 + b + 1]):
                    if j < last:  # the tile of the position _SUMS_AHEAD on, on its way
                        ahead = order[j + _SUMS_AHEAD]
                        for k in range(s0, s0 + width, step):
                            prefetch(p, ahead, k)
                    i = order[j]
                    f, pi = factor[i], p[i, s0: s0 + width]
                    for s in range(width):
                        a[s] += pi[s] * f
            for s in range(width):
                m = mass_t[s0 + s]
                for b in range(block):
                    m[r0 + b] = acc[b, s]


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _combine_lines(x_t, offsets, index, value, out):  # pragma: no cover - numba
    """out[:, l] = sum over line l's entries e (offsets[l]:offsets[l + 1]) of value[e] *
    x_t[index[e]]: x_t [*, rows] holds all the block's rows transposed, so each W entry is
    read once a block and adds one contiguous vector; a tile of lines is summed into a
    [tile, rows] piece, then written into out [rows, lines] row by row (parallel over
    tiles: each writes its own columns of out)."""
    rows, lines = out.shape
    entries, step = index.shape[0], max(1, 64 // x_t.itemsize)  # elements a cache line
    for tile in prange((lines + _TILE - 1) // _TILE):
        l0 = tile * _TILE
        width = min(_TILE, lines - l0)
        piece = np.zeros((width, rows), out.dtype)
        for line in range(width):
            o = piece[line]
            for e in range(offsets[l0 + line], offsets[l0 + line + 1]):
                if e + _AHEAD < entries:  # the row an entry _AHEAD on reads, on its way
                    ahead = index[e + _AHEAD]
                    for k in range(0, rows, step):
                        prefetch(x_t, ahead, k)
                    prefetch(x_t, ahead, rows - 1)
                v, x = value[e], x_t[index[e]]
                for k in range(rows):
                    o[k] += v * x[k]
        for k in range(rows):
            ok = out[k]
            for line in range(width):
                ok[l0 + line] = piece[line, k]


#: Columns a tile of :func:`_transpose_into` takes (its [tile, rows] piece of dst in L1)
_TRANSPOSE_TILE = 64


@njit(parallel=True, cache=True, nogil=True)
def _transpose_into(src, dst):  # pragma: no cover - numba
    """dst [cols, rows] = src [rows, cols]^T, a tile of :data:`_TRANSPOSE_TILE` columns at a
    time (parallel over tiles), four rows of src read as runs together so that each row of
    the tile's piece of dst takes four adjacent stores. From memory, one thread: 1.56 / 1.29 ms
    at 60 x 40,132 / 23 x 109,827 against torch's copy of the transposed view 3.48 / 4.22 (a
    row at a time, tiles of 256: 1.65 / 1.84); in the loss, fresh from the KL's pass, at
    8,192 tokens, V_s 128,257: torch 0.94 s, a row at a time 0.74, four rows 0.48."""
    rows, cols = src.shape
    width = _TRANSPOSE_TILE
    for tile in prange((cols + width - 1) // width):
        c0 = tile * width
        c1 = min(c0 + width, cols)
        k = 0
        while k + 4 <= rows:
            s0, s1, s2, s3 = src[k], src[k + 1], src[k + 2], src[k + 3]
            for j in range(c0, c1):
                d = dst[j]
                d[k] = s0[j]
                d[k + 1] = s1[j]
                d[k + 2] = s2[j]
                d[k + 3] = s3[j]
            k += 4
        for r in range(k, rows):
            s = src[r]
            for j in range(c0, c1):
                dst[j, r] = s[j]


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_dots(p, factor, seg, h, dot):  # pragma: no cover - numba
    """dot[i] = <p_i, h[row of i]> factor[i] (this shard's part); 0 for positions of no row."""
    n = p.shape[1]
    for i in prange(p.shape[0]):
        row = seg[i]
        if row < 0:
            dot[i] = 0.0
            continue
        d = 0.0
        pi, hr = p[i], h[row]
        for s in range(n):
            d += pi[s] * hr[s]
        dot[i] = d * factor[i]


@njit(parallel=True, cache=True, nogil=True)
def _combine(out, factor, seg, h, dot, inv_t, coef):  # pragma: no cover - numba
    """out (this shard's softmax) <- p * (inv_t * (h[row] - dot) + coef), p = out * factor."""
    n = out.shape[1]
    for i in prange(out.shape[0]):
        f, row = factor[i], seg[i]
        if row < 0:
            c = f * coef[i]
            for s in range(n):
                out[i, s] *= c
        else:
            a = f * inv_t
            b = f * (coef[i] - inv_t * dot[i])
            hr = h[row]
            for s in range(n):
                out[i, s] = out[i, s] * (a * hr[s] + b)


def _row_runs(seg: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions that belong to a row, grouped by row; offsets [num_rows + 1] into them)."""
    order = torch.nonzero(seg >= 0, as_tuple=True)[0]
    rows = seg.index_select(0, order)
    counts = torch.bincount(rows, minlength=num_rows)
    _, perm = torch.sort(rows, stable=True)
    off = torch.zeros(num_rows + 1, dtype=torch.int64, device=seg.device)
    off[1:] = torch.cumsum(counts, 0)
    return order.index_select(0, perm), off


def by_lines(projection, x_t: torch.Tensor, by_column: bool, name: str) -> torch.Tensor:
    """All of a block's rows at once, by ``projection``'s lines (``ImageProjection``'s CSR /
    CSC arrays), from them transposed (``x_t`` [width, rows]):
    ``by_column`` x W_I ([rows, V_real] -> [rows, |I|], W's columns of I as lines), else
    x W_I^T ([rows, |I|] -> [rows, V_real], W's student rows as lines). Each W entry adds
    one contiguous vector of all the rows (eight rows at a time with one strided store a
    row and entry took 37 ms at 90 rows x |I| 87,607; this 10-16 ms, the transposes
    included). Returns a view of the scratch buffer ``name`` (valid until its next use)."""
    rows = x_t.shape[1]
    if by_column:
        offsets, index, lines = projection.ccol, projection.csc_student, projection.size
    else:
        offsets, index, lines = projection.crow, projection.col, projection.crow.numel() - 1
    out = scratch(name, rows * lines, x_t.device, x_t.dtype).view(rows, lines)
    use_torch_threads()
    _combine_lines(x_t.numpy(), offsets.numpy(), index.numpy(),
                   projection.weights(x_t.dtype, by_column).numpy(), out.numpy())
    return out


def project(projection, probs_local: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
            num_rows: int) -> torch.Tensor:
    """``ImageProjection.project`` on CPU tensors: [num_rows, |I|], a view of a reused
    buffer (valid until the next projection or :func:`backward_into`)."""
    order, off = _row_runs(seg, num_rows)
    use_torch_threads()
    n = probs_local.shape[1]
    mass_t = scratch("image_mass_t", n * num_rows, probs_local.device,
                     probs_local.dtype).view(n, num_rows)
    _row_sums_t(probs_local.numpy(), factor.contiguous().numpy(), order.numpy(),
                off.numpy(), mass_t.numpy())
    return by_lines(projection, mass_t, True, "image_q")


def backward_into(projection, out: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
                  grad_q: torch.Tensor, inv_t: float, coef: torch.Tensor, tp_group: Group
                  ) -> None:
    """``ImageProjection.backward_into`` on CPU tensors (``grad_q`` in ``out``'s dtype)."""
    num_rows = grad_q.shape[0]
    # The block's projection is read before its gradient is made: its two buffers
    # (same sizes) take the gradient transposed and h, unless the gradient is one.
    grad_t = scratch("image_q", grad_q.numel(), out.device, out.dtype)
    if grad_t.untyped_storage().data_ptr() == grad_q.untyped_storage().data_ptr():
        grad_t = scratch("image_grad_t", grad_q.numel(), out.device, out.dtype)
    grad_t = grad_t.view(projection.size, num_rows)
    _transpose_into(grad_q.contiguous().numpy(), grad_t.numpy())
    h = by_lines(projection, grad_t, False, "image_mass_t")
    dot = torch.zeros(out.shape[0], dtype=out.dtype)
    seg_np, factor_np = seg.contiguous().numpy(), factor.contiguous().numpy()
    _row_dots(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy())
    all_reduce(dot, tp_group)
    _combine(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy(), float(inv_t),
             coef.to(out.dtype).contiguous().numpy())


__all__ = ["backward_into", "by_lines", "project"]
