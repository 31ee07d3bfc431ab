"""One block's logits gradient in the loss's fused mode: one dense pass plus sparse corrections.

The gradient of the column P-KL forms and CE on a block is ``p * (a + c * r) [+ b * p1]`` on
every column (written by :func:`row_softmax.softmax_combine_` in one pass) plus values at a few
places: W's entries of each chunk's teacher columns and each position's label. An fp32 gradient
takes those with ``index_add_``. A bf16 / fp16 gradient (the logits' own dtype; Megatron's CE
instead keeps an fp32 copy of all logits) would round twice that way, so there the corrections are
summed per place in fp32, added to the dense value recomputed in fp32 at that place, and stored
with one rounding: the same value an fp32 buffer followed by one cast gives, without the buffer.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.gpu import row_softmax


class FusedGradWriter:
    """Writes ``out`` [n, V] (contiguous, any float dtype) from the logits ``z`` [n, V] of the
    same block: :meth:`dense` once, :meth:`add` any number of times, then :meth:`finish`.

    p = exp(scale * z - lz) per row; p1 = exp(z - lz1) with weight ``b`` per row (CE's own
    softmax at T != 1), both optional together."""

    def __init__(self, out: torch.Tensor, z: torch.Tensor, scale: float, lz: torch.Tensor,
                 lz1: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
        if not out.is_contiguous():
            raise ValueError("the fused gradient writer needs a contiguous [n, V] block")
        self.out, self.z, self.scale = out, z, float(scale)
        self.lz, self.lz1, self.b = lz, lz1, b
        self.a = self.c = self.r = None
        self._lin: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []

    def dense(self, a: torch.Tensor, c: torch.Tensor | None = None,
              r: torch.Tensor | None = None) -> None:
        """out <- p * (a + c * r) (+ b * p1): ``a``/``c`` [n] per row, ``r`` [V] per column."""
        self.a, self.c, self.r = a, c, r
        row_softmax.softmax_combine_(self.out, self.z, self.scale, self.lz, a, c, r, self.lz1,
                                     self.b)

    def add(self, lin: torch.Tensor, values: torch.Tensor) -> None:
        """Adds ``values`` at flat [n, V] indices ``lin`` (repeats add up)."""
        self._lin.append(lin)
        self._values.append(values)

    def finish(self) -> None:
        """Applies the additions (see the module docstring for low-precision gradients)."""
        if not self._lin:
            return
        flat = self.out.view(-1)
        if self.out.dtype == torch.float32:
            for lin, values in zip(self._lin, self._values):
                flat.index_add_(0, lin, values.to(flat.dtype))
            return
        lin = torch.cat(self._lin)
        places, which = torch.unique(lin, return_inverse=True)
        added = torch.zeros(places.numel(), dtype=torch.float32, device=lin.device)
        added.index_add_(0, which, torch.cat([v.float() for v in self._values]))
        flat[places] = (self._dense_at(places) + added).to(flat.dtype)

    def _dense_at(self, lin: torch.Tensor) -> torch.Tensor:
        """The dense pass's value at flat indices ``lin``, in fp32."""
        width = self.z.shape[1]
        pos = torch.div(lin, width, rounding_mode="floor")
        z = row_softmax.values_at(self.z, lin, pos)
        coef = self.a.float().index_select(0, pos)
        if self.c is not None:
            coef = coef + self.c.float().index_select(0, pos) * self.r.float().index_select(
                0, lin - pos * width)
        value = torch.exp(z * self.scale - self.lz.float().index_select(0, pos)) * coef
        if self.lz1 is not None:
            value += (torch.exp(z - self.lz1.float().index_select(0, pos))
                      * self.b.float().index_select(0, pos))
        return value


__all__ = ["FusedGradWriter"]
