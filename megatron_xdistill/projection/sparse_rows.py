"""Packing sparse (row, column, weight) entries into the fixed-width top-k row form of W.

Every producer of W (the builders, the NeMo-RL loaders) ends here, so duplicates, ties and the
top-k cut are handled one way: duplicate (row, column) entries are summed, non-positive weights
dropped, each row is ordered by weight (descending), then priority (ascending; builders use it to
rank their sources), then column id (ascending), and cut to its first ``k`` entries.
"""

from __future__ import annotations

import numpy as np


def pack_rows(
    rows: np.ndarray,
    cols: np.ndarray,
    vals: np.ndarray,
    n_rows: int,
    k: int | None = None,
    priority: np.ndarray | None = None,
    renormalize: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(indices int64 [n_rows, k], weights float32 [n_rows, k])``, -1/0 in empty slots.

    ``k=None`` keeps every entry (k = the longest row, at least 1). ``renormalize`` scales each
    non-empty row to sum to 1 after the cut.
    """
    rows = np.asarray(rows, dtype=np.int64)
    cols = np.asarray(cols, dtype=np.int64)
    vals = np.asarray(vals, dtype=np.float64)
    prio = (
        np.zeros(rows.shape, dtype=np.int64)
        if priority is None
        else np.asarray(priority, dtype=np.int64)
    )
    if not (rows.shape == cols.shape == vals.shape == prio.shape):
        raise ValueError("rows, cols, vals and priority must have the same length")
    if rows.size and (rows.min() < 0 or rows.max() >= n_rows):
        raise ValueError(f"row ids must lie in [0, {n_rows})")
    if cols.size and cols.min() < 0:
        raise ValueError("column ids must be >= 0")
    if k is not None and k < 1:
        raise ValueError(f"k must be >= 1, got {k}")

    if rows.size:
        n_cols = int(cols.max()) + 1
        key = rows * n_cols + cols
        uniq, inverse = np.unique(key, return_inverse=True)
        vals = np.bincount(inverse, weights=vals, minlength=uniq.size)
        p = np.full(uniq.size, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(p, inverse, prio)
        rows, cols, prio = uniq // n_cols, uniq % n_cols, p
        keep = vals > 0
        rows, cols, vals, prio = rows[keep], cols[keep], vals[keep], prio[keep]

    order = np.lexsort((cols, prio, -vals, rows))
    rows, cols, vals = rows[order], cols[order], vals[order]
    counts = np.bincount(rows, minlength=n_rows)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(rows.size) - starts[rows]
    width = k if k is not None else max(1, int(counts.max()) if counts.size else 1)
    keep = rank < width
    rows, cols, vals, rank = rows[keep], cols[keep], vals[keep], rank[keep]
    if renormalize and rows.size:
        sums = np.bincount(rows, weights=vals, minlength=n_rows)
        vals = vals / sums[rows]

    indices = np.full((n_rows, width), -1, dtype=np.int64)
    weights = np.zeros((n_rows, width), dtype=np.float32)
    indices[rows, rank] = cols
    weights[rows, rank] = vals.astype(np.float32)
    return indices, weights


def unpack_rows(indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, ...]:
    """Inverse of ``pack_rows``: the (rows, cols, vals) of the non-empty slots."""
    indices = np.asarray(indices)
    weights = np.asarray(weights)
    valid = (indices >= 0) & (weights > 0)
    rows, slots = np.nonzero(valid)
    return rows.astype(np.int64), indices[rows, slots].astype(np.int64), weights[rows, slots]
