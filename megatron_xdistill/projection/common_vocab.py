"""Common vocabulary for the gold (ULD hybrid) loss: one-to-one (student, teacher) token pairs.

Two rules (DESIGN.md, "Gold"):

``strict``
    (s, t) is a pair when row s of W is one-hot on t (a single non-empty entry, weight 1 within
    ``1e-6``) and no other eligible one-hot row targets t. A column hit by several one-hot rows is
    dropped altogether (no tie-breaking: strict means unambiguous). When W carries row kinds, only
    ``EXACT`` and ``SPECIAL`` rows are eligible: a multi-token row whose pieces are all the same
    token (``"00"`` -> ``"0"``, ``"0"``) is one-hot too, but is no one-to-one correspondence.
``xtoken``
    (s, t) is a candidate when t is row s's top-1 entry and its weight is >= ``threshold`` (0.6).
    Several candidates for one t are resolved by highest weight, then (when W carries row kinds)
    ``EXACT``/``SPECIAL`` rows before other rows, then lowest student id.

In both rules rows marked ``RowKind.EXACT_ALIAS`` (a student token that spells the same text as
another, canonical student token, e.g. SentencePiece byte-fallback ``<0x0A>`` next to ``\\n``) are
not eligible, so the canonical token keeps the pair. Multi-token rows that put some weight on t do
not block a pair: the gold loss compares p_s(s) with p_t(t) directly, not through W.
"""

from __future__ import annotations

import torch

from .fileio import RowKind

XTOKEN_THRESHOLD = 0.6


def _top1(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.where(indices >= 0, weights, torch.zeros_like(weights))
    top_w, pos = w.max(dim=1)
    top_t = indices.gather(1, pos[:, None])[:, 0].long()
    return top_t, top_w


def _eligible(indices: torch.Tensor, row_kind: torch.Tensor | None) -> torch.Tensor:
    ok = torch.ones(indices.shape[0], dtype=torch.bool)
    if row_kind is not None:
        ok &= row_kind.to(torch.int64) != int(RowKind.EXACT_ALIAS)
    return ok


def _one_to_one_kind(n: int, row_kind: torch.Tensor | None) -> torch.Tensor:
    """Rows whose builder asserts a one-to-one correspondence (all rows when kinds are unknown)."""
    if row_kind is None:
        return torch.ones(n, dtype=torch.bool)
    kind = row_kind.to(torch.int64)
    return (kind == int(RowKind.EXACT)) | (kind == int(RowKind.SPECIAL))


def strict_common_vocab(
    indices: torch.Tensor, weights: torch.Tensor, row_kind: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs under the ``strict`` rule, as (student_ids, teacher_ids) int64, by student id."""
    valid = (indices >= 0) & (weights > 0)
    top_t, top_w = _top1(indices, weights)
    one_hot = (valid.sum(dim=1) == 1) & ((top_w - 1.0).abs() <= 1e-6)
    one_hot &= _eligible(indices, row_kind) & _one_to_one_kind(indices.shape[0], row_kind)
    s = torch.nonzero(one_hot, as_tuple=False)[:, 0]
    t = top_t[s]
    if t.numel() == 0:
        return s, t
    hits = torch.bincount(t, minlength=int(t.max()) + 1)
    keep = hits[t] == 1
    return s[keep], t[keep]


def xtoken_common_vocab(
    indices: torch.Tensor,
    weights: torch.Tensor,
    row_kind: torch.Tensor | None = None,
    threshold: float = XTOKEN_THRESHOLD,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs under the ``xtoken`` rule, as (student_ids, teacher_ids) int64, by student id."""
    top_t, top_w = _top1(indices, weights)
    cand = (top_w >= threshold) & (top_t >= 0) & _eligible(indices, row_kind)
    s = torch.nonzero(cand, as_tuple=False)[:, 0]
    if s.numel() == 0:
        return s, s.clone()
    t, w = top_t[s], top_w[s].double()
    pref = (~_one_to_one_kind(indices.shape[0], row_kind)[s]).to(torch.int64)
    # Order by (t, -w, pref, s); the first row of each t-group wins.
    order = torch.argsort(s, stable=True)
    order = order[torch.argsort(pref[order], stable=True)]
    order = order[torch.argsort(-w[order], stable=True)]
    order = order[torch.argsort(t[order], stable=True)]
    t_sorted = t[order]
    first = torch.ones_like(t_sorted, dtype=torch.bool)
    first[1:] = t_sorted[1:] != t_sorted[:-1]
    win = order[first]
    s_win, t_win = s[win], t[win]
    by_s = torch.argsort(s_win)
    return s_win[by_s], t_win[by_s]


def common_vocab(
    indices: torch.Tensor,
    weights: torch.Tensor,
    rule: str,
    row_kind: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch on ``rule`` ("strict" | "xtoken")."""
    if rule == "strict":
        return strict_common_vocab(indices, weights, row_kind)
    if rule == "xtoken":
        return xtoken_common_vocab(indices, weights, row_kind)
    raise ValueError(f"common vocabulary rule must be 'strict' or 'xtoken', got {rule!r}")
