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
from megatron_xdistill.loss.fused.layout import RowGroup, RowLayout, next_pow2
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


def _beta_kind(beta: float) -> int:
    return 0 if beta == 0.0 else 1 if beta == 1.0 else 2


class ImagePass:
    """The image form's passes over row groups (see the module docstring)."""

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
            group: RowGroup, grad: bool, dot: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(KL [g] float64, top-1 [g] bool, h [g, V_real] or None) of ``group``: with ``grad``
        h is the KL's gradient on the rows' summed softmax and ``dot`` [N] gets each of their
        positions' <p, h> (summed over TP)."""
        from megatron_xdistill.loss.gpu import triton_image  # Triton: only where the passes run

        n_rows, n_image, dev = group.size, self.proj.size, x.device
        block = min(2048, next_pow2(max(self.num_real, 16)))
        s = torch.empty(n_rows, self.num_real, dtype=torch.float32, device=dev)
        triton_image.chunk_prob_sums[(n_rows,)](
            x, x.stride(0), lse, layout.first, layout.length, group.rows, self.num_real,
            float(scale), s, s.stride(0), BLOCK=block)
        u = torch.zeros(n_rows, n_image, dtype=torch.float32, device=dev)
        t = self.tables
        if n_image:
            triton_image.project_on_image[(n_rows,)](
                s, s.stride(0), u, u.stride(0), t.order, t.start, t.degree, t.tile_degree,
                t.student, t.weight, n_image, BLOCK=IMAGE_BLOCK)
        all_reduce(u, self.tp_group)
        if group.split:
            all_reduce(u, self.cp_group)
        mass = u.sum(1)
        value = torch.empty(n_rows, dtype=torch.float64, device=dev)
        at = torch.zeros(n_rows, dtype=torch.int32, device=dev)
        if n_image:
            triton_image.image_divergence[(n_rows,)](
                u, u.stride(0), mass, self.probs, self.probs.stride(0), group.keys, value, at,
                n_image, float(self.beta), TINY, EPS, BETA_KIND=_beta_kind(self.beta),
                GRAD=grad, BLOCK=min(2048, next_pow2(n_image)))
        else:
            value.zero_()
        kl = value + self.outside.index_select(0, group.keys)
        top1 = (self.proj.image.index_select(0, at.long()) ==
                self.teacher_argmax.index_select(0, group.keys)) if n_image else \
            torch.zeros(n_rows, dtype=torch.bool, device=dev)
        if not grad:
            return kl, top1, None
        h = s  # s is not read again
        lo, hi = group.lo, group.hi
        table = self.tables
        triton_image.pull_back[(n_rows,)](
            u, u.stride(0), h, h.stride(0), x, x.stride(0), lse, layout.first, layout.length,
            group.rows, dot, table.row_col, table.row_weight, table.row_col.shape[1],
            self.num_real, float(scale), BLOCK=block)
        if group_size(self.tp_group) > 1:  # the group's positions, contiguous
            all_reduce(dot[lo:hi], self.tp_group)
        return kl, top1, h

    @staticmethod
    def coefficient(weight: torch.Tensor, group: RowGroup, temperature: float
                    ) -> torch.Tensor:
        """Each row's factor on p (h - <p, h>): d(T^2 KL) / d(logits) = T p (h - <p, h>)
        times the row's weight and the loss's weight on the KD sum."""
        return (weight * group.weight * temperature).float().contiguous()


__all__ = ["IMAGE_BLOCK", "ImagePass", "ImageTables"]
