"""The teacher's sequence length from the data: as long as the student's text needs.

The teacher sample must hold the text of a full student sample (a teacher micro-batch then runs
only the positions its longest sample needs: ``parallel.teacher_batches``). The two tokenizers'
ratio on that text varies with the text: :func:`teacher_length_from_data` tokenises a spread
sample of the documents with both tokenizers, cuts the student side into windows of one sample
(``seq_length + 1`` tokens), counts the teacher tokens of the same characters, and takes a high
quantile of the per-window ratio. Windows whose ratio is above it (a few percent) get a
teacher-bound sample whose rest of the text moves to the next sample: no text is dropped, the
student sample of those few has some padding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthChoice:
    """The derived teacher length and what it was derived from."""

    teacher_seq_length: int
    windows: int
    median_ratio: float
    quantile_ratio: float
    quantile: float
    expected_fill: float  # mean real-token share of the teacher sample (1 - padding)

    def describe(self) -> str:
        return (f"teacher sequence length {self.teacher_seq_length} from the data: teacher / "
                f"student tokens per window median {self.median_ratio:.3f}, "
                f"{100 * self.quantile:.0f}th percentile {self.quantile_ratio:.3f} over "
                f"{self.windows} windows; {100 * self.expected_fill:.1f}% of it is text on "
                f"average (a teacher micro-batch runs as many positions as its longest text "
                f"needs; pass --teacher-seq-length to choose the length yourself)")


def _spread(count: int, limit: int) -> list[int]:
    """Up to ``limit`` indices spread evenly over ``range(count)`` (deterministic)."""
    if count <= limit:
        return list(range(count))
    return sorted({int(i * count / limit) for i in range(limit)})


def window_ratios(documents: Sequence[str], aligner, seq_length: int, max_docs: int = 256,
                  max_chars: int = 50_000) -> np.ndarray:
    """Teacher / student token counts of windows of ``seq_length + 1`` student tokens, over up
    to ``max_docs`` documents spread through the corpus (each cut to ``max_chars``)."""
    picked = [documents[i][:max_chars] for i in _spread(len(documents), max_docs)]
    texts = [t for t in picked if t.strip()]
    if not texts:
        raise ValueError("the data files hold no text to measure the tokenizers' ratio on")
    clean, s_enc, t_enc = aligner.encode_texts(texts)
    width = seq_length + 1
    ratios = []
    for (s_ids, s_off), (t_ids, t_off) in zip(s_enc, t_enc, strict=True):
        if len(s_ids) == 0 or len(t_ids) == 0:
            continue
        t_ends = np.asarray(t_off, dtype=np.int64).reshape(-1, 2)[:, 1]
        s_off = np.asarray(s_off, dtype=np.int64).reshape(-1, 2)
        for start in range(0, len(s_ids), width):
            stop = min(start + width, len(s_ids))
            if stop - start < width // 2 and start:  # a short tail window says little
                continue
            lo, hi = s_off[start, 0], s_off[stop - 1, 1]
            n_t = int(np.searchsorted(t_ends, hi, side="right")
                      - np.searchsorted(t_ends, lo, side="right"))
            ratios.append(max(n_t, 1) / (stop - start))
    if not ratios:
        raise ValueError("the data's documents produced no tokens to measure the ratio on")
    return np.asarray(ratios)


def teacher_length_from_data(documents: Sequence[str], aligner, seq_length: int,
                             multiple: int = 1, quantile: float = 0.98) -> LengthChoice:
    """The teacher sequence length for ``seq_length`` student tokens: the ``quantile`` of the
    per-window token ratio times the student sample, rounded up to ``multiple`` (what the
    teacher's context / sequence parallelism needs)."""
    ratios = window_ratios(documents, aligner, seq_length)
    high = float(np.quantile(ratios, quantile))
    tokens = math.ceil(high * (seq_length + 1))  # the teacher sample holds length + 1 tokens
    length = max(tokens - 1, (seq_length + 1) // 2, 1)
    length = -(-length // multiple) * multiple
    fill = float(np.minimum(ratios * (seq_length + 1), length + 1).mean() / (length + 1))
    return LengthChoice(length, len(ratios), float(np.median(ratios)), high, quantile, fill)
