"""Exact builder: a student token whose canonical text equals a teacher token's maps one-hot to it.

Several ids of one vocabulary can spell the same bytes (SentencePiece byte fallback ``<0x0A>`` next
to ``\\n``, an added token repeating a vocab entry). Each such group gets one *canonical* id: the one
the tokenizer itself produces for that text (re-encoded as a single token), else the lowest id.
Exact matches target the teacher's canonical id; student ids that are not canonical for their text
are reported as aliases (``RowKind.EXACT_ALIAS``) so the gold loss pairs only the canonical one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .reencode import Reencoder


def canonical_ids(table: Sequence[bytes | None], reencoder: Reencoder) -> dict[bytes, int]:
    """Map each non-empty token text (bytes) of a vocabulary to its canonical id."""
    first: dict[bytes, int] = {}
    groups: dict[bytes, list[int]] = {}
    for i, b in enumerate(table):
        if not b:
            continue
        j = first.setdefault(b, i)
        if j != i:
            groups.setdefault(b, [j]).append(i)
    if groups:
        keys, texts = [], []
        for b in groups:
            try:
                texts.append(b.decode("utf-8"))
                keys.append(b)
            except UnicodeDecodeError:
                pass  # keeps the lowest id
        for b, ids in zip(keys, reencoder.encode(texts)):
            if len(ids) == 1 and ids[0] in groups[b]:
                first[b] = ids[0]
    return first


def exact_matches(
    student_table: Sequence[bytes | None], teacher_canonical: dict[bytes, int]
) -> np.ndarray:
    """Teacher id per student id whose text equals a teacher token's (-1 where none)."""
    out = np.full(len(student_table), -1, dtype=np.int64)
    for s, b in enumerate(student_table):
        if b:
            t = teacher_canonical.get(b)
            if t is not None:
                out[s] = t
    return out


def alias_mask(table: Sequence[bytes | None], canonical: dict[bytes, int]) -> np.ndarray:
    """True for ids whose text has another, canonical id in the same vocabulary."""
    out = np.zeros(len(table), dtype=bool)
    for i, b in enumerate(table):
        if b and canonical.get(b, i) != i:
            out[i] = True
    return out
