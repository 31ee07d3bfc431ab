"""The n largest values of each row, sorted descending, differentiable: gold's uncommon part
where :mod:`.sorted_l1` does not run (TP > 1: the ranks' candidates are merged; other devices).

``torch.topk`` with large n (gold sorts up to 8,192 of the ~tens of thousands of uncommon
columns per chunk) is slow on CPU: about 0.8 ms per row of 24,576 floats, the largest cost of the
gold / H-KL loss. NumPy's selection and sort are SIMD: values alone (what the loss's forward needs)
cost a tenth of that, values with their columns (what a backward needs) a third. So the forward
asks for values only, and only a call that will be differentiated (the loss recomputes each block
under autograd for its backward) finds the columns. Other devices keep ``torch.topk``.
"""

from __future__ import annotations

import numpy as np
import torch


def _numpy_top(x: torch.Tensor, n: int, with_index: bool
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values [r, n] descending, their columns or None) of a CPU tensor, by NumPy."""
    a = x.detach().numpy()
    m = a.shape[1]
    if not with_index:
        part = a if n == m else -np.partition(-a, n - 1, axis=1)[:, :n]
        return torch.from_numpy(-np.sort(-part, axis=1)), None
    cols = np.argpartition(-a, n - 1, axis=1)[:, :n] if n < m else np.broadcast_to(
        np.arange(m), a.shape)
    picked = np.take_along_axis(a, cols, axis=1)
    order = np.argsort(-picked, axis=1)  # introsort: 3x the stable sort
    cols = np.take_along_axis(cols, order, axis=1)
    return (torch.from_numpy(np.take_along_axis(picked, order, axis=1)),
            torch.from_numpy(np.ascontiguousarray(cols)).to(torch.int64))


class _SortedTop(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, n: int):
        values, cols = _numpy_top(x, n, with_index=ctx.needs_input_grad[0])
        ctx.save_for_backward(cols if cols is not None else torch.empty(0, dtype=torch.int64))
        ctx.width = x.shape[1]
        return values

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (cols,) = ctx.saved_tensors
        out = grad.new_zeros(grad.shape[0], ctx.width)
        return out.scatter_(1, cols, grad), None


def _numpy_path(x: torch.Tensor) -> bool:
    """Whether NumPy sorts ``x`` (CPU fp32 / fp64); elsewhere ``torch.topk``."""
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def sorted_top(x: torch.Tensor, n: int) -> torch.Tensor:
    """The ``n`` largest values of each row of ``x`` [r, m] (n <= m), sorted descending;
    differentiable (the gradient goes to the columns they came from)."""
    if n == 0:
        return x[:, :0]
    if _numpy_path(x):
        return _SortedTop.apply(x, n)
    return x.topk(n, dim=1).values


__all__ = ["sorted_top"]
