"""A block's chunk rows as runs of its positions, for the CPU passes that take a block a chunk
row at a time (:mod:`cpu.gold_block`, :mod:`cpu.image_block`): each chunk's positions are one run of
the block (:mod:`blocks.chunk_rows`), so a row's work can read and write its positions together."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def row_runs(seg, first, end, orphans):  # pragma: no cover - numba
    """Row r's positions are [first[r], end[r]) (``seg``: each position's row, -1 for none);
    ``orphans`` takes the positions of no row. Returns the number of orphans."""
    count = 0
    for p in range(seg.shape[0]):
        r = seg[p]
        if r < 0:
            orphans[count] = p
            count += 1
        else:
            if p == 0 or seg[p - 1] != r:
                first[r] = p
            end[r] = p + 1
    return count


def run_buffers(n: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(each row's first position, its end, the positions of no row) buffers of a block of
    ``n`` positions and ``rows`` rows (:func:`row_runs`)."""
    return np.empty(rows, np.int64), np.empty(rows, np.int64), np.empty(n, np.int64)


__all__ = ["row_runs", "run_buffers"]
