"""First-token heads: each teacher token mapped to the teacher twin of the student token that
begins its text.

At a chunk start both models predict what the next text begins with. The teacher puts mass on
tokens the student spells in pieces (teacher ``'    def'``, student ``'   '`` + ``' def'``);
for the student's next-token distribution that mass belongs to the piece it predicts first
(``'   '``). ``heads[t]`` is the teacher token whose text is that first student token's text
(its *twin*), so moving the teacher's mass from t to ``heads[t]`` puts it where W sends the
student's first piece (exact rows are one-hot on the twin). Tokens that keep their place:
those whose first student token has no teacher twin, special tokens and texts that are not
whole UTF-8 (byte pieces). Every head is its own head, so the map is idempotent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..align.canonical import token_bytes_table
from .exact import canonical_ids
from .reencode import Reencoder


def first_token_heads(student_tokenizer: Any, teacher_tokenizer: Any,
                      teacher_vocab_size: int | None = None) -> np.ndarray:
    """``heads`` int64 [V_t]: the teacher id each teacher id's mass moves to (itself when it
    stays). ``teacher_vocab_size``: the model's (padded) vocabulary, >= the tokenizer's; the
    ids past the tokenizer's stay."""
    teacher = list(token_bytes_table(teacher_tokenizer))
    student = list(token_bytes_table(student_tokenizer))
    size = max(len(teacher), teacher_vocab_size or 0)
    heads = np.arange(size, dtype=np.int64)
    twin_of_text = canonical_ids(teacher, Reencoder(teacher_tokenizer))
    ids, texts = [], []
    for t, data in enumerate(teacher):
        if not data:
            continue
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue  # a byte piece: no student tokenization of its own
        ids.append(t)
    for t, pieces in zip(ids, Reencoder(student_tokenizer).encode(texts)):
        if not pieces:
            continue
        first = student[pieces[0]] if pieces[0] < len(student) else None
        twin = twin_of_text.get(first) if first else None
        if twin is not None:
            heads[t] = twin
    targets = np.unique(heads[heads != np.arange(size)])
    heads[targets] = targets  # a head keeps its own mass: heads[heads] == heads
    return heads
