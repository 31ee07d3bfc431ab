"""The exact (all of V_t) P-KL's per-row teacher work on CPU: few passes, each vectorised.

Three maps of :class:`kernels.pkl.DenseKernel`, written for a CPU (float32 / float64 tensors):

* ``teacher_terms``: per payload row, the teacher's argmax over V_t and the divergence's terms
  outside W's image I (entropy, mass outside I), one pass over the row where it lies, a piece
  at a time (its maximum, then its exps): what the torch passes of the other divergences
  (reverse KL, JSD) read.
* ``image_kl``: a block's forward KL over all of V_t and the argmaxes of the projected mass
  and of the teacher: per row one pass over the payload row, a piece at a time: the piece's
  exps with the teacher-only terms (entropy, mass outside I), then P gathered from them on
  the piece's columns of I against the logs of q there, while the piece is in L1. Was a
  teacher-terms pass over every row when the call began, then per block a gather of the
  row's columns on I and an exp-and-log pass over them: the payload read twice and I's exps
  taken twice; then the logs spread into a piece-sized buffer that the exps' loop read (the
  spread 0.5 ns a payload element). With a weight (a forward that writes the gradient,
  ``parallel_kd_loss(loss_weights=...)``) the same pass also writes ``image_kl_grad``'s
  gradient from the gathered P, in the cross sum's loop: 1.9 ns a payload element for both
  (22 rows x 151,936, one thread; 2.0-2.2 with the cross sum and the gradient in two loops,
  3.8 with float64 accumulators and the spread).
* ``image_kl_grad``: its gradient on the projected mass u (q = u / sum u), written directly:
  ``-(w / S) (P_t / (q_t + EPS) - sum_t' P_t' q_t' / (q_t' + EPS))``, P gathered into the
  gradient's row and exponentiated in the pass. No log and no autograd through a recompute of
  the forward.

A gather with the exp and a store in one loop keeps LLVM from vectorising it (measured: the
gradient's pass 0.21 s against 0.07 s with the gather on its own), hence the gathers first.
The exp and log are :mod:`cpu.rows`' (vectorised float32 polynomials; Numba's ``math.exp`` /
``math.log`` are scalar libm calls here, ~4x torch's). The payload's exp is taken in its own
dtype.
"""

from __future__ import annotations

import math

import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.projected import (
    SUM_RUN,
    cross_grad_piece,
    cross_piece,
    floored_rows_grad,
    numba_scalar,
    rows_in_place,
)
from megatron_xdistill.loss.cpu.rows import FASTMATH, fast_exp, first_argmax, row_max
from megatron_xdistill.loss.cpu.threads import numba_takes, use_torch_threads
from megatron_xdistill.loss.definitions.common import EPS
from megatron_xdistill.loss.definitions.formulas import grad_scale, normaliser, teacher_only_terms
from megatron_xdistill.loss.workspace import scratch

#: Whether these CPU maps take a tensor (the projection's Numba kernels take the same).
supported = numba_takes


#: Columns of a payload row taken at a time by the passes below: the piece's maximum, then its
#: exps while it is still in L1, so each row is read from memory once (a whole-row argmax pass
#: and then the exps read it twice: 0.80 + 1.3 ns an element, 2.05 together, 1.76-1.87 in
#: pieces, at 2,000 x 151,936)
_PIECE = 2048


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _row_sums(lp, keys, entropy, outside, with_sums, sums, argmax, zero, floor
              ):  # pragma: no cover - numba
    """For each payload row ``keys[j]`` of ``lp``: the first argmax, and (``with_sums``)
    sums[key] = (sum of p log p weighted by ``entropy``, sum of p weighted by ``outside``),
    p = exp(lp) in the pass (0 log 0 = 0), fp64 totals of :data:`SUM_RUN`-element partials. One
    pass over the row, a piece at a time (:data:`_PIECE`). ``zero``, ``floor``: 0 and -1e30
    in the payload's dtype."""
    n = lp.shape[1]
    for j in prange(keys.shape[0]):
        key = keys[j]
        row = lp[key]
        best, at = row[0], 0  # the first piece holding the largest value
        plogp = 0.0
        mass = 0.0
        for lo in range(0, n, _PIECE):
            hi = min(lo + _PIECE, n)
            piece, ent, off = row[lo:hi], entropy[lo:hi], outside[lo:hi]  # indices from 0
            top = row_max(piece)
            if top > best:
                best, at = top, lo
            if not with_sums:
                continue
            for s0 in range(0, piece.shape[0], SUM_RUN):
                pc, ec, oc = piece[s0: s0 + SUM_RUN], ent[s0: s0 + SUM_RUN], off[s0: s0 + SUM_RUN]
                a, b = zero, zero
                for t in range(pc.shape[0]):
                    e = fast_exp(pc[t])
                    a += e * max(pc[t], floor) * ec[t]  # 0 log 0 = 0 at a -inf log-prob (e =
                    # 0): a select on e here would keep the loop from vectorising (5.4 ns)
                    b += e * oc[t]
                plogp += a
                mass += b
        argmax[key] = at + first_argmax(row[at: min(at + _PIECE, n)])
        sums[key, 0] = plogp
        sums[key, 1] = mass


def _sums_of_rows(logprobs: torch.Tensor, keys: torch.Tensor, entropy: torch.Tensor,
                  outside: torch.Tensor, with_sums: bool, rows_per_step: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_row_sums` over the rows ``keys`` of ``logprobs`` [n, V], read in place,
    ``rows_per_step`` to a parallel loop: (sums [n, 2] fp64, argmax [n] int64), filled for
    ``keys``."""
    n, width = logprobs.shape
    sums = torch.zeros(n, 2, dtype=torch.float64)
    argmax = torch.zeros(n, dtype=torch.int64)
    if width == 0:
        return sums, argmax
    lp = rows_in_place(logprobs)
    weights = [w.to(logprobs.dtype).contiguous().numpy() for w in (entropy, outside)]
    zero, floor = numba_scalar(0.0, logprobs), numba_scalar(-1e30, logprobs)
    use_torch_threads()
    for lo in range(0, keys.numel(), rows_per_step):
        _row_sums(lp, keys[lo: lo + rows_per_step].contiguous().numpy(), *weights, with_sums,
                  sums.numpy(), argmax.numpy(), zero, floor)
    return sums, argmax


def teacher_terms(logprobs: torch.Tensor, keys: torch.Tensor, in_image: torch.Tensor,
                  beta: float, rows_per_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(const [n] fp64, argmax [n] int64) per payload row of ``logprobs`` [n, V_t], filled for
    the rows ``keys``: the divergence's terms outside W's image (``in_image`` [V_t] bool;
    :func:`definitions.formulas.teacher_only_terms` of the row's entropy term and its mass
    outside I) and the teacher's argmax over V_t."""
    outside = ~in_image
    sums, argmax = _sums_of_rows(logprobs, torch.unique(keys), torch.ones_like(outside),
                                 outside, beta != 1.0, rows_per_step)
    return teacher_only_terms(beta, sums[:, 0], sums[:, 1]), argmax


def image_sums(logprobs: torch.Tensor, outside: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 [n, 2]: the sum of P log P over all columns and of P over the columns where
    ``outside`` [V] is 1, int64 [n]: the first argmax over all columns) of each row of
    ``logprobs`` [n, V]: the image form's teacher sums (``teacher.py``), one pass over each
    row (torch's float64 sums took 8x the teacher's log-softmax at 151,936 columns)."""
    n = logprobs.shape[0]
    every = torch.ones(logprobs.shape[1], dtype=logprobs.dtype, device=logprobs.device)
    return _sums_of_rows(logprobs, torch.arange(n), every, outside, True, max(n, 1))


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _kl_rows(u, lp, keys, image, cut, outside, inv_total, eps, log_eps, kl, at, teacher_at,
             work, grad, scale, g, zero, floor):  # pragma: no cover - numba
    """Per row r: kl[r] = the forward KL over all of V_t of teacher row lp[keys[r]] against
    q = u[r] inv_total[r] on I (0 elsewhere): sum_t P_t log P_t - log(EPS) * (P's mass
    outside I) - sum_{t in I} P_t log(q_t + eps), fp64 sums; at[r] = the first argmax of u[r];
    teacher_at[r] = the first argmax of the teacher row. One pass over the teacher row, a piece
    of _PIECE columns at a time: the piece's exps (kept in work) with the teacher-only sums,
    then P gathered on the piece's columns of I (image[cut[p]: cut[p + 1]]) against the logs
    of q there, while it is in L1. ``grad``: also g[r] = scale[r] (c - P / (q + eps)) on I,
    c = sum_t P q / (q + eps) (:func:`image_kl_grad`'s), in the cross sum's loop (two loops
    over the I-range, the cross sum then the gradient: 2.04-2.19 against 1.91 ns a payload
    element, 22 rows, one thread). ``work`` [rows, 2, _PIECE];
    ``zero``, ``floor``: 0 and -1e30 in the payload's dtype (sums of :data:`SUM_RUN`-element
    partials in it)."""
    n_t = lp.shape[1]
    for r in prange(u.shape[0]):
        ur, row, inv = u[r], lp[keys[r]], inv_total[r]
        gathered, exps = work[r, 0], work[r, 1]
        best_t, at_t = row[0], 0         # the first piece holding the teacher's largest value
        best_u, lo_u, hi_u = -math.inf, 0, 0  # and u's: the range of I that holds it
        plogp = 0.0
        out = 0.0
        cross = 0.0
        c = 0.0
        for p in range(cut.shape[0] - 1):
            lo = p * _PIECE
            hi = min(lo + _PIECE, n_t)
            i0, i1 = cut[p], cut[p + 1]
            piece, off, ex = row[lo:hi], outside[lo:hi], exps[: hi - lo]
            top = row_max(piece)
            if top > best_t:
                best_t, at_t = top, lo
            for s0 in range(0, piece.shape[0], SUM_RUN):
                pc, oc, xc = piece[s0: s0 + SUM_RUN], off[s0: s0 + SUM_RUN], ex[s0: s0 + SUM_RUN]
                a, b = zero, zero
                for t in range(pc.shape[0]):
                    e = fast_exp(pc[t])
                    xc[t] = e
                    a += e * max(pc[t], floor)  # 0 log 0 = 0 at a -inf log-prob (e = 0)
                    b += e * oc[t]
                plogp += a
                out += b
            if i1 == i0:
                continue
            uu, pp, cols = ur[i0:i1], gathered[: i1 - i0], image[i0:i1]
            top = row_max(uu)
            if top > best_u:
                best_u, lo_u, hi_u = top, i0, i1
            for k in range(cols.shape[0]):  # the gather on its own: with the arithmetic in
                pp[k] = ex[cols[k] - lo]    # the loop, the loop does not vectorise
            if grad:  # the cross sum and the gradient in one loop over the piece's I-range
                gr = g[r, i0:i1]
                for s0 in range(0, uu.shape[0], SUM_RUN):
                    x, y = cross_grad_piece(uu[s0: s0 + SUM_RUN], pp[s0: s0 + SUM_RUN],
                                            gr[s0: s0 + SUM_RUN], inv, eps, zero)
                    cross += x
                    c += y
            else:
                for s0 in range(0, uu.shape[0], SUM_RUN):
                    cross += cross_piece(uu[s0: s0 + SUM_RUN], pp[s0: s0 + SUM_RUN], inv, eps,
                                         zero)
        kl[r] = plogp - log_eps * out - cross
        teacher_at[r] = at_t + first_argmax(row[at_t: min(at_t + _PIECE, n_t)])
        at[r] = lo_u + first_argmax(ur[lo_u:hi_u]) if hi_u > lo_u else 0
        if grad:
            gr, sr = g[r], scale[r]
            for k in range(gr.shape[0]):
                gr[k] = sr * (c - gr[k])


def image_kl(u: torch.Tensor, logprobs: torch.Tensor, keys: torch.Tensor, image: torch.Tensor,
             outside: torch.Tensor, weight: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(forward KL over all of V_t per row, column of I where u is largest, the teacher's
    argmax over V_t, gradient or None) of the rows ``keys``: u [r, |I|] the projected student
    mass on I, ``outside`` [V_t] 1 on the teacher columns outside I (0 on I) in the payload's
    dtype. The teacher-only terms are taken in the same pass over each payload row (read
    once). Not differentiable; with ``weight`` (a scalar or one per row) the same pass also
    writes :func:`image_kl_grad`'s gradient (the payload rows not read a second time)."""
    rows, width = u.shape[0], logprobs.shape[1]
    kl = torch.zeros(rows, dtype=torch.float64)
    at = torch.zeros(rows, dtype=torch.int64)
    teacher_at = torch.zeros(rows, dtype=torch.int64)
    grad = weight is not None
    if rows == 0 or width == 0:
        return kl.to(u.dtype), at, teacher_at, torch.zeros_like(u) if grad else None
    u = u.detach().contiguous()
    sums, inv = normaliser(u)
    cut = torch.searchsorted(image, torch.arange(-(-width // _PIECE) + 1) * _PIECE)
    work = scratch("image_kl", rows * 2 * _PIECE, u.device, u.dtype).view(rows, 2, _PIECE)
    g = torch.empty_like(u) if grad else u.new_empty(rows, 0)
    scale = grad_scale(weight, inv) if grad else inv
    use_torch_threads()
    _kl_rows(u.numpy(), rows_in_place(logprobs), keys.contiguous().numpy(), image.numpy(),
             cut.numpy(), outside.numpy(), inv.numpy(), numba_scalar(EPS, u), math.log(EPS),
             kl.numpy(), at.numpy(), teacher_at.numpy(), work.numpy(), grad, scale.numpy(),
             g.numpy(), numba_scalar(0.0, logprobs), numba_scalar(-1e30, logprobs))
    if grad:
        floored_rows_grad(g, u, sums, inv, scale, logprobs, keys, image)
    return kl.to(u.dtype), at, teacher_at, g if grad else None


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _kl_grad(u, lp, keys, image, inv_total, scale, eps, g):  # pragma: no cover - numba
    """g[r] = scale[r] (c - P / (q + eps)), q = u inv_total[r], c = sum_t P q / (q + eps);
    P = exp(lp[keys[r], image]) read in place."""
    n = u.shape[1]
    for r in prange(u.shape[0]):
        ur, row, gr = u[r], lp[keys[r]], g[r]
        inv = inv_total[r]
        for t in range(n):  # the gather on its own: with the exp and the stores in one
            gr[t] = row[image[t]]  # loop, the loop does not vectorise
        c = 0.0
        for t in range(n):
            q = ur[t] * inv
            d = fast_exp(gr[t]) / (q + eps)
            gr[t] = d
            c += d * q
        s = scale[r]
        for t in range(n):
            gr[t] = s * (c - gr[t])


def image_kl_grad(u: torch.Tensor, logprobs: torch.Tensor, keys: torch.Tensor,
                  image: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """d(sum_r weight_r KL_r) / d u [r, |I|] of :func:`image_kl`'s forward KL (``weight``: a
    scalar or one per row). Where sum u falls under TINY the floor holds it, so the
    normalisation contributes nothing there (as autograd's ``clamp_min``)."""
    rows = u.shape[0]
    g = torch.empty_like(u)
    if rows == 0 or image.numel() == 0:
        return g.zero_()
    u = u.detach().contiguous()
    sums, inv = normaliser(u)
    scale = grad_scale(weight, inv)
    use_torch_threads()
    _kl_grad(u.numpy(), rows_in_place(logprobs), keys.contiguous().numpy(), image.numpy(),
             inv.numpy(), scale.numpy(), numba_scalar(EPS, u), g.numpy())
    floored_rows_grad(g, u, sums, inv, scale, logprobs, keys, image)
    return g


__all__ = ["image_kl", "image_kl_grad", "image_sums", "supported",
           "teacher_terms"]
