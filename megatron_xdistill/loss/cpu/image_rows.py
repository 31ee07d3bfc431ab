"""The image form's per-row work: the forward KL on I from payload rows that hold I only.

An ``image`` payload row holds the teacher's P on I, aligned with the projected mass u [rows,
|I|] column for column, so its pass reads both contiguously, one row at a time: no pieces of
V_t, no gather, no exp (the teacher ships P and the sum of P log P; a row of log P took an exp
an element here: 5.0-6.3 against 3.7-3.8 ms a block of 60 rows x 40,132, one thread), a log
and a divide an element. With a weight (a forward that writes the gradient) the same pass
writes the gradient on u, into a buffer kept between blocks (a block's [rows, |I|] is 20 MiB
at 60 rows and |I| 87,607). Writing it transposed, as W's backward product reads it, a tile of
2,048 columns of all the rows at a time, saved that product's transposing copy but was no
faster in all (20.0-20.5 against 20.5-21.4 ms at 60 rows, one thread, payload rows from
memory): a tile reads 2 x rows short runs where the row pass reads two streams; 16 rows at a
time in tiles of 4,096 columns: 7.3-7.5 against 7.7 ms with the copy at |I| 40,132, and no
gain in-process (``benchmarks/bench_loss.py``). Other devices take the same map as torch
operations (:func:`kernels.image.image_kl_on_image`).
"""

from __future__ import annotations

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
from megatron_xdistill.loss.cpu.rows import FASTMATH, first_argmax
from megatron_xdistill.loss.cpu.threads import use_torch_threads
from megatron_xdistill.loss.definitions.common import EPS
from megatron_xdistill.loss.definitions.formulas import grad_scale, normaliser
from megatron_xdistill.loss.workspace import scratch


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _cross_rows_on_image(u, pp, keys, inv_total, eps, cross, at, grad, scale, g, zero
                         ):  # pragma: no cover - numba
    """Per row r, against payload row ``pp[keys[r]]`` (P on I, aligned with u[r]): cross[r]
    = sum_I P log(q + eps), q = u[r] inv_total[r] (fp64 over :data:`SUM_RUN`-element partials),
    the first argmax of u[r], and with ``grad`` g[r] = scale[r] (c - P / (q + eps)), c = sum_I
    P q / (q + eps). One contiguous pass over the row: no pieces, no gather."""
    for r in prange(u.shape[0]):
        ur, row, inv = u[r], pp[keys[r]], inv_total[r]
        x_total = 0.0
        c = 0.0
        gr = g[r] if grad else g[0]
        for s0 in range(0, ur.shape[0], SUM_RUN):
            us, ps = ur[s0: s0 + SUM_RUN], row[s0: s0 + SUM_RUN]
            if grad:
                x, y = cross_grad_piece(us, ps, gr[s0: s0 + SUM_RUN], inv, eps, zero)
                c += y
            else:
                x = cross_piece(us, ps, inv, eps, zero)
            x_total += x
        cross[r] = x_total
        at[r] = first_argmax(ur) if ur.shape[0] else 0
        if grad:
            sr = scale[r]
            for k in range(gr.shape[0]):
                gr[k] = sr * (c - gr[k])


def image_kl_rows(u: torch.Tensor, probs: torch.Tensor, keys: torch.Tensor,
                  weight: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`kernels.image.image_kl_on_image` on CPU tensors (``u`` contiguous, at least
    one row and one column, ``probs`` as wide as ``u``): one pass a row. The gradient is a
    view of a reused buffer, valid until the next call."""
    rows, width = u.shape
    grad = weight is not None
    cross = torch.empty(rows, dtype=torch.float64)
    at = torch.empty(rows, dtype=torch.int64)
    sums, inv = normaliser(u)
    g = (scratch("image_grad", rows * width, u.device, u.dtype).view(rows, width) if grad
         else u.new_empty(1, 0))
    scale = grad_scale(weight, inv) if grad else inv
    use_torch_threads()
    _cross_rows_on_image(u.numpy(), rows_in_place(probs), keys.contiguous().numpy(),
                         inv.numpy(), numba_scalar(EPS, u), cross.numpy(), at.numpy(), grad,
                         scale.numpy(), g.numpy(), numba_scalar(0.0, probs))
    if grad:
        floored_rows_grad(g, u, sums, inv, scale, probs, keys, None, probs=True)
    return cross.neg_(), at, g if grad else None


__all__ = ["image_kl_rows"]
