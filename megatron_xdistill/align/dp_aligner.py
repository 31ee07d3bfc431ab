"""Fallback path: align two id sequences from canonical token bytes alone (no text, no offsets).

Where both byte streams agree, a compiled two-pointer walk takes *minimal exact steps*: the
shortest ``a:b`` token runs (1:1, 1:k, k:1, or a:b) that spell the same bytes and end on a common
character boundary. This is exactly the chunking the offset path finds on the same text, in O(n).

Where the streams disagree (unknown tokens, normalisation, generated ids) the walk stops and a
Needleman-Wunsch DP re-aligns the stretch up to the next *anchor*: a pair of token boundaries, one
per side, whose surrounding ``2 * anchor_bytes`` bytes are equal and occur at no other boundary of
either side (unique byte n-grams; kept in order by a longest increasing subsequence). DP steps:
exact minimal steps with at most ``max_step`` tokens per side (score ``a + b``), 1:1 substitution
and 1:0 / 0:1 gaps (score -1 each), inside a diagonal band, so long sequences stay near-linear.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .chunks import finalize
from .sides import Side

__all__ = ["align_sides", "check_dp_options", "dp_spans"]

_NEG = np.int64(-(1 << 60))
_UNBOUNDED = 1 << 30


@njit(cache=True, nogil=True, inline="always")
def _char_start(stream, starts, k, n):
    """True when the text after token ``k - 1`` starts a character (or the stream ends)."""
    if k >= n:
        return True
    pos = starts[k]
    if pos >= stream.shape[0]:
        return True
    return (stream[pos] & 0xC0) != 0x80


@njit(cache=True, nogil=True)
def _min_step(i, j, n, m, cap, s_starts, s_stream, s_opq, t_starts, t_stream, t_opq):
    """End ``(a, b)`` of the minimal exact step from ``(i, j)``, or ``(-1, -1)`` if there is none."""
    if s_opq[i] or t_opq[j]:
        return -1, -1
    if not (_char_start(s_stream, s_starts, i, n) and _char_start(t_stream, t_starts, j, m)):
        return -1, -1  # a chunk never starts inside a character
    a = i + 1
    b = j + 1
    ls = s_starts[a] - s_starts[i]
    lt = t_starts[b] - t_starts[j]
    while True:
        if ls == lt and ls > 0 and _char_start(s_stream, s_starts, a, n) and _char_start(
            t_stream, t_starts, b, m
        ):
            break
        if ls <= lt:
            if a >= n or a - i >= cap or s_opq[a]:
                return -1, -1
            ls += s_starts[a + 1] - s_starts[a]
            a += 1
        else:
            if b >= m or b - j >= cap or t_opq[b]:
                return -1, -1
            lt += t_starts[b + 1] - t_starts[b]
            b += 1
    x0 = s_starts[i]
    y0 = t_starts[j]
    for k in range(ls):
        if s_stream[x0 + k] != t_stream[y0 + k]:
            return -1, -1
    return a, b


@njit(cache=True, nogil=True)
def _window_keys(starts, stream, n, half):
    """Hash of the ``2 * half`` bytes around each interior token boundary (-1 if none)."""
    total = stream.shape[0]
    base = np.uint64(1099511628211)
    pref = np.zeros(total + 1, np.uint64)
    for k in range(total):
        pref[k + 1] = pref[k] * base + np.uint64(stream[k]) + np.uint64(1)
    powl = np.uint64(1)
    for _ in range(2 * half):
        powl *= base
    keys = np.empty(n + 1, np.uint64)
    valid = np.zeros(n + 1, np.bool_)
    for k in range(1, n):
        pos = starts[k]
        if pos - half < 0 or pos + half > total or (stream[pos] & 0xC0) == 0x80:
            continue
        keys[k] = pref[pos + half] - pref[pos - half] * powl
        valid[k] = True
    return keys, valid


@njit(cache=True, nogil=True)
def _unique_keys(keys, valid):
    """Token boundaries whose key occurs once; returned sorted by key: (keys, boundary index)."""
    idx = np.flatnonzero(valid)
    kv = keys[idx]
    order = np.argsort(kv, kind="mergesort")
    kv = kv[order]
    idx = idx[order]
    keep = np.zeros(kv.shape[0], np.bool_)
    for r in range(kv.shape[0]):
        if (r == 0 or kv[r - 1] != kv[r]) and (r + 1 == kv.shape[0] or kv[r + 1] != kv[r]):
            keep[r] = True
    return kv[keep], idx[keep]


@njit(cache=True, nogil=True)
def _anchors(s_starts, s_stream, n, t_starts, t_stream, m, half):
    """Ordered anchor pairs (student boundary, teacher boundary) from unique byte n-grams."""
    ks, vs = _window_keys(s_starts, s_stream, n, half)
    kt, vt = _window_keys(t_starts, t_stream, m, half)
    us, ps = _unique_keys(ks, vs)
    ut, pt = _unique_keys(kt, vt)
    pairs_s = np.empty(min(us.shape[0], ut.shape[0]), np.int64)
    pairs_t = np.empty_like(pairs_s)
    c = 0
    x = 0
    y = 0
    while x < us.shape[0] and y < ut.shape[0]:
        if us[x] < ut[y]:
            x += 1
        elif us[x] > ut[y]:
            y += 1
        else:
            a = ps[x]
            b = pt[y]
            same = True
            for k in range(-half, half):  # rule out hash collisions
                if s_stream[s_starts[a] + k] != t_stream[t_starts[b] + k]:
                    same = False
                    break
            if same:
                pairs_s[c] = a
                pairs_t[c] = b
                c += 1
            x += 1
            y += 1
    order = np.argsort(pairs_s[:c], kind="mergesort")
    ps_sorted = pairs_s[:c][order]
    pt_sorted = pairs_t[:c][order]
    # Longest strictly increasing run of teacher boundaries (patience sorting).
    k_all = ps_sorted.shape[0]
    tails = np.empty(k_all, np.int64)
    prev = np.full(k_all, -1, np.int64)
    length = 0
    for r in range(k_all):
        v = pt_sorted[r]
        lo = 0
        hi = length
        while lo < hi:
            mid = (lo + hi) // 2
            if pt_sorted[tails[mid]] < v:
                lo = mid + 1
            else:
                hi = mid
        if lo > 0:
            prev[r] = tails[lo - 1]
        tails[lo] = r
        if lo == length:
            length += 1
    out_s = np.empty(length, np.int64)
    out_t = np.empty(length, np.int64)
    r = tails[length - 1] if length > 0 else -1
    for k in range(length - 1, -1, -1):
        out_s[k] = ps_sorted[r]
        out_t[k] = pt_sorted[r]
        r = prev[r]
    return out_s, out_t


@njit(cache=True, nogil=True)
def _nw_window(i0, i1, j0, j1, cap, band, s_starts, s_stream, s_opq, t_starts, t_stream,
               t_opq, out, c):
    """Needleman-Wunsch over tokens [i0, i1) x [j0, j1) in a diagonal band; spans into ``out``."""
    nw = i1 - i0
    mw = j1 - j0
    if nw == 0 or mw == 0:
        out[c, 0] = i0
        out[c, 1] = i1
        out[c, 2] = j0
        out[c, 3] = j1
        return c + 1
    lo = np.empty(nw + 1, np.int64)
    hi = np.empty(nw + 1, np.int64)
    row = np.empty(nw + 2, np.int64)
    row[0] = 0
    for r in range(nw + 1):
        lo[r] = max(0, (r * mw) // nw - band)
        hi[r] = min(mw, ((r + 1) * mw + nw - 1) // nw + band)
        if r == nw:
            hi[r] = mw
        row[r + 1] = row[r] + hi[r] - lo[r] + 1
    size = row[nw + 1]
    score = np.full(size, _NEG, np.int64)
    back = np.zeros(size, np.int32)  # di * 1024 + dj
    score[0] = 0
    for r in range(nw + 1):
        for q in range(lo[r], hi[r] + 1):
            cur = score[row[r] + q - lo[r]]
            if cur == _NEG:
                continue
            if r < nw and q < mw:
                a, b = _min_step(i0 + r, j0 + q, i1, j1, cap, s_starts, s_stream, s_opq,
                                 t_starts, t_stream, t_opq)
                if a >= 0:
                    ra = a - i0
                    qb = b - j0
                    if lo[ra] <= qb <= hi[ra]:
                        v = cur + (ra - r) + (qb - q)
                        k = row[ra] + qb - lo[ra]
                        if v > score[k]:
                            score[k] = v
                            back[k] = (ra - r) * 1024 + (qb - q)
                if lo[r + 1] <= q + 1 <= hi[r + 1]:
                    k = row[r + 1] + q + 1 - lo[r + 1]
                    if cur - 1 > score[k]:
                        score[k] = cur - 1
                        back[k] = 1024 + 1
            if r < nw and lo[r + 1] <= q <= hi[r + 1]:
                k = row[r + 1] + q - lo[r + 1]
                if cur - 1 > score[k]:
                    score[k] = cur - 1
                    back[k] = 1024
            if q < hi[r]:
                k = row[r] + q + 1 - lo[r]
                if cur - 1 > score[k]:
                    score[k] = cur - 1
                    back[k] = 1
    # Backtrack from the end of the window; spans come out reversed.
    start = c
    r = nw
    q = mw
    while r > 0 or q > 0:
        code = back[row[r] + q - lo[r]]
        di = code // 1024
        dj = code % 1024
        out[c, 0] = i0 + r - di
        out[c, 1] = i0 + r
        out[c, 2] = j0 + q - dj
        out[c, 3] = j0 + q
        c += 1
        r -= di
        q -= dj
    end = c - 1
    while start < end:
        for col in range(4):
            tmp = out[start, col]
            out[start, col] = out[end, col]
            out[end, col] = tmp
        start += 1
        end -= 1
    return c


@njit(cache=True, nogil=True)
def dp_spans(s_starts, s_stream, s_opq, t_starts, t_stream, t_opq, max_step, anchor_bytes,
             band):
    """Chunk spans [a, b, p, q] over kept tokens: synchronous walk + anchored, banded DP."""
    n = s_opq.shape[0]
    m = t_opq.shape[0]
    out = np.empty((n + m + 1, 4), np.int64)
    c = 0
    i = 0
    j = 0
    have_anchors = False
    an_s = np.empty(0, np.int64)
    an_t = np.empty(0, np.int64)
    k = 0
    while i < n and j < m:
        a, b = _min_step(i, j, n, m, _UNBOUNDED, s_starts, s_stream, s_opq, t_starts,
                         t_stream, t_opq)
        if a >= 0:
            out[c, 0] = i
            out[c, 1] = a
            out[c, 2] = j
            out[c, 3] = b
            c += 1
            i = a
            j = b
            continue
        if not have_anchors:
            an_s, an_t = _anchors(s_starts, s_stream, n, t_starts, t_stream, m, anchor_bytes)
            have_anchors = True
        while k < an_s.shape[0] and (an_s[k] <= i or an_t[k] <= j):
            k += 1
        ei = an_s[k] if k < an_s.shape[0] else n
        ej = an_t[k] if k < an_s.shape[0] else m
        c = _nw_window(i, ei, j, ej, max_step, band, s_starts, s_stream, s_opq, t_starts,
                       t_stream, t_opq, out, c)
        i = ei
        j = ej
    if i < n or j < m:
        out[c, 0] = i
        out[c, 1] = n
        out[c, 2] = j
        out[c, 3] = m
        c += 1
    return out[:c]


def check_dp_options(max_step: int, anchor_bytes: int, band: int) -> None:
    """Raise ``ValueError`` for DP options out of range."""
    if not 1 <= max_step <= 1000:
        raise ValueError(f"max_step must be in [1, 1000], got {max_step}")
    if anchor_bytes < 1 or band < 1:
        raise ValueError(f"anchor_bytes and band must be >= 1, got {anchor_bytes}, {band}")


def align_sides(s: Side, t: Side, *, max_step: int = 4, anchor_bytes: int = 16,
                band: int = 64) -> np.ndarray:
    """Chunks (int64 [C, 5], original positions) of two sides from canonical bytes only.

    ``max_step``: most tokens per side in one exact DP step inside a re-alignment window (the
    synchronous walk has no limit); ``anchor_bytes``: half-width of the anchor n-grams;
    ``band``: half-width of the DP band around the window's diagonal.
    """
    check_dp_options(max_step, anchor_bytes, band)
    spans = dp_spans(s.starts, s.stream, s.opaque, t.starts, t.stream, t.opaque,
                     int(max_step), int(anchor_bytes), int(band))
    return finalize(spans, s, t)
