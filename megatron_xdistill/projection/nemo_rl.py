"""NeMo-RL projection files (``.pt``): read with ``torch.load(weights_only=True)``, and write.

NeMo-RL's cross-tokenizer distillation stores W student-major in one of two forms:

dense
    ``{"indices": LongTensor [V_s, k], "likelihoods": FloatTensor [V_s, k]}``; likelihoods are
    probabilities (rows need not sum to 1). Slots with a negative index or a weight <= 0 are empty.
    A file whose finite likelihoods are all <= 0 (some < 0) is taken as log-probabilities.
sparse
    ``{(student_id, teacher_id): weight, ...}`` (a dict keyed by int pairs; weights are floats or
    0-d tensors).

Weights are kept as stored (no renormalisation) so that a loaded file projects exactly as in
NeMo-RL; duplicates are summed and rows ordered by weight, like every W here (``sparse_rows``).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megatron_xdistill.storage import atomic_file

from .sparse_rows import pack_rows, unpack_rows

_EXPECTED = (
    "a dict {'indices': LongTensor [V_s, k], 'likelihoods': FloatTensor [V_s, k]} or a sparse "
    "dict {(student_id, teacher_id): weight}"
)


def read_nemo_rl(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray, str]:
    """Load a NeMo-RL projection file: ``(indices [R, k] int64, weights [R, k] float32, form)``.

    ``R`` is the number of student rows the file describes (the last row with an entry, for the
    sparse form); callers pad it to the student vocabulary.
    """
    path = Path(path)
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except OSError:
        raise
    except Exception as e:  # corrupt bytes fail the unpickler in many ways (IndexError, ...)
        raise ValueError(
            f"{path}: cannot be unpickled with torch.load(weights_only=True); expected {_EXPECTED} "
            f"({e})"
        ) from e
    if isinstance(obj, dict) and "indices" in obj and "likelihoods" in obj:
        indices, weights = _read_dense(path, obj["indices"], obj["likelihoods"])
        return indices, weights, "dense"
    if isinstance(obj, dict) and all(_is_id_pair(k) for k in obj):
        indices, weights = _read_sparse(path, obj)
        return indices, weights, "sparse"
    keys = list(obj)[:5] if isinstance(obj, dict) else None
    raise ValueError(
        f"{path}: unrecognised NeMo-RL projection ({type(obj).__name__}"
        f"{f', keys {keys}' if keys is not None else ''}); expected {_EXPECTED}"
    )


def _is_id_pair(key: object) -> bool:
    return (
        isinstance(key, tuple)
        and len(key) == 2
        and all(isinstance(x, int | np.integer) for x in key)
    )


def _read_dense(path: Path, indices: object, likelihoods: object) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 2:
        raise ValueError(f"{path}: 'indices' must be a 2-D integer tensor [V_s, k]")
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"{path}: 'indices' must be an integer tensor, got {indices.dtype}")
    if not isinstance(likelihoods, torch.Tensor) or likelihoods.shape != indices.shape:
        raise ValueError(
            f"{path}: 'likelihoods' must be a tensor shaped like 'indices' {tuple(indices.shape)}"
        )
    idx = indices.to(torch.int64).numpy()
    val = likelihoods.to(torch.float64).numpy().copy()
    slot = idx >= 0
    if np.isnan(val[slot]).any():
        raise ValueError(f"{path}: 'likelihoods' contains NaN")
    finite = val[slot & np.isfinite(val)]
    if finite.size and finite.max() <= 0 and finite.min() < 0:
        val = np.exp(val)  # log-probabilities
    elif (val[slot] < 0).any() or np.isinf(val[slot]).any():
        raise ValueError(
            f"{path}: 'likelihoods' mixes negative and positive values; expected probabilities "
            "(>= 0) or log-probabilities (all <= 0)"
        )
    rows, slots = np.nonzero(slot & (val > 0))
    out_i, out_w = pack_rows(
        rows, idx[rows, slots], val[rows, slots], n_rows=idx.shape[0], k=max(1, idx.shape[1])
    )
    return out_i, out_w


def _read_sparse(path: Path, obj: dict) -> tuple[np.ndarray, np.ndarray]:
    n = len(obj)
    rows = np.empty(n, dtype=np.int64)
    cols = np.empty(n, dtype=np.int64)
    vals = np.empty(n, dtype=np.float64)
    for i, ((s, t), v) in enumerate(obj.items()):
        rows[i], cols[i] = int(s), int(t)
        vals[i] = float(v.item() if isinstance(v, torch.Tensor) else v)
    if n and (rows.min() < 0 or cols.min() < 0):
        raise ValueError(f"{path}: sparse projection has negative token ids")
    if n and (np.isnan(vals).any() or (vals < 0).any()):
        raise ValueError(f"{path}: sparse projection weights must be finite and >= 0")
    n_rows = int(rows.max()) + 1 if n else 0
    return pack_rows(rows, cols, vals, n_rows=n_rows, k=None)


def write_nemo_rl(
    path: str | os.PathLike, indices: torch.Tensor, weights: torch.Tensor, form: str = "dense"
) -> None:
    """Write W in NeMo-RL's dense or sparse ``.pt`` form (atomic: temp file + ``os.replace``).

    Dense empty slots are written as index 0 with likelihood 0 (a no-op for a gather-based
    consumer, which a -1 index would not be).
    """
    idx = indices.detach().cpu().to(torch.int64)
    w = weights.detach().cpu().to(torch.float32)
    if form == "dense":
        empty = (idx < 0) | (w <= 0)
        obj: object = {
            "indices": torch.where(empty, torch.zeros_like(idx), idx),
            "likelihoods": torch.where(empty, torch.zeros_like(w), w),
        }
    elif form == "sparse":
        rows, cols, vals = unpack_rows(idx.numpy(), w.numpy())
        obj = {(int(s), int(t)): float(v) for s, t, v in zip(rows, cols, vals)}
    else:
        raise ValueError(f"NeMo-RL projection form must be 'dense' or 'sparse', got {form!r}")
    with atomic_file(path) as tmp:
        torch.save(obj, tmp)
