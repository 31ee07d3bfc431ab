"""Packed batch form of alignments, as the loss consumes it.

Per sample ``b`` with chunks ``c = 0 .. C_b - 1``:

* ``student_chunk_id[b, i]`` (int64 ``[B, T_s]``): the chunk student token ``i`` belongs to, -1
  for tokens in no chunk (prepended BOS, control tokens, padding, chunks past ``max_chunks``);
  ``teacher_chunk_id[b, j]`` likewise (``[B, T_t]``);
* ``chunk_valid[b, c]`` (bool ``[B, C]``): slot ``c`` holds a chunk with at least one token on
  each side, all of them inside the padded widths (a chunk cut by truncation is not valid);
* ``chunk_exact[b, c]``: valid and exact (same canonical text on both sides);
* ``student_span`` / ``teacher_span`` (int64 ``[B, C, 2]``): the chunk's token span ``[start,
  end)`` in packed positions (offset included), ``[-1, -1]`` for empty slots.

Positions are token positions; the logits that *predict* a chunk's tokens sit one to the left
(DESIGN.md, "Next-token shift"): :func:`predicting_chunk_id` gives that view.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .chunks import Alignment

__all__ = ["pack_alignments", "predicting_chunk_id"]

ChunkLike = Alignment | np.ndarray | Sequence[Sequence[int]]


def _per_sample(value: int | Sequence[int] | None, batch: int, what: str) -> np.ndarray | None:
    if value is None:
        return None
    arr = np.asarray(value, dtype=np.int64)
    if arr.ndim == 0:
        arr = np.full(batch, int(arr), np.int64)
    if arr.shape != (batch,):
        raise ValueError(f"{what} must be an int or one value per sample ({batch}), got {arr.shape}")
    if (arr < 0).any():
        raise ValueError(f"{what} must be >= 0, got {arr.tolist()}")
    return arr


def _as_array(chunks: ChunkLike, k: int) -> np.ndarray:
    if isinstance(chunks, Alignment):
        return chunks.chunks_array
    arr = np.asarray(chunks, dtype=np.int64)
    if arr.size == 0:
        return np.zeros((0, 5), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise ValueError(
            f"chunks of sample {k} must be (s_start, s_end, t_start, t_end, exact) rows, "
            f"got shape {arr.shape}"
        )
    return arr


def _token_ids(width: int, start: np.ndarray, end: np.ndarray, row: np.ndarray,
               slot: np.ndarray, batch: int) -> np.ndarray:
    """Chunk slot per token position: ``[batch, width]``, -1 outside every span."""
    out = np.full((batch, width), -1, np.int64)
    lo = np.minimum(start, width)
    hi = np.minimum(end, width)
    lens = np.maximum(hi - lo, 0)
    total = int(lens.sum())
    if total:
        first = np.repeat(np.cumsum(lens) - lens, lens)
        pos = np.repeat(lo, lens) + (np.arange(total) - first)
        out[np.repeat(row, lens), pos] = np.repeat(slot, lens)
    return out


def pack_alignments(
    chunks: Sequence[ChunkLike],
    student_lengths: int | Sequence[int] | None = None,
    teacher_lengths: int | Sequence[int] | None = None,
    *,
    student_offset: int | Sequence[int] = 0,
    teacher_offset: int | Sequence[int] = 0,
    student_width: int | None = None,
    teacher_width: int | None = None,
    max_chunks: int | None = None,
    device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Pack per-sample chunk lists into padded tensors (see the module docstring).

    ``chunks[b]``: an :class:`Alignment`, an int array ``[C, 5]`` or a list of
    ``(s_start, s_end, t_start, t_end, exact)``. ``*_lengths``: ids per sample on that side
    (default: the Alignment's ids, else the last span end). ``*_offset``: tokens put in front of
    that side's ids (e.g. 1 for a prepended BOS): they belong to no chunk and shift every span.
    ``*_width``: padded sequence length (default: longest ``offset + length``); tokens past it
    are cut and chunks reaching past it become invalid. ``max_chunks``: chunk slots (default: the
    most chunks in a sample); later chunks are dropped.
    """
    batch = len(chunks)
    arrays = [_as_array(c, k) for k, c in enumerate(chunks)]
    s_off = _per_sample(student_offset, batch, "student_offset")
    t_off = _per_sample(teacher_offset, batch, "teacher_offset")
    s_len = _per_sample(student_lengths, batch, "student_lengths")
    t_len = _per_sample(teacher_lengths, batch, "teacher_lengths")
    if s_len is None:
        s_len = np.array([len(c.student_ids) if isinstance(c, Alignment)
                          else (int(a[:, 1].max()) if len(a) else 0)
                          for c, a in zip(chunks, arrays)], np.int64)
    if t_len is None:
        t_len = np.array([len(c.teacher_ids) if isinstance(c, Alignment)
                          else (int(a[:, 3].max()) if len(a) else 0)
                          for c, a in zip(chunks, arrays)], np.int64)
    for k, a in enumerate(arrays):
        if len(a) and (a[:, 1].max() > s_len[k] or a[:, 3].max() > t_len[k] or a[:, :4].min() < 0):
            raise ValueError(
                f"chunks of sample {k} reach past its lengths (student {s_len[k]}, teacher "
                f"{t_len[k]}) or hold negative positions"
            )
    n_chunks = np.array([len(a) for a in arrays], np.int64)
    cap = int(n_chunks.max(initial=0)) if max_chunks is None else int(max_chunks)
    if cap < 0:
        raise ValueError(f"max_chunks must be >= 0, got {max_chunks}")
    s_w = int((s_off + s_len).max(initial=0)) if student_width is None else int(student_width)
    t_w = int((t_off + t_len).max(initial=0)) if teacher_width is None else int(teacher_width)

    kept = [a[:cap] for a in arrays]
    flat = np.concatenate(kept) if kept else np.zeros((0, 5), np.int64)
    counts = np.array([len(a) for a in kept], np.int64)
    row = np.repeat(np.arange(batch), counts)
    slot = np.arange(len(flat)) - np.repeat(np.cumsum(counts) - counts, counts)
    ss = flat[:, 0] + s_off[row]
    se = flat[:, 1] + s_off[row]
    ts = flat[:, 2] + t_off[row]
    te = flat[:, 3] + t_off[row]

    valid = (se > ss) & (te > ts) & (se <= s_w) & (te <= t_w)
    chunk_valid = np.zeros((batch, cap), np.bool_)
    chunk_exact = np.zeros((batch, cap), np.bool_)
    chunk_valid[row, slot] = valid
    chunk_exact[row, slot] = valid & (flat[:, 4] != 0)
    s_span = np.full((batch, cap, 2), -1, np.int64)
    t_span = np.full((batch, cap, 2), -1, np.int64)
    s_span[row, slot] = np.stack([ss, se], 1)
    t_span[row, slot] = np.stack([ts, te], 1)

    out = {
        "student_chunk_id": _token_ids(s_w, ss, se, row, slot, batch),
        "teacher_chunk_id": _token_ids(t_w, ts, te, row, slot, batch),
        "chunk_valid": chunk_valid,
        "chunk_exact": chunk_exact,
        "student_span": s_span,
        "teacher_span": t_span,
    }
    return {k: torch.from_numpy(v).to(device) if device is not None else torch.from_numpy(v)
            for k, v in out.items()}


def predicting_chunk_id(chunk_id: torch.Tensor) -> torch.Tensor:
    """Chunk predicted by each position's logits: ``out[:, i] = chunk_id[:, i + 1]`` (last: -1).

    Position ``i`` predicts token ``i + 1``, so a chunk with span ``[a, b)`` gets the predicting
    positions ``a - 1 .. b - 2`` (with a prepended BOS the first chunk uses the BOS position).
    Apply it to the *full* sequence, then slice for a CP rank: that carries the shift across CP
    boundaries. The loss takes chunk ids in this view.
    """
    out = torch.full_like(chunk_id, -1)
    out[..., :-1] = chunk_id[..., 1:]
    return out
