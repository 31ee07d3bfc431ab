"""The exact P-KL from an ``image`` payload: the teacher's columns on W's image I only.

A column outside I gets projected mass 0 whatever the student does, so its share of the KL is
the teacher's alone; the image form's teacher computes it once per chunk (the float64 sums of
P log P over all of V_t and of P over the columns outside I, and its argmax over all of V_t)
and ships P on the columns of I with them (``payload.py``). The student then reads |I| columns
a row, not V_t (the demo's SmolLM2 -> Qwen2.5 W: 40,132 of 151,936; the synthetic W of
``bench_loss.py``: 87,607), and the payload shrinks as much. Everything else is
:class:`~.kernels.DenseKernel`'s: the same projection onto I, the same formulas; on CPU one
contiguous pass over each row (:mod:`.image_rows`: no pieces of V_t, no gather, no exp), on
a GPU a few torch operations that make the KL and its gradient together (no autograd).
Reverse KL and the JSD read log P on I as the log of the shipped P floored at TINY (a teacher
probability under 1.2e-38 counts as 1.2e-38 there; the forward KL reads P itself).
"""

from __future__ import annotations

import torch

from . import image_block, image_rows
from .collectives import Group, group_size
from .common import TINY
from .formulas import teacher_only_terms
from .image_projection import ImageProjection
from .kernels import DenseKernel
from .numba_cpu import numba_takes
from .payload import TeacherPayload
from .shard import ProjectionShard


class ImageKernel(DenseKernel):
    """:class:`~.kernels.DenseKernel` over an ``image`` payload (see the module docstring)."""

    #: a block taken from its logits (``fuses_block``) has its gradient written by the same
    #: call that makes its KL (:meth:`block_from_logits`), not by ``backward_block``
    writes_block_gradient = True

    def __init__(self, payload: TeacherPayload, shard: ProjectionShard, num_real: int,
                 beta: float, tp_group: Group, keys: torch.Tensor) -> None:
        self.payload, self.num_real = payload, num_real
        self.beta, self.tp_group = beta, tp_group
        self.proj = ImageProjection.of(shard, num_real, tp_group)
        if payload.spec.width != self.proj.size:
            raise ValueError(
                f"the image payload has {payload.spec.width} columns a chunk, but W's image "
                f"(the teacher ids this rank's projection maps real student tokens to, over "
                f"TP) has {self.proj.size}: the teacher must ship the image of the same "
                f"projection (teacher_payload(..., image_teacher_ids="
                f"teacher_image(indices, weights, student_vocab_size)))")
        self.probs = payload.probs.reshape(-1, payload.spec.width)
        self.keys = keys
        self._terms: tuple[torch.Tensor, torch.Tensor] | None = None
        self._outside: torch.Tensor | None = None

    def _outside_terms(self) -> torch.Tensor:
        """Per payload row, float64: the divergence's teacher-only terms (the forward KL's:
        the entropy over V_t and the columns outside I; the others': outside I), from the
        teacher's sums; made once."""
        if self._outside is None:
            plogp, mass = (t.reshape(-1) for t in self.payload.teacher_sums())
            self._outside = teacher_only_terms(self.beta, plogp, mass)
        return self._outside

    def _teacher_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(const, argmax) as :class:`DenseKernel` makes them from a full row, from the
        teacher's sums and argmax."""
        if self._terms is None:
            self._terms = self._outside_terms(), self.payload.teacher_argmax.reshape(-1)
        return self._terms

    def _p_on_image(self, keys: torch.Tensor) -> torch.Tensor:
        return self.probs.index_select(0, keys)

    def _logp_on_image(self, keys: torch.Tensor) -> torch.Tensor:
        return self.probs.index_select(0, keys).clamp_min(TINY).log()

    def _exact(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor | None):
        """The forward KL on I from the payload's own columns, plus the teacher's terms (its
        entropy, the columns outside I); the teacher's argmax from the payload."""
        kl, at, g = image_rows.image_kl_on_image(u, self.probs, keys, weight)
        kl = (kl + self._outside_terms().index_select(0, keys)).to(u.dtype)
        return kl, at, self.payload.teacher_argmax.reshape(-1).index_select(0, keys), g

    def _exact_grad(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
        """The gradient of :meth:`_exact`'s pass (its KL made too: a log an element, as the
        exp of a log-prob row's pass), copied out of the pass's reused buffer."""
        return image_rows.image_kl_on_image(u, self.probs, keys, weight)[2].clone()

    def fuses_block(self, like: torch.Tensor) -> bool:
        """Whether :meth:`block_from_logits` takes blocks of logits like ``like``: the forward
        KL, one TP rank, CPU tensors Numba takes."""
        return (self.beta == 0.0 and group_size(self.tp_group) == 1 and numba_takes(like)
                and numba_takes(self.probs))

    def block_from_logits(self, blk, keys: torch.Tensor, counts: torch.Tensor,
                          weight: torch.Tensor, inv_t: float, coef: torch.Tensor,
                          out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`kl`, top-1) of a block whose chunk rows are all held whole here, with the
        block's gradient written into ``out`` as they are made (:mod:`.image_block`: a chunk
        row at a time from its positions' logits ``blk.x``): inv_t times that of
        sum_r weight_r KL_r, plus ``coef * p``. Each position's log-partition goes into
        ``blk.lz_local`` (one TP rank: the TP-wide one). For a forward that writes the
        gradient; no [rows, |I|] or [positions, V] buffers."""
        x = blk.x
        cross, at = image_block.image_block(
            out, x, blk.seg, blk.num_rows, self.proj.row_layout(x.dtype), self.proj.size,
            self.probs, keys, weight, coef, inv_t, blk.lz_local)
        kl = (cross + self._outside_terms().index_select(0, keys)).to(x.dtype)
        return kl, self._top1(at, self.payload.teacher_argmax.reshape(-1).index_select(0, keys))

    def _direct(self, u: torch.Tensor) -> bool:
        """The forward KL takes :func:`.image_rows.image_kl_on_image` on every device (its
        KL and gradient written directly); the other divergences autograd."""
        return self.beta == 0.0


__all__ = ["ImageKernel"]
