"""Canonical tables and both aligners on the real shared tokenizers and corpora."""

from __future__ import annotations

import itertools
import json
import time
import unicodedata

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.align import (
    TokenAligner,
    align_ids,
    load_tokenizer,
    pack_alignments,
    token_bytes_table,
    token_table,
)
from megatron_xdistill.align.chunks import check_partition
from megatron_xdistill.align.coverage import CoverageStats

NAMES = ["smollm2", "qwen2", "gemma3", "llama3", "gpt2", "mistral"]
PAIRS = list(itertools.combinations(NAMES, 2))
CORPORA = ["enwiki_train", "enwiki_val", "shakespeare"]

pytestmark = needs_shared_assets

TRICKY = [
    "Hello world",
    " leading space and  double  spaces\n\nnew\tlines\r\n",
    "Héllo wörld — naïve café, Ærøskøbing; Ελληνικά; Русский; עברית",
    "你好，世界。日本語のテキスト。한국어 텍스트",
    "emoji 🤖🚀👩‍👩‍👧 flags 🇫🇷 and ⟨math⟩ ∑∫√ ≤ ≥",
    "digits 1234567890 3.14159 1,000,000 and ============ ---- ...",
    "code: def f(x):\n    return x**2  # comment\n\t\tindent",
    "\n starts with newline",
    "x",
]
SPECIAL_TEXT = "special tokens as text: <|endoftext|> <s> </s> <bos> <|im_start|>user"


@pytest.fixture(scope="module")
def toks() -> dict:
    return {n: load_tokenizer(ASSETS / "tokenizers" / n) for n in NAMES}


@pytest.fixture(scope="module")
def aligners(toks) -> dict:
    return {(s, t): TokenAligner(toks[s], toks[t]) for s, t in PAIRS}


def _corpus_head(name: str, limit: int) -> list[str]:
    """Documents of a corpus, cut to ``limit`` characters in total (all if ``limit`` is 0)."""
    out, used = [], 0
    with open(ASSETS / "corpora" / f"{name}.jsonl", encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            if limit:
                text = text[: limit - used]
            out.append(text)
            used += len(text)
            if limit and used >= limit:
                break
    return out


# -- canonical tables ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_table_covers_vocab_and_marks_specials(toks, name) -> None:
    tok = toks[name]
    table = token_bytes_table(tok)
    assert len(table) >= len(tok)
    for tid in tok.all_special_ids:
        assert table[tid] is None, tok.convert_ids_to_tokens(tid)
    assert token_bytes_table(tok) is table  # cached
    tab = token_table(tok)
    space = tok(" x", add_special_tokens=False)["input_ids"]
    assert b"".join(table[i] for i in space).endswith(b" x")
    newline = tok("a\nb", add_special_tokens=False)["input_ids"]
    assert b"\n" in b"".join(table[i] for i in newline)
    assert tab.kind == ("sentencepiece" if name in ("gemma3", "mistral") else "byte_level")
    assert tab.prefix_space == (name == "mistral")


def test_table_markers() -> None:
    from megatron_xdistill.align.canonical import byte_level_alphabet

    alpha = byte_level_alphabet()
    assert len(alpha) == 256 and sorted(alpha.values()) == list(range(256))
    assert alpha["Ġ"] == 32 and alpha["Ċ"] == 10 and alpha["A"] == 65


def test_table_byte_fallback_and_sp_space(toks) -> None:
    for name in ("gemma3", "mistral"):
        tok = toks[name]
        table = token_bytes_table(tok)
        assert table[tok.convert_tokens_to_ids("<0x0A>")] == b"\n"
        assert table[tok.convert_tokens_to_ids("<0xF0>")] == b"\xf0"
        assert table[tok.convert_tokens_to_ids("▁the")] == b" the"


def test_big_vocab_table_is_fast(toks) -> None:
    from megatron_xdistill.align.canonical import _build

    t0 = time.perf_counter()
    tab = _build(toks["gemma3"])
    assert tab.vocab_size == 262144
    assert time.perf_counter() - t0 < 20.0


@pytest.mark.parametrize("name", NAMES)
def test_table_concatenation_spells_text(toks, name) -> None:
    """Canonical bytes of the ids of a text are the text (NFC for qwen, prefix space removed)."""
    tok = toks[name]
    tab = token_table(tok)
    for text in TRICKY + _corpus_head("enwiki_val", 5000):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        got = b"".join(tab.table[i] for i in ids)
        if tab.strips_prefix(text) and got.startswith(b" "):
            got = got[1:]
        want = unicodedata.normalize("NFC", text) if name == "qwen2" else text
        assert got == want.encode("utf-8"), text[:40]


@pytest.mark.parametrize("name", NAMES)
def test_backend_encoding_matches_hf_call(toks, name) -> None:
    tok = toks[name]
    texts = TRICKY[:4]
    _, enc, _ = TokenAligner(tok, tok).encode_texts(texts)
    for text, (ids, offs) in zip(texts, enc):
        hf = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert ids.tolist() == hf["input_ids"]
        assert offs.tolist() == [list(o) for o in hf["offset_mapping"]]


# -- both aligners -------------------------------------------------------------------------------
def _check(al, aligner, text: str) -> None:
    """Partition, exactness and agreement with the text and with HF decode."""
    check_partition(al.chunks_array, len(al.student_ids), len(al.teacher_ids))
    covered_s = np.zeros(len(al.student_ids), bool)
    covered_t = np.zeros(len(al.teacher_ids), bool)
    for a, b, p, q, _ in al.chunks:
        covered_s[a:b] = True
        covered_t[p:q] = True
    # Every token is in a chunk except control tokens (here: special tokens written in the text).
    control_s = aligner.student_table.special[al.student_ids] & (
        al.student_ids != aligner.student_table.unk_id)
    control_t = aligner.teacher_table.special[al.teacher_ids] & (
        al.teacher_ids != aligner.teacher_table.unk_id)
    assert (covered_s | control_s).all() and (covered_t | control_t).all()
    s_tab, t_tab = aligner.student_table, aligner.teacher_table
    for a, b, p, q, ex in al.chunks:
        s_bytes = [s_tab.table[i] for i in al.student_ids[a:b].tolist()]
        t_bytes = [t_tab.table[i] for i in al.teacher_ids[p:q].tolist()]
        if a == 0 and s_tab.strips_prefix(text) and s_bytes and s_bytes[0]:
            s_bytes[0] = s_bytes[0].removeprefix(b" ")
        if p == 0 and t_tab.strips_prefix(text) and t_bytes and t_bytes[0]:
            t_bytes[0] = t_bytes[0].removeprefix(b" ")
        same = None not in s_bytes and None not in t_bytes and b"".join(s_bytes) == b"".join(t_bytes)
        assert ex == (same and b > a and q > p)
        if ex:  # exact chunks decode to the same text with both tokenizers
            s_txt = _decode(aligner.student_tokenizer, al.student_ids[a:b])
            t_txt = _decode(aligner.teacher_tokenizer, al.teacher_ids[p:q])
            assert s_txt.lstrip(" ") == t_txt.lstrip(" ")
            assert b"".join(s_bytes).decode("utf-8").lstrip(" ") == s_txt.lstrip(" ")


def _decode(tok, ids) -> str:
    return tok.decode(ids.tolist(), clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{s}-{t}" for s, t in PAIRS])
def test_paths_agree_on_tricky_texts(aligners, pair) -> None:
    aligner = aligners[pair]
    texts = [*TRICKY, SPECIAL_TEXT, *_corpus_head("shakespeare", 3000)]
    fast = aligner.align_texts(texts)
    slow = aligner.align_texts(texts, method="dp")
    for text, x, y in zip(texts, fast, slow):
        _check(x, aligner, text)
        assert np.array_equal(x.chunks_array, y.chunks_array), text[:40]
        direct = aligner.align_ids(x.student_ids, x.teacher_ids,
                                   student_prefix_space=aligner.student_table.strips_prefix(text),
                                   teacher_prefix_space=aligner.teacher_table.strips_prefix(text))
        assert np.array_equal(direct.chunks_array, x.chunks_array)
    packed_fast = pack_alignments(fast)
    packed_slow = pack_alignments(slow)
    for key in packed_fast:
        assert packed_fast[key].equal(packed_slow[key]), key


_TEXT = st.text(
    alphabet=st.one_of(
        st.sampled_from(list(" \n\t.,;'-0123456789aeiouxyzAEZéüßñçøæ—…€你好世界日本🤖🚀")),
        st.characters(codec="utf-8"),
    ),
    max_size=60,
)


@given(text=_TEXT, pair=st.sampled_from(PAIRS))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_property_partition_exactness_and_agreement(aligners, text, pair) -> None:
    aligner = aligners[pair]
    fast = aligner.align_text(text)
    _check(fast, aligner, text)
    slow = aligner.align_text(text, method="dp")
    assert np.array_equal(fast.chunks_array, slow.chunks_array)


# -- ids without text, bad input -----------------------------------------------------------------
def test_dp_handles_control_tokens_and_odd_tokenisation(toks) -> None:
    s, t = toks["gemma3"], toks["smollm2"]
    text = "The quick brown fox jumps over the lazy dog."
    s_ids = [s.bos_token_id] + s(text, add_special_tokens=False)["input_ids"] + [s.eos_token_id]
    # A non-canonical teacher tokenisation (as a model may generate): one piece per character.
    t_ids = [t.convert_tokens_to_ids(t.convert_ids_to_tokens(t(c, add_special_tokens=False)
                                                             ["input_ids"])[0]) for c in text]
    al = align_ids(s_ids, t_ids, s, t)
    check_partition(al.chunks_array, len(s_ids), len(t_ids))
    assert al.chunks[0][0] == 1 and al.chunks[-1][1] == len(s_ids) - 1  # BOS/EOS in no chunk
    assert all(ex for *_, ex in al.chunks)
    assert sum(q - p for _, _, p, q, _ in al.chunks) == len(text)
    packed = pack_alignments([al])
    assert packed["student_chunk_id"][0, 0] == -1 and packed["student_chunk_id"][0, -1] == -1


def test_dp_resyncs_after_corruption_in_near_linear_time(toks, aligners) -> None:
    aligner = aligners[("smollm2", "llama3")]
    text = " ".join(_corpus_head("enwiki_train", 200_000))
    al = aligner.align_text(text)
    rng = np.random.default_rng(0)
    s_ids = al.student_ids.copy()
    bad = rng.choice(len(s_ids), size=len(s_ids) // 200, replace=False)
    s_ids[bad] = rng.integers(1000, 40000, size=len(bad))
    t0 = time.perf_counter()
    dp = aligner.align_ids(s_ids, al.teacher_ids)
    elapsed = time.perf_counter() - t0
    check_partition(dp.chunks_array, len(s_ids), len(al.teacher_ids))
    exact_tokens = sum(b - a for a, b, _, _, ex in dp.chunks if ex)
    assert exact_tokens > 0.95 * len(s_ids)
    assert elapsed < 5.0, f"{len(s_ids)} tokens took {elapsed:.1f} s"


def test_out_of_range_and_unknown_ids_are_inexact(toks) -> None:
    s, t = toks["gpt2"], toks["llama3"]
    s_ids = s("hello brave new world", add_special_tokens=False)["input_ids"]
    t_ids = t("hello brave new world", add_special_tokens=False)["input_ids"]
    s_ids[1] = 10**9
    al = align_ids(s_ids, t_ids, s, t)
    check_partition(al.chunks_array, len(s_ids), len(t_ids))
    assert [ex for *_, ex in al.chunks] == [True, False, True, True]


def test_bad_inputs_raise_clear_errors(toks, aligners, tmp_path) -> None:
    aligner = aligners[("smollm2", "gemma3")]
    empty = aligner.align_text("")
    assert len(empty.student_ids) == 0 and empty.chunks == []
    assert pack_alignments([empty])["chunk_valid"].shape == (1, 0)
    with pytest.raises(ValueError, match="not valid UTF-8"):
        aligner.align_text(b"caf\xe9")
    assert aligner.align_text("café".encode()).num_exact >= 1
    with pytest.raises(ValueError, match="text #1.*surrogate"):
        aligner.align_texts(["fine", "bad \ud800 text"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="method"):
        aligner.align_text("x", method="magic")
    with pytest.raises(ValueError, match="1-D"):
        aligner.align_ids([[1, 2]], [1])


def test_nfd_text_aligns_inexactly_where_qwen_normalises(aligners) -> None:
    aligner = aligners[("smollm2", "qwen2")]
    text = "cafe\u0301 au lait"
    for method in ("offsets", "dp"):
        al = aligner.align_text(text, method=method)
        check_partition(al.chunks_array, len(al.student_ids), len(al.teacher_ids))
        assert [ex for *_, ex in al.chunks].count(False) == 1
        assert al.chunks[-1][4]


def _unk_tokenizer():
    """A small BPE tokenizer with no byte fallback: characters outside its alphabet are <unk>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"],
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz ."))
    tok.train_from_iterator(["the cat sat on the mat. a dog ate the hat."] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def test_unknown_tokens_give_inexact_chunks(toks) -> None:
    unk_tok = _unk_tokenizer()
    tab = token_table(unk_tok)
    assert tab.kind == "sentencepiece" and tab.unk_id == unk_tok.unk_token_id
    aligner = TokenAligner(unk_tok, toks["gpt2"])
    text = "the cat ate a Zebra. the dog sat"
    for method in ("offsets", "dp"):
        al = aligner.align_text(text, method=method)
        assert unk_tok.unk_token_id in al.student_ids.tolist()
        check_partition(al.chunks_array, len(al.student_ids), len(al.teacher_ids))
        flags = [ex for *_, ex in al.chunks]
        assert not all(flags) and flags[0] and flags[-1]


# -- coverage ------------------------------------------------------------------------------------
def _coverage_table(toks, limit: int) -> dict:
    table = {}
    for corpus in CORPORA:
        texts = _corpus_head(corpus, limit)
        for s, t in PAIRS:
            aligner = TokenAligner(toks[s], toks[t])
            cov = CoverageStats()
            for text, al in zip(texts, aligner.align_texts(texts)):
                cov.add(text, al, aligner.student_table)
            table[(corpus, s, t)] = cov
    print(f"\n{'corpus':14} {'student':8} {'teacher':8} {'chars%':>8} {'s_tok%':>8} {'t_tok%':>8}")
    for (corpus, s, t), cov in table.items():
        print(f"{corpus:14} {s:8} {t:8} {100 * cov.char_coverage:8.3f} "
              f"{100 * cov.student_token_coverage:8.3f} {100 * cov.teacher_token_coverage:8.3f}")
    return table


def test_coverage_every_pair_on_corpus_heads(toks) -> None:
    table = _coverage_table(toks, 20_000)
    low = {k: c.char_coverage for k, c in table.items() if c.char_coverage < 0.99}
    assert not low, low


@pytest.mark.slow
def test_coverage_every_pair_on_full_corpora(toks) -> None:
    table = _coverage_table(toks, 0)
    low = {k: c.char_coverage for k, c in table.items() if c.char_coverage < 0.99}
    assert not low, low


def test_anchors_are_ordered_unique_ngrams(aligners) -> None:
    from megatron_xdistill.align.dp_aligner import _anchors
    from megatron_xdistill.align.sides import make_side

    aligner = aligners[("gemma3", "llama3")]
    text = " ".join(_corpus_head("enwiki_val", 30_000))
    al = aligner.align_text(text)
    s = make_side(al.student_ids, aligner.student_table)
    t = make_side(al.teacher_ids, aligner.teacher_table)
    an_s, an_t = _anchors(s.starts, s.stream, s.n, t.starts, t.stream, t.n, 16)
    assert len(an_s) > len(al.chunks) // 4  # dense: most common boundaries are anchors
    assert (np.diff(an_s) > 0).all() and (np.diff(an_t) > 0).all()
    # On identical text every anchor is a common boundary at the same byte position.
    assert np.array_equal(s.starts[an_s], t.starts[an_t])


def test_aligner_pickles_for_dataloader_workers(aligners) -> None:
    import pickle

    aligner = aligners[("smollm2", "mistral")]
    clone = pickle.loads(pickle.dumps(aligner))
    a = aligner.align_text("Pickled for a worker.")
    b = clone.align_text("Pickled for a worker.")
    assert np.array_equal(a.chunks_array, b.chunks_array)
