"""This TP rank's rows of the projection W, in the forms the vocab-parallel loss needs.

Built from ``(indices, weights)`` [V_local, k] (``ProjectionMatrix.local_shard(vocab_start,
vocab_end)``: teacher ids, -1 = empty, Megatron's padded rows empty) once per run; the loss then
projects chunk sums through it (:meth:`ProjectionShard.project`) or looks up which local student
rows feed given teacher columns (:meth:`ProjectionShard.column_entries`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ColumnEntries:
    """Nonzeros of W[local rows, columns[r, j]] for every (row r, slot j), grouped by row.

    ``pair`` (r * k + j), ``student`` (local student column) and ``weight`` are [E]; the entries
    of row r are ``offset[r] : offset[r] + length[r]``. 20 bytes an entry.
    """

    pair: torch.Tensor
    student: torch.Tensor
    weight: torch.Tensor
    offset: torch.Tensor
    length: torch.Tensor


@dataclass
class ProjectionShard:
    """Rows [vocab_start, vocab_start + V_local) of W (see the module docstring)."""

    indices: torch.Tensor
    weights: torch.Tensor
    vocab_start: int
    teacher_vocab_size: int

    def __post_init__(self) -> None:
        self.indices = torch.as_tensor(self.indices).to(torch.int64)
        self.weights = torch.as_tensor(self.weights).to(torch.float32)
        if self.indices.dim() != 2 or self.indices.shape != self.weights.shape:
            raise ValueError("projection shard indices/weights must both be [V_local, k]")
        keep = (self.indices >= 0) & (self.weights > 0)
        if keep.any() and int(self.indices[keep].max()) >= self.teacher_vocab_size:
            raise ValueError("projection shard maps to teacher ids >= teacher_vocab_size")
        self.rowsum = torch.where(keep, self.weights, 0.0).sum(1)
        rows = torch.nonzero(keep, as_tuple=True)[0]
        cols = self.indices[keep]
        vals = self.weights[keep]
        order = torch.argsort(cols * max(self.indices.shape[0], 1) + rows)
        self.student, self.teacher, self.value = rows, cols, vals  # row-major nonzeros
        self.csr_student, self.csr_value = rows[order], vals[order]
        counts = torch.bincount(cols, minlength=self.teacher_vocab_size)
        self.crow = torch.zeros(self.teacher_vocab_size + 1, dtype=torch.int64,
                                device=self.indices.device)
        self.crow[1:] = torch.cumsum(counts, 0)

    @property
    def num_rows(self) -> int:
        return int(self.indices.shape[0])

    def to(self, device: torch.device) -> ProjectionShard:
        """This shard with its tensors on ``device`` (a no-op when they are there)."""
        if self.indices.device == torch.device(device):
            return self
        return ProjectionShard(self.indices.to(device), self.weights.to(device),
                               self.vocab_start, self.teacher_vocab_size)

    def project(self, student_mass: torch.Tensor) -> torch.Tensor:
        """[r, n] student mass on the first n local rows -> [r, V_t] (differentiable)."""
        n = student_mass.shape[1]
        sel = self.student < n
        s, t, w = self.student[sel], self.teacher[sel], self.value[sel]
        out = student_mass.new_zeros(student_mass.shape[0], self.teacher_vocab_size)
        return out.index_add(1, t, student_mass[:, s] * w)

    def column_entries(self, columns: torch.Tensor, num_real: int) -> ColumnEntries:
        """Entries feeding teacher ``columns`` [r, k] from local rows below ``num_real``."""
        r, k = columns.shape
        flat = columns.reshape(-1).to(torch.int64)
        start = self.crow.index_select(0, flat)
        length = self.crow.index_select(0, flat + 1) - start
        total = int(length.sum())
        first = torch.cumsum(length, 0) - length
        pair = torch.repeat_interleave(torch.arange(r * k, device=flat.device), length)
        pos = torch.repeat_interleave(start - first, length, output_size=total)
        pos += torch.arange(total, device=flat.device)
        student = self.csr_student.index_select(0, pos)
        weight = self.csr_value.index_select(0, pos)
        if num_real < self.num_rows and total:  # drop Megatron's padded rows
            keep = torch.nonzero(student < num_real, as_tuple=True)[0]
            pair, student, weight = (t.index_select(0, keep) for t in (pair, student, weight))
        row_len = torch.bincount(torch.div(pair, max(k, 1), rounding_mode="floor"), minlength=r)
        return ColumnEntries(pair=pair, student=student, weight=weight,
                             offset=torch.cumsum(row_len, 0) - row_len, length=row_len)
