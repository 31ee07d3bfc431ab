"""The n largest values of each row, sorted descending, differentiable: gold's uncommon part
(values for :mod:`cpu.sorted_l1`; values and columns where it does not run: TP > 1, the ranks'
candidates are merged).

``torch.topk`` with large n (gold sorts up to 8,192 of the ~tens of thousands of uncommon
columns per chunk) is slow on CPU: about 0.8 ms per row of 24,576 floats, the largest cost of the
gold / H-KL loss. NumPy's partition + sort take 0.1-0.4 ms (0.4 where its sort is not SIMD, as on
AMD EPYC CPUs). On CPU float32 / float64 a Numba kernel does it in linear time, ~0.07 ms: each
value becomes an unsigned key in the same order as the floats (IEEE bits, sign-flipped), a
4,096-bucket histogram of the keys' top bits finds the bucket holding the n-th largest, the
values at or above that bucket (n plus part of one bucket) go through an LSD radix sort (12 bits
a pass), and the n largest are written back as floats, bit for bit the input's. Only a call that
will be differentiated (the loss recomputes each block under autograd for its backward) carries
the columns. Other devices keep ``torch.topk``.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.threads import numba_takes, use_torch_threads

_DIGIT = 12  # bits per radix pass: of 11-14 and 16, the fastest (2,900 rows x 24,576 fp32:
#             12 bits 0.21 s, 11 0.28, 13 0.22, 14 0.25, 16 0.44; 10% -inf: 0.11 vs 0.22 at 11)
_BINS = 1 << _DIGIT
_ONES64 = 0xFFFFFFFFFFFFFFFF


@njit(inline="always")
def _key(b, width):  # pragma: no cover - numba
    """A float's IEEE bits (``width`` 32 or 64, as uint64) -> an unsigned key of the same order:
    negative floats have every bit flipped, positive ones the sign bit set."""
    sign = np.uint64(1) << np.uint64(width - 1)
    flip = np.uint64(_ONES64) >> np.uint64(64 - width)
    return b ^ (flip if b & sign else sign)


@njit(inline="always")
def _unkey(k, width):  # pragma: no cover - numba
    """The inverse of :func:`_key`."""
    sign = np.uint64(1) << np.uint64(width - 1)
    flip = np.uint64(_ONES64) >> np.uint64(64 - width)
    return k ^ (sign if k & sign else flip)


@njit(inline="always")
def _bit_length(x):  # pragma: no cover - numba
    nb = 0
    while x:
        x >>= np.uint64(1)
        nb += 1
    return nb


@njit(inline="always")
def _radix_sort(keys, cols, tmp_keys, tmp_cols, count, bits, with_cols, hist
                ):  # pragma: no cover - numba
    """Sort ``keys[:count]`` ascending (``cols`` along when ``with_cols``), ``bits`` wide, by
    LSD passes (``hist``: [_BINS] scratch); returns the arrays that hold the result."""
    mask = np.uint64(_BINS - 1)
    for p in range((bits + _DIGIT - 1) // _DIGIT):
        shift = np.uint64(p * _DIGIT)
        hist[:] = 0
        for i in range(count):
            hist[(keys[i] >> shift) & mask] += 1
        total = 0
        for d in range(_BINS):
            h = hist[d]
            hist[d] = total
            total += h
        for i in range(count):
            d = (keys[i] >> shift) & mask
            tmp_keys[hist[d]] = keys[i]
            if with_cols:
                tmp_cols[hist[d]] = cols[i]
            hist[d] += 1
        keys, tmp_keys = tmp_keys, keys
        cols, tmp_cols = tmp_cols, cols
    return keys, cols


@njit(cache=True, nogil=True)
def _top_row(bits, r, n, width, out_bits, out_cols, keys, cand, cols, tmp, tmp_cols, hist
             ):  # pragma: no cover - numba
    """out_bits[r] = the n largest of row r (IEEE bits, ``width`` 32 / 64), descending; their
    columns to ``out_cols`` unless it has no columns. The rest: the thread's scratch."""
    m = bits.shape[1]
    with_cols = out_cols.shape[1] > 0
    low, high = np.uint64(_ONES64), np.uint64(0)
    for i in range(m):
        k = _key(np.uint64(bits[r, i]), width)
        keys[i] = k
        low, high = min(low, k), max(high, k)
    shift = np.uint64(max(_bit_length(high - low) - _DIGIT, 0))
    hist[:] = 0
    for i in range(m):
        hist[(keys[i] - low) >> shift] += 1
    b, count = _BINS - 1, hist[_BINS - 1]
    while count < n:  # the bucket that holds the n-th largest
        b -= 1
        count += hist[b]
    floor = low + (np.uint64(b) << shift)
    c = 0  # keys at or above that bucket, relative to its floor
    for i in range(m):  # branch-free: a write per value, the count moves on the kept ones
        k = keys[i]
        cand[c] = k - floor
        if with_cols:
            cols[c] = i
        c += k >= floor
    out, out_c = _radix_sort(cand, cols, tmp, tmp_cols, c, _bit_length(high - floor),
                             with_cols, hist)
    for j in range(n):
        out_bits[r, j] = _unkey(out[c - 1 - j] + floor, width)
        if with_cols:
            out_cols[r, j] = out_c[c - 1 - j]


@njit(parallel=True, cache=True, nogil=True)
def _top_rows(bits, n, width, out_bits, out_cols, threads):  # pragma: no cover - numba
    """:func:`_top_row` of every row, the rows split evenly over ``threads``; each thread's
    scratch allocated once (a row's allocations churned the C heap: its trims and page faults
    doubled the sort's time once nothing else kept the heap grown)."""
    rows, m = bits.shape
    mc = m if out_cols.shape[1] > 0 else 0
    for t in prange(threads):
        keys, cand, tmp = (np.empty(m, np.uint64), np.empty(m, np.uint64),
                           np.empty(m, np.uint64))
        cols, tmp_cols = np.empty(mc, np.int64), np.empty(mc, np.int64)
        hist = np.empty(_BINS, np.int64)
        for r in range(rows * t // threads, rows * (t + 1) // threads):
            _top_row(bits, r, n, width, out_bits, out_cols, keys, cand, cols, tmp, tmp_cols,
                     hist)


def top_values(a: np.ndarray, n: int, with_columns: bool = False,
               out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """(the ``n`` largest values of each row of ``a`` [r, m] (float32 / float64, 1 <= n <= m),
    descending; their columns [r, n] int64 or None). Equal values come in any order.
    ``out``: where the values go ([r, n], a's dtype, C-contiguous), else a new array."""
    uint = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}[a.dtype]
    values = np.empty((a.shape[0], n), a.dtype) if out is None else out
    cols = np.empty((a.shape[0], n if with_columns else 0), np.int64)
    threads = max(1, min(use_torch_threads(), a.shape[0]))
    _top_rows(np.ascontiguousarray(a).view(uint), n, 8 * a.itemsize, values.view(uint), cols,
              threads)
    return values, (cols if with_columns else None)


class _SortedTop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        values, cols = top_values(x.detach().numpy(), n, with_columns=ctx.needs_input_grad[0])
        ctx.save_for_backward(torch.from_numpy(cols) if cols is not None
                              else torch.empty(0, dtype=torch.int64))
        ctx.width = x.shape[1]
        return torch.from_numpy(values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (cols,) = ctx.saved_tensors
        out = grad.new_zeros(grad.shape[0], ctx.width)
        return out.scatter_(1, cols, grad), None


#: Whether the Numba kernel sorts ``x`` (CPU fp32 / fp64); elsewhere ``torch.topk``.
_numba_path = numba_takes


def sorted_top(x: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` largest values of each row of ``x`` [r, m] (n <= m), sorted descending;
    differentiable (the gradient goes to the columns they came from)."""
    if n == 0:
        return x[:, :0]
    if _numba_path(x):
        return _SortedTop.apply(x, n)
    return x.topk(n, dim=1).values


def sorted_top_columns(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ``n`` largest values of each row of ``x`` [r, m] (n <= m), descending; their
    columns int64 [r, n]), not differentiable: for a caller that writes its gradient itself."""
    if n == 0:
        return x[:, :0], torch.zeros(x.shape[0], 0, dtype=torch.int64, device=x.device)
    if _numba_path(x):
        values, cols = top_values(x.detach().numpy(), n, with_columns=True)
        return torch.from_numpy(values), torch.from_numpy(cols)
    values, cols = x.topk(n, dim=1)
    return values, cols


__all__ = ["sorted_top", "sorted_top_columns", "top_values"]
