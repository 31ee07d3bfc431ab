"""The data layer for several teachers (real tokenizers and text): one teacher packs and samples
exactly as the one-teacher code did; K teachers each get samples that fit their own length and
cover the student's text; a teacher with the student's tokenizer gets the student's tokens."""

from __future__ import annotations

import hashlib
import json
import pickle
from functools import cache

import numpy as np
import pytest
import torch
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.data import dataset as dataset_module
from megatron_xdistill.data import packing
from megatron_xdistill.data.dataset import DistillationDataset, collate_samples, teacher_view
from megatron_xdistill.data.packing import build_plan, document_order, plan_key
from megatron_xdistill.data.sources import DataSource
from megatron_xdistill.data.tokenizations import SampleTokenizers

SOURCES = [DataSource("docs.jsonl")]  # the plan depends on the documents and counts only


def one_teacher_digest(arrays) -> str:
    """Digest of int arrays (shape and values) to pin what the one-teacher code produced."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a, dtype=np.int64))
        h.update(str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def item_arrays(item: dict) -> list:
    """A one-teacher sample's arrays in the order the pinned digests were taken."""
    return [item["tokens"], item["teacher_tokens"], item["chunks"], item["loss_mask"],
            [item["student_length"], item["teacher_length"], item["num_bytes"]]]


@cache
def _tok(name: str):
    from megatron_xdistill.align import load_tokenizer

    return load_tokenizer(ASSETS / "tokenizers" / name)


def _docs(n: int, chars: int) -> list[str]:
    lines = (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()
    return [json.loads(line)["text"][:chars] for line in lines[:n]]


def _plan(tokenizers, docs, seq, teacher_seqs, seed, num):
    return build_plan(docs, SOURCES, [len(docs)], tokenizers, seq, teacher_seqs, seed, num,
                      log=lambda _: None)


def _same_plans(a, b) -> bool:
    return (np.array_equal(a.pieces, b.pieces)
            and np.array_equal(a.sample_offsets, b.sample_offsets))


def check_tiling(plan, documents, counts, seed, sources=SOURCES, passes: int = 20) -> list[int]:
    """Pieces tile each document in order and documents follow the seeded order, pass after
    pass: no text of a document is dropped or repeated within its turn. Returns the documents
    in the order the plan starts them."""
    expected = np.concatenate([document_order(sources, counts, seed, e) for e in range(passes)])
    seen, current, pos = [], None, 0
    for d, c0, c1, starts_doc, ends_doc in plan.pieces.tolist():
        if starts_doc:
            assert current is None and c0 == 0
            current, pos = d, 0
            seen.append(d)
        assert d == current and c0 == pos and c1 > c0
        pos = c1
        assert bool(ends_doc) == (c1 == len(documents[d]))
        if ends_doc:
            current = None
    assert seen == expected[: len(seen)].tolist()
    return seen


def check_pieces_tile(pieces: np.ndarray, documents, passes_of: int | None = None) -> list[int]:
    """Independently of the packer's code: the plan's pieces, in order, tile every document they
    start, from its first character to its last, each piece going on where the one before
    stopped (nothing dropped or repeated). ``passes_of``: the documents hold no weights, so
    every ``passes_of`` document starts (a pass) start each non-empty document once. Returns the
    documents in the order the plan starts them."""
    started, current, pos = [], None, 0
    for d, c0, c1, starts_doc, ends_doc in pieces.tolist():
        if current is None:
            assert starts_doc and c0 == 0, f"document {d} entered at character {c0}"
            current = d
            started.append(d)
        assert not (starts_doc and c0), (d, c0)
        assert d == current and c0 == pos and c1 > c0, f"document {current} resumed {(d, c0)} " \
                                                        f"after character {pos}"
        pos = c1
        assert bool(ends_doc) == (c1 == len(documents[d])), f"document {d} ended at {c1}"
        if ends_doc:
            current, pos = None, 0
    if passes_of is not None:
        nonempty = sorted(d for d in range(passes_of) if documents[d])
        for lo in range(0, len(started), len(nonempty)):
            one_pass = started[lo : lo + len(nonempty)]
            assert len(set(one_pass)) == len(one_pass) and set(one_pass) <= set(nonempty)
    return started


def tokenizer_ids(tokenizer, pieces: np.ndarray, documents) -> tuple[list[int], list[int]]:
    """A side's ids of a sample from its tokenizer alone: per piece, BOS before a document's
    first piece (where the tokenizer starts its encodings with one), the tokenizer's ids of the
    piece's text, EOS after a document's last piece; and, per id, how many characters of the
    sample's text the ids up to it spell (the tokenizer's offsets)."""
    bos = tokenizer.bos_token_id
    uses_bos = bos is not None and tokenizer("a")["input_ids"][:1] == [bos]
    ids: list[int] = []
    ends: list[int] = []
    done = 0
    for d, c0, c1, starts_doc, ends_doc in pieces.tolist():
        if starts_doc and uses_bos:
            ids.append(bos)
            ends.append(done)
        enc = tokenizer(documents[d][c0:c1], add_special_tokens=False,
                        return_offsets_mapping=True)
        ids += enc["input_ids"]
        ends += [done + end for _, end in enc["offset_mapping"]]
        done += c1 - c0
        if ends_doc:
            ids.append(tokenizer.eos_token_id)
            ends.append(done)
    return ids, ends


def check_sample_ids(item: dict, pieces: np.ndarray, documents, student, teacher) -> bool:
    """One teacher's view of a sample against the tokenizers alone: the student's ids are the
    student tokenizer's ids of the sample's text spans (:func:`tokenizer_ids`), the teacher's
    the teacher tokenizer's ids of the same spans. A sample cut short (too long for a side)
    keeps a prefix of both that ends at the same character: the same text. True when whole."""
    s_ids, s_ends = tokenizer_ids(student, pieces, documents)
    t_ids, t_ends = tokenizer_ids(teacher, pieces, documents)
    n_s, n_t = item["student_length"], item["teacher_length"]
    assert item["tokens"][:n_s].tolist() == s_ids[:n_s], "student ids are not its text's"
    assert item["teacher_tokens"][:n_t].tolist() == t_ids[:n_t], "teacher ids are not its text's"
    if n_s == len(s_ids) and n_t == len(t_ids):
        return True
    assert 0 < n_s < len(s_ids) and 0 < n_t < len(t_ids), (n_s, len(s_ids), n_t, len(t_ids))
    assert s_ends[n_s - 1] == t_ends[n_t - 1], "a cut sample's sides keep different text"
    return False


def _text_bytes(tokenizer, ids) -> bytes:
    """The canonical bytes that ``ids`` spell (control tokens spell nothing)."""
    from megatron_xdistill.align import token_bytes_table

    table = token_bytes_table(tokenizer)
    return b"".join(table[i] or b"" for i in np.asarray(ids).tolist())


def _sample_text(plan, documents, i) -> str:
    return "".join(documents[d][c0:c1] for d, c0, c1, _, _ in plan.sample_pieces(i).tolist())


# -- one teacher: the plans, samples and keys of the one-teacher code -----------------------------

# Digests taken from the one-teacher code (packing.py / dataset.py at 089ec65) on these inputs;
# the smollm2 / mistral case truncates overlong samples (SentencePiece prefix space).
ONE_TEACHER = [
    (("smollm2", "mistral"), "662f565897ebe21e", "0eeb26f44a10a8b9"),
    (("smollm2", "qwen2"), "f3b72ba4f26ba127", "507dabd70073fc4a"),
]


@needs_shared_assets
@pytest.mark.parametrize("pair,plan_digest,items_digest", ONE_TEACHER)
def test_one_teacher_packs_and_samples_as_before(pair, plan_digest, items_digest, monkeypatch):
    """The pins say that nothing changed; first, that what they pin is right, checked from the
    tokenizers alone: the pieces tile the documents, and every sample's ids are each
    tokenizer's ids of its text (a sample cut short keeps the same text on both sides)."""
    docs = _docs(6, 1500)
    tokenizers = SampleTokenizers(_tok(pair[0]), [_tok(pair[1])])
    plan = _plan(tokenizers, docs, 16, [12], seed=5, num=40)
    check_pieces_tile(plan.pieces, docs, passes_of=len(docs))
    cuts = []
    real_cut = dataset_module._student_cut
    monkeypatch.setattr(dataset_module, "_student_cut", lambda *a: cuts.append(1) or real_cut(*a))
    ds = DistillationDataset(docs, plan, tokenizers, 16, [12])
    items = [teacher_view(ds[i], 0) for i in range(len(ds))]
    whole = [check_sample_ids(item, plan.sample_pieces(i), docs, *map(_tok, pair))
             for i, item in enumerate(items)]
    assert sum(whole) == len(items) - len(cuts)  # the cut samples keep the same text
    assert one_teacher_digest([plan.pieces, plan.sample_offsets]) == plan_digest
    assert one_teacher_digest([a for item in items for a in item_arrays(item)]) == items_digest
    assert (len(cuts) > 0) == (pair[1] == "mistral")  # the truncation branch is pinned too


def test_one_teacher_plan_key_is_unchanged(monkeypatch):
    """Keys taken from the one-teacher plan_key; several teachers key their lists."""
    monkeypatch.setattr(packing, "source_fingerprint", lambda _: [["fixed", 1, 2, None]])
    assert plan_key([], "text", "stu", ["tea"], 64, [48], 0, 150) == "0545b80b9b3faab11f23"
    assert plan_key([], "text", "stu", ["tea"], 64, [48], 0, 150, data_tokenizer="dt",
                    split="train") == "0bf89e950b405284bebb"
    two = plan_key([], "text", "stu", ["tea", "other"], 64, [48, 40], 0, 150)
    assert two not in {plan_key([], "text", "stu", ["tea"], 64, [48], 0, 150),
                       plan_key([], "text", "stu", ["other", "tea"], 64, [40, 48], 0, 150),
                       plan_key([], "text", "stu", ["tea", "other"], 64, [48, 48], 0, 150)}
    with pytest.raises(TypeError, match="one entry per teacher"):
        plan_key([], "text", "stu", "tea", 64, [48], 0, 150)
    with pytest.raises(ValueError, match="2 teacher names for 1 teacher lengths"):
        plan_key([], "text", "stu", ["tea", "other"], 64, [48], 0, 150)


# -- two cross-tokenizer teachers ------------------------------------------------------------------

@needs_shared_assets
def test_two_cross_teachers_fit_cover_the_same_text_and_cut_where_both_align(monkeypatch):
    """Student smollm2 (byte-level BPE), teachers qwen2 (byte-level BPE) and mistral
    (SentencePiece with BOS and a prefix space): every sample fits each side's own length,
    each teacher's exact chunks spell the student's text, pieces end only where both
    alignments start a chunk at the same student token, and one pass covers every document.
    Some samples overflow mistral's length once their pieces are tokenised alone, and are cut
    where every teacher's chunks still fit."""
    from megatron_xdistill.align import TokenAligner

    docs = _docs(4, 1500) + ["Grüße aus Köln: naïve café, 日本語の文章。 😀 emoji\n\nend."]
    student, teachers = _tok("smollm2"), [_tok("qwen2"), _tok("mistral")]
    tokenizers = SampleTokenizers(student, teachers)
    assert tokenizers.same_tokenizer == [False, False] and tokenizers.num_teachers == 2
    seq, teacher_seqs, num = 32, [34, 28], 70
    plan = _plan(tokenizers, docs, seq, teacher_seqs, seed=2, num=num)
    assert len(plan) == num
    check_tiling(plan, docs, [len(docs)], seed=2)
    assert plan.pieces[:, 4].sum() > len(docs)  # more than one pass: every document ended

    # Pieces end where both teachers' whole-document alignments start a chunk at one student
    # token a, at the earliest end of the three sides' tokens before it.
    cuts = {}
    aligners = [TokenAligner(student, t) for t in teachers]
    for d, doc in enumerate(docs):
        _, s_enc, _ = aligners[0].encode_texts([doc])
        ends = [s_enc[0][1][:, 1]]
        starts = []
        for al in aligners:
            _, _, t_enc = al.encode_texts([doc])
            ends.append(t_enc[0][1][:, 1])
            starts.append({(a, p) for a, _, p, _, _ in al.align_text(doc).chunks_array.tolist()})
        cuts[d] = {min(int(ends[0][a - 1]), int(ends[1][p - 1]), int(ends[2][q - 1]))
                   for a, p in starts[0] for a2, q in starts[1] if a == a2 and a and p and q}
    for d, _, c1, _, ends_doc in plan.pieces.tolist():
        assert ends_doc or c1 in cuts[d]

    cut = []
    real_cut = dataset_module._student_cut
    monkeypatch.setattr(dataset_module, "_student_cut", lambda *a: cut.append(1) or real_cut(*a))
    ds = DistillationDataset(docs, plan, tokenizers, seq, teacher_seqs)
    whole = 0
    for i in range(len(ds)):
        item = ds[i]
        n_s = item["student_length"]
        assert n_s <= seq + 1 and len(item["tokens"]) == seq + 1
        s_text = _text_bytes(student, item["tokens"][:n_s])
        if s_text == _sample_text(plan, docs, i).encode():
            whole += 1  # the student's tokens spell the sample's text (not truncated)
        for k, (teacher, teacher_seq) in enumerate(zip(teachers, teacher_seqs, strict=True)):
            view = teacher_view(item, k)
            n_t = view["teacher_length"]
            assert n_t <= teacher_seq + 1 and len(view["teacher_tokens"]) == teacher_seq + 1
            assert (view["teacher_tokens"][n_t:] == ds.teacher_special[k].pad).all()
            chunks = view["chunks"]
            assert (chunks[:, 1] <= n_s).all() and (chunks[:, 3] <= n_t).all()
            assert (np.diff(chunks[:, 0]) >= 0).all() and (np.diff(chunks[:, 2]) >= 0).all()
            controls = {ds.teacher_special[k].bos, ds.teacher_special[k].eos}
            for a, b, p, q, exact in chunks.tolist():
                if exact:
                    s_bytes = _text_bytes(student, view["tokens"][a:b])
                    t_bytes = _text_bytes(teacher, view["teacher_tokens"][p:q])
                    # SentencePiece's prefix space on the first token of a piece spells nothing
                    # (pieces start at the sample's start or after a document's control tokens).
                    first = p == 0 or int(view["teacher_tokens"][p - 1]) in controls
                    assert s_bytes == t_bytes or (first and t_bytes == b" " + s_bytes)
            # The sample ends at a common chunk end: the student's last chunk is each teacher's.
            if len(chunks):
                assert chunks[-1, 1] <= n_s and (n_s - chunks[-1, 1]) <= 1  # at most an EOS
    assert whole >= 0.9 * len(ds) and cut


def test_overlong_sample_is_cut_where_every_cross_teacher_fits():
    """Two cross teachers (chunk rows ``a, b, p, q, exact``): the student keeps the longest
    prefix that ends at a chunk end of both whose chunks up to there fit; each teacher keeps
    its chunks up to that prefix."""
    from megatron_xdistill.data.dataset import _kept_chunks, _student_cut

    one = np.array([[0, 2, 0, 3, 1], [2, 4, 3, 6, 1], [4, 6, 6, 9, 1], [6, 8, 9, 12, 1]])
    two = np.array([[0, 3, 0, 2, 1], [3, 4, 2, 3, 1], [4, 8, 3, 6, 0]])
    cut = _student_cut(9, [(one, 10), (two, 5)])  # fit: one's ends {2, 4, 6}, two's {3, 4}
    assert cut == 4
    assert _kept_chunks(one, 9, 10, cut).tolist() == one[:2].tolist()
    assert _kept_chunks(two, 9, 5, cut).tolist() == two[:2].tolist()
    assert _student_cut(9, [(one, 10)]) == 6 and _student_cut(5, [(one, 20)]) == 4
    assert _student_cut(7, []) == 7  # same-tokenizer teachers only: the student width


# -- same-tokenizer teachers -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed():
    """Student smollm2; teacher 0 smollm2 (loaded again: its vocabulary, not its object, makes
    it a same-tokenizer teacher), teacher 1 qwen2; and the qwen2 teacher alone."""
    from megatron_xdistill.align import load_tokenizer

    docs = _docs(3, 1200)
    same = load_tokenizer(ASSETS / "tokenizers" / "smollm2")
    both = SampleTokenizers(_tok("smollm2"), [same, _tok("qwen2")])
    alone = SampleTokenizers(_tok("smollm2"), [_tok("qwen2")])
    return docs, both, alone


@needs_shared_assets
def test_same_tokenizer_teacher_gets_the_student_tokens_and_adds_no_cut(mixed):
    docs, both, alone = mixed
    assert both.same_tokenizer == [True, False] and both.aligners[0] is None
    plan = _plan(both, docs, 24, [24, 20], seed=1, num=30)
    assert _same_plans(plan, _plan(alone, docs, 24, [20], seed=1, num=30))
    ds = DistillationDataset(docs, plan, both, 24, [24, 20])
    ds_alone = DistillationDataset(docs, plan, alone, 24, [20])
    for i in range(len(ds)):
        item, single = ds[i], ds_alone[i]
        n = item["student_length"]
        same, cross = item["teachers"]
        assert np.array_equal(same["teacher_tokens"], item["tokens"])
        assert same["teacher_length"] == n
        assert same["chunks"].tolist() == [[j, j + 1, j, j + 1, 1] for j in range(n)]
        for key in ("tokens", "student_length", "loss_mask", "num_bytes"):
            assert np.array_equal(item[key], single[key])
        for key in ("teacher_tokens", "teacher_length", "chunks"):
            assert np.array_equal(cross[key], single["teachers"][0][key])
    for bad in (lambda: DistillationDataset(docs, plan, both, 24, [20, 20]),
                lambda: _plan(both, docs, 24, [20, 20], seed=1, num=30)):
        with pytest.raises(ValueError, match="teacher 0 uses the student's tokenizer"):
            bad()
    with pytest.raises(ValueError, match="1 teacher sequence lengths for 2 teachers"):
        DistillationDataset(docs, plan, both, 24, [24])


@needs_shared_assets
def test_only_same_tokenizer_teachers_cut_at_student_tokens(mixed):
    """With no cross teacher every student token boundary is a cut: samples are full, their
    tokens spell their text, and the pieces tile the documents."""
    docs, both, _ = mixed
    tokenizers = SampleTokenizers(both.student_tokenizer, both.teacher_tokenizers[:1])
    plan = _plan(tokenizers, docs, 24, [24], seed=3, num=40)
    check_tiling(plan, docs, [len(docs)], seed=3)
    ds = DistillationDataset(docs, plan, tokenizers, 24, [24])
    full = 0
    for i in range(len(ds)):
        item = ds[i]
        n = item["student_length"]
        assert n <= 25
        assert _text_bytes(tokenizers.student_tokenizer, item["tokens"][:n]) == \
            _sample_text(plan, docs, i).encode()
        full += n >= 24
        assert np.array_equal(item["teachers"][0]["teacher_tokens"], item["tokens"])
    ends_doc = plan.pieces[plan.sample_offsets[1:] - 1, 4]
    assert full >= (ends_doc == 0).sum() - 1  # a sample ends early only at a document's end


@needs_shared_assets
def test_collate_and_teacher_view(mixed):
    docs, both, alone = mixed
    plan = _plan(both, docs, 24, [24, 20], seed=1, num=6)
    ds = DistillationDataset(docs, plan, both, 24, [24, 20])
    samples = [ds[i] for i in range(4)]
    batch = collate_samples(samples)
    assert set(batch) == {"tokens", "loss_mask", "num_bytes", "teachers"}
    assert batch["tokens"].shape == (4, 25) and batch["loss_mask"].shape == (4, 24)
    lengths = torch.tensor([s["student_length"] for s in samples])
    for k, width in enumerate((25, 21)):
        t = batch["teachers"][k]
        assert t["teacher_tokens"].shape == (4, width) and t["teacher_length"].shape == (4,)
        assert t["student_chunk_id"].shape == (4, 25) and t["teacher_chunk_id"].shape == (4, width)
        assert t["chunk_valid"].shape == (4, 25) and t["chunk_exact"].shape == (4, 25)
    same = batch["teachers"][0]
    assert torch.equal(same["teacher_tokens"], batch["tokens"])
    assert torch.equal(same["teacher_length"], lengths)
    positions = torch.arange(25).expand(4, 25)
    identity = torch.where(positions < lengths[:, None], positions, -1)
    assert torch.equal(same["student_chunk_id"], identity)
    assert torch.equal(same["teacher_chunk_id"], identity)
    assert torch.equal(same["chunk_valid"].sum(1), lengths)

    # Teacher 1's view of the batch is the batch of the qwen2 teacher alone.
    view = teacher_view(batch, 1)
    assert "teachers" not in view and view["teacher_tokens"] is batch["teachers"][1][
        "teacher_tokens"]
    single = teacher_view(collate_samples(
        [DistillationDataset(docs, plan, alone, 24, [20])[i] for i in range(4)]), 0)
    assert set(view) == set(single)
    for key in single:
        assert torch.equal(view[key], single[key]), key
    sample_view = teacher_view(samples[1], 0)
    assert sample_view["teacher_tokens"] is samples[1]["teachers"][0]["teacher_tokens"]
    assert sample_view["index"] == 1 and "teachers" not in sample_view
    assert "teachers" in samples[1]  # the view leaves the item as it was


@needs_shared_assets
def test_sample_tokenizers_pickle_and_encode_the_student_once(mixed, monkeypatch):
    docs = mixed[0]
    both = SampleTokenizers(_tok("smollm2"), [mixed[1].teacher_tokenizers[0], _tok("mistral")])
    again = pickle.loads(pickle.dumps(both))
    assert again.same_tokenizer == both.same_tokenizer
    texts, student, alignments = again.encode_align(docs[:2])
    ref_texts, ref_student, ref_alignments = both.encode_align(docs[:2])
    assert texts == ref_texts and alignments[0] is None
    for (ids, offs), (ref_ids, ref_offs) in zip(student, ref_student, strict=True):
        assert np.array_equal(ids, ref_ids) and np.array_equal(offs, ref_offs)
    for al, ref in zip(alignments[1], ref_alignments[1], strict=True):
        assert np.array_equal(al.chunks_array, ref.chunks_array)
        assert np.array_equal(al.teacher_ids, ref.teacher_ids)
    from megatron_xdistill.align.api import TokenAligner

    encoded = []
    real = TokenAligner._encode
    monkeypatch.setattr(TokenAligner, "_encode", staticmethod(
        lambda tok, texts: encoded.append(tok) or real(tok, texts)))
    both.encode_align(docs[:2])
    assert encoded == [both.student_tokenizer, both.teacher_tokenizers[1]]
