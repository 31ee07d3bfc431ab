"""W on its image: the exact (all of V_t) P-KL with no [rows, V_t] work on the student side.

A teacher column that no student token maps to (outside the image I of W) gets projected mass 0
whatever the student does, so its share of the KL is the teacher's alone (``DenseKernel`` takes it
once per row from the payload). The student side therefore projects onto I only: for each chunk
row, q_I = (sum of its positions' probabilities) W_I, with W's nonzeros renumbered onto I. I is the
image of the whole W (the union over the TP ranks), so every TP rank writes its rows' shares into
the same [rows, |I|] layout and one sum over TP completes q.

Two implementations of the same two maps (a block's positions -> q_I per row; a gradient on q_I
-> the gradient on the block's logits), chosen by device: the CPU backend's Numba kernels
(:mod:`cpu.image_projection`), and elsewhere (CUDA) the rows' summed probabilities times W as a
sparse CSR matrix product (cuSPARSE, here): no [rows, nonzeros] gather, which made the gather
path's time on an H200.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from megatron_xdistill.loss.blocks.block_data import with_zero_row
from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.collectives import Group, all_reduce
from megatron_xdistill.loss.cpu import image_projection as cpu_image_projection
from megatron_xdistill.loss.cpu.image_block import RowLayout
from megatron_xdistill.loss.cpu.threads import numba_takes


def teacher_image(indices: torch.Tensor, weights: torch.Tensor, student_vocab_size: int
                  ) -> torch.Tensor:
    """W's image I, ascending: the teacher ids that W maps real student tokens to (rows below
    ``student_vocab_size`` of ``indices`` / ``weights`` [V_s, k], -1 or weight 0 = no entry, as
    ``ProjectionMatrix.local_shard(0, V_s)`` gives them). The columns an ``image`` payload
    ships, in the order :class:`ImageProjection` numbers them."""
    indices = torch.as_tensor(indices)[:student_vocab_size]
    weights = torch.as_tensor(weights)[:student_vocab_size]
    return torch.unique(indices[(indices >= 0) & (weights > 0)].to(torch.int64))


def _seg_dummy(seg: torch.Tensor, num_rows: int, given: torch.Tensor | None) -> torch.Tensor:
    """Each position's row with ``num_rows`` for none (the gathers' zero row): ``given``
    where the caller has it."""
    return given if given is not None else torch.where(seg >= 0, seg, num_rows)


@dataclass
class ImageProjection:
    """This TP rank's real rows of W, with teacher columns renumbered onto the image I of the
    whole W (see the module docstring). Entries are row-major (CSR over local student rows)."""

    image: torch.Tensor    # [|I|] int64 teacher ids, ascending, the same on every TP rank
    crow: torch.Tensor     # [n + 1] int64 entry offsets of the n real local student rows
    col: torch.Tensor      # [E] int64 position in ``image``
    val: torch.Tensor      # [E] float32 weight
    ccol: torch.Tensor     # [|I| + 1] int64 entry offsets per column of I (the CSC order below)
    csc_student: torch.Tensor  # [E] int64 student row of each entry, by column of I
    csc_val: torch.Tensor  # [E] float32 its weight
    _matrices: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(cls, shard: ProjectionShard, num_real: int, tp_group: Group) -> ImageProjection:
        """Collective over TP (one max all-reduce of a [V_t] mask): every rank must call it."""
        keep = shard.student < num_real
        student, teacher = shard.student[keep], shard.teacher[keep]
        mask = torch.zeros(shard.teacher_vocab_size, dtype=torch.int32, device=teacher.device)
        mask[teacher] = 1
        all_reduce(mask, tp_group, "max")
        image = torch.nonzero(mask, as_tuple=True)[0]
        position = torch.cumsum(mask, 0) - 1
        counts = torch.bincount(student, minlength=num_real)
        crow = torch.zeros(num_real + 1, dtype=torch.int64, device=teacher.device)
        crow[1:] = torch.cumsum(counts, 0)
        col = position.index_select(0, teacher).to(torch.int64)
        value = shard.value[keep].contiguous()
        by_column = torch.argsort(col * max(num_real, 1) + student)
        ccol = torch.zeros(image.numel() + 1, dtype=torch.int64, device=teacher.device)
        ccol[1:] = torch.cumsum(torch.bincount(col, minlength=image.numel()), 0)
        return cls(image, crow, col, value, ccol,
                   student.index_select(0, by_column), value.index_select(0, by_column))

    @classmethod
    def of(cls, shard: ProjectionShard, num_real: int, tp_group: Group) -> ImageProjection:
        """:meth:`build`, kept on the shard (a run's shard lives as long as the run)."""
        cache = shard.__dict__.setdefault("_image_projections", {})
        key = (num_real, id(tp_group))
        if key not in cache:
            cache[key] = cls.build(shard, num_real, tp_group)
        return cache[key]

    @property
    def size(self) -> int:
        return int(self.image.numel())

    _numba = staticmethod(numba_takes)

    def _matrix(self, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
        """W on I as a sparse CSR matrix [V_real, |I|] (``transposed``: [|I|, V_real]),
        built once per dtype."""
        key = (dtype, transposed)
        if key not in self._matrices:
            num_real = self.crow.numel() - 1
            if transposed:
                parts, size = (self.ccol, self.csc_student, self.csc_val), (self.size, num_real)
            else:
                parts, size = (self.crow, self.col, self.val), (num_real, self.size)
            with warnings.catch_warnings():  # torch's "CSR support is in beta" notice
                warnings.simplefilter("ignore", UserWarning)
                self._matrices[key] = torch.sparse_csr_tensor(
                    parts[0], parts[1], parts[2].to(dtype), size=size, check_invariants=False)
        return self._matrices[key]

    def row_layout(self, dtype: torch.dtype) -> RowLayout:
        """W on I by student rows as :mod:`cpu.image_block`'s row pass reads it, built once per
        dtype."""
        key = ("rows", dtype)
        if key not in self._matrices:
            self._matrices[key] = RowLayout.of(self.crow, self.col, self.val, self.size, dtype)
        return self._matrices[key]

    def weights(self, dtype: torch.dtype, by_column: bool = False) -> torch.Tensor:
        """W's entries in ``dtype``, row-major (CSR) or ``by_column`` (CSC)."""
        val = self.csc_val if by_column else self.val
        return val if val.dtype == dtype else val.to(dtype)

    def project(self, probs_local: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
                num_rows: int, use_numba: bool | None = None, *,
                seg_dummy: torch.Tensor | None = None, unit_factor: bool = False
                ) -> torch.Tensor:
        """[num_rows, |I|]: per row, its positions' probabilities (``probs_local * factor``)
        summed and projected onto I. ``seg``: row of each position, -1 for none
        (``seg_dummy``: the same with ``num_rows`` for none, where the caller has it;
        ``unit_factor``: ``factor`` is all ones). ``use_numba``: None picks by device (tests
        force either). On CPU a view of a reused buffer: valid until the next projection or
        :meth:`backward_into` (a block's: its KL, then its gradient, read it first)."""
        if self._numba(probs_local) if use_numba is None else use_numba:
            return cpu_image_projection.project(self, probs_local, factor, seg, num_rows)
        if num_rows == 0 or self.size == 0:
            return probs_local.new_zeros(num_rows, self.size)
        seg_d = _seg_dummy(seg, num_rows, seg_dummy)
        n = probs_local.shape[1]
        rows = probs_local.new_zeros(num_rows + 1, n).index_add_(
            0, seg_d, probs_local if unit_factor else probs_local * factor[:, None])[:-1]
        # q_I^T = W_I^T rows^T: [|I|, V_real] CSR times [V_real, rows]
        return torch.sparse.mm(self._matrix(rows.dtype, True), rows.t()).t().contiguous()

    def backward_into(self, out: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
                      grad_q: torch.Tensor, inv_t: float, coef: torch.Tensor,
                      tp_group: Group, use_numba: bool | None = None, *,
                      seg_dummy: torch.Tensor | None = None, unit_factor: bool = False
                      ) -> None:
        """``out`` holds this shard's softmax of the block; leaves in it the gradient on the
        block's logits / T of sum_r <grad_q[r], q_I[r]> scaled by inv_t, plus ``coef * p``
        (CE's softmax part). One sum all-reduce over TP (the <p, h> of each position).
        ``seg_dummy`` / ``unit_factor``: as :meth:`project`'s."""
        num_rows = grad_q.shape[0]
        grad_q = grad_q.to(out.dtype)
        if self._numba(out) if use_numba is None else use_numba:
            cpu_image_projection.backward_into(self, out, factor, seg, grad_q, inv_t, coef,
                                               tp_group)
            return
        # With h' = inv_t W_I grad_q (grad_q scaled before the product: [rows, |I|], not
        # [positions, V]) and d' = <p, h'> (p = out * factor), the gradient is
        # p (h' - d' + coef): dot, shift and one product with out; no [positions, V]
        # temporary beyond the gathered h'.
        if num_rows and self.size:  # h'^T = W_I grad_q'^T: [V_real, |I|] CSR times [|I|, rows]
            h_rows = torch.sparse.mm(self._matrix(out.dtype, False), (grad_q * inv_t).t()).t()
        else:
            h_rows = out.new_zeros(num_rows, out.shape[1])
        h = with_zero_row(h_rows).index_select(0, _seg_dummy(seg, num_rows, seg_dummy))
        dot = torch.bmm(out.unsqueeze(1), h.unsqueeze(2)).view(-1)  # one batched product
        if not unit_factor:
            dot.mul_(factor)
        all_reduce(dot, tp_group)
        h.sub_(torch.sub(dot, coef)[:, None])
        if not unit_factor:
            h.mul_(factor[:, None])
        out.mul_(h)


__all__ = ["ImageProjection", "teacher_image"]
