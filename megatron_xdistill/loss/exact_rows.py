"""The exact (all of V_t) P-KL's per-row teacher work on CPU: few passes, each vectorised.

Three maps of :class:`~.kernels.DenseKernel`, written for a CPU (float32 / float64 tensors):

* ``teacher_terms``: per payload row, the teacher's argmax over V_t and the divergence's terms
  outside W's image I (entropy, mass outside I). One ``exp`` of a few rows at a time into a
  cache-sized buffer (torch's vectorised exp) and one Numba pass over them; torch's way took
  seven passes (copy, argmax, exp, product, fp64 sum, exp again, gather of the columns outside I).
* ``image_kl``: a block's forward KL on I, ``const - sum_{t in I} P_t log(q_t + EPS)``, and the
  argmax of the projected mass: the teacher's columns on I gathered straight from the payload
  (no [rows, V_t] copy), exp and log by torch, the sums in one Numba pass (fp64).
* ``image_kl_grad``: its gradient on the projected mass u (q = u / sum u), written directly:
  ``-(w / S) (P_t / (q_t + EPS) - sum_t' P_t' q_t' / (q_t' + EPS))``. No log and no autograd
  through a recompute of the forward.

Numba has no vectorised exp / log here (no SVML), so transcendental functions stay with torch
(~1 ns an element against ~4-8 ns scalar); the loops Numba runs are sums, maxima and products.
"""

from __future__ import annotations

import math

import torch
from numba import njit, prange

from .common import EPS, TINY
from .numba_cpu import numba_takes, use_torch_threads
from .workspace import scratch

#: Whether these CPU maps take a tensor (the projection's Numba kernels take the same).
supported = numba_takes


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_terms(lp, p, outside, keys, mode, beta, log_eps, const, argmax):  # pragma: no cover
    """For each row j of ``lp`` (payload row ``keys[j]``; ``p`` = exp(lp)): the first argmax,
    and the teacher-only terms: mode 0 (forward KL) sum p log p - log(EPS) * outside mass,
    mode 1 (reverse) nothing, mode 2 (JSD) -beta log(beta) * outside mass. fp64 sums."""
    n = lp.shape[1]
    for j in prange(lp.shape[0]):
        row = lp[j]
        best = row[0]
        for t in range(n):
            best = max(best, row[t])
        at = 0
        for t in range(n):
            if row[t] == best:
                at = t
                break
        argmax[keys[j]] = at
        if mode == 1:
            continue
        pr = p[j]
        plogp = 0.0
        out = 0.0
        for t in range(n):
            e = pr[t]
            if e > 0.0:  # 0 log 0 = 0 (a -inf log-prob)
                plogp += e * row[t]
            out += e * outside[t]
        if mode == 0:
            const[keys[j]] = plogp - log_eps * out
        else:
            const[keys[j]] = -beta * math.log(beta) * out


def teacher_terms(logprobs: torch.Tensor, keys: torch.Tensor, in_image: torch.Tensor,
                  beta: float, rows_per_step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(const [n] fp64, argmax [n] int64) per payload row of ``logprobs`` [n, V_t], filled for
    the rows ``keys``: the divergence's terms outside W's image (``in_image`` [V_t] bool) and
    the teacher's argmax over V_t. Rows are read ``rows_per_step`` at a time."""
    n, width = logprobs.shape
    const = torch.zeros(n, dtype=torch.float64)
    argmax = torch.zeros(n, dtype=torch.int64)
    keys = torch.unique(keys)
    outside = (~in_image).to(logprobs.dtype)
    mode = 0 if beta == 0.0 else 1 if beta == 1.0 else 2
    use_torch_threads()
    for lo in range(0, keys.numel(), rows_per_step):
        part = keys[lo: lo + rows_per_step]
        m = part.numel()
        lp = scratch("teacher_lp", m * width, logprobs.device, logprobs.dtype).view(m, width)
        torch.index_select(logprobs, 0, part, out=lp)
        p = scratch("teacher_p", m * width, logprobs.device, logprobs.dtype).view(m, width)
        if mode != 1:
            torch.exp(lp, out=p)
        _row_terms(lp.numpy(), p.numpy(), outside.numpy(), part.numpy(), mode, float(beta),
                   math.log(EPS), const.numpy(), argmax.numpy())
    return const, argmax


@njit(parallel=True, cache=True, nogil=True)
def _gather(lp, keys, image, out):  # pragma: no cover - numba
    """out[r, t] = lp[keys[r], image[t]] (the payload rows' columns on I)."""
    for r in prange(keys.shape[0]):
        row = lp[keys[r]]
        o = out[r]
        for t in range(image.shape[0]):
            o[t] = row[image[t]]


def _teacher_probs(logprobs: torch.Tensor, keys: torch.Tensor, image: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """P on I of the payload rows ``keys`` [r, |I|] (a reused buffer)."""
    p = scratch("image_p", keys.numel() * image.numel(), logprobs.device, dtype)
    p = p.view(keys.numel(), image.numel())
    use_torch_threads()
    _gather(logprobs.numpy(), keys.contiguous().numpy(), image.numpy(), p.numpy())
    return p.exp_()


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _kl_sums(p, log_q, u, kl, at):  # pragma: no cover - numba
    """kl[r] = sum_t p log_q (fp64); at[r] = the first argmax of u[r]."""
    n = p.shape[1]
    for r in prange(p.shape[0]):
        pr, lr, ur = p[r], log_q[r], u[r]
        acc = 0.0
        best = ur[0]
        for t in range(n):
            acc += pr[t] * lr[t]
            best = max(best, ur[t])
        kl[r] = acc
        k = 0
        for t in range(n):
            if ur[t] == best:
                k = t
                break
        at[r] = k


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
    u = u.contiguous()
    p = _teacher_probs(logprobs, keys, image, u.dtype)
    total = u.sum(-1, keepdim=True).clamp_min_(TINY)
    log_q = scratch("image_log_q", u.numel(), u.device, u.dtype).view_as(u)
    torch.div(u, total, out=log_q).add_(EPS).log_()
    _kl_sums(p.numpy(), log_q.numpy(), u.numpy(), kl.numpy(), at.numpy())
    return (const.index_select(0, keys) - kl).to(u.dtype), at


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _kl_grad(p, u, inv_total, scale, eps, g):  # pragma: no cover - numba
    """g[r] = scale[r] (c - p / (q + eps)), q = u inv_total[r], c = sum_t p q / (q + eps)."""
    n = p.shape[1]
    for r in prange(p.shape[0]):
        pr, ur, gr = p[r], u[r], g[r]
        inv = inv_total[r]
        c = 0.0
        for t in range(n):
            q = ur[t] * inv
            d = pr[t] / (q + eps)
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
    u = u.contiguous()
    p = _teacher_probs(logprobs, keys, image, u.dtype)
    sums = u.sum(-1)
    total = sums.clamp_min(TINY)
    inv = 1.0 / total
    # q = u / total: dq_t/du_k = (delta_tk - q_t [sum above TINY]) / total
    scale = weight.to(u.dtype).expand(rows) * inv
    _kl_grad(p.numpy(), u.numpy(), inv.numpy(), scale.contiguous().numpy(), EPS, g.numpy())
    floored = sums < TINY
    if bool(floored.any()):  # no normalisation term: -scale p / (q + EPS) alone
        q = u[floored] * inv[floored, None]
        g[floored] = -scale[floored, None] * p[floored] / (q + EPS)
    return g


__all__ = ["image_kl", "image_kl_grad", "supported", "teacher_terms"]
