"""Gold / H-KL's CPU passes over a block straight from its logits, for a forward that writes
the gradient (one TP rank, forward KL, every chunk row of the block held whole).

Each chunk's positions are one run of the block (:mod:`blocks.chunk_rows`), so a chunk row's sums
can be made where its positions are read, and its gradient spread where they are written:

* :func:`forward_block`: per position its log-partition (a row maximum, one pass of exps), per
  chunk row the sum of its positions' logits in a buffer of the thread's (a row of V, in its
  cache), then :func:`cpu.gold_rows.forward_row` on that buffer. The logits are read from memory
  once; the [rows, V] raw sums are never written (they were: a logsumexp's two reads, an
  index_add's read and write, the row pass's read).
* :func:`spread_block`: per chunk row its raw gradient (:func:`cpu.gold_rows.gradient_row`) into
  the thread's buffer, then each of its positions' ``exp(x - lz) (coef + g_lz / T) + g / T``
  written over the logits or into the gradient; positions of no row get ``exp(x - lz) coef``.
  Was :func:`cpu.gold_rows.gradient_rows` writing [rows, V] and :func:`cpu.rows.exp_spread_`
  reading it back.

The numbers are those of the unfused passes (the same operations in the same order), which
stay for the other calls (the recomputing backward, CP-split chunks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.gold_rows import forward_row, gradient_row
from megatron_xdistill.loss.cpu.rows import FASTMATH, exp_row, exp_row_plus, logsumexp_of
from megatron_xdistill.loss.cpu.runs import row_runs, run_buffers
from megatron_xdistill.loss.cpu.sorted_l1 import SignRuns
from megatron_xdistill.loss.cpu.threads import use_torch_threads
from megatron_xdistill.loss.workspace import scratch


@dataclass
class GoldRowsGrad:
    """The raw gradient of a block's chunk rows, not yet written out: what
    :func:`spread_block` makes each row's from (its uncommon means, their sign runs, the
    teacher's rows, weight / count per row)."""

    a_unc: torch.Tensor
    runs: SignRuns
    table: torch.Tensor
    b_keys: torch.Tensor
    scale: torch.Tensor


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _forward_block(x, seg, counts, col_common, col_uncommon, b, b_keys, lz, a_unc, checksum,
                   kl, agree, sums, work, first, end, orphans):  # pragma: no cover
    rows, threads = a_unc.shape[0], sums.shape[0]
    num_orphans = row_runs(seg, first, end, orphans)
    for t in prange(threads):
        buf, w = sums[t], work[t]
        for r in range(rows * t // threads, rows * (t + 1) // threads):
            p0 = first[r]
            lz[p0] = logsumexp_of(x[p0])
            z = lz[p0]  # in the rows' dtype, summed in position order (as index_add)
            buf[:] = x[p0]
            for p in range(p0 + 1, end[r]):
                lz[p] = logsumexp_of(x[p])
                z += lz[p]
                xp = x[p]
                for v in range(buf.shape[0]):
                    buf[v] += xp[v]
            checksum[r], kl[r], agree[r] = forward_row(buf, z, counts[r], col_common,
                                                       col_uncommon, b[b_keys[r]], a_unc[r], w)
    for i in prange(num_orphans):
        p = orphans[i]
        lz[p] = logsumexp_of(x[p])


def forward_block(x: torch.Tensor, seg: torch.Tensor, num_rows: int, counts: torch.Tensor,
                  col_common: torch.Tensor, col_uncommon: torch.Tensor, b_table: torch.Tensor,
                  b_keys: torch.Tensor, lz_out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`cpu.gold_rows.forward_rows`' outputs (uncommon means, their fp64 sums, KL on the
    common columns, argmax agreement) of a block's ``num_rows`` chunk rows, from the block's
    logits / T ``x`` [n, V] (CPU, unit-stride rows) and ``seg`` [n] (each position's row, -1
    for none; a row's positions one run, rows in order); each position's log-partition into
    ``lz_out`` [n]. ``counts``: each row's positions (all in this block)."""
    n, width = x.shape
    dt = x.dtype
    threads = use_torch_threads()
    a_unc = x.new_empty(num_rows, col_uncommon.numel())
    checksum = torch.empty(num_rows, dtype=torch.float64)
    kl = torch.empty(num_rows, dtype=torch.float64)
    agree = torch.empty(num_rows, dtype=torch.bool)
    sums = scratch("gold_block_sums", threads * width, x.device, dt).view(threads, width)
    work = scratch("gold_block_work", threads * col_common.numel(), x.device, dt)
    arrays = [t.detach().contiguous().numpy() for t in (
        seg, counts.to(dt), col_common, col_uncommon, b_table, b_keys)]
    _forward_block(x.detach().numpy(), *arrays, lz_out.numpy(), a_unc.numpy(),
                   checksum.numpy(), kl.numpy(), agree.numpy(), sums.numpy(),
                   work.view(threads, col_common.numel()).numpy(), *run_buffers(n, num_rows))
    return a_unc, checksum, kl.to(dt), agree


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _spread_block(out, x, same, lz, coef, seg, alpha, a_unc, col_common, col_uncommon, b,
                  b_keys, scale, threshold, starts, signs, tie_values, tie_signs, grads,
                  slopes, e_work, g_lz, first, end, orphans):  # pragma: no cover - numba
    rows, threads = a_unc.shape[0], grads.shape[0]
    num_orphans = row_runs(seg, first, end, orphans)
    for t in prange(threads):
        g = grads[t]
        for r in range(rows * t // threads, rows * (t + 1) // threads):
            # in the rows' dtype, as the unfused passes' [rows] tensor of them
            g_lz[r] = gradient_row(a_unc[r], r, scale[r], b[b_keys[r]], col_common,
                                   col_uncommon, threshold, starts, signs, tie_values,
                                   tie_signs, g, slopes[t], e_work[t])
            for p in range(first[r], end[r]):
                c = coef[p] + alpha * g_lz[r]
                if same:  # one array to LLVM: vectorised (see cpu_rows._exp_spread_over)
                    xp = x[p]
                    exp_row_plus(xp, xp, lz[p], c, g, alpha)
                else:
                    exp_row_plus(out[p], x[p], lz[p], c, g, alpha)
    for i in prange(num_orphans):
        p = orphans[i]
        if same:
            xp = x[p]
            exp_row(xp, xp, lz[p], coef[p])
        else:
            exp_row(out[p], x[p], lz[p], coef[p])


def spread_block(out: torch.Tensor, x: torch.Tensor, lz: torch.Tensor, coef: torch.Tensor,
                 seg: torch.Tensor, grad: GoldRowsGrad, col_common: torch.Tensor,
                 col_uncommon: torch.Tensor, alpha: float) -> None:
    """``out[p] = exp(x[p] - lz[p]) (coef[p] + alpha g_lz[r]) + alpha g[r]`` for the
    positions p of chunk row r (``seg``, as :func:`forward_block`'s), ``exp(x[p] - lz[p])
    coef[p]`` for the others, with (g, g_lz) each row's raw gradient made from ``grad`` as it
    goes. ``out`` is ``x`` (written over) or does not overlap it; CPU, unit-stride rows."""
    n, width = x.shape
    dt = x.dtype
    threads = use_torch_threads()
    a = grad.a_unc
    same = (out.data_ptr() == x.data_ptr() and out.shape == x.shape
            and out.stride() == x.stride())
    dt_np = out.detach().numpy().dtype
    grads = scratch("gold_block_sums", threads * width, x.device, dt).view(threads, width)
    slopes = scratch("gold_block_slopes", threads * a.shape[1], x.device, dt)
    e_width = max(a.shape[1], col_common.numel())
    e_work = scratch("gold_block_work", threads * e_width, x.device, dt)
    arrays = [t.detach().to(dt).contiguous().numpy() if t.is_floating_point()
              else t.detach().contiguous().numpy()
              for t in (lz, coef, seg)]
    rest = [t.detach().contiguous().numpy() for t in (
        a, col_common, col_uncommon, grad.table, grad.b_keys, grad.scale.to(dt))]
    _spread_block(out.detach().numpy(), x.detach().numpy(), same, *arrays,
                  out.detach().numpy().dtype.type(alpha), *rest, *grad.runs.lookup(dt),
                  grads.numpy(), slopes.view(threads, a.shape[1]).numpy(),
                  e_work.view(threads, e_width).numpy(), np.empty(a.shape[0], dt_np),
                  *run_buffers(n, a.shape[0]))


__all__ = ["GoldRowsGrad", "forward_block", "spread_block"]
