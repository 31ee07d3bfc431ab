"""Gold / H-KL's per-chunk-row work on CPU (float32 / float64, one TP rank, forward KL): few
passes over a row instead of torch's many.

Three maps of :class:`~.kernels.GoldKernel`:

* ``forward_rows``: a block's chunk rows of summed logits ``x`` [R, V] and log-partitions ->
  the uncommon chunk means ``a_u = (x[:, U] - lz) / count`` [R, |U|] (for the sort), the forward
  KL on the common columns ``sum_i p_i (b_i - a_i)`` (fp64 sums; the teacher's p = exp(b) by
  torch) and whether the student's and teacher's argmax on the common columns agree. One pass
  over each row; torch's way was two gathers, two subtractions, two divisions, the KL's four
  passes and two argmaxes, each over [R, |C|] or [R, |U|].
* ``gradient_rows``: the weighted KL's gradient on ``x`` [R, V] (vocabulary order) and on
  ``lz``: ``-w p_i / count`` on common column i, ``w sign_j exp(a_j) / count`` on uncommon
  column j (the L1's slope: :func:`.sorted_l1.row_slopes`), and for lz minus their sum. One pass
  (after torch's exp of a_u); was the slopes' pass, a concatenation, a product and a gather
  back into vocabulary order.
* ``spread_rows_``: a block's logits gradient from it, ``out[i] = out[i] * c_i + alpha
  g[row(i)]`` (``out`` holds the softmax): one pass; was a concatenation with a zero row, a
  [positions, V] gather and two passes.
"""

from __future__ import annotations

import math

import torch
from numba import njit, prange

from .numba_cpu import use_torch_threads
from .sorted_l1 import SignRuns, row_slopes
from .workspace import scratch

_FAST = {"reassoc", "contract"}  # sums may be reordered (vectorised); no other licence


@njit(cache=True, nogil=True, fastmath=_FAST)
def _means_row(xr, z, c, cols, out):  # pragma: no cover - numba
    """out = (xr[cols] - z) / c: a gather, then a vectorised pass; returns their fp64 sum."""
    for j in range(cols.shape[0]):
        out[j] = xr[cols[j]]
    total = 0.0
    for j in range(cols.shape[0]):
        out[j] = (out[j] - z) / c
        total += out[j]
    return total


@njit(cache=True, nogil=True, fastmath=_FAST)
def _first_max(v):  # pragma: no cover - numba
    """The first largest of a row, as torch.argmax (a row with a NaN has a NaN KL: its
    agreement is not looked at)."""
    best, arg = -math.inf, 0
    for i in range(v.shape[0]):
        if v[i] > best:
            best, arg = v[i], i
    return arg


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _means_rows(x, lz, counts, cols, out, checksum):  # pragma: no cover - numba
    for r in prange(x.shape[0]):
        checksum[r] = _means_row(x[r], lz[r], counts[r], cols, out[r])


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _forward_rows(x, lz, counts, col_common, col_uncommon, b, p, a_unc, checksum, kl, agree,
                  work):  # pragma: no cover - numba
    for r in prange(x.shape[0]):
        xr, z, c, br, pr, a = x[r], lz[r], counts[r], b[r], p[r], work[r]
        checksum[r] = _means_row(xr, z, c, col_uncommon, a_unc[r])
        _means_row(xr, z, c, col_common, a)
        total = 0.0
        for i in range(a.shape[0]):
            total += pr[i] * (br[i] - a[i])
        kl[r] = total
        agree[r] = a.shape[0] > 0 and _first_max(a) == _first_max(br)


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _gradient_rows(a_unc, e_unc, col_common, col_uncommon, p, scale, threshold, starts, signs,
                   tie_values, tie_signs, g, g_lz, work):  # pragma: no cover - numba
    for r in prange(a_unc.shape[0]):
        w, gr, pr, slopes = scale[r], g[r], p[r], work[r]
        row_slopes(a_unc[r], e_unc[r], r, threshold, starts, signs, tie_values, tie_signs,
                   slopes)
        mass = 0.0
        for i in range(pr.shape[0]):
            mass += pr[i]
        for j in range(slopes.shape[0]):
            mass -= slopes[j]
        for i in range(pr.shape[0]):
            gr[col_common[i]] = -pr[i] * w
        for j in range(slopes.shape[0]):
            gr[col_uncommon[j]] = slopes[j] * w
        g_lz[r] = w * mass


@njit(parallel=True, cache=True, nogil=True)
def _spread_rows(out, coef, seg, g, alpha):  # pragma: no cover - numba
    rows = g.shape[0]
    for i in prange(out.shape[0]):
        o, c, r = out[i], coef[i], seg[i]
        if 0 <= r < rows:
            gr = g[r]
            for v in range(o.shape[0]):
                o[v] = o[v] * c + alpha * gr[v]
        else:
            for v in range(o.shape[0]):
                o[v] *= c


def _arrays(*tensors: torch.Tensor):
    """NumPy views of contiguous CPU tensors (detached)."""
    return [t.detach().contiguous().numpy() for t in tensors]


def uncommon_means(x: torch.Tensor, lz: torch.Tensor, counts: torch.Tensor,
                   col_uncommon: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``(x[:, U] - lz) / count`` [R, |U|], their fp64 row sums): the same values as
    :func:`forward_rows` gives (the sums check that the L1's memo holds runs of them)."""
    out = x.new_empty(x.shape[0], col_uncommon.numel())
    checksum = torch.empty(x.shape[0], dtype=torch.float64)
    use_torch_threads()
    _means_rows(*_arrays(x, lz, counts.to(x.dtype), col_uncommon), out.numpy(),
                checksum.numpy())
    return out, checksum


def forward_rows(x: torch.Tensor, lz: torch.Tensor, counts: torch.Tensor,
                 col_common: torch.Tensor, col_uncommon: torch.Tensor, b_common: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uncommon chunk means [R, |U|], their fp64 row sums, forward KL on the common columns
    [R] (fp64 sums, in x's dtype), student / teacher argmax agreement on them [R] bool) of
    chunk rows with summed logits ``x`` [R, V], log-partitions ``lz`` and ``counts``
    positions; ``b_common`` [R, |C|] the teacher's log-probs on the common columns (pair order
    of ``col_common``)."""
    rows = x.shape[0]
    b = b_common.to(x.dtype).contiguous()
    p = torch.exp(b)
    a_unc = x.new_empty(rows, col_uncommon.numel())
    checksum, kl = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float64)
    agree = torch.empty(rows, dtype=torch.bool)
    use_torch_threads()
    work = scratch("gold_rows", rows * col_common.numel(), x.device, x.dtype)
    _forward_rows(*_arrays(x, lz, counts.to(x.dtype), col_common, col_uncommon, b, p),
                  a_unc.numpy(), checksum.numpy(), kl.numpy(), agree.numpy(),
                  work.view(rows, col_common.numel()).numpy())
    return a_unc, checksum, kl.to(x.dtype), agree


def gradient_rows(a_unc: torch.Tensor, runs: SignRuns, col_common: torch.Tensor,
                  col_uncommon: torch.Tensor, b_common: torch.Tensor, scale: torch.Tensor,
                  num_columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient on the rows' summed logits [R, ``num_columns``], on their log-partitions [R])
    of ``sum_r scale_r count_r KL_r`` (``scale`` = weight / count): see the module docstring.
    ``runs``: the L1's sign runs of ``a_unc`` (the uncommon chunk means)."""
    dt = a_unc.dtype
    a = a_unc.detach().contiguous()
    g = a.new_empty(a.shape[0], num_columns)
    g_lz = a.new_empty(a.shape[0])
    use_torch_threads()
    _gradient_rows(*_arrays(a, torch.exp(a), col_common, col_uncommon,
                            torch.exp(b_common.to(dt)), scale.to(dt)),
                   *runs.lookup(dt),
                   g.numpy(), g_lz.numpy(),
                   scratch("gold_rows", a.numel(), a.device, dt).view(a.shape).numpy())
    return g, g_lz


def spread_rows_(out: torch.Tensor, coef: torch.Tensor, seg: torch.Tensor, g: torch.Tensor,
                 alpha: float) -> None:
    """``out[i] = out[i] * coef[i] + alpha * g[seg[i]]`` in place (``seg[i]`` outside [0, R):
    ``out[i] * coef[i]``); ``out`` [n, V] contiguous, ``g`` [R, V]."""
    use_torch_threads()
    _spread_rows(out.numpy(), *_arrays(coef.to(out.dtype), seg, g.to(out.dtype)), alpha)


__all__ = ["forward_rows", "gradient_rows", "spread_rows_", "uncommon_means"]
