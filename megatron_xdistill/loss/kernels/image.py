"""The exact P-KL from an ``image`` payload: the teacher's columns on W's image I only.

A column outside I gets projected mass 0 whatever the student does, so its share of the KL is
the teacher's alone; the image form's teacher computes it once per chunk (the float64 sums of
P log P over all of V_t and of P over the columns outside I, and its argmax over all of V_t)
and ships P on the columns of I with them (``payload.py``). The student then reads |I| columns
a row, not V_t (the demo's SmolLM2 -> Qwen2.5 W: 40,132 of 151,936; the synthetic W of
``bench_loss.py``: 87,607), and the payload shrinks as much. Everything else is
:class:`kernels.pkl.DenseKernel`'s: the same projection onto I, the same formulas; on CPU one
contiguous pass over each row (:mod:`cpu.image_rows`: no pieces of V_t, no gather, no exp), on
a GPU a few torch operations that make the KL and its gradient together (no autograd).
Reverse KL and the JSD read log P on I as the log of the shipped P floored at TINY (a teacher
probability under 1.2e-38 counts as 1.2e-38 there; the forward KL reads P itself).
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.collectives import Group, group_size
from megatron_xdistill.loss.cpu import image_block
from megatron_xdistill.loss.cpu.image_rows import image_kl_rows
from megatron_xdistill.loss.cpu.threads import numba_takes
from megatron_xdistill.loss.definitions.common import EPS, TINY
from megatron_xdistill.loss.definitions.formulas import grad_scale, normaliser, teacher_only_terms
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.kernels.image_projection import ImageProjection
from megatron_xdistill.loss.kernels.pkl import DenseKernel


class ImageKernel(DenseKernel):
    """:class:`kernels.pkl.DenseKernel` over an ``image`` payload (see the module docstring)."""

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
        kl, at, g = image_kl_on_image(u, self.probs, keys, weight)
        kl = (kl + self._outside_terms().index_select(0, keys)).to(u.dtype)
        return kl, at, self.payload.teacher_argmax.reshape(-1).index_select(0, keys), g

    def _exact_grad(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
        """The gradient of :meth:`_exact`'s pass (its KL made too: a log an element, as the
        exp of a log-prob row's pass), copied out of the pass's reused buffer."""
        return image_kl_on_image(u, self.probs, keys, weight)[2].clone()

    def fuses_block(self, like: torch.Tensor) -> bool:
        """Whether :meth:`block_from_logits` takes blocks of logits like ``like``: the forward
        KL, one TP rank, CPU tensors Numba takes."""
        return (self.beta == 0.0 and group_size(self.tp_group) == 1 and numba_takes(like)
                and numba_takes(self.probs))

    def block_from_logits(self, blk, keys: torch.Tensor, counts: torch.Tensor,
                          weight: torch.Tensor, inv_t: float, coef: torch.Tensor,
                          out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(:meth:`kl`, top-1) of a block whose chunk rows are all held whole here, with the
        block's gradient written into ``out`` as they are made (:mod:`cpu.image_block`: a chunk
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
        """The forward KL takes :func:`cpu.image_rows.image_kl_on_image` on every device (its
        KL and gradient written directly); the other divergences autograd."""
        return self.beta == 0.0


#: Whether :func:`image_kl_on_image` gives a tensor to the CPU backend's pass (tests force the
#: torch path on CPU tensors through it).
_rows_on_cpu = numba_takes


def image_kl_on_image(u: torch.Tensor, probs: torch.Tensor, keys: torch.Tensor,
                      weight: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(-sum_I P log(q + EPS) per row, float64: the forward KL's part on I that the student
    moves; column of I where u is largest; gradient on u or None) of the rows ``keys`` of an
    ``image`` payload (``probs`` [n, |I|], P on I's columns only): the KL is this plus the
    teacher's sums (entropy over V_t, -log EPS x the mass outside I). Not differentiable: with
    ``weight`` (a scalar or one per row) the gradient of sum_r weight_r KL_r, written directly.
    On CPU the gradient is a view of a reused buffer, valid until the next call. (With log P
    rows, an exp an element more: 0.46 against 1.3 ns a V_t element of a full row at |I| = 26%
    of V_t, 22 rows, one thread; P rows: :mod:`cpu.image_rows`.)"""
    rows, width = u.shape
    grad = weight is not None
    if rows == 0 or width == 0:
        return (torch.zeros(rows, dtype=torch.float64, device=u.device),
                torch.zeros(rows, dtype=torch.int64, device=u.device),
                torch.zeros_like(u) if grad else None)
    if probs.shape[1] != width:
        raise ValueError(f"image payload rows have {probs.shape[1]} columns, u {width}")
    u = u.detach().contiguous()
    if _rows_on_cpu(u) and _rows_on_cpu(probs):
        return image_kl_rows(u, probs, keys, weight)
    return _on_image_by_torch(u, probs, keys, weight)


def _on_image_by_torch(u: torch.Tensor, probs: torch.Tensor, keys: torch.Tensor,
                       weight: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`image_kl_on_image` by torch operations (a GPU's tensors; CPU tensors Numba does
    not take): the same quantities, the cross sum in float64; no host wait (a row whose sum
    falls under TINY drops the normalisation's term by a mask, as the floor holds its
    total)."""
    sums, inv = normaliser(u)
    q = u * inv[:, None]
    q_eps = q + EPS
    p = probs.index_select(0, keys.to(probs.device)).to(u.dtype)
    cross = torch.sum(p * torch.log(q_eps), -1, dtype=torch.float64)
    at = u.argmax(-1)
    if weight is None:
        return cross.neg_(), at, None
    d = p.div_(q_eps)  # P / (q + EPS)
    c = torch.sum(d * q, -1).masked_fill_(sums < TINY, 0.0)
    g = torch.sub(c[:, None], d).mul_(grad_scale(weight, inv)[:, None])
    return cross.neg_(), at, g


__all__ = ["ImageKernel", "image_kl_on_image"]
