"""Multi-token builder and reverse pass: W entries from spelling texts across vocabularies.

Multi-token (student row s has no exact teacher match): spell s's text with teacher pieces
p_0 .. p_{n-1} (n <= ``max_pieces``, ``spelling``) and give piece i the weight ``decay**i``; rows are
normalised later, so the default ``decay=0.1`` gives the issue's 0.9 * 0.1^i up to normalisation
(2 pieces: 0.909, 0.091). The first piece dominates because at a position that predicts s, the
teacher predicts the first piece of s's text.

Reverse pass: spell every teacher token t with student pieces s_0 .. s_{m-1}; if m >= 2, student
s_0 starts t's text, so the student's mass on s_0 partly stands for t: add (s_0, t) with weight
``reverse_weight`` (relative to 1 for a first forward piece). Rows in ``blocked`` (exact or special
rows) get nothing, so exact rows stay one-hot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .reencode import Reencoder
from .spelling import VIA_NONE, BytesCover, Spelling, spell_all


def multi_token_entries(
    student_table: Sequence[bytes | None],
    rows: np.ndarray,
    teacher_table: Sequence[bytes | None],
    teacher_reencoder: Reencoder,
    teacher_cover: BytesCover,
    max_pieces: int = 4,
    decay: float = 0.1,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[Spelling]]:
    """COO entries (rows, cols, vals) for the given student rows, and each row's spelling."""
    sources = [student_table[int(s)] for s in rows]
    spellings = spell_all(
        sources, teacher_table, teacher_reencoder, teacher_cover, max_pieces, on_progress
    )
    out_r, out_c, out_v = [], [], []
    for s, sp in zip(rows, spellings):
        for i, t in enumerate(sp.pieces):
            out_r.append(int(s))
            out_c.append(t)
            out_v.append(decay**i)
    return (
        np.asarray(out_r, dtype=np.int64),
        np.asarray(out_c, dtype=np.int64),
        np.asarray(out_v, dtype=np.float64),
        spellings,
    )


def reverse_entries(
    teacher_table: Sequence[bytes | None],
    student_table: Sequence[bytes | None],
    student_reencoder: Reencoder,
    student_cover: BytesCover,
    blocked: np.ndarray,
    weight: float = 0.05,
    max_pieces: int = 4,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """COO entries (s_0, t, weight) from teacher tokens whose student spelling has >= 2 pieces."""
    cols = np.asarray([t for t, b in enumerate(teacher_table) if b], dtype=np.int64)
    sources = [teacher_table[int(t)] for t in cols]
    spellings = spell_all(
        sources, student_table, student_reencoder, student_cover, max_pieces, on_progress
    )
    first = np.asarray(
        [sp.pieces[0] if sp.via != VIA_NONE and len(sp.pieces) >= 2 else -1 for sp in spellings],
        dtype=np.int64,
    )
    keep = first >= 0
    keep[keep] = ~blocked[first[keep]]
    rows = first[keep]
    return rows, cols[keep], np.full(rows.shape, weight, dtype=np.float64)
