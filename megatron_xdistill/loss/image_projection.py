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
[rows, nonzeros] gather, which made the gather path's time on an H200. The CPU kernels take the
block's rows eight at a time, transposed ([V, 8]), so each of W's nonzeros is read once per eight
rows and adds a short vector (no data-dependent inner loop per column: row by row, the branch
misses of columns with 1-4 entries cost more than the gathers); the entries are split at column
(forward) or row (backward) boundaries, so parallel parts never write the same place.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numba
import torch
from numba import njit, prange

from .collectives import Group, all_reduce
from .numba_cpu import numba_takes, use_torch_threads
from .shard import ProjectionShard
from .workspace import scratch

#: Rows projected together: each W entry read once serves this many rows (one 32-byte vector of
#: a [V, 8] transposed mass); measured fastest of 4, 8, 16 and 32 on a 2-core AVX-512 CPU
#: (22 rows, V_s 49,152, |I| 87,607: 8 rows 5.0 ms, 4 rows 5.9, 16 rows 8.1; row by row 13 ms).
_GROUP = 8


@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _row_sum(p, factor, order, lo, hi, m):  # pragma: no cover - numba
    """m = sum of p[i] * factor[i] over the positions order[lo:hi] (one row's)."""
    m[:] = 0.0
    for j in range(lo, hi):
        i = order[j]
        f, pi = factor[i], p[i]
        for s in range(p.shape[1]):
            m[s] += pi[s] * f


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _project_rows(p, factor, order, row_off, split, ccol_e, cstudent, cval, mass, mass_t, out
                  ):  # pragma: no cover - numba
    """out[r] += (sum over row r's positions i of p[i] * factor[i]) W_I. The rows' sums go to
    ``mass`` [rows, n] (parallel over rows), then a group of rows at a time to ``mass_t``
    [n, group] transposed, so each W entry (CSC order: ``ccol_e`` its column of I,
    ``cstudent`` its student row) adds one short vector. The entries are split at column
    boundaries (``split``) so parallel parts write apart."""
    rows, n = row_off.shape[0] - 1, p.shape[1]
    for r in prange(rows):
        _row_sum(p, factor, order, row_off[r], row_off[r + 1], mass[r])
    group = mass_t.shape[1]
    for g0 in range(0, rows, group):
        width = min(group, rows - g0)
        for s in prange(n):
            mt = mass_t[s]
            for k in range(width):
                mt[k] = mass[g0 + k, s]
        for part in prange(split.shape[0] - 1):
            for e in range(split[part], split[part + 1]):
                c, v, mt = ccol_e[e], cval[e], mass_t[cstudent[e]]
                for k in range(width):
                    out[g0 + k, c] += v * mt[k]


@njit(parallel=True, cache=True, nogil=True)
def _project_row_by_row(p, factor, order, row_off, ccol, cstudent, cval, mass, out
                        ):  # pragma: no cover - numba
    """:func:`_project_rows` one row at a time: a row's sum in ``mass[r]``, then per column of
    I its entries' products summed in a register (fewer than a group of rows: the transposed
    table would only spread the row over more cache lines)."""
    for r in prange(out.shape[0]):
        m = mass[r]
        _row_sum(p, factor, order, row_off[r], row_off[r + 1], m)
        o = out[r]
        for t in range(o.shape[0]):
            acc = 0.0
            for e in range(ccol[t], ccol[t + 1]):
                acc += m[cstudent[e]] * cval[e]
            o[t] = acc


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _unproject_rows(split, rstudent, rcol, rval, g, g_t, h):  # pragma: no cover - numba
    """h[r] = W_I g[r] (the gradient on a row's student probabilities), a group of rows at a
    time: ``g_t`` [|I|, group] scratch holds a group's rows of g transposed; entries in CSR order
    (``rstudent`` their student row, ``rcol`` their column of I), split at row boundaries."""
    rows, size = g.shape
    h[:] = 0.0
    group = g_t.shape[1]
    for g0 in range(0, rows, group):
        width = min(group, rows - g0)
        for t in prange(size):
            for k in range(width):
                g_t[t, k] = g[g0 + k, t]
        for part in prange(split.shape[0] - 1):
            for e in range(split[part], split[part + 1]):
                s, v, x = rstudent[e], rval[e], g_t[rcol[e]]
                for k in range(width):
                    h[g0 + k, s] += v * x[k]


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


def _row_runs(seg: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions that belong to a row, grouped by row; offsets [num_rows + 1] into them)."""
    order = torch.nonzero(seg >= 0, as_tuple=True)[0]
    rows = seg.index_select(0, order)
    counts = torch.bincount(rows, minlength=num_rows)
    _, perm = torch.sort(rows, stable=True)
    off = torch.zeros(num_rows + 1, dtype=torch.int64, device=seg.device)
    off[1:] = torch.cumsum(counts, 0)
    return order.index_select(0, perm), off


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)


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
    _entry_rows: dict = field(default_factory=dict, repr=False, compare=False)

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

    def _lines(self, by_column: bool) -> torch.Tensor:
        """The column of I (``by_column``: CSC order) or the student row (CSR order) of each
        entry, made once."""
        if by_column not in self._entry_rows:
            offsets = self.ccol if by_column else self.crow
            self._entry_rows[by_column] = torch.repeat_interleave(
                torch.arange(offsets.numel() - 1, device=offsets.device), offsets.diff())
        return self._entry_rows[by_column]

    @staticmethod
    def _split(offsets: torch.Tensor) -> torch.Tensor:
        """Entry offsets cutting ``offsets``' lines into a few parts per thread (the parts of a
        parallel loop, each writing its own lines)."""
        parts = 4 * numba.get_num_threads()
        lines = offsets.numel() - 1
        return offsets.index_select(0, torch.arange(parts + 1) * lines // parts)

    def _weights(self, dtype: torch.dtype, by_column: bool = False) -> torch.Tensor:
        val = self.csc_val if by_column else self.val
        return val if val.dtype == dtype else val.to(dtype)

    def project(self, probs_local: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
                num_rows: int, use_numba: bool | None = None) -> torch.Tensor:
        """[num_rows, |I|]: per row, its positions' probabilities (``probs_local * factor``)
        summed and projected onto I. ``seg``: row of each position, -1 for none.
        ``use_numba``: None picks by device (tests force either)."""
        out = probs_local.new_zeros(num_rows, self.size)
        if self._numba(probs_local) if use_numba is None else use_numba:
            order, off = _row_runs(seg, num_rows)
            use_torch_threads()
            n = probs_local.shape[1]
            mass = scratch("image_mass", num_rows * n, out.device, out.dtype).view(num_rows, n)
            args = (probs_local.numpy(), factor.contiguous().numpy(), order.numpy(), off.numpy())
            weights = self._weights(out.dtype, by_column=True).numpy()
            if num_rows < _GROUP:
                _project_row_by_row(*args, self.ccol.numpy(), self.csc_student.numpy(), weights,
                                    mass.numpy(), out.numpy())
                return out
            mass_t = scratch("image_mass_t", n * _GROUP, out.device, out.dtype)
            _project_rows(*args, self._split(self.ccol).numpy(),
                          self._lines(by_column=True).numpy(), self.csc_student.numpy(), weights,
                          mass.numpy(), mass_t.view(n, _GROUP).numpy(), out.numpy())
            return out
        seg_d = torch.where(seg >= 0, seg, num_rows)
        n = probs_local.shape[1]
        rows = probs_local.new_zeros(num_rows + 1, n).index_add_(
            0, seg_d, probs_local * factor[:, None])[:-1]
        if num_rows == 0 or self.size == 0:
            return out
        # q_I^T = W_I^T rows^T: [|I|, V_real] CSR times [V_real, rows]
        return torch.sparse.mm(self._matrix(out.dtype, True), rows.t()).t().contiguous()

    def backward_into(self, out: torch.Tensor, factor: torch.Tensor, seg: torch.Tensor,
                      grad_q: torch.Tensor, inv_t: float, coef: torch.Tensor,
                      tp_group: Group, use_numba: bool | None = None) -> None:
        """``out`` holds this shard's softmax of the block; leaves in it the gradient on the
        block's logits / T of sum_r <grad_q[r], q_I[r]> scaled by inv_t, plus ``coef * p``
        (CE's softmax part). One sum all-reduce over TP (the <p, h> of each position)."""
        num_rows = grad_q.shape[0]
        grad_q = grad_q.to(out.dtype).contiguous()
        if self._numba(out) if use_numba is None else use_numba:
            h = out.new_empty(num_rows, out.shape[1])
            dot = torch.zeros(out.shape[0], dtype=out.dtype)
            group = max(1, min(_GROUP, num_rows))
            g_t = scratch("image_grad", self.size * group, out.device, out.dtype)
            use_torch_threads()
            seg_np, factor_np = seg.contiguous().numpy(), factor.contiguous().numpy()
            _unproject_rows(self._split(self.crow).numpy(), self._lines(by_column=False).numpy(),
                            self.col.numpy(), self._weights(out.dtype).numpy(), grad_q.numpy(),
                            g_t.view(self.size, group).numpy(), h.numpy())
            _row_dots(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy())
            all_reduce(dot, tp_group)
            _combine(out.numpy(), factor_np, seg_np, h.numpy(), dot.numpy(), float(inv_t),
                     coef.to(out.dtype).contiguous().numpy())
            return
        if num_rows and self.size:  # h^T = W_I grad_q^T: [V_real, |I|] CSR times [|I|, rows]
            h_rows = torch.sparse.mm(self._matrix(out.dtype, False), grad_q.t()).t()
        else:
            h_rows = out.new_zeros(num_rows, out.shape[1])
        h = _with_zero_row(h_rows)[torch.where(seg >= 0, seg, num_rows)]
        dot = (out * h).sum(1) * factor
        all_reduce(dot, tp_group)
        h.sub_((dot - coef / inv_t)[:, None]).mul_((factor * inv_t)[:, None])
        out.mul_(h)


__all__ = ["ImageProjection"]
