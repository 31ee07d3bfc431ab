"""What the CPU passes over the projected student mass u share (:mod:`cpu.exact` over full
payload rows, :mod:`cpu.image_rows` over rows of W's image): the cross sum and its gradient's
pieces in one vectorised loop, the gradient of rows whose sum falls under the floor, and how
payload rows and scalars reach the Numba kernels (the normalisation q = u / sum u and the
gradient's per-row scale are :mod:`definitions.formulas`')."""

from __future__ import annotations

import torch
from numba import njit

from megatron_xdistill.loss.cpu.rows import FASTMATH, fast_log
from megatron_xdistill.loss.definitions.common import EPS, TINY

#: Elements summed in the payload's dtype before a sum joins its float64 total: each lane of the
#: vectorised loop adds a few terms, so the float32 partial is as exact as float64 sums of
#: the float32 terms, and the loop takes no float64 conversions (a piece's three sums: 2.95 ->
#: 1.99 ns a payload element, in isolation at 22 rows x 151,936; whole pieces: 1.98)
SUM_RUN = 256


@njit(inline="always", fastmath=FASTMATH)
def cross_grad_piece(us, ps, gs, inv, eps, zero):  # pragma: no cover - numba
    """Over one piece of a row (at most :data:`SUM_RUN` columns), q = u inv: (sum P log(q +
    eps), sum P q / (q + eps)) in the rows' dtype, with gs <- P / (q + eps) (``gs`` may be
    ``us``: each element is read before it is written). The forward KL's cross sum and the
    pieces of its gradient in one vectorised loop."""
    x = zero
    y = zero
    for k in range(us.shape[0]):
        q = us[k] * inv
        qe = q + eps
        x += ps[k] * fast_log(qe)
        d = ps[k] / qe
        gs[k] = d
        y += d * q
    return x, y


@njit(inline="always", fastmath=FASTMATH)
def cross_piece(us, ps, inv, eps, zero):  # pragma: no cover - numba
    """:func:`cross_grad_piece`'s cross sum alone."""
    x = zero
    for k in range(us.shape[0]):
        x += ps[k] * fast_log(us[k] * inv + eps)
    return x


def numba_scalar(value: float, like: torch.Tensor):
    """``value`` as a NumPy scalar of ``like``'s dtype (Numba then keeps float32 arithmetic
    float32: a Python float would make every product float64)."""
    return like.numpy().dtype.type(value)


def floored_rows_grad(g, u, sums, inv, scale, payload_rows, keys, image, probs: bool = False
                      ) -> None:
    """Rows whose sum u falls under TINY: the floor holds the total, so the normalisation
    contributes nothing there (as autograd's ``clamp_min``): -scale P / (q + EPS) alone.
    ``image``: the payload columns of u's columns, None where they are the same; ``probs``:
    ``payload_rows`` hold P (else log P)."""
    floored = sums < TINY
    if bool(floored.any()):
        q = u[floored] * inv[floored, None]
        p = payload_rows.index_select(0, keys[floored])
        p = (p if image is None else p[:, image]).to(u.dtype)
        p = p if probs else p.exp()
        g[floored] = -scale[floored, None] * p / (q + EPS)


def rows_in_place(logprobs: torch.Tensor):
    """The payload rows as a NumPy array the kernels index by key (a copy only if its rows
    are not of unit stride)."""
    return (logprobs if logprobs.stride(-1) == 1 else logprobs.contiguous()).numpy()


__all__ = ["SUM_RUN", "cross_grad_piece", "cross_piece", "floored_rows_grad", "numba_scalar",
           "rows_in_place"]
