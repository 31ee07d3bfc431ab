"""Chunks: the result both aligners produce, and the normal form they are brought to.

A chunk is ``(s_start, s_end, t_start, t_end, exact)``: half-open spans over the student and
teacher id lists that cover the same piece of text. Chunks are ordered and disjoint and every
token except control tokens (BOS/EOS/pad/...) lies in exactly one. Control tokens have no text and
sit between spans (only in id lists without text can one fall strictly inside a span, where the
other side has no boundary). A side with no tokens in a chunk has ``start == end``; such a chunk
is never exact.

Normal form (shared by the offset path and the DP path, which is why they agree): a chunk is exact
iff both sides are non-empty, hold no opaque token and their canonical bytes are equal; runs of
neighbouring inexact chunks are merged into one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numba import njit

from .sides import Side

__all__ = ["Alignment", "Chunk", "check_partition", "finalize"]

Chunk = tuple[int, int, int, int, bool]


@njit(cache=True, nogil=True)
def _is_exact(a, b, p, q, s_starts, s_stream, s_opq, t_starts, t_stream, t_opq):
    if a >= b or p >= q:
        return False
    if s_opq[b] - s_opq[a] != 0 or t_opq[q] - t_opq[p] != 0:
        return False
    x0 = s_starts[a]
    y0 = t_starts[p]
    ln = s_starts[b] - x0
    if ln != t_starts[q] - y0:
        return False
    # Both ends must fall between characters (a side can lose bytes of a character it cannot
    # encode; the bytes that are left are not a piece of text).
    if ln > 0 and (s_stream[x0] & 0xC0) == 0x80:
        return False
    if x0 + ln < s_stream.shape[0] and (s_stream[x0 + ln] & 0xC0) == 0x80:
        return False
    if y0 + ln < t_stream.shape[0] and (t_stream[y0 + ln] & 0xC0) == 0x80:
        return False
    for k in range(ln):
        if s_stream[x0 + k] != t_stream[y0 + k]:
            return False
    return True


@njit(cache=True, nogil=True)
def _finalize(spans, s_starts, s_stream, s_opq, t_starts, t_stream, t_opq):
    """Mark exact chunks and merge runs of inexact ones; spans are over kept tokens."""
    c_in = spans.shape[0]
    out = np.empty((c_in, 5), np.int64)
    c = 0
    for k in range(c_in):
        a, b, p, q = spans[k, 0], spans[k, 1], spans[k, 2], spans[k, 3]
        ex = _is_exact(a, b, p, q, s_starts, s_stream, s_opq, t_starts, t_stream, t_opq)
        if c > 0 and not ex and out[c - 1, 4] == 0:
            out[c - 1, 1] = b
            out[c - 1, 3] = q
            continue
        out[c, 0] = a
        out[c, 1] = b
        out[c, 2] = p
        out[c, 3] = q
        out[c, 4] = 1 if ex else 0
        c += 1
    # A merged run can spell the same text on both sides (e.g. when a step was too long for
    # the DP): check merged chunks once more.
    for k in range(c):
        if out[k, 4] == 0:
            ok = _is_exact(out[k, 0], out[k, 1], out[k, 2], out[k, 3],
                           s_starts, s_stream, s_opq, t_starts, t_stream, t_opq)
            out[k, 4] = 1 if ok else 0
    return out[:c]


def _span_map(side: Side) -> tuple[np.ndarray, np.ndarray]:
    """Original-position lookup for span starts and ends over kept tokens (length n + 1)."""
    n = side.n
    start = np.empty(n + 1, np.int64)
    end = np.empty(n + 1, np.int64)
    start[:n] = side.index
    end[1:] = side.index + 1
    tail = int(side.index[-1]) + 1 if n else 0
    start[n] = tail
    end[0] = side.index[0] if n else 0
    return start, end


def finalize(spans: np.ndarray, s: Side, t: Side) -> np.ndarray:
    """Normal form of chunk spans over kept tokens, mapped to original positions: int64 [C, 5]."""
    spans = np.ascontiguousarray(spans, dtype=np.int64).reshape(-1, 4)
    s_opq = np.concatenate([[0], np.cumsum(s.opaque, dtype=np.int64)])
    t_opq = np.concatenate([[0], np.cumsum(t.opaque, dtype=np.int64)])
    out = _finalize(spans, s.starts, s.stream, s_opq, t.starts, t.stream, t_opq)
    s_start, s_end = _span_map(s)
    t_start, t_end = _span_map(t)
    res = np.empty_like(out)
    # An empty side sits where the other side's text is: at the next kept token.
    res[:, 0] = s_start[out[:, 0]]
    res[:, 1] = np.where(out[:, 1] > out[:, 0], s_end[out[:, 1]], res[:, 0])
    res[:, 2] = t_start[out[:, 2]]
    res[:, 3] = np.where(out[:, 3] > out[:, 2], t_end[out[:, 3]], res[:, 2])
    res[:, 4] = out[:, 4]
    return res


@dataclass(frozen=True)
class Alignment:
    """Token ids of both sides for one text and the chunks that align them."""

    student_ids: np.ndarray  # int64 [n]
    teacher_ids: np.ndarray  # int64 [m]
    chunks_array: np.ndarray  # int64 [C, 5]: s_start, s_end, t_start, t_end, exact (0/1)
    _list: list = field(default_factory=list, repr=False, compare=False)

    @property
    def chunks(self) -> list[Chunk]:
        """Chunks as a list of ``(s_start, s_end, t_start, t_end, exact)`` tuples."""
        if not self._list and len(self.chunks_array):
            self._list.extend(
                (a, b, p, q, bool(e)) for a, b, p, q, e in self.chunks_array.tolist()
            )
        return self._list

    @property
    def num_exact(self) -> int:
        """Number of exact chunks."""
        return int(self.chunks_array[:, 4].sum()) if len(self.chunks_array) else 0


def check_partition(chunks: np.ndarray, n: int, m: int) -> None:
    """Raise ``AssertionError`` unless chunks are ordered, disjoint spans inside ``[0,n)``/``[0,m)``."""
    arr = np.asarray(chunks, dtype=np.int64).reshape(-1, 5)
    prev_s = prev_t = 0
    for a, b, p, q, _ in arr.tolist():
        assert prev_s <= a <= b <= n, f"student span [{a},{b}) out of order (prev end {prev_s})"
        assert prev_t <= p <= q <= m, f"teacher span [{p},{q}) out of order (prev end {prev_t})"
        assert b > a or q > p, "chunk with no tokens on either side"
        prev_s, prev_t = b, q
