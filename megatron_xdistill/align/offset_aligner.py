"""Fast path: align two tokenisations of one text from their character offsets, O(n + m).

A side has a token boundary at character ``c`` when every token so far ends at or before ``c`` and
the next one starts at or after it (tokens that split one character, e.g. byte-level pieces of an
emoji, overlap and so make no boundary). Characters no token covers widen a boundary to an
interval. A chunk closes where both sides have a boundary at the same character: a single compiled
two-pointer walk.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .chunks import finalize
from .sides import Side

__all__ = ["align_offsets", "walk_offsets"]

_INF = np.int64(1) << 62


@njit(cache=True, nogil=True)
def walk_offsets(s_lo, s_hi, t_lo, t_hi):
    """Chunk spans [a, b, p, q] over two token lists given their character spans ``[lo, hi)``."""
    n = s_lo.shape[0]
    m = t_lo.shape[0]
    out = np.empty((n + m + 1, 4), np.int64)
    c = 0
    i = 0
    j = 0
    reach_s = np.int64(-1)
    reach_t = np.int64(-1)
    while i < n and j < m:
        a = i
        p = j
        # Tokens lying wholly in text the other side skips (e.g. a dropped special token) form
        # a chunk of their own, with an empty other side.
        if s_lo[i] < t_lo[j] and s_hi[i] <= t_lo[j]:
            while i < n and s_lo[i] < t_lo[j] and s_hi[i] <= t_lo[j]:
                reach_s = max(reach_s, s_hi[i])
                i += 1
            if i == n or s_lo[i] >= reach_s:
                out[c, 0] = a
                out[c, 1] = i
                out[c, 2] = p
                out[c, 3] = p
                c += 1
                continue
        elif t_lo[j] < s_lo[i] and t_hi[j] <= s_lo[i]:
            while j < m and t_lo[j] < s_lo[i] and t_hi[j] <= s_lo[i]:
                reach_t = max(reach_t, t_hi[j])
                j += 1
            if j == m or t_lo[j] >= reach_t:
                out[c, 0] = a
                out[c, 1] = a
                out[c, 2] = p
                out[c, 3] = j
                c += 1
                continue
        if i < n:
            reach_s = max(reach_s, s_hi[i])
            i += 1
        if j < m:
            reach_t = max(reach_t, t_hi[j])
            j += 1
        while True:
            nxt_s = s_lo[i] if i < n else _INF
            nxt_t = t_lo[j] if j < m else _INF
            if nxt_s < reach_s:  # no boundary on the student side yet
                reach_s = max(reach_s, s_hi[i])
                i += 1
            elif nxt_t < reach_t:
                reach_t = max(reach_t, t_hi[j])
                j += 1
            elif max(reach_s, reach_t) <= min(nxt_s, nxt_t):  # boundary intervals meet
                break
            elif nxt_s < reach_t:  # student is behind the teacher
                reach_s = max(reach_s, s_hi[i])
                i += 1
            else:
                reach_t = max(reach_t, t_hi[j])
                j += 1
        out[c, 0] = a
        out[c, 1] = i
        out[c, 2] = p
        out[c, 3] = j
        c += 1
    if i < n or j < m:  # text only one side covers at the end
        out[c, 0] = i
        out[c, 1] = n
        out[c, 2] = j
        out[c, 3] = m
        c += 1
    return out[:c]


def align_offsets(s: Side, s_offsets: np.ndarray, t: Side, t_offsets: np.ndarray) -> np.ndarray:
    """Chunks (int64 [C, 5], original positions) from per-token character offsets ``[N, 2]``.

    Offsets are those of *all* ids of each side; rows of tokens the side dropped are ignored.
    """
    so = np.asarray(s_offsets, dtype=np.int64).reshape(-1, 2)[s.index]
    to = np.asarray(t_offsets, dtype=np.int64).reshape(-1, 2)[t.index]
    spans = walk_offsets(
        np.ascontiguousarray(so[:, 0]), np.ascontiguousarray(so[:, 1]),
        np.ascontiguousarray(to[:, 0]), np.ascontiguousarray(to[:, 1]),
    )
    return finalize(spans, s, t)
