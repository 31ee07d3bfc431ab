"""Gold's uncommon term, the L1 between sorted probability vectors, with a backward that sorts nothing.

``L1 = sum_{i < n} |exp(a)_(i) - t_i|`` (``exp(a)_(i)`` the i-th largest of a row, ``t`` the
teacher's sorted values). Its gradient on element j is ``sign(exp(a_j) - t_rank(j)) exp(a_j)``
for the n largest, 0 elsewhere: it needs each element's sign, not its rank. The signs along the
ranks change in few places (on a real SmolLM2 / Qwen2.5-Coder pair a median of 2 runs per chunk
row, at most 37 of 8,192 ranks), so the forward keeps, per row, the values where a run of
equal signs starts and the n-th largest value; the backward finds each element's run by
comparing it with those few values. That replaces the sort with columns (2.2x the values-only
sort) by a few branch-free Numba passes over the row (:func:`row_slopes`, which the fused gold
gradient of :mod:`cpu.gold_rows` shares) after torch's vectorised exp. ``sign_runs`` gives the
runs to a loss that writes its backward itself (``GoldKernel.raw_grad``).

Equal values whose ranks straddle a change of sign, or the n-th value when equal ones fall
beyond the n largest, share their ranks' signs equally (each gets the mean sign of the ranks
the group holds among the n largest). That is a subgradient like any assignment of the ranks
to the tied elements (``torch.topk`` picks one), with the same sum over the group, and it does
not depend on an order among equal values (low-precision logits have many).

The loss recomputes each block's row values for its backward, so the forward's runs are kept in
a :class:`RunMemo` and reused when the recomputed values are the same (checked by each row's
sum); otherwise the values are sorted again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from numba import njit, prange

from megatron_xdistill.loss.cpu.sorted_top import top_values
from megatron_xdistill.loss.cpu.threads import numba_takes, use_torch_threads
from megatron_xdistill.loss.workspace import scratch

#: Run starts a row that the memo keeps (a median of 2 on a real pair, at most 37 seen).
_MEMO_STARTS = 12


@dataclass
class SignRuns:
    """Per row: the L1 value, the n-th largest value, where runs of equal sign start (values,
    descending, -inf padded), each run's sign, and the tied values with their shared sign."""

    value: torch.Tensor      # [r]
    threshold: torch.Tensor  # [r] the n-th largest of the row
    starts: torch.Tensor     # [r, K] the value at which run k + 1 starts (-inf: none)
    signs: torch.Tensor      # [r, K + 1] sign of run k
    tie_values: torch.Tensor  # [r, S] values whose elements share a mean sign (NaN: none)
    tie_signs: torch.Tensor  # [r, S] that mean sign
    checksum: torch.Tensor   # [r] fp64 sum of the row values they were found on

    def lookup(self, dtype: torch.dtype) -> list[np.ndarray]:
        """What :func:`row_slopes` reads (threshold, starts, signs, tie values and signs), as
        contiguous NumPy arrays of ``dtype``."""
        return [t.to(dtype).contiguous().numpy() for t in (
            self.threshold, self.starts, self.signs, self.tie_values, self.tie_signs)]


class RunMemo:
    """The forward's sign runs of every row (by key, the caller's row ids in ``[0, num_keys)``),
    for the recomputing backward: one fp64 table allocated once, up front (entries made between
    a block's large transients would pin the heap; a few hundred bytes a row here), written and
    read a call's rows at a time. A call with a row of more than ``capacity`` run starts or
    tied values is not kept: its backward sorts again."""

    # columns: checksum (NaN: nothing kept), value, threshold, the number of run starts and
    # of tied values, then the run starts, run signs, tied values and their signs (_blocks)
    def __init__(self, num_keys: int, capacity: int = _MEMO_STARTS, ties: int = 8) -> None:
        self.capacity, self.ties = capacity, ties
        width = 5 + capacity + (capacity + 1) + 2 * ties
        self.table = torch.zeros(num_keys, width, dtype=torch.float64)
        self.table[:, 0] = float("nan")  # checksum: nothing kept

    def _blocks(self, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c, t = self.capacity, self.ties
        return torch.split(rows, [1, 1, 1, 1, 1, c, c + 1, t, t], dim=1)

    def put(self, keys: torch.Tensor, runs: SignRuns) -> None:
        k, s = runs.starts.shape[1], runs.tie_values.shape[1]
        if k > self.capacity or s > self.ties:
            return
        r = keys.numel()
        f64 = {"dtype": torch.float64}
        pad = torch.full((r, self.capacity - k), float("-inf"), **f64)
        rows = torch.cat([
            runs.checksum[:, None], runs.value.double()[:, None],
            runs.threshold.double()[:, None],
            (runs.starts > float("-inf")).sum(1, keepdim=True).double(),
            (~torch.isnan(runs.tie_values)).sum(1, keepdim=True).double(),
            runs.starts.double(), pad, runs.signs.double(),
            torch.zeros(r, self.capacity - k, **f64),
            runs.tie_values.double(), torch.full((r, self.ties - s), float("nan"), **f64),
            runs.tie_signs.double(), torch.zeros(r, self.ties - s, **f64)], 1)
        self.table.index_copy_(0, keys, rows)

    def take(self, keys: torch.Tensor, checksum: torch.Tensor, like: torch.Tensor
             ) -> SignRuns | None:
        """The runs of rows ``keys`` if every one was kept from the same values (``checksum``),
        in the dtype of ``like``; else None. Taken entries are cleared."""
        if keys is None:
            return None
        rows = self.table.index_select(0, keys)
        if not bool((rows[:, 0] == checksum).all()):
            return None
        self.table[keys, 0] = float("nan")
        _, value, threshold, k, s, starts, signs, tie_values, tie_signs = self._blocks(
            rows.to(like.dtype))
        k, s = (int(k.max()), int(s.max())) if keys.numel() else (0, 0)
        return SignRuns(value[:, 0], threshold[:, 0], starts[:, :k], signs[:, : k + 1],
                        tie_values[:, :s], tie_signs[:, :s], checksum)


def _top_values(a: np.ndarray, n: int, out: np.ndarray) -> None:
    """The n largest of each row, descending, into ``out`` (:func:`cpu.sorted_top.top_values`'
    radix select)."""
    top_values(a, n, out=out)


def _scratch(name: str, like: torch.Tensor) -> torch.Tensor:
    """A [rows, n] scratch buffer shaped and typed as ``like`` (contents undefined)."""
    return scratch("sorted_l1_" + name, like.numel(), like.device, like.dtype).view(like.shape)


@njit(cache=True, nogil=True)
def _tie_group(top, sign, a, r, v, threshold, tie_values, tie_signs, count
               ):  # pragma: no cover - numba
    """Add value ``v`` of row ``r`` as a tie group (unless it is the last one added): the sum
    of its ranks' signs among the n largest over its elements in the row. Returns the count
    of groups."""
    if count > 0 and tie_values[r, count - 1] == v:
        return count
    n = top.shape[1]
    lo = 0
    while top[r, lo] != v:
        lo += 1
    total, hi = 0.0, lo
    while hi < n and top[r, hi] == v:
        total += sign[r, hi]
        hi += 1
    members = hi - lo
    if v == threshold:  # every element equal to the n-th value shares those ranks
        members = 0
        for j in range(a.shape[1]):
            members += a[r, j] == v
    tie_values[r, count] = v
    tie_signs[r, count] = total / members
    return count + 1


@njit(parallel=True, cache=True, nogil=True, fastmath={"reassoc"})
def _run_rows(top, d, a, value, sign, starts, signs, num_starts, tie_values, tie_signs,
              num_ties):  # pragma: no cover - numba
    """Per row of ``d`` = exp(top) - t: the L1 value (fp64 sum), where runs of equal sign
    start and each run's sign, and the tie groups (see the module docstring)."""
    n = top.shape[1]
    for r in prange(top.shape[0]):
        total = 0.0
        for i in range(n):
            x = d[r, i]
            total += abs(x)
            sign[r, i] = 1.0 if x > 0 else (-1.0 if x < 0 else 0.0)
        value[r] = total
        k = 0
        signs[r, 0] = sign[r, 0]
        for i in range(n - 1):
            if sign[r, i + 1] != sign[r, i]:
                starts[r, k] = top[r, i + 1]
                signs[r, k + 1] = sign[r, i + 1]
                k += 1
        num_starts[r] = k
        threshold = top[r, n - 1]
        ties = 0
        for i in range(n - 1):  # equal values on both sides of a change of sign
            if sign[r, i + 1] != sign[r, i] and top[r, i] == top[r, i + 1]:
                ties = _tie_group(top, sign, a, r, top[r, i], threshold, tie_values,
                                  tie_signs, ties)
        in_top = 0
        for i in range(n):
            in_top += top[r, i] == threshold
        beyond = 0
        for j in range(a.shape[1]):
            beyond += a[r, j] == threshold
        if beyond > in_top:  # the n-th value also lies beyond the n largest
            ties = _tie_group(top, sign, a, r, threshold, threshold, tie_values, tie_signs,
                              ties)
        num_ties[r] = ties


def _table(t: torch.Tensor, count: torch.Tensor, fill: float) -> torch.Tensor:
    """The first max(count) columns of ``t``, ``fill`` past each row's ``count``."""
    width = int(count.max()) if count.numel() else 0
    keep = torch.arange(width) < count[:, None]
    return torch.where(keep, t[:, :width], torch.full((), fill, dtype=t.dtype))


def _sign_runs(top: torch.Tensor, t: torch.Tensor, a: torch.Tensor, checksum: torch.Tensor
               ) -> SignRuns:
    """Runs of the signs of ``exp(top) - t`` ([r, n], ``top`` the n largest of ``a``,
    descending), the L1 value and the tied values' shared signs: one Numba pass a row after
    torch's exp."""
    top = top.contiguous()
    rows, n = top.shape
    d = torch.exp(top, out=_scratch("d", top)).sub_(t)
    value = torch.empty(rows, dtype=torch.float64)
    # the [rows, n] temporaries in scratch buffers, as the sort's (see sorted_top._top_rows)
    sign, starts, signs, tie_values, tie_signs = (
        _scratch(name, top) for name in ("sign", "starts", "signs", "tie_values", "tie_signs"))
    num_starts = torch.empty(rows, dtype=torch.int64)
    num_ties = torch.empty(rows, dtype=torch.int64)
    use_torch_threads()
    _run_rows(top.numpy(), d.numpy(), a.detach().contiguous().numpy(), value.numpy(),
              sign.numpy(), starts.numpy(), signs.numpy(), num_starts.numpy(),
              tie_values.numpy(), tie_signs.numpy(), num_ties.numpy())
    return SignRuns(value.to(top.dtype), top[:, -1].clone(), _table(starts, num_starts, -math.inf),
                    _table(signs, num_starts + 1, 0.0), _table(tie_values, num_ties, math.nan),
                    _table(tie_signs, num_ties, 0.0), checksum)


@njit(cache=True, nogil=True, fastmath={"contract"})
def row_slopes(a, e, r, threshold, starts, signs, tie_values, tie_signs, out
               ):  # pragma: no cover - numba
    """out = the slopes of row ``r`` (values ``a``, ``e`` = exp(a)): each value's sign times its
    exp, the sign that of the run the value falls in (0 below the n-th largest) or its tie
    group's shared one. Run k + 1 holds the values at or below ``starts[r, k]`` (descending,
    -inf padded): the sign is run 0's plus the change at each start at or above the value.
    A pass per start, each branch-free over the row (vectorised); exact (signs are -1, 0, 1
    or a tie group's shared value)."""
    m = a.shape[0]
    s0 = signs[r, 0]
    for j in range(m):
        out[j] = s0
    for k in range(starts.shape[1]):
        start, change = starts[r, k], signs[r, k + 1] - signs[r, k]
        for j in range(m):
            out[j] += change if a[j] <= start else 0.0
    t = threshold[r]
    for j in range(m):
        out[j] = out[j] * e[j] if a[j] >= t else 0.0
    for k in range(tie_values.shape[1]):
        v, shared = tie_values[r, k], tie_signs[r, k]
        for j in range(m):
            out[j] = shared * e[j] if a[j] == v else out[j]


@njit(parallel=True, cache=True, nogil=True, fastmath={"contract"})
def _slope_rows(a, e, threshold, starts, signs, tie_values, tie_signs, out
                ):  # pragma: no cover - numba
    for r in prange(a.shape[0]):
        row_slopes(a[r], e[r], r, threshold, starts, signs, tie_values, tie_signs, out[r])


def _slopes(a: torch.Tensor, runs: SignRuns) -> torch.Tensor:
    """d L1 / d a: each element's sign times exp(a) (0 outside the n largest), by
    :func:`row_slopes` after torch's vectorised exp."""
    a = a.detach().contiguous()
    out = torch.empty_like(a)
    use_torch_threads()
    _slope_rows(a.numpy(), torch.exp(a).numpy(), *runs.lookup(a.dtype), out.numpy())
    return out


def _runs_of(a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None,
             keys: torch.Tensor | None, keep: bool, checksum: torch.Tensor | None = None
             ) -> SignRuns:
    """The runs of ``a``'s rows: the memo's if it holds them for these values (``checksum``,
    their fp64 row sums: found here unless given), else found by sorting (and kept in the
    memo when ``keep``)."""
    if checksum is None:
        checksum = a.sum(1, dtype=torch.float64)
    runs = memo.take(keys, checksum, a) if memo is not None else None
    if runs is None:
        top = scratch("sorted_l1_top", a.shape[0] * t.shape[1], a.device, a.dtype)
        top = top.view(a.shape[0], t.shape[1])
        _top_values(a.detach().numpy(), t.shape[1], top.numpy())
        runs = _sign_runs(top, t, a, checksum)
        if memo is not None and keep:
            memo.put(keys, runs)
    return runs


class _SortedL1(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None,
                keys: torch.Tensor | None):
        # a forward keeps its runs; a recompute for the backward takes them (if the same)
        runs = _runs_of(a, t, memo, keys, keep=not ctx.needs_input_grad[0])
        # (tensors on ctx go through save_for_backward: an attribute holding the output would
        # make a cycle through the autograd graph that the garbage collector cannot free)
        ctx.save_for_backward(a, runs.threshold, runs.starts, runs.signs, runs.tie_values,
                              runs.tie_signs)
        return runs.value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, *runs = ctx.saved_tensors
        return _slopes(a, SignRuns(None, *runs, None)).mul_(grad[:, None]), None, None, None


#: Whether :func:`sorted_l1` runs on a tensor (CPU fp32 / fp64: its Numba kernels take it).
supported = numba_takes


def sorted_l1(a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None = None,
              keys: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_{i<n} |exp(a)_(i) - t_i|`` per row of ``a`` [r, m] (log values; n = t.shape[1] <=
    m; ``t`` [r, n] sorted descending), differentiable in ``a``. ``memo`` / ``keys`` (the rows'
    ids): keep the forward's runs for a recomputing backward of the same rows (see the module
    docstring)."""
    if t.shape[1] == 0 or a.shape[0] == 0:
        return a.new_zeros(a.shape[0])
    return _SortedL1.apply(a, t.to(a.dtype), memo, keys)


def sign_runs(a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None = None,
              keys: torch.Tensor | None = None, checksum: torch.Tensor | None = None,
              keep: bool = False) -> SignRuns:
    """The sign runs of :func:`sorted_l1`'s rows (``a`` [r, m] log values, ``t`` [r, n] sorted
    teacher values; ``checksum``: a's fp64 row sums if the caller has them), with the L1 value:
    the memo's when it holds them for these values, else found by sorting and, if ``keep``,
    kept (n = 0: value 0, a threshold of +inf, every sign 0). For a loss that writes its
    gradient itself (:mod:`cpu.gold_rows`): its forward keeps, its backward takes."""
    if t.shape[1] == 0:
        none = a.new_empty(a.shape[0], 0)
        return SignRuns(a.new_zeros(a.shape[0]), a.new_full((a.shape[0],), float("inf")), none,
                        a.new_zeros(a.shape[0], 1), none, none, None)
    return _runs_of(a, t.to(a.dtype), memo, keys, keep, checksum)


__all__ = ["RunMemo", "SignRuns", "row_slopes", "sign_runs", "sorted_l1", "supported"]
