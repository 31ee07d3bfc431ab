"""Gold / H-KL's per-chunk-row work on CPU (float32 / float64, one TP rank, forward KL): few
passes over a row instead of torch's many.

Two maps of :class:`kernels.gold.GoldKernel`:

* ``forward_rows``: a block's chunk rows of summed logits ``x`` [R, V] and log-partitions ->
  the uncommon chunk means ``a_u = (x[:, U] - lz) / count`` [R, |U|] (for the sort), the forward
  KL on the common columns ``sum_i p_i (b_i - a_i)`` (fp64 sums; the teacher's p = exp(b) in
  the same pass) and whether the student's and teacher's argmax on the common columns agree.
  One pass over each row; torch's way was two gathers, two subtractions, two divisions, the
  KL's four passes and two argmaxes, each over [R, |C|] or [R, |U|].
* ``gradient_rows``: the weighted KL's gradient on ``x`` [R, V] (vocabulary order) and on
  ``lz``: ``-w p_i / count`` on common column i, ``w sign_j exp(a_j) / count`` on uncommon
  column j (the L1's slope: :func:`cpu.sorted_l1.row_slopes`), and for lz minus their sum. One pass;
  was the slopes' pass, a concatenation, a product and a gather back into vocabulary order.

The exps are :func:`cpu.rows.fast_exp`'s, inside the passes (no [R, V] temporaries). The
block's logits gradient from these is :func:`cpu.rows.exp_spread_`'s, from the logits.
"""

from __future__ import annotations

import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.rows import fast_exp, first_argmax
from megatron_xdistill.loss.cpu.sorted_l1 import SignRuns, row_slopes
from megatron_xdistill.loss.cpu.threads import use_torch_threads
from megatron_xdistill.loss.workspace import scratch

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


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _means_rows(x, lz, counts, cols, out, checksum):  # pragma: no cover - numba
    for r in prange(x.shape[0]):
        checksum[r] = _means_row(x[r], lz[r], counts[r], cols, out[r])


@njit(inline="always", fastmath=_FAST)
def forward_row(xr, z, c, col_common, col_uncommon, br, a_unc, work):  # pragma: no cover
    """One chunk row of :func:`forward_rows` (summed logits ``xr`` [V], log-partition sum
    ``z``, ``c`` positions, the teacher's log-probs ``br`` on the common columns): writes the
    uncommon means into ``a_unc``; returns (their fp64 sum, the common part's KL, whether
    the argmaxes agree). ``work``: |C| scratch (the common means)."""
    checksum = _means_row(xr, z, c, col_uncommon, a_unc)
    _means_row(xr, z, c, col_common, work)
    total = 0.0
    for i in range(work.shape[0]):
        total += fast_exp(br[i]) * (br[i] - work[i])
    agree = work.shape[0] > 0 and first_argmax(work) == first_argmax(br)
    return checksum, total, agree


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _forward_rows(x, lz, counts, col_common, col_uncommon, b, b_keys, a_unc, checksum, kl,
                  agree, work):  # pragma: no cover - numba
    for r in prange(x.shape[0]):
        checksum[r], kl[r], agree[r] = forward_row(x[r], lz[r], counts[r], col_common,
                                                   col_uncommon, b[b_keys[r]], a_unc[r],
                                                   work[r])


@njit(inline="always", fastmath=_FAST)
def gradient_row(ar, r, w, br, col_common, col_uncommon, threshold, starts, signs, tie_values,
                 tie_signs, gr, slopes, e):  # pragma: no cover - numba
    """One chunk row of :func:`gradient_rows` (uncommon means ``ar``, row ``r`` of the sign
    runs, weight / count ``w``, the teacher's log-probs ``br``): writes the gradient on the
    summed logits into ``gr`` [V] (vocabulary order); returns the one on the log-partition
    sum. ``slopes`` [|U|], ``e`` [max(|U|, |C|)]: scratch."""
    for j in range(ar.shape[0]):
        e[j] = fast_exp(ar[j])
    row_slopes(ar, e, r, threshold, starts, signs, tie_values, tie_signs, slopes)
    mass = 0.0
    for i in range(br.shape[0]):  # e now takes the teacher's p (vectorised; the scatter
        e[i] = fast_exp(br[i])    # below is not)
        mass += e[i]
    for j in range(slopes.shape[0]):
        mass -= slopes[j]
    for i in range(br.shape[0]):
        gr[col_common[i]] = -e[i] * w
    for j in range(slopes.shape[0]):
        gr[col_uncommon[j]] = slopes[j] * w
    return w * mass


@njit(parallel=True, cache=True, nogil=True, fastmath=_FAST)
def _gradient_rows(a_unc, col_common, col_uncommon, b, b_keys, scale, threshold, starts,
                   signs, tie_values, tie_signs, g, g_lz, work, e_work
                   ):  # pragma: no cover - numba
    for r in prange(a_unc.shape[0]):
        g_lz[r] = gradient_row(a_unc[r], r, scale[r], b[b_keys[r]], col_common, col_uncommon,
                               threshold, starts, signs, tie_values, tie_signs, g[r], work[r],
                               e_work[r])


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
                 col_common: torch.Tensor, col_uncommon: torch.Tensor, b_table: torch.Tensor,
                 b_keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uncommon chunk means [R, |U|], their fp64 row sums, forward KL on the common columns
    [R] (fp64 sums, in x's dtype), student / teacher argmax agreement on them [R] bool) of
    chunk rows with summed logits ``x`` [R, V], log-partitions ``lz`` and ``counts``
    positions; the teacher's log-probs on the common columns (pair order of ``col_common``)
    are row ``b_keys[r]`` [R] of ``b_table`` (contiguous, x's dtype; e.g. the payload's)."""
    rows = x.shape[0]
    a_unc = x.new_empty(rows, col_uncommon.numel())
    checksum, kl = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float64)
    agree = torch.empty(rows, dtype=torch.bool)
    use_torch_threads()
    work = scratch("gold_rows", rows * col_common.numel(), x.device, x.dtype)
    _forward_rows(*_arrays(x, lz, counts.to(x.dtype), col_common, col_uncommon, b_table,
                          b_keys),
                  a_unc.numpy(), checksum.numpy(), kl.numpy(), agree.numpy(),
                  work.view(rows, col_common.numel()).numpy())
    return a_unc, checksum, kl.to(x.dtype), agree


def gradient_rows(a_unc: torch.Tensor, runs: SignRuns, col_common: torch.Tensor,
                  col_uncommon: torch.Tensor, b_table: torch.Tensor, b_keys: torch.Tensor,
                  scale: torch.Tensor, num_columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gradient on the rows' summed logits [R, ``num_columns``], on their log-partitions [R])
    of ``sum_r scale_r count_r KL_r`` (``scale`` = weight / count): see the module docstring.
    ``runs``: the L1's sign runs of ``a_unc`` (the uncommon chunk means); ``b_table`` /
    ``b_keys`` as :func:`forward_rows`' (in a_unc's dtype)."""
    dt = a_unc.dtype
    a = a_unc.detach().contiguous()
    g = a.new_empty(a.shape[0], num_columns)
    g_lz = a.new_empty(a.shape[0])
    width = max(a.shape[1], col_common.numel())  # a row's exp(a), then its teacher's p
    use_torch_threads()
    _gradient_rows(*_arrays(a, col_common, col_uncommon, b_table, b_keys, scale.to(dt)),
                   *runs.lookup(dt),
                   g.numpy(), g_lz.numpy(),
                   scratch("gold_rows", a.numel(), a.device, dt).view(a.shape).numpy(),
                   scratch("gold_rows_exp", a.shape[0] * width, a.device, dt)
                   .view(a.shape[0], width).numpy())
    return g, g_lz


__all__ = ["forward_row", "forward_rows", "gradient_row", "gradient_rows", "uncommon_means"]
