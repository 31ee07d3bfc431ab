"""The aligner's chunks are the finest partition, on the real tokenizer pairs and corpora.

``check_partition`` accepts any ordered cover, so an aligner that merged two exact chunks into
one (a coarser, still exact, partition: a KD term over two tokens where two were possible) would
pass it. Here the finest partition is worked out from the tokenizers' own character offsets,
without the aligner: a side has a token boundary before its token ``k`` at every character ``c``
with every token before ``k`` ending at or before ``c`` and every token from ``k`` on starting
at or after it (an interval where no token covers the text; none where tokens share a character,
as byte pieces of one character do). An exact chunk must start and end where both sides have a
boundary at one character, and hold no such place inside it on both sides at once.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.align import TokenAligner, load_tokenizer

pytestmark = needs_shared_assets

PAIRS = [("smollm2", "qwen2"), ("smollm2", "gemma3"), ("llama3", "mistral"),
         ("gpt2", "gemma3"), ("qwen2", "mistral")]
CORPORA = {"enwiki_val": 12_000, "shakespeare": 12_000}


@cache
def _tok(name: str):
    return load_tokenizer(ASSETS / "tokenizers" / name)


def _texts() -> list[str]:
    """Whole documents from the head of each corpus, cut to its characters."""
    out = []
    for name, limit in CORPORA.items():
        used = 0
        with open(ASSETS / "corpora" / f"{name}.jsonl", encoding="utf-8") as f:
            for line in f:
                text = json.loads(line)["text"][: limit - used]
                out.append(text)
                used += len(text)
                if used >= limit:
                    break
    return out


def boundaries(tokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Per position ``k`` = 0..n of the tokenizer's ids of ``text``, the characters ``[lo, hi]``
    where the side has a boundary before token ``k`` (``lo > hi``: none), from its offsets."""
    offsets = np.asarray(tokenizer(text, add_special_tokens=False,
                                   return_offsets_mapping=True)["offset_mapping"],
                         dtype=np.int64).reshape(-1, 2)
    lo = np.concatenate([[0], np.maximum.accumulate(offsets[:, 1])])
    hi = np.concatenate([np.minimum.accumulate(offsets[::-1, 0])[::-1], [len(text)]])
    return lo, hi


def coarser_chunks(chunks: np.ndarray, s: tuple, t: tuple) -> list[tuple]:
    """The exact chunks that are not chunks of the finest partition: an end where the sides'
    boundaries do not meet, or a place inside where they do (the chunk cuts into two)."""
    (s_lo, s_hi), (t_lo, t_hi) = s, t

    def meet(k: int, j: int) -> bool:
        return max(s_lo[k], t_lo[j]) <= min(s_hi[k], t_hi[j])

    bad = []
    for a, b, p, q, exact in chunks.tolist():
        if not exact:
            continue
        if not (meet(a, p) and meet(b, q)) or any(
                meet(k, j) for k in range(a + 1, b) for j in range(p + 1, q)):
            bad.append((a, b, p, q))
    return bad


def test_a_merged_pair_of_exact_chunks_is_found():
    """The reference itself: two exact chunks of a real alignment merged into one are named."""
    student, teacher = _tok("smollm2"), _tok("gemma3")
    text = "The cat sat on the mat, and the dog sat on the log."
    chunks = TokenAligner(student, teacher).align_text(text).chunks_array
    s, t = boundaries(student, text), boundaries(teacher, text)
    assert coarser_chunks(chunks, s, t) == []
    merged = np.concatenate([[[chunks[0, 0], chunks[1, 1], chunks[0, 2], chunks[1, 3], 1]],
                             chunks[2:]])
    assert coarser_chunks(merged, s, t) == [tuple(merged[0, :4].tolist())]


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def test_exact_chunks_are_the_finest_partition_on_real_text(pair):
    """Both aligner paths (offsets, and the DP on canonical bytes) on the corpora's heads: no
    exact chunk could be cut into two exact chunks, and every one starts and ends where both
    tokenizations have a boundary at one character."""
    student, teacher = map(_tok, pair)
    aligner = TokenAligner(student, teacher)
    texts = _texts()
    checked = several = 0
    for method in ("offsets", "dp"):
        for text, al in zip(texts, aligner.align_texts(texts, method=method), strict=True):
            chunks = al.chunks_array
            s, t = boundaries(student, text), boundaries(teacher, text)
            assert len(s[0]) == len(al.student_ids) + 1 and len(t[0]) == len(al.teacher_ids) + 1
            bad = coarser_chunks(chunks, s, t)
            assert not bad, f"{method}: {len(bad)} exact chunks not the finest, first {bad[0]}: " \
                            f"{text[s[0][bad[0][0]]:s[0][bad[0][1]]]!r}"
            exact = chunks[chunks[:, 4] == 1]
            checked += len(exact)
            several += int(((exact[:, 1] - exact[:, 0] > 1) | (exact[:, 3] - exact[:, 2] > 1))
                           .sum())
    assert checked > 5000 and several > 100, (checked, several)  # chunks of several tokens too
