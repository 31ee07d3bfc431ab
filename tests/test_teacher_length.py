"""The teacher's sequence length derived from the data (real tokenizers and corpora)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.data.lengths import teacher_length_from_data, window_ratios

pytestmark = needs_shared_assets


def _aligner(student: str, teacher: str):
    from megatron_xdistill.align import TokenAligner, load_tokenizer

    tok = ASSETS / "tokenizers"
    return TokenAligner(load_tokenizer(str(tok / student)), load_tokenizer(str(tok / teacher)))


def _docs(name: str, n: int = 40) -> list[str]:
    lines = (ASSETS / "corpora" / name).read_text().splitlines()
    return [json.loads(x)["text"][:20000] for x in lines[:n]]


@pytest.mark.parametrize("pair", [("smollm2", "qwen2"), ("mistral", "smollm2"),
                                  ("smollm2", "gemma3")])
def test_windows_count_the_same_text_on_both_sides(pair):
    """Each window's teacher count is the teacher tokenisation of the window's characters (an
    independent count: tokenise the window's text alone)."""
    aligner = _aligner(*pair)
    docs = _docs("enwiki_val.jsonl", 3)
    ratios = window_ratios(docs, aligner, 127)
    _, s_enc, t_enc = aligner.encode_texts(docs[:1])
    s_off = np.asarray(s_enc[0][1]).reshape(-1, 2)
    text = docs[0][s_off[0, 0]: s_off[127, 1]]
    _, s_alone, t_alone = aligner.encode_texts([text])
    # tokenising a cut piece can move a token at either end: within 2 tokens
    assert abs(ratios[0] * 128 - len(t_alone[0][0])) <= 2
    assert len(s_alone[0][0]) == pytest.approx(128, abs=2)


@pytest.mark.parametrize("pair,corpus", [(("smollm2", "qwen2"), "enwiki_train.jsonl"),
                                         (("mistral", "smollm2"), "shakespeare.jsonl"),
                                         (("smollm2", "gemma3"), "enwiki_train.jsonl")])
def test_derived_length_pads_at_most_ten_percent(pair, corpus):
    """On the shared corpora the derived teacher sample is at least 90% real tokens on average
    (2 x --seq-length, the old default, was about half padding), and covers the student's
    text in nearly every window."""
    aligner = _aligner(*pair)
    docs = _docs(corpus)
    choice = teacher_length_from_data(docs, aligner, 255, multiple=8)
    ratios = window_ratios(docs, aligner, 255)
    assert choice.teacher_seq_length % 8 == 0
    covered = np.mean(ratios * 256 <= choice.teacher_seq_length + 1)
    assert covered >= 0.97
    assert choice.expected_fill >= 0.90, choice.describe()
    assert np.mean(np.minimum(ratios * 256, 511) / 511) < 0.7  # what 2 x 255 gave
    assert "teacher sequence length" in choice.describe()
