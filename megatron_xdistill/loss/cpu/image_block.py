"""The exact form's CPU pass over a block straight from its logits, for a forward that writes
the gradient (one TP rank, forward KL over an ``image`` payload, every chunk row of the block
held whole): a chunk row at a time, from its positions' logits to their gradient, with
everything of the row's in the thread's caches.

Each chunk's positions are one run of the block (:mod:`blocks.chunk_rows`), so per chunk row r:

1. each position's softmax ``exp(x - shift) / sum`` written where its gradient goes (over the
   logits, or into the gradient), its log-partition saved, their sum m_r [V] in a buffer of the
   thread's;
2. u_r = m_r W on I: a student token that maps to one teacher token with weight 1 (80-85% of a
   real W's rows: 39,238 of 49,152 SmolLM2 -> Qwen2.5, 109,713 of 128,257 Llama-3 -> Qwen2)
   adds its mass to one column (one int32 an element), the other rows by their own entries;
3. the forward KL on I against the payload row (as :func:`cpu.image_rows.image_kl_on_image`), its
   gradient g on u_r;
4. h = W_I g [V] (a gather for the one-entry rows) into m's buffer, then each position's
   gradient ``p (alpha (h - <p, h>) + coef)`` over its softmax, still in the caches.

Each logit is read once from memory and its gradient written once; W's entries are read twice a
row, from the caches. The blockwise passes it replaces (the rows' sums transposed, W's two
products over all of a block's rows, the gradient's transpose, the dots and the combine) read
and wrote [rows, V] and [rows, |I|] buffers out of the caches. The numbers are those of the
blockwise passes up to the order of sums, which stay for every other call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.projected import SUM_RUN, cross_grad_piece, rows_in_place
from megatron_xdistill.loss.cpu.rows import (
    EXP_PIECE,
    FASTMATH,
    cast_like,
    exp_row,
    exp_sum_row,
    first_argmax,
    logsumexp_of,
)
from megatron_xdistill.loss.cpu.runs import row_runs, run_buffers
from megatron_xdistill.loss.cpu.threads import use_torch_threads
from megatron_xdistill.loss.definitions.common import EPS, TINY
from megatron_xdistill.loss.workspace import scratch


@dataclass
class RowLayout:
    """W on I by student rows, as the row pass reads it: ``single[s]`` the one column of I of
    a row with one entry of weight 1, ``|I|`` (a spare column, its gradient 0) for the
    others, whose entries are ``multi_*`` (row, column, weight each, in row order: one flat
    loop, no loop per row: 35 -> 19 us a chunk row for u, 56 -> 46 for h, 9,897 such rows
    of the SmolLM2 -> Qwen2.5 W)."""

    single: torch.Tensor     # [V_real] int32
    multi_row: torch.Tensor  # [E'] int32
    multi_col: torch.Tensor  # [E'] int32
    multi_val: torch.Tensor  # [E'] the compute dtype

    @classmethod
    def of(cls, crow: torch.Tensor, col: torch.Tensor, val: torch.Tensor, width: int,
           dtype: torch.dtype) -> RowLayout:
        """From W on I in CSR over the student rows (``crow`` [V_real + 1], ``col``, ``val``;
        ``width`` = |I|)."""
        counts = crow[1:] - crow[:-1]
        one = counts == 1
        if col.numel():
            first = crow[:-1].clamp_max(col.numel() - 1)
            one &= val.index_select(0, first) == 1.0
            single = torch.where(one, col.index_select(0, first), width)
        else:
            single = torch.full_like(counts, width)
        row = torch.repeat_interleave(torch.arange(counts.numel()), counts)
        multi = ~one.index_select(0, row)
        return cls(single.to(torch.int32), row[multi].to(torch.int32),
                   col[multi].to(torch.int32), val[multi].to(dtype))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return tuple(t.numpy() for t in (self.single, self.multi_row, self.multi_col,
                                         self.multi_val))


@njit(inline="always", fastmath=FASTMATH)
def _project(m, q, single, multi_row, multi_col, multi_val):  # pragma: no cover - numba
    """q[:|I|] = m W on I (q[|I|] takes the mass of the rows of other entries: not read)."""
    q[:] = 0.0
    for v in range(m.shape[0]):
        q[single[v]] += m[v]
    for e in range(multi_row.shape[0]):
        q[multi_col[e]] += m[multi_row[e]] * multi_val[e]


@njit(inline="always", fastmath=FASTMATH)
def _back_project(g, h, single, multi_row, multi_col, multi_val):  # pragma: no cover - numba
    """h = W_I g [V] (g[|I|] is 0: the rows of other entries start from it)."""
    for v in range(h.shape[0]):
        h[v] = g[single[v]]
    for e in range(multi_row.shape[0]):
        h[multi_row[e]] += multi_val[e] * g[multi_col[e]]


@njit(inline="always", fastmath=FASTMATH)
def _kl_on_image(u, mult, row, eps, tiny, scale, zero):  # pragma: no cover - numba
    """(sum_I P log(q + eps), u's first argmax) of U = mult u (u [|I| + 1]) against the payload
    row P on I, q = U / max(sum U, tiny); then u[:|I|] <- the gradient on U, scale / max(sum U,
    tiny) (c - P / (q + eps)), c = sum_I P q / (q + eps) where sum U >= tiny (else 0: the
    floor holds the total), u[|I|] <- 0 (as :func:`cpu.image_rows.image_kl_on_image`; sums in
    fp64 over :data:`SUM_RUN` pieces). Written over u: one buffer of |I| in the caches, not
    two."""
    width = row.shape[0]
    at = first_argmax(u[:width]) if width else 0
    total = 0.0
    for s0 in range(0, width, SUM_RUN):
        us = u[s0: min(s0 + SUM_RUN, width)]
        part = zero
        for k in range(us.shape[0]):
            part += us[k]
        total += part
    total *= mult
    floored = total < tiny
    inv = 1.0 / max(total, tiny)
    inv_c = cast_like(inv, zero)
    q_of_u = cast_like(inv * mult, zero)
    cross = 0.0
    c = 0.0
    for s0 in range(0, width, SUM_RUN):
        s1 = min(s0 + SUM_RUN, width)
        us = u[s0:s1]
        x, y = cross_grad_piece(us, row[s0:s1], us, q_of_u, eps, zero)
        cross += x
        c += y
    if floored:
        c = 0.0
    sr = scale * inv_c
    cc = cast_like(c, zero)
    for k in range(width):
        u[k] = sr * (cc - u[k])
    u[width] = zero
    return cross, at


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _image_block(x, out, same, seg, coef, alpha, single, multi_row, multi_col, multi_val, pp,
                 keys, scale, eps, tiny, zero, lz, inv_pos, cross, at, mass, qs, pieces, first,
                 end, orphans):  # pragma: no cover - numba
    rows, threads = cross.shape[0], mass.shape[0]
    num_orphans = row_runs(seg, first, end, orphans)
    for t in prange(threads):
        m, q, buf = mass[t], qs[t], pieces[t]
        for r in range(rows * t // threads, rows * (t + 1) // threads):
            p0, p1 = first[r], end[r]
            alone = p1 - p0 == 1  # u from the position's exps, times 1 / their sum
            for p in range(p0, p1):  # 1. the positions' softmaxes, summed into m
                xp = x[p]
                if same:  # one array to LLVM: vectorised
                    shift, total = exp_sum_row(xp, xp, buf, True)
                    o = xp
                else:
                    o = out[p]
                    shift, total = exp_sum_row(o, xp, buf, False)
                lz[p] = shift + np.log(total)
                iv = cast_like(1.0 / total, zero)
                inv_pos[p] = iv
                if not alone:
                    if p == p0:
                        for v in range(m.shape[0]):
                            m[v] = o[v] * iv
                    else:
                        for v in range(m.shape[0]):
                            m[v] += o[v] * iv
            # 2.-3. u on I, the KL and its gradient g on u (over u)
            if alone:
                _project(x[p0] if same else out[p0], q, single, multi_row, multi_col,
                         multi_val)
                mult = inv_pos[p0]
            else:
                _project(m, q, single, multi_row, multi_col, multi_val)
                mult = zero + 1.0
            cross[r], at[r] = _kl_on_image(q, mult, pp[keys[r]], eps, tiny, scale[r], zero)
            # 4. h = W_I g over m, then each position's gradient
            _back_project(q, m, single, multi_row, multi_col, multi_val)
            for p in range(p0, p1):
                o = x[p] if same else out[p]
                d = 0.0  # (slices: a range with a min() bound was not vectorised, 15x slower)
                for v0 in range(0, m.shape[0], SUM_RUN):
                    os, ms = o[v0: v0 + SUM_RUN], m[v0: v0 + SUM_RUN]
                    part = zero
                    for v in range(os.shape[0]):
                        part += os[v] * ms[v]
                    d += part
                iv = inv_pos[p]
                a = iv * alpha
                b = iv * (coef[p] - alpha * cast_like(d, zero) * iv)
                for v in range(m.shape[0]):
                    o[v] = o[v] * (a * m[v] + b)
    for i in prange(num_orphans):  # positions of no chunk row: CE's part alone
        p = orphans[i]
        xp = x[p]
        lz[p] = logsumexp_of(xp)
        if same:
            exp_row(xp, xp, lz[p], coef[p])
        else:
            exp_row(out[p], xp, lz[p], coef[p])


def image_block(out: torch.Tensor, x: torch.Tensor, seg: torch.Tensor, num_rows: int,
                layout: RowLayout, width: int, probs: torch.Tensor, keys: torch.Tensor,
                weight: torch.Tensor, coef: torch.Tensor, alpha: float, lz_out: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's part of the exact form (see the module docstring) from its logits / T ``x``
    [n, V] (CPU, unit-stride rows) and ``seg`` [n] (each position's chunk row, -1 for none;
    a row's positions one run, rows in order): into ``out`` (``x`` itself, or not overlapping
    it) the gradient of sum_r weight_r KL_r scaled by ``alpha`` (1 / T) plus ``coef * p``;
    each position's log-partition into ``lz_out``. ``probs`` [*, width]: P on I of the
    payload's rows, row r's at ``keys[r]``. Returns (-sum_I P log(q + EPS) per row in
    float64, the column of I where u is largest): the KL is the former plus the teacher's
    terms."""
    n, vocab = x.shape
    dt = x.dtype
    threads = use_torch_threads()
    cross = torch.empty(num_rows, dtype=torch.float64)
    at = torch.empty(num_rows, dtype=torch.int64)
    if n == 0:
        return cross, at
    mass = scratch("image_block_mass", threads * vocab, x.device, dt).view(threads, vocab)
    qs = scratch("image_block_q", threads * (width + 1), x.device, dt).view(threads, width + 1)
    pieces = scratch("image_block_piece", threads * EXP_PIECE, x.device, dt)
    pieces = pieces.view(threads, EXP_PIECE)
    same = (out.data_ptr() == x.data_ptr() and out.shape == x.shape
            and out.stride() == x.stride())
    scale = weight.to(dt).expand(num_rows).contiguous()
    np_dt = x.detach().numpy().dtype.type
    _image_block(x.detach().numpy(), out.detach().numpy(), same, seg.contiguous().numpy(),
                 coef.to(dt).contiguous().numpy(), np_dt(alpha), *layout.arrays(),
                 rows_in_place(probs), keys.contiguous().numpy(), scale.numpy(), np_dt(EPS),
                 np_dt(TINY), np_dt(0.0), lz_out.numpy(), np.empty(n, np_dt), cross.numpy(),
                 at.numpy(), mass.numpy(), qs.numpy(), pieces.numpy(),
                 *run_buffers(n, num_rows))
    return cross.neg_(), at


__all__ = ["RowLayout", "image_block"]
