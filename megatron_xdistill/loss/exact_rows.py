"""The exact (all of V_t) P-KL's per-row teacher work on CPU: few passes, each vectorised.

Three maps of :class:`~.kernels.DenseKernel`, written for a CPU (float32 / float64 tensors):

* ``teacher_terms``: per payload row, the teacher's argmax over V_t and the divergence's terms
  outside W's image I (entropy, mass outside I): one Numba pass over the row where it lies (the
  exp inside it) after a branch-free one for the maximum; was a copy of 32 rows at a time,
  torch's exp of them into a second buffer and a pass over both.
* ``image_kl``: a block's forward KL on I, ``const - sum_{t in I} P_t log(q_t + EPS)``, and the
  argmax of the projected mass: per row, the teacher's columns on I gathered from the payload
  row into a reused buffer, then one pass with exp and log inside it (fp64 sum); was torch's
  exp of the gathered rows and its division, addition and log into a second [rows, |I|] buffer.
* ``image_kl_grad``: its gradient on the projected mass u (q = u / sum u), written directly:
  ``-(w / S) (P_t / (q_t + EPS) - sum_t' P_t' q_t' / (q_t' + EPS))``, P gathered into the
  gradient's row and exponentiated in the pass. No log and no autograd through a recompute of
  the forward.

A gather with the exp and a store in one loop keeps LLVM from vectorising it (measured: the
gradient's pass 0.21 s against 0.07 s with the gather on its own), hence the gathers first.
The exp and log are :mod:`.cpu_rows`' (vectorised float32 polynomials; Numba's ``math.exp`` /
``math.log`` are scalar libm calls here, ~4x torch's). The payload's exp is taken in its own
dtype.
"""

from __future__ import annotations

import math

import torch
from numba import njit, prange

from .common import EPS, TINY
from .cpu_rows import FASTMATH, fast_exp, fast_log, first_argmax, row_max
from .numba_cpu import numba_takes, use_torch_threads
from .workspace import scratch

#: Whether these CPU maps take a tensor (the projection's Numba kernels take the same).
supported = numba_takes


#: Columns of a payload row taken at a time by :func:`_row_terms`: its maximum, then its exps
#: while it is still in L1 (the row read from memory once; a whole-row argmax pass first, then
#: the exps, read it twice: 0.80 + 1.3 ns an element, 2.1 together, at 2,000 x 151,936)
_PIECE = 2048


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _row_terms(lp, keys, outside, mode, beta, log_eps, const, argmax):  # pragma: no cover
    """For each payload row ``keys[j]`` of ``lp``: the first argmax, and the teacher-only
    terms: mode 0 (forward KL) sum p log p - log(EPS) * outside mass, mode 1 (reverse)
    nothing, mode 2 (JSD) -beta log(beta) * outside mass; p = exp(lp) in the pass, fp64
    sums. One pass over the row, a piece at a time (:data:`_PIECE`)."""
    n = lp.shape[1]
    for j in prange(keys.shape[0]):
        key = keys[j]
        row = lp[key]
        best, at = row[0], 0  # the first piece holding the largest value
        plogp = 0.0
        out = 0.0
        for lo in range(0, n, _PIECE):
            hi = min(lo + _PIECE, n)
            piece, off = row[lo:hi], outside[lo:hi]  # indices from 0: no wraparound checks
            top = row_max(piece)
            if top > best:
                best, at = top, lo
            if mode == 1:
                continue
            for t in range(piece.shape[0]):
                e = fast_exp(piece[t])
                plogp += e * max(piece[t], -1e30)  # 0 log 0 = 0 at a -inf log-prob (e = 0): a
                # select on e here would keep the loop from vectorising (5.4 ns an element, 0.65)
                out += e * off[t]
        argmax[key] = at + first_argmax(row[at: min(at + _PIECE, n)])
        if mode == 0:
            const[key] = plogp - log_eps * out
        elif mode == 2:
            const[key] = -beta * math.log(beta) * out


def teacher_terms(logprobs: torch.Tensor, keys: torch.Tensor, in_image: torch.Tensor,
                  beta: float, rows_per_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(const [n] fp64, argmax [n] int64) per payload row of ``logprobs`` [n, V_t], filled for
    the rows ``keys``: the divergence's terms outside W's image (``in_image`` [V_t] bool) and
    the teacher's argmax over V_t. Rows are read in place, ``rows_per_step`` to a parallel
    loop."""
    n, width = logprobs.shape
    const = torch.zeros(n, dtype=torch.float64)
    argmax = torch.zeros(n, dtype=torch.int64)
    keys = torch.unique(keys)
    outside = (~in_image).to(logprobs.dtype)
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    if width == 0:
        return const, argmax
    lp = logprobs if logprobs.stride(-1) == 1 else logprobs.contiguous()
    use_torch_threads()
    for lo in range(0, keys.numel(), rows_per_step):
        _row_terms(lp.numpy(), keys[lo: lo + rows_per_step].numpy(), outside.numpy(), mode,
                   float(beta), math.log(EPS), const.numpy(), argmax.numpy())
    return const, argmax


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _kl_rows(u, lp, keys, image, inv_total, eps, kl, at, work):  # pragma: no cover - numba
    """kl[r] = sum_t P_t log(q_t + eps) (fp64 sum), P_t = exp(lp[keys[r], image[t]]) read from
    the payload row in place, q = u[r] inv_total[r]; at[r] = the first argmax of u[r].
    ``work`` [rows, |I|]: each row's gathered log-probs (a loop of its own vectorises both)."""
    n = u.shape[1]
    for r in prange(u.shape[0]):
        ur, row, inv, w = u[r], lp[keys[r]], inv_total[r], work[r]
        for t in range(n):
            w[t] = row[image[t]]
        acc = 0.0
        for t in range(n):
            acc += fast_exp(w[t]) * fast_log(ur[t] * inv + eps)
        kl[r] = acc
        at[r] = first_argmax(ur)


def _scalar(value: float, like: torch.Tensor):
    """``value`` as a NumPy scalar of ``like``'s dtype (Numba then keeps float32 arithmetic
    float32: a Python float would make every product float64)."""
    return like.numpy().dtype.type(value)


def image_kl(u: torch.Tensor, logprobs: torch.Tensor, keys: torch.Tensor, image: torch.Tensor,
             const: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(forward KL per row, column of I where u is largest) of the rows ``keys``: u [r, |I|]
    the projected student mass on I, const the rows' teacher-only terms (fp64). Not
    differentiable (the backward takes :func:`image_kl_grad`)."""
    rows = u.shape[0]
    kl = torch.empty(rows, dtype=torch.float64)
    at = torch.zeros(rows, dtype=torch.int64)
    if rows == 0 or image.numel() == 0:
        return const.index_select(0, keys).to(u.dtype), at
    u = u.detach().contiguous()
    inv = 1.0 / u.sum(-1).clamp_min_(TINY)
    use_torch_threads()
    work = scratch("image_lp", u.numel(), u.device, logprobs.dtype).view(u.shape)
    _kl_rows(u.numpy(), _rows_in_place(logprobs), keys.contiguous().numpy(), image.numpy(),
             inv.numpy(), _scalar(EPS, u), kl.numpy(), at.numpy(), work.numpy())
    return (const.index_select(0, keys) - kl).to(u.dtype), at


def _rows_in_place(logprobs: torch.Tensor):
    """The payload rows as a NumPy array the kernels index by key (a copy only if its rows
    are not of unit stride)."""
    return (logprobs if logprobs.stride(-1) == 1 else logprobs.contiguous()).numpy()


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
    sums = u.sum(-1)
    total = sums.clamp_min(TINY)
    inv = 1.0 / total
    # q = u / total: dq_t/du_k = (delta_tk - q_t [sum above TINY]) / total
    scale = weight.to(u.dtype).expand(rows) * inv
    use_torch_threads()
    _kl_grad(u.numpy(), _rows_in_place(logprobs), keys.contiguous().numpy(), image.numpy(),
             inv.numpy(), scale.contiguous().numpy(), _scalar(EPS, u), g.numpy())
    floored = sums < TINY
    if bool(floored.any()):  # no normalisation term: -scale p / (q + EPS) alone
        q = u[floored] * inv[floored, None]
        p = logprobs.index_select(0, keys[floored])[:, image].to(u.dtype).exp()
        g[floored] = -scale[floored, None] * p / (q + EPS)
    return g


__all__ = ["image_kl", "image_kl_grad", "supported", "teacher_terms"]
