"""Coverage of an alignment: how much of the text, and of each side's tokens, is in exact chunks."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from .canonical import TokenTable
from .chunks import Alignment
from .sides import make_side

__all__ = ["CoverageStats", "size_bucket"]


def size_bucket(n: int) -> str:
    """Histogram bucket of a chunk side with ``n`` tokens: 0..4 or "5+"."""
    return str(n) if n <= 4 else "5+"


def _exact_chars(al: Alignment, table: TokenTable, strip: bool) -> int:
    """Characters of text in exact chunks, counted on the student side's canonical bytes."""
    ex = al.chunks_array[al.chunks_array[:, 4] != 0] if len(al.chunks_array) else None
    if ex is None or not len(ex):
        return 0
    side = make_side(al.student_ids, table, None, strip)
    starts_char = np.concatenate(
        [[0], np.cumsum((side.stream & 0xC0) != 0x80, dtype=np.int64)]
    )[side.starts]
    lo = np.searchsorted(side.index, ex[:, 0])
    hi = np.searchsorted(side.index, ex[:, 1])
    return int((starts_char[hi] - starts_char[lo]).sum())


@dataclass
class CoverageStats:
    """Running totals over documents (``add`` one alignment at a time)."""

    docs: int = 0
    chars: int = 0
    exact_chars: int = 0
    student_tokens: int = 0
    teacher_tokens: int = 0
    exact_student_tokens: int = 0
    exact_teacher_tokens: int = 0
    chunks: int = 0
    exact_chunks: int = 0
    sizes: Counter = field(default_factory=Counter)

    def add(self, text: str, al: Alignment, student_table: TokenTable) -> None:
        """Count one aligned document (``student_table``: the student tokenizer's table)."""
        ch = al.chunks_array
        self.docs += 1
        self.chars += len(text)
        self.student_tokens += len(al.student_ids)
        self.teacher_tokens += len(al.teacher_ids)
        if not len(ch):
            return
        ns = ch[:, 1] - ch[:, 0]
        nt = ch[:, 3] - ch[:, 2]
        exact = ch[:, 4] != 0
        self.chunks += len(ch)
        self.exact_chunks += int(exact.sum())
        self.exact_student_tokens += int(ns[exact].sum())
        self.exact_teacher_tokens += int(nt[exact].sum())
        self.exact_chars += _exact_chars(al, student_table, student_table.strips_prefix(text))
        pairs, counts = np.unique(np.stack([np.minimum(ns, 5), np.minimum(nt, 5)], 1), axis=0,
                                  return_counts=True)
        for (a, b), k in zip(pairs.tolist(), counts.tolist()):
            self.sizes[f"{size_bucket(a)}:{size_bucket(b)}"] += k

    @property
    def char_coverage(self) -> float:
        """Share of characters inside exact chunks (1.0 for no text)."""
        return self.exact_chars / self.chars if self.chars else 1.0

    @property
    def student_token_coverage(self) -> float:
        """Share of student tokens inside exact chunks."""
        return self.exact_student_tokens / self.student_tokens if self.student_tokens else 1.0

    @property
    def teacher_token_coverage(self) -> float:
        """Share of teacher tokens inside exact chunks."""
        return self.exact_teacher_tokens / self.teacher_tokens if self.teacher_tokens else 1.0
