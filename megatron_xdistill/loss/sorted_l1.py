"""Gold's uncommon term, the L1 between sorted probability vectors, with a backward that sorts nothing.

``L1 = sum_{i < n} |exp(a)_(i) - t_i|`` (``exp(a)_(i)`` the i-th largest of a row, ``t`` the
teacher's sorted values). Its gradient on element j is ``sign(exp(a_j) - t_rank(j)) exp(a_j)``
for the n largest, 0 elsewhere: it needs each element's sign, not its rank. The signs along the
ranks change in few places (on a real SmolLM2 / Qwen2.5-Coder pair a median of 2 runs per chunk
row, at most 37 of 8,192 ranks), so the forward keeps, per row, the values where a run of
equal signs starts and the n-th largest value; the backward finds each element's run by
comparing it with those few values. That replaces the sort with columns (``argpartition`` +
``argsort``: 2.2x the values-only sort) by a few passes over the row, in NumPy (its masks and
products are several times torch's on these [rows, ~24k] arrays). ``sorted_l1_slopes`` gives
that gradient without autograd, for a loss that writes its backward itself
(``GoldKernel.raw_grad``).

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

from dataclasses import dataclass

import numpy as np
import torch

from .numba_cpu import numba_takes
from .sorted_top import top_values

#: Above this many run starts in a row, the backward finds runs by binary search, not by passes.
_PASSES_UP_TO = 12


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


def _padded(row: torch.Tensor, values: torch.Tensor, rows: int, fill: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries ``values`` of rows ``row`` (sorted by row) as a [rows, max per row] table padded
    with ``fill``, and each entry's column there."""
    per_row = torch.bincount(row, minlength=rows)
    width = int(per_row.max()) if row.numel() else 0
    slot = torch.arange(row.numel()) - torch.repeat_interleave(per_row.cumsum(0) - per_row,
                                                               per_row)
    table = values.new_full((rows, width), fill)
    table[row, slot] = values
    return table, slot


class RunMemo:
    """The forward's sign runs of every row (by key, the caller's row ids in ``[0, num_keys)``),
    for the recomputing backward: one fp64 table allocated once, up front (entries made between
    a block's large transients would pin the heap; a few hundred bytes a row here), written and
    read a call's rows at a time. A call with a row of more than ``capacity`` run starts or
    tied values is not kept: its backward sorts again."""

    # columns: checksum (NaN: nothing kept), value, threshold, the number of run starts and
    # of tied values, then the run starts, run signs, tied values and their signs (_blocks)
    def __init__(self, num_keys: int, capacity: int = _PASSES_UP_TO, ties: int = 8) -> None:
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


def _top_values(a: np.ndarray, n: int) -> np.ndarray:
    """The n largest of each row, descending (:func:`.sorted_top.top_values`' radix select)."""
    return top_values(a, n)[0]


def _tied_signs(top: torch.Tensor, sign: torch.Tensor, a: torch.Tensor, row: torch.Tensor,
                rank: torch.Tensor, threshold: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """[r, S] tables of the values whose elements share their ranks' signs (equal values on
    both sides of a change of sign at (``row``, ``rank``); the n-th value when equal ones lie
    beyond the n largest) and that shared sign: the sum of the group's signs among the n
    largest over its number of elements in the row."""
    rows, n = top.shape
    straddle = top[row, rank] == top[row, rank + 1]
    at_threshold = a == threshold[:, None]
    count_eq = at_threshold.sum(1)
    beyond = torch.nonzero(count_eq > (top == threshold[:, None]).sum(1), as_tuple=True)[0]
    t_row = torch.cat([row[straddle], beyond])
    t_val = torch.cat([top[row[straddle], rank[straddle]], threshold[beyond]])
    if t_row.numel() == 0:
        return top.new_zeros(rows, 0), top.new_zeros(rows, 0)
    order = torch.argsort(t_val, stable=True)
    order = order[torch.argsort(t_row[order], stable=True)]
    t_row, t_val = t_row[order], t_val[order]
    fresh = torch.ones_like(t_row, dtype=torch.bool)
    fresh[1:] = (t_row[1:] != t_row[:-1]) | (t_val[1:] != t_val[:-1])
    t_row, t_val = t_row[fresh], t_val[fresh]
    ascending = -top[t_row]  # each group's ranks [lo, hi) among the row's n largest
    lo = torch.searchsorted(ascending, -t_val[:, None], right=False)[:, 0]
    hi = torch.searchsorted(ascending, -t_val[:, None], right=True)[:, 0]
    cumulative = torch.cat([sign.new_zeros(rows, 1), sign.cumsum(1)], 1)
    total = cumulative[t_row, hi] - cumulative[t_row, lo]
    members = torch.where(t_val == threshold[t_row], count_eq[t_row], hi - lo)
    values, slot = _padded(t_row, t_val, rows, float("nan"))
    shared = sign.new_zeros(values.shape)
    shared[t_row, slot] = total / members.to(sign.dtype)
    return values, shared


def _sign_runs(top: torch.Tensor, t: torch.Tensor, a: torch.Tensor, checksum: torch.Tensor
               ) -> SignRuns:
    """Runs of the signs of ``exp(top) - t`` ([r, n], ``top`` the n largest of ``a``,
    descending), the L1 value and the tied values' shared signs."""
    d = top.exp() - t
    value = d.abs().sum(-1)
    sign = torch.sign(d)
    change = sign[:, 1:] != sign[:, :-1]  # a run starts at rank i + 1
    row, rank = torch.nonzero(change, as_tuple=True)
    threshold = top[:, -1].clone()  # not a view: the memo would keep all of top
    starts, slot = _padded(row, top[row, rank + 1], top.shape[0], float("-inf"))
    signs = sign.new_zeros(top.shape[0], starts.shape[1] + 1)
    signs[:, 0] = sign[:, 0]
    signs[row, slot + 1] = sign[row, rank + 1]
    tie_values, tie_signs = _tied_signs(top, sign, a, row, rank, threshold)
    return SignRuns(value, threshold, starts, signs, tie_values, tie_signs, checksum)


def _element_signs(a: torch.Tensor, threshold: torch.Tensor, starts: torch.Tensor,
                   signs: torch.Tensor, tie_values: torch.Tensor, tie_signs: torch.Tensor
                   ) -> np.ndarray:
    """Each element's sign: that of the run its value falls in (0 outside the n largest), or
    its tie group's shared sign. Run k + 1 holds the values at or below ``starts[:, k]``
    (descending): the sign is run 0's plus the change at each start at or above the value.
    NumPy's masks and products (several times torch's on these [rows, ~24k] arrays); every
    step is exact (signs are -1, 0, 1 or a tie group's shared value, masks 0 / 1)."""
    x = a.detach().numpy()
    sg = signs.numpy()
    k = starts.shape[1]
    if k <= _PASSES_UP_TO:
        out = np.broadcast_to(sg[:, :1], x.shape).copy()
        st = starts.numpy()
        for i in range(k):
            out += (x <= st[:, i: i + 1]) * (sg[:, i + 1: i + 2] - sg[:, i: i + 1])
    else:
        seg = k - torch.searchsorted(starts.flip(1).contiguous(), a.detach().contiguous(),
                                     right=False)
        out = np.take_along_axis(sg, seg.numpy(), 1)
    out *= x >= threshold.numpy()[:, None]
    tv, ts = tie_values.numpy(), tie_signs.numpy()
    for i in range(tv.shape[1]):  # out * (1 - eq) + shared * eq, exactly
        eq = x == tv[:, i: i + 1]
        out *= ~eq
        out += eq * ts[:, i: i + 1]
    return out


def _slopes(a: torch.Tensor, runs: SignRuns) -> torch.Tensor:
    """d L1 / d a: each element's sign times exp(a) (0 outside the n largest)."""
    out = _element_signs(a, runs.threshold, runs.starts, runs.signs, runs.tie_values,
                         runs.tie_signs)
    out *= np.exp(a.detach().numpy())
    return torch.from_numpy(out)


def _runs_of(a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None,
             keys: torch.Tensor | None, keep: bool) -> SignRuns:
    """The runs of ``a``'s rows: the memo's if it holds them for these values, else found by
    sorting (and kept in the memo when ``keep``)."""
    checksum = a.sum(1, dtype=torch.float64)
    runs = memo.take(keys, checksum, a) if memo is not None else None
    if runs is None:
        top = torch.from_numpy(_top_values(a.detach().numpy(), t.shape[1]))
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


#: Whether :func:`sorted_l1` runs on a tensor (CPU fp32 / fp64: Numba sorts it, NumPy masks it).
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


def sorted_l1_slopes(a: torch.Tensor, t: torch.Tensor, memo: RunMemo | None = None,
                     keys: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of :func:`sorted_l1`'s rows with respect to ``a`` [r, m], without
    autograd (a backward that writes its gradient directly); the memo's runs when it holds
    them for these values."""
    if t.shape[1] == 0 or a.shape[0] == 0:
        return torch.zeros_like(a)
    return _slopes(a, _runs_of(a, t.to(a.dtype), memo, keys, keep=False))


__all__ = ["RunMemo", "SignRuns", "sorted_l1", "sorted_l1_slopes", "supported"]
