"""The exact (image) P-KL of a row group by :mod:`gpu.triton_image`'s kernels.

Per chunk row: the summed softmax of its positions on this shard, s [V_real]; its projection
onto W's image, u = s W_I (a gather over W's entries by column, no sparse library, no atomics);
summed over TP (and CP for split rows); the divergence of the teacher's P from q = u / sum u on
I and its gradient on u; back through W, h = W_I g; each position's <p, h> (summed over TP);
then :func:`gpu.triton_rows.chunk_gradient` writes p (h - <p, h>) into the logits' gradient.
The teacher-only terms outside I and the argmax come from the payload as in
:class:`kernels.image.ImageKernel`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.collectives import Group, all_reduce, group_size
from megatron_xdistill.loss.definitions.common import EPS, TINY
from megatron_xdistill.loss.definitions.formulas import teacher_only_terms
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.fused.layout import (
    GradientTarget,
    RowGroup,
    RowLayout,
    beta_kind,
    column_tile,
    next_pow2,
    whole_row_programs,
)
from megatron_xdistill.loss.kernels.image_projection import ImageProjection

#: columns a tile of I (the gather's tiles are sorted by W's entries per column)
IMAGE_BLOCK = 512


@dataclass
class ImageTables:
    """W on I as the kernels read it, made once per projection: columns ordered by their
    number of entries with each tile's largest count, and a padded [V_real, width] table of
    each student row's (column of I, weight)."""

    order: torch.Tensor        # [|I|] int64, columns of I by entry count
    start: torch.Tensor        # [|I|] int64, first CSC entry of each column
    degree: torch.Tensor       # [|I|] int64
    tile_degree: torch.Tensor  # [tiles] int64, largest degree in each tile of ``order``
    student: torch.Tensor      # [E] int64, CSC entries' student rows
    weight: torch.Tensor       # [E] float32
    row_col: torch.Tensor      # [V_real, width] int64, -1 = none
    row_weight: torch.Tensor   # [V_real, width] float32

    @classmethod
    def of(cls, proj: ImageProjection) -> ImageTables:
        """Built once and kept on the projection."""
        cache = proj._matrices
        if "fused_tables" not in cache:
            cache["fused_tables"] = cls._build(proj)
        return cache["fused_tables"]

    @classmethod
    def _build(cls, proj: ImageProjection) -> ImageTables:
        dev = proj.ccol.device
        degree = proj.ccol[1:] - proj.ccol[:-1]
        order = torch.argsort(degree, stable=True)
        tiles = -(-proj.size // IMAGE_BLOCK)
        padded = torch.zeros(tiles * IMAGE_BLOCK, dtype=torch.int64, device=dev)
        padded[: proj.size] = degree.index_select(0, order)
        tile_degree = padded.view(tiles, IMAGE_BLOCK).amax(1) if tiles else padded[:0]
        num_real = proj.crow.numel() - 1
        row_degree = proj.crow[1:] - proj.crow[:-1]
        width = max(int(row_degree.max()) if num_real else 0, 1)
        row_col = torch.full((num_real, width), -1, dtype=torch.int64, device=dev)
        row_weight = torch.zeros(num_real, width, dtype=torch.float32, device=dev)
        rows = torch.repeat_interleave(torch.arange(num_real, device=dev), row_degree)
        slot = torch.arange(proj.col.numel(), device=dev) - proj.crow[:-1].index_select(0, rows)
        row_col[rows, slot] = proj.col
        row_weight[rows, slot] = proj.val.float()
        return cls(order, proj.ccol[:-1].contiguous(), degree, tile_degree,
                   proj.csc_student.contiguous(), proj.csc_val.float().contiguous(),
                   row_col, row_weight)


#: one TP rank, rows held whole: every step of a row in one persistent kernel (tests turn it
#: off to run the one-step kernels alike)
WHOLE_ROWS = True



class ImagePass:
    """The image form's passes over row groups (see the module docstring)."""

    #: what :class:`fused.call.FusedCall` gives the passes: the per-position log-partitions
    #: and a scratch for each position's <p, h> (not the gold forms' per-row sums)
    image = True

    def __init__(self, payload: TeacherPayload, proj: ImageProjection, num_real: int,
                 beta: float, tp_group: Group, cp_group: Group) -> None:
        self.payload, self.proj, self.num_real = payload, proj, num_real
        self.beta, self.tp_group, self.cp_group = beta, tp_group, cp_group
        self.tables = ImageTables.of(proj)
        self.probs = payload.probs.reshape(-1, payload.spec.width).float().contiguous()
        plogp, mass = (t.reshape(-1) for t in payload.teacher_sums())
        self.outside = teacher_only_terms(beta, plogp, mass)  # float64 per payload row
        self.teacher_argmax = payload.teacher_argmax.reshape(-1)

    def row_bytes(self) -> int:
        """fp32 bytes a row of a group holds: s / h on V_real and u / g on I."""
        return 4 * (self.num_real + self.proj.size)

    def run(self, x: torch.Tensor, scale: float, lse: torch.Tensor, layout: RowLayout,
            group: RowGroup, target: GradientTarget | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(KL [g] float64, top-1 [g] bool) of ``group``; with a ``target`` the gradient of its
        rows' positions written there. One TP rank and rows held whole: every step of a row in
        one persistent kernel (:func:`gpu.triton_image.image_rows`); else a kernel a step with
        the TP / CP sums between them."""
        n_rows, dev = group.size, x.device
        value = torch.zeros(n_rows, dtype=torch.float64, device=dev)
        at = torch.zeros(n_rows, dtype=torch.int32, device=dev)
        if self.proj.size == 0:
            if target is not None:  # q = 0 everywhere: the KL's gradient is 0, CE's is not
                target.dot[group.lo: group.hi] = 0.0
                target.write(group, x.new_zeros(n_rows, self.num_real, dtype=torch.float32),
                             self._coef(target, group), image=True)
        elif WHOLE_ROWS and group_size(self.tp_group) == 1 and not group.split:
            self._whole_rows(x, scale, lse, layout, group, target, value, at)
        else:
            self._by_steps(x, scale, lse, layout, group, target, value, at)
        kl = value + self.outside.index_select(0, group.keys)
        if self.proj.size == 0:
            return kl, torch.zeros(n_rows, dtype=torch.bool, device=dev)
        top1 = (self.proj.image.index_select(0, at.long()) ==
                self.teacher_argmax.index_select(0, group.keys))
        return kl, top1

    def _coef(self, target: GradientTarget, group: RowGroup) -> torch.Tensor:
        return self.coefficient(target.kd_weight, group, target.temperature)

    def _whole_rows(self, x, scale, lse, layout, group, target, value, at) -> None:
        from megatron_xdistill.loss.gpu import triton_image

        n_rows, n_image, dev = group.size, self.proj.size, x.device
        programs = whole_row_programs(dev, n_rows)
        s = torch.empty(programs, self.num_real, dtype=torch.float32, device=dev)
        u = torch.empty(programs, n_image, dtype=torch.float32, device=dev)
        t = self.tables
        grad = target is not None
        out = target.out if grad else x
        coef = self._coef(target, group) if grad else value
        ce = (target.ce_coef, target.label, target.lse1) if grad else (lse, lse, lse)
        dot = target.dot if grad else lse
        table = self.tables
        triton_image.image_rows[(programs,)](
            x, x.stride(0), lse, layout.first, layout.length, group.rows, group.keys, n_rows,
            self.num_real, float(scale), s, s.stride(0), u, u.stride(0), t.order, t.start,
            t.degree, t.tile_degree, t.student, t.weight, n_image, self.probs,
            self.probs.stride(0), value, at, dot, table.row_col, table.row_weight,
            table.row_col.shape[1], out, out.stride(0), out.shape[1], coef, *ce,
            float(self.beta), TINY, EPS, BETA_KIND=beta_kind(self.beta), GRAD=grad,
            CE=grad and target.has_ce, CE_OWN=grad and target.ce_own,
            BLOCK=column_tile(self.num_real), IMAGE_BLOCK=IMAGE_BLOCK,
            DIV_BLOCK=min(2048, next_pow2(n_image)))

    def _by_steps(self, x, scale, lse, layout, group, target, value, at) -> None:
        from megatron_xdistill.loss.gpu import triton_image

        n_rows, n_image, dev = group.size, self.proj.size, x.device
        block = column_tile(self.num_real)
        s = torch.empty(n_rows, self.num_real, dtype=torch.float32, device=dev)
        triton_image.chunk_prob_sums[(n_rows,)](
            x, x.stride(0), lse, layout.first, layout.length, group.rows, self.num_real,
            float(scale), s, s.stride(0), BLOCK=block)
        u = torch.zeros(n_rows, n_image, dtype=torch.float32, device=dev)
        t = self.tables
        triton_image.project_on_image[(n_rows,)](
            s, s.stride(0), u, u.stride(0), t.order, t.start, t.degree, t.tile_degree,
            t.student, t.weight, n_image, BLOCK=IMAGE_BLOCK)
        all_reduce(u, self.tp_group)
        if group.split:
            all_reduce(u, self.cp_group)
        mass = u.sum(1)
        grad = target is not None
        triton_image.image_divergence[(n_rows,)](
            u, u.stride(0), mass, self.probs, self.probs.stride(0), group.keys, value, at,
            n_image, float(self.beta), TINY, EPS, BETA_KIND=beta_kind(self.beta),
            GRAD=grad, BLOCK=min(2048, next_pow2(n_image)))
        if not grad:
            return
        h = s  # s is not read again
        table = self.tables
        triton_image.pull_back[(n_rows,)](
            u, u.stride(0), h, h.stride(0), x, x.stride(0), lse, layout.first, layout.length,
            group.rows, target.dot, table.row_col, table.row_weight, table.row_col.shape[1],
            self.num_real, float(scale), BLOCK=block)
        if group_size(self.tp_group) > 1:
            if group.split:
                all_reduce(target.dot, self.tp_group)  # the split rows' positions, anywhere
            else:  # the group's positions, contiguous
                all_reduce(target.dot[group.lo: group.hi], self.tp_group)
        target.write(group, h, self._coef(target, group), image=True)

    @staticmethod
    def coefficient(weight: torch.Tensor, group: RowGroup, temperature: float
                    ) -> torch.Tensor:
        """Each row's factor on p (h - <p, h>): d(T^2 KL) / d(logits) = T p (h - <p, h>)
        times the row's weight and the loss's weight on the KD sum."""
        return (weight * group.weight * temperature).float().contiguous()


__all__ = ["IMAGE_BLOCK", "ImagePass", "ImageTables"]
