"""W on its image: the exact (all of V_t) P-KL with no [rows, V_t] work on the student side.

A teacher column that no student token maps to (outside the image I of W) gets projected mass 0
whatever the student does, so its share of the KL is the teacher's alone (``DenseKernel`` takes it
once per row from the payload). The student side therefore projects onto I only: for each chunk
row, q_I = (sum of its positions' probabilities) W_I, with W's nonzeros renumbered onto I. I is the
image of the whole W (the union over the TP ranks), so every TP rank writes its rows' shares into
the same [rows, |I|] layout and one sum over TP completes q.

Two implementations of the same two maps (a block's positions -> q_I per row; a gradient on q_I
-> the gradient on the block's logits), chosen by device: Numba kernels on CPU, and elsewhere
(CUDA) the rows' summed probabilities times W as a sparse CSR matrix product (cuSPARSE): no
[rows, nonzeros] gather, which made the gather path's time on an H200. The CPU kernels take all
of a block's rows at once, transposed ([V, rows]): each of W's nonzeros is read once a block and
adds one contiguous vector of all the rows, and each line of W (a column of I forward, a student
row backward) is written by one thread. Eight rows at a time with the rows kept as they are (one
strided store per row and entry) was 3x slower at the 90 rows of a 16k-token block.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit, prange

from .block_data import with_zero_row
from .collectives import Group, all_reduce
from .cpu_rows import prefetch
from .image_block import RowLayout
from .numba_cpu import numba_takes, use_torch_threads
from .shard import ProjectionShard
from .workspace import scratch

#: W entries ahead whose row of the transposed operand :func:`_combine_lines` asks the CPU to
#: fetch while it adds the current one (the operand is 4-33 MiB, out of L2; at 85 rows x |I|
#: 87,607, one thread: 11.7-14.1 -> 10.8-11.3 ms forward, 8.8-9.7 -> 7.1-7.4 ms backward; 16 and
#: 32 ahead no better, 2 no gain; none at 22 rows)
_AHEAD = 8
#: Rows :func:`_row_sums_t` sums before writing them transposed (one row at a time, each
#: store a line of its own: 4.3 -> 2.9 ms at 85 positions, 8.8 -> 4.7 at 120; 16: 3.4 / 6.7)
_ROW_BLOCK = 32
#: Positions ahead whose tile :func:`_row_sums_t` asks the CPU to fetch while it adds the current
#: one (each tile of a position is its own 1 KiB run, a page away from the last)
_SUMS_AHEAD = 2
#: Lines of a tile: the Numba kernels below work on [tile, rows] pieces of the transposed
#: operands (~20-90 KiB at 22-90 rows, within L2), written out or read in the rows' order.
_TILE = 256


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_sums_t(p, factor, order, row_off, mass_t):  # pragma: no cover - numba
    """mass_t[s, r] = sum of p[i, s] * factor[i] over row r's positions
    order[row_off[r]:row_off[r + 1]]: the rows' sums transposed ([V, rows]), a tile of
    columns at a time (parallel over tiles), :data:`_ROW_BLOCK` rows summed into an L1 piece
    before they are written (each store then fills a run of a line of mass_t)."""
    n, rows = p.shape[1], row_off.shape[0] - 1
    step, last = max(1, 64 // p.itemsize), order.shape[0] - _SUMS_AHEAD  # elements a line
    for tile in prange((n + _TILE - 1) // _TILE):
        s0 = tile * _TILE
        width = min(_TILE, n - s0)
        acc = np.empty((_ROW_BLOCK, width), mass_t.dtype)
        for r0 in range(0, rows, _ROW_BLOCK):
            block = min(_ROW_BLOCK, rows - r0)
            for b in range(block):
                a = acc[b]
                a[:] = 0.0
                for j in range(row_off[r0 + b], row_off[r0 + b + 1]):
                    if j < last:  # the tile of the position _SUMS_AHEAD on, on its way
                        ahead = order[j + _SUMS_AHEAD]
                        for k in range(s0, s0 + width, step):
                            prefetch(p, ahead, k)
                    i = order[j]
                    f, pi = factor[i], p[i, s0: s0 + width]
                    for s in range(width):
                        a[s] += pi[s] * f
            for s in range(width):
                m = mass_t[s0 + s]
                for b in range(block):
                    m[r0 + b] = acc[b, s]


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _combine_lines(x_t, offsets, index, value, out):  # pragma: no cover - numba
    """out[:, l] = sum over line l's entries e (offsets[l]:offsets[l + 1]) of value[e] *
    x_t[index[e]]: x_t [*, rows] holds all the block's rows transposed, so each W entry is
    read once a block and adds one contiguous vector; a tile of lines is summed into a
    [tile, rows] piece, then written into out [rows, lines] row by row (parallel over
    tiles: each writes its own columns of out)."""
    rows, lines = out.shape
    entries, step = index.shape[0], max(1, 64 // x_t.itemsize)  # elements a cache line
    for tile in prange((lines + _TILE - 1) // _TILE):
        l0 = tile * _TILE
        width = min(_TILE, lines - l0)
        piece = np.zeros((width, rows), out.dtype)
        for line in range(width):
            o = piece[line]
            for e in range(offsets[l0 + line], offsets[l0 + line + 1]):
                if e + _AHEAD < entries:  # the row an entry _AHEAD on reads, on its way
                    ahead = index[e + _AHEAD]
                    for k in range(0, rows, step):
                        prefetch(x_t, ahead, k)
                    prefetch(x_t, ahead, rows - 1)
                v, x = value[e], x_t[index[e]]
                for k in range(rows):
                    o[k] += v * x[k]
        for k in range(rows):
            ok = out[k]
            for line in range(width):
                ok[l0 + line] = piece[line, k]


#: Columns a tile of :func:`_transpose_into` takes (its [tile, rows] piece of dst in L1)
_TRANSPOSE_TILE = 64


@njit(parallel=True, cache=True, nogil=True)
def _transpose_into(src, dst):  # pragma: no cover - numba
    """dst [cols, rows] = src [rows, cols]^T, a tile of :data:`_TRANSPOSE_TILE` columns at a
    time (parallel over tiles), four rows of src read as runs together so that each row of
    the tile's piece of dst takes four adjacent stores. From memory, one thread: 1.56 / 1.29 ms
    at 60 x 40,132 / 23 x 109,827 against torch's copy of the transposed view 3.48 / 4.22 (a
    row at a time, tiles of 256: 1.65 / 1.84); in the loss, fresh from the KL's pass, at
    8,192 tokens, V_s 128,257: torch 0.94 s, a row at a time 0.74, four rows 0.48."""
    rows, cols = src.shape
    width = _TRANSPOSE_TILE
    for tile in prange((cols + width - 1) // width):
        c0 = tile * width
        c1 = min(c0 + width, cols)
        k = 0
        while k + 4 <= rows:
            s0, s1, s2, s3 = src[k], src[k + 1], src[k + 2], src[k + 3]
            for j in range(c0, c1):
                d = dst[j]
                d[k] = s0[j]
                d[k + 1] = s1[j]
                d[k + 2] = s2[j]
                d[k + 3] = s3[j]
            k += 4
        for r in range(k, rows):
            s = src[r]
            for j in range(c0, c1):
                dst[j, r] = s[j]


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_dots(p, factor, seg, h, dot):  # pragma: no cover - numba
    """dot[i] = <p_i, h[row of i]> factor[i] (this shard's part); 0 for positions of no row."""
    n = p.shape[1]
    for i in prange(p.shape[0]):
        row = seg[i]
        if row < 0:
            dot[i] = 0.0
            continue
        d = 0.0
        pi, hr = p[i], h[row]
        for s in range(n):
            d += pi[s] * hr[s]
        dot[i] = d * factor[i]


@njit(parallel=True, cache=True, nogil=True)
def _combine(out, factor, seg, h, dot, inv_t, coef):  # pragma: no cover - numba
    """out (this shard's softmax) <- p * (inv_t * (h[row] - dot) + coef), p = out * factor."""
    n = out.shape[1]
    for i in prange(out.shape[0]):
        f, row = factor[i], seg[i]
        if row < 0:
            c = f * coef[i]
            for s in range(n):
                out[i, s] *= c
        else:
            a = f * inv_t
            b = f * (coef[i] - inv_t * dot[i])
            hr = h[row]
            for s in range(n):
                out[i, s] = out[i, s] * (a * hr[s] + b)


def teacher_image(indices: torch.Tensor, weights: torch.Tensor, student_vocab_size: int
                  ) -> torch.Tensor:
    """W's image I, ascending: the teacher ids that W maps real student tokens to (rows below
    ``student_vocab_size`` of ``indices`` / ``weights`` [V_s, k], -1 or weight 0 = no entry, as
    ``ProjectionMatrix.local_shard(0, V_s)`` gives them). The columns an ``image`` payload
    ships, in the order :class:`ImageProjection` numbers them."""
    indices = torch.as_tensor(indices)[:student_vocab_size]
    weights = torch.as_tensor(weights)[:student_vocab_size]
    return torch.unique(indices[(indices >= 0) & (weights > 0)].to(torch.int64))


def _row_runs(seg: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions that belong to a row, grouped by row; offsets [num_rows + 1] into them)."""
    order = torch.nonzero(seg >= 0, as_tuple=True)[0]
    rows = seg.index_select(0, order)
    counts = torch.bincount(rows, minlength=num_rows)
    _, perm = torch.sort(rows, stable=True)
    off = torch.zeros(num_rows + 1, dtype=torch.int64, device=seg.device)
    off[1:] = torch.cumsum(counts, 0)
    return order.index_select(0, perm), off


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
        """W on I by student rows as :mod:`.image_block`'s row pass reads it, built once per
        dtype."""
        key = ("rows", dtype)
        if key not in self._matrices:
            self._matrices[key] = RowLayout.of(self.crow, self.col, self.val, self.size, dtype)
        return self._matrices[key]

    def _weights(self, dtype: torch.dtype, by_column: bool = False) -> torch.Tensor:
        val = self.csc_val if by_column else self.val
        return val if val.dtype == dtype else val.to(dtype)

    def _by_lines(self, x_t: torch.Tensor, by_column: bool, name: str) -> torch.Tensor:
        """Numba, all of a block's rows at once, from them transposed (``x_t`` [width, rows]):
        ``by_column`` x W_I ([rows, V_real] -> [rows, |I|], W's columns of I as lines), else
        x W_I^T ([rows, |I|] -> [rows, V_real], W's student rows as lines). Each W entry adds
        one contiguous vector of all the rows (eight rows at a time with one strided store a
        row and entry took 37 ms at 90 rows x |I| 87,607; this 10-16 ms, the transposes
        included). Returns a view of the scratch buffer ``name`` (valid until its next use)."""
        rows = x_t.shape[1]
        if by_column:
            offsets, index, lines = self.ccol, self.csc_student, self.size
        else:
            offsets, index, lines = self.crow, self.col, self.crow.numel() - 1
        out = scratch(name, rows * lines, x_t.device, x_t.dtype).view(rows, lines)
        use_torch_threads()
        _combine_lines(x_t.numpy(), offsets.numpy(), index.numpy(),
                       self._weights(x_t.dtype, by_column).numpy(), out.numpy())
        return out

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
            order, off = _row_runs(seg, num_rows)
            use_torch_threads()
            n = probs_local.shape[1]
            mass_t = scratch("image_mass_t", n * num_rows, probs_local.device,
                             probs_local.dtype).view(n, num_rows)
            _row_sums_t(probs_local.numpy(), factor.contiguous().numpy(), order.numpy(),
                        off.numpy(), mass_t.numpy())
            return self._by_lines(mass_t, True, "image_q")
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
            # The block's projection is read before its gradient is made: its two buffers
            # (same sizes) take the gradient transposed and h, unless the gradient is one.
            grad_t = scratch("image_q", grad_q.numel(), out.device, out.dtype)
            if grad_t.untyped_storage().data_ptr() == grad_q.untyped_storage().data_ptr():
                grad_t = scratch("image_grad_t", grad_q.numel(), out.device, out.dtype)
            grad_t = grad_t.view(self.size, num_rows)
            _transpose_into(grad_q.contiguous().numpy(), grad_t.numpy())
            h = self._by_lines(grad_t, False, "image_mass_t")
            dot = torch.zeros(out.shape[0], dtype=out.dtype)
            seg_np, factor_np = seg.contiguous().numpy(), factor.contiguous().numpy()
            _row_dots(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy())
            all_reduce(dot, tp_group)
            _combine(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy(), float(inv_t),
                     coef.to(out.dtype).contiguous().numpy())
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
