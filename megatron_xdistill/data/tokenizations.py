"""One student tokenizer and K teacher tokenizers: tokenise a text once per tokenizer, align it
once per cross-tokenizer teacher.

A teacher whose vocabulary is the student's (same vocabulary hash) is a *same-tokenizer* teacher:
its tokens of a text are the student's, so it needs no alignment and constrains no packing cut.
Every other teacher is a *cross-tokenizer* teacher with its own :class:`TokenAligner`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_xdistill.align.api import TokenAligner, check_texts
from megatron_xdistill.align.chunks import Alignment
from megatron_xdistill.projection.vocab import vocab_hash

Encoding = tuple[np.ndarray, np.ndarray]  # token ids [n], character offsets [n, 2]


class SampleTokenizers:
    """The student's tokenizer and each teacher's, ready to tokenise a text once per tokenizer
    and align it per cross-tokenizer teacher. Pickles (DataLoader workers)."""

    def __init__(self, student_tokenizer: Any, teacher_tokenizers: Sequence[Any]) -> None:
        if not len(teacher_tokenizers):
            raise ValueError("at least one teacher tokenizer is needed")
        self.student_tokenizer = student_tokenizer
        self.teacher_tokenizers = list(teacher_tokenizers)
        student_hash = vocab_hash(student_tokenizer)
        self.same_tokenizer = [vocab_hash(t) == student_hash for t in self.teacher_tokenizers]
        self.aligners: list[TokenAligner | None] = [
            None if same else TokenAligner(student_tokenizer, t)
            for t, same in zip(self.teacher_tokenizers, self.same_tokenizer, strict=True)]

    @property
    def num_teachers(self) -> int:
        return len(self.teacher_tokenizers)

    @property
    def cross_teachers(self) -> list[int]:
        """Indices of the cross-tokenizer teachers, in order."""
        return [k for k, same in enumerate(self.same_tokenizer) if not same]

    def check_lengths(self, seq_length: int, teacher_seq_lengths: Sequence[int]) -> list[int]:
        """One sequence length per teacher, a same-tokenizer teacher's equal to the student's
        (its tokens are the student's); as a list."""
        lengths = [int(n) for n in teacher_seq_lengths]
        if len(lengths) != self.num_teachers:
            raise ValueError(f"{len(lengths)} teacher sequence lengths for "
                             f"{self.num_teachers} teachers")
        for k, (n, same) in enumerate(zip(lengths, self.same_tokenizer, strict=True)):
            if same and n != seq_length:
                raise ValueError(f"teacher {k} uses the student's tokenizer, so its sequence "
                                 f"length must be the student's {seq_length}, got {n}")
        return lengths

    def encode(self, texts: Sequence[str | bytes]) -> tuple[list[str], list[Encoding],
                                                             list[list[Encoding] | None]]:
        """Checked texts, the student's encoding of each, and per teacher its encodings (None
        for a same-tokenizer teacher). No special tokens are added."""
        clean = check_texts(texts)
        student = TokenAligner._encode(self.student_tokenizer, clean)
        teachers = [None if al is None else al.encode_teacher(clean) for al in self.aligners]
        return clean, student, teachers

    def align(self, texts: Sequence[str], student: Sequence[Encoding],
              teachers: Sequence[Sequence[Encoding] | None]) -> list[list[Alignment] | None]:
        """Per teacher the alignment of each text (None for a same-tokenizer teacher)."""
        return [None if al is None else al.align_encoded(texts, student, enc)
                for al, enc in zip(self.aligners, teachers, strict=True)]

    def encode_align(self, texts: Sequence[str | bytes]) -> tuple[list[str], list[Encoding],
                                                                   list[list[Alignment] | None]]:
        """Checked texts, the student's encoding of each (once, shared by every teacher), and
        per teacher the alignments (None for a same-tokenizer teacher)."""
        clean, student, teachers = self.encode(texts)
        return clean, student, self.align(clean, student, teachers)
