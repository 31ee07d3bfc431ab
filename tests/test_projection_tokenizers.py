"""Projection W built from the shared real tokenizers, the file checks, and the CLI.

Pairs (student -> teacher), both directions: qwen2/smollm2, gemma3/llama3, mistral/gpt2. Builds are
shared per module (about 15 s for all six on 2 cores, plus tokenizer loading).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from shared_assets import TOKENIZERS, needs_shared_assets

from megatron_xdistill.projection import (
    BuildOptions,
    ProjectionMismatchError,
    RowKind,
    build_projection,
    load_projection,
    save_projection,
)
from megatron_xdistill.projection.cli import main
from megatron_xdistill.projection.nemo_rl import write_nemo_rl

NAMES = ("qwen2", "smollm2", "gemma3", "llama3", "mistral", "gpt2")
PAIRS = [
    ("qwen2", "smollm2"),
    ("smollm2", "qwen2"),
    ("gemma3", "llama3"),
    ("llama3", "gemma3"),
    ("mistral", "gpt2"),
    ("gpt2", "mistral"),
]

pytestmark = needs_shared_assets


@pytest.fixture(scope="module")
def toks():
    from transformers import AutoTokenizer

    return {n: AutoTokenizer.from_pretrained(str(TOKENIZERS / n)) for n in NAMES}


@pytest.fixture(scope="module")
def tables(toks):
    from megatron_xdistill.align.canonical import token_bytes_table

    return {n: token_bytes_table(t) for n, t in toks.items()}


@pytest.fixture(scope="module")
def built(toks):
    cache = {}

    def get(student, teacher, **options):
        key = (student, teacher, tuple(sorted(options.items())))
        if key not in cache:
            cache[key] = build_projection(toks[student], toks[teacher], BuildOptions(**options))
        return cache[key]

    return get


def _segmentable(data: bytes, vocab: set[bytes], max_len: int) -> bool:
    """Can ``data`` be cut into pieces that are all teacher token texts? (word-break DP)"""
    ok = [False] * (len(data) + 1)
    ok[0] = True
    for i in range(1, len(data) + 1):
        ok[i] = any(ok[j] and data[j:i] in vocab for j in range(max(0, i - max_len), i))
    return ok[-1]


def _entries(matrix, s):
    idx, w = matrix.indices[s], matrix.weights[s]
    return [(int(t), float(x)) for t, x in zip(idx, w) if int(t) >= 0]


def _check_spelling(ent, text: bytes, t_tab, max_pieces: int = 4, decay: float = 0.1) -> bool:
    """Assert some sequence of the row's tokens spells ``text`` with the row's weights.

    The sequence p_0 .. p_{n-1} (n <= max_pieces, using every token of the row) must concatenate
    to ``text`` (or to a prefix of it when cut at max_pieces), and weights decay**i summed per
    token and normalised must equal the row's weights. Returns True when it spells all of it.
    """
    tokens = [t for t, _ in ent]
    want = dict(ent)
    for n in range(1, max_pieces + 1):
        for seq in itertools.product(tokens, repeat=n):
            if set(seq) != set(tokens):
                continue
            joined = b"".join(t_tab[t] for t in seq)
            if joined != text and not (n == max_pieces and text.startswith(joined)):
                continue
            got = dict.fromkeys(tokens, 0.0)
            for i, t in enumerate(seq):
                got[t] += decay**i
            total = sum(got.values())
            if all(abs(got[t] / total - want[t]) < 1e-5 for t in tokens):
                return joined == text
    raise AssertionError(f"row {ent} does not spell {text!r}")


# ----------------------------------------------------------------------------- builders


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_exact_rows_are_one_hot_and_complete(built, tables, student, teacher):
    m = built(student, teacher)
    s_tab, t_tab = tables[student], tables[teacher]
    kinds = m.row_kind.numpy()
    exact = np.flatnonzero((kinds == RowKind.EXACT) | (kinds == RowKind.EXACT_ALIAS))
    assert exact.size > 0.2 * len(s_tab)
    for s in exact:
        ((t, w),) = _entries(m, s)
        assert w == 1.0 and t_tab[t] == s_tab[s]
    teacher_texts = {b for b in t_tab if b}
    should = {s for s, b in enumerate(s_tab) if b and b in teacher_texts}
    assert should == set(exact.tolist())


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_every_spellable_text_token_has_a_row(built, tables, student, teacher):
    m = built(student, teacher)
    s_tab, t_tab = tables[student], tables[teacher]
    vocab = {b for b in t_tab if b}
    max_len = max(len(b) for b in vocab)
    empty = torch.nonzero((m.indices < 0).all(dim=1))[:, 0].tolist()
    unspellable = [s for s in empty if s_tab[s] is not None]
    for s in unspellable:  # only texts the teacher vocabulary cannot spell at all
        assert not _segmentable(s_tab[s], vocab, max_len), (s, s_tab[s])
    assert len(unspellable) <= 30
    sums = m.weights.sum(dim=1)
    nonempty = sums > 0
    assert torch.allclose(sums[nonempty], torch.ones_like(sums[nonempty]), atol=1e-5)


@pytest.mark.parametrize(("student", "teacher"), PAIRS)
def test_multi_token_rows_spell_the_student_token(built, tables, student, teacher):
    m = built(student, teacher)
    s_tab, t_tab = tables[student], tables[teacher]
    kinds = m.row_kind.numpy()
    rows = np.flatnonzero((kinds == RowKind.MULTI_TOKEN) | (kinds == RowKind.BYTES))
    assert rows.size > 0
    full = sum(_check_spelling(_entries(m, s), s_tab[s], t_tab) for s in rows)
    assert full > 0.8 * rows.size  # the rest need more than max_pieces=4 teacher pieces


@pytest.mark.parametrize("teacher", ["smollm2", "gemma3", "gpt2"])
def test_multi_token_rows_follow_the_teacher_tokenizer(built, toks, tables, teacher):
    student = {"smollm2": "qwen2", "gemma3": "llama3", "gpt2": "mistral"}[teacher]
    m = built(student, teacher)
    kinds = m.row_kind.numpy()
    rows = np.flatnonzero(kinds == RowKind.MULTI_TOKEN)
    rng = np.random.default_rng(0)
    checked = 0
    for s in rng.choice(rows, size=300, replace=False):
        text = tables[student][s].decode("utf-8")
        ids = toks[teacher](text, add_special_tokens=False)["input_ids"]
        if len(ids) < m.top_k and len(set(ids)) == len(ids):
            assert [t for t, _ in _entries(m, s)] == ids, (s, text)
            checked += 1
    assert checked > 100


def test_hand_checked_rows(built, toks):
    m = built("llama3", "gemma3")
    s = toks["llama3"].convert_tokens_to_ids("201")
    two, zero, one = (toks["gemma3"].convert_tokens_to_ids(c) for c in "201")
    ent = _entries(m, s)
    assert [t for t, _ in ent] == [two, zero, one]
    np.testing.assert_allclose([w for _, w in ent], [1 / 1.11, 0.1 / 1.11, 0.01 / 1.11], rtol=1e-5)
    m2 = built("qwen2", "smollm2")
    s = toks["qwen2"].convert_tokens_to_ids("Ġhello")
    assert _entries(m2, s) == [(toks["smollm2"].convert_tokens_to_ids("Ġhello"), 1.0)]


def test_partial_utf8_rows_use_teacher_bytes(built, tables):
    m = built("llama3", "gemma3")
    s_tab, t_tab = tables["llama3"], tables["gemma3"]
    kinds = m.row_kind.numpy()
    partial = []
    for s, b in enumerate(s_tab):
        if b:
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                partial.append(s)
    assert len(partial) > 1000
    for s in partial:
        assert kinds[s] in (RowKind.EXACT, RowKind.BYTES)
        if kinds[s] == RowKind.BYTES:
            _check_spelling(_entries(m, s), s_tab[s], t_tab)


def test_reverse_pass_and_special_tokens(built, toks, tables):
    base = built("gpt2", "mistral")
    m = built("gpt2", "mistral", reverse_pass=True, special_tokens=True)
    s_tab, t_tab = tables["gpt2"], tables["mistral"]
    kinds = m.row_kind.numpy()
    exact = (kinds == RowKind.EXACT) | (kinds == RowKind.EXACT_ALIAS)
    assert torch.equal(m.indices[exact], base.indices[exact])  # exact rows stay one-hot
    added = 0
    for s in np.flatnonzero(kinds == RowKind.MULTI_TOKEN):
        forward = {t for t, _ in _entries(base, s)}
        for t, _ in _entries(m, s):
            if t not in forward:  # a reverse entry: the teacher token starts with s's text
                assert t_tab[t].startswith(s_tab[s]), (s, t)
                added += 1
    assert added > 100  # few: most first pieces are exact rows, which take no reverse entries
    eos = toks["gpt2"].convert_tokens_to_ids("<|endoftext|>")
    assert _entries(m, eos) == [(toks["mistral"].convert_tokens_to_ids("</s>"), 1.0)]
    assert kinds[eos] == RowKind.SPECIAL


@pytest.mark.parametrize(("student", "teacher"), [("mistral", "gpt2"), ("gemma3", "llama3")])
def test_common_vocab_on_real_pairs(built, student, teacher):
    m = built(student, teacher)
    s_strict, t_strict = m.common_vocab("strict")
    s_x, t_x = m.common_vocab("xtoken")
    kinds = m.row_kind
    assert (kinds[s_strict] == RowKind.EXACT).all()
    assert t_strict.unique().numel() == t_strict.numel()
    assert t_x.unique().numel() == t_x.numel()
    assert set(zip(s_strict.tolist(), t_strict.tolist())) <= set(zip(s_x.tolist(), t_x.tolist()))
    assert (m.weights[s_x, 0] >= 0.6).all()
    assert s_strict.numel() > 0.5 * int((kinds == RowKind.EXACT).sum())


def test_local_shards_cover_padded_vocab(built):
    m = built("mistral", "gpt2")
    tp, divisible = 4, 128
    padded = -(-m.student_vocab_size // (divisible * tp)) * divisible * tp
    part = padded // tp
    idx = torch.cat([m.local_shard(r * part, (r + 1) * part)[0] for r in range(tp)])
    assert idx.shape[0] == padded
    assert torch.equal(idx[: m.student_vocab_size], m.indices)
    assert (idx[m.student_vocab_size :] == -1).all()


# ----------------------------------------------------------------------------- files


def test_hash_mismatch_is_refused(built, toks, tmp_path):
    m = built("mistral", "gpt2")
    path = tmp_path / "w.safetensors"
    save_projection(m, path)
    ok = load_projection(path, toks["mistral"], toks["gpt2"])
    assert torch.equal(ok.indices, m.indices)
    with pytest.raises(ProjectionMismatchError) as err:
        load_projection(path, student_tokenizer=toks["gpt2"], teacher_tokenizer=toks["gpt2"])
    msg = str(err.value)
    assert "tokenizers/mistral" in msg and "tokenizers/gpt2" in msg and "student" in msg
    with pytest.raises(ProjectionMismatchError, match="teacher"):
        load_projection(path, teacher_tokenizer=toks["smollm2"])
    # Same tokenizer with one token renamed: same size, different hash.
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(TOKENIZERS / "gpt2"))
    other.add_tokens(["<zzz-new-token>"])
    with pytest.raises(ProjectionMismatchError, match="teacher tokenizer in use"):
        load_projection(path, teacher_tokenizer=other)


@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_nemo_rl_files_roundtrip_and_convert(built, toks, tmp_path, form, capsys):
    m = built("mistral", "gpt2")
    pt = tmp_path / f"w_{form}.pt"
    write_nemo_rl(pt, m.indices, m.weights, form=form)
    back = load_projection(pt, toks["mistral"], toks["gpt2"])
    assert back.student_vocab_size == m.student_vocab_size
    assert back.teacher_vocab_size == m.teacher_vocab_size
    assert torch.equal(back.indices, m.indices) and torch.allclose(back.weights, m.weights)
    out = tmp_path / "converted.safetensors"
    rc = main(
        [
            "convert-nemo-rl",
            str(pt),
            "--student-tokenizer",
            str(TOKENIZERS / "mistral"),
            "--teacher-tokenizer",
            str(TOKENIZERS / "gpt2"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    conv = load_projection(out, toks["mistral"], toks["gpt2"])  # hashes recorded and checked
    assert torch.equal(conv.indices, m.indices) and torch.allclose(conv.weights, m.weights)
    cov = conv.coverage()
    assert cov["exact"] == int((m.row_kind == RowKind.EXACT).sum() + (m.row_kind == 6).sum())
    with pytest.raises(ProjectionMismatchError):
        load_projection(out, toks["gpt2"], toks["gpt2"])
    capsys.readouterr()
    wrong = ["--student-tokenizer", str(TOKENIZERS / "mistral")]
    wrong += ["--teacher-tokenizer", str(TOKENIZERS / "qwen2")]  # no hash in .pt: text check
    assert main(["convert-nemo-rl", str(pt), *wrong, "--out", str(tmp_path / "x.st")]) == 2
    assert "built for other tokenizers" in capsys.readouterr().err


def test_nemo_rl_model_vocab_rows_beyond_tokenizer(built, toks, tmp_path):
    m = built("mistral", "gpt2")
    extra = 64  # NeMo-RL sizes W by the model config's (padded) vocab
    idx = torch.cat([m.indices, torch.full((extra, m.top_k), -1)])
    w = torch.cat([m.weights, torch.zeros(extra, m.top_k)])
    write_nemo_rl(tmp_path / "pad.pt", idx, w)
    back = load_projection(tmp_path / "pad.pt", toks["mistral"], toks["gpt2"])
    assert back.student_vocab_size == len(toks["mistral"])
    idx[-1, 0], w[-1, 0] = 5, 1.0
    write_nemo_rl(tmp_path / "bad.pt", idx, w)
    with pytest.raises(ProjectionMismatchError, match="student rows"):
        load_projection(tmp_path / "bad.pt", toks["mistral"], toks["gpt2"])


# ----------------------------------------------------------------------------- CLI


def test_cli_build_and_inspect(tmp_path, capsys):
    out = tmp_path / "m2g.safetensors"
    args = ["--student-tokenizer", str(TOKENIZERS / "mistral")]
    args += ["--teacher-tokenizer", str(TOKENIZERS / "gpt2")]
    rc = main(["build", *args, "--reverse-pass", "--special-tokens", "--quiet", "--out", str(out)])
    assert rc == 0 and out.is_file()
    capsys.readouterr()
    assert main(["inspect", str(out), *args, "--examples", "12"]) == 0
    text = capsys.readouterr().out
    assert "exact" in text and "multi_token" in text and "empty" in text
    assert '"reverse_pass": true' in text
    rows = [line for line in text.splitlines() if " -> " in line]
    assert len(rows) >= 10 and any('"' in r for r in rows)
    assert main(["inspect", str(out), "--examples", "3"]) == 0  # ids only, no tokenizers
    assert " -> " in capsys.readouterr().out
    bad = ["--student-tokenizer", str(TOKENIZERS / "gpt2")]
    assert main(["inspect", str(out), *bad]) == 2
    err = capsys.readouterr().err
    assert "tokenizers/mistral" in err and "tokenizers/gpt2" in err


def test_exact_only_build(built):
    m = built("mistral", "gpt2", multi_token=False, top_k=2)
    base = built("mistral", "gpt2")
    assert m.top_k == 2
    exact = (base.row_kind == RowKind.EXACT) | (base.row_kind == RowKind.EXACT_ALIAS)
    assert torch.equal(m.indices[exact, 0], base.indices[exact, 0])
    assert (m.indices[~exact] == -1).all()
    assert m.metadata["builder_options"].count('"multi_token": false') == 1
