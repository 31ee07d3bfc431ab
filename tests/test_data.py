"""Text-space packing with real tokenizers: samples fit, cover the same text, lose nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from shared_assets import ASSETS
from shared_assets import needs_shared_assets as needs_assets
from test_data_teachers import (
    check_pieces_tile,
    check_sample_ids,
    check_tiling,
    item_arrays,
    one_teacher_digest,
)

from megatron_xdistill.data.dataset import DistillationDataset, collate_samples, teacher_view
from megatron_xdistill.data.packing import (
    build_plan,
    document_order,
    load_documents,
    load_plan,
    save_plan,
)
from megatron_xdistill.data.sources import DataSource, parse_data_path, read_documents


def _docs_jsonl(tmp_path: Path, texts: list[str], name: str = "docs.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def test_readers_agree_across_formats(tmp_path):
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    texts = ["first doc", "second\nline", "third é"]
    jsonl = _docs_jsonl(tmp_path, texts)
    table = pa.table({"text": texts})
    pq.write_table(table, tmp_path / "d.parquet")
    feather.write_feather(table, tmp_path / "d.arrow")
    (tmp_path / "d.txt").write_text("whole file")
    assert read_documents(jsonl) == texts
    assert read_documents(str(tmp_path / "d.parquet")) == texts
    assert read_documents(str(tmp_path / "d.arrow")) == texts
    assert read_documents(str(tmp_path / "d.txt")) == ["whole file"]


def test_parquet_reads_the_text_column_only(tmp_path, monkeypatch):
    """A corpus with other columns (ids, metadata, embeddings) costs only its text to read; a
    missing text column is named with the columns there are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["a doc", "another"]
    pq.write_table(pa.table({"id": [1, 2], "text": texts, "blob": [b"x" * 1000, b"y" * 1000]}),
                   tmp_path / "d.parquet")
    read = []
    real = pq.read_table
    monkeypatch.setattr(pq, "read_table", lambda path, columns=None, **kw: (
        read.append(columns), real(path, columns=columns, **kw))[1])
    assert read_documents(str(tmp_path / "d.parquet")) == texts
    assert read == [["text"]]
    with pytest.raises(ValueError, match=r"d.parquet: no column 'body' \(columns: \['id', 'text', "
                                         r"'blob'\]\); use --text-field"):
        read_documents(str(tmp_path / "d.parquet"), "body")
    assert read == [["text"]]  # refused from the schema, before any data is read


def test_bad_inputs_name_file_and_field(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: no field 'text'"):
        read_documents(str(path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        parse_data_path([str(tmp_path / "missing.jsonl")])
    with pytest.raises(ValueError, match="weights for every file or for none"):
        parse_data_path([str(path), "0.5"])
    assert parse_data_path(["0.3", str(path), "0.7", str(path)])[1].weight == 0.7


def test_document_order_is_seeded_and_weighted():
    sources = [DataSource("a", 0.75), DataSource("b", 0.25)]
    order = document_order(sources, [10, 10], seed=3, epoch=0)
    assert np.array_equal(order, document_order(sources, [10, 10], seed=3, epoch=0))
    assert not np.array_equal(order, document_order(sources, [10, 10], seed=4, epoch=0))
    from_a = (order < 10).mean()
    assert from_a == pytest.approx(0.75, abs=0.05)
    plain = document_order([DataSource("a"), DataSource("b")], [3, 4], seed=0, epoch=0)
    assert sorted(plain.tolist()) == list(range(7))


def test_step_sampler_gives_each_rank_its_samples_and_resumes():
    """Global batch 8, micro-batch 2: student DP rank r holds micro-batches r, r + 2, ... of
    each step (Megatron's order); a teacher DP rank a contiguous half; the steps follow each
    other, wrap around the plan, and a sampler started at step k continues the same sequence."""
    from megatron_xdistill.data.loader import StepSampler
    from megatron_xdistill.parallel.layout import ParallelLayout

    student, teacher = ParallelLayout(dp=2), ParallelLayout(dp=2)

    def steps(s_rank, t_rank, start, n, num=20):
        it = iter(StepSampler(num, start, 8, 2, s_rank, student, t_rank, teacher))
        return [next(it) for _ in range(n)]

    assert steps(0, None, 0, 2) == [[0, 1, 4, 5], [8, 9, 12, 13]]
    assert steps(1, None, 0, 2) == [[2, 3, 6, 7], [10, 11, 14, 15]]
    assert steps(None, 1, 0, 1) == [[4, 5, 6, 7]]
    assert steps(0, 1, 0, 1) == [[0, 1, 4, 5, 6, 7]]  # colocated: what either model needs
    assert steps(0, None, 2, 1) == [[16, 17, 0, 1]]  # step 2 wraps around 20 samples
    assert steps(1, None, 1, 2) == steps(1, None, 0, 3)[1:]  # resume = start at the step


@pytest.fixture(scope="module")
def tokenizers():
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.tokenizations import SampleTokenizers

    return SampleTokenizers(load_tokenizer(ASSETS / "tokenizers" / "smollm2"),
                            [load_tokenizer(ASSETS / "tokenizers" / "gemma3")])


@needs_assets
def test_packed_samples_fit_and_cover_all_text(tokenizers, tmp_path):
    docs = [json.loads(line)["text"][:3000]
            for line in (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:4]]
    path = _docs_jsonl(tmp_path, docs)
    sources = parse_data_path([path])
    documents, counts = load_documents(sources, "text")
    plan = build_plan(documents, sources, counts, tokenizers, 64, [48], seed=0, num_samples=150,
                      log=lambda m: None)
    assert len(plan) == 150
    seen_docs = check_tiling(plan, documents, counts, 0, sources, passes=10)
    assert len(seen_docs) > len(documents)  # more than one pass was needed
    assert check_pieces_tile(plan.pieces, documents, passes_of=len(documents)) == seen_docs

    ds = DistillationDataset(documents, plan, tokenizers, 64, [48])
    # What the pins below stand for, from the tokenizers alone: every sample's ids are each
    # tokenizer's ids of the sample's text spans (none is cut short here).
    s_tok, t_tok = tokenizers.student_tokenizer, tokenizers.teacher_tokenizers[0]
    assert all(check_sample_ids(teacher_view(ds[i], 0), plan.sample_pieces(i), documents, s_tok,
                                t_tok) for i in range(len(ds)))
    # The one-teacher code's plan and first samples, pinned (digests taken from it at 089ec65).
    assert one_teacher_digest([plan.pieces, plan.sample_offsets]) == "45625509287cb8b4"
    assert one_teacher_digest([a for i in range(12)
                               for a in item_arrays(teacher_view(ds[i], 0))]) == "2cad3592dc90ee47"
    for i in range(min(len(ds), 12)):
        item = teacher_view(ds[i], 0)
        assert item["student_length"] <= 65 and item["teacher_length"] <= 49
        text = "".join(documents[d][c0:c1] for d, c0, c1, _, _ in plan.sample_pieces(i).tolist())
        s_text = s_tok.decode(item["tokens"][: item["student_length"]], skip_special_tokens=True)
        t_text = t_tok.decode(item["teacher_tokens"][: item["teacher_length"]],
                              skip_special_tokens=True)
        if item["student_length"] < 65 and item["teacher_length"] < 49:
            assert s_text == text or s_text.strip() == text.strip()
        assert s_text.strip()[:20] == t_text.strip()[:20]
        exact = item["chunks"][item["chunks"][:, 4] == 1]
        for a, b, p, q, _ in exact[:10].tolist():
            assert s_tok.decode(item["tokens"][a:b]) == t_tok.decode(item["teacher_tokens"][p:q])
    batch = teacher_view(collate_samples([ds[0], ds[1]]), 0)
    assert batch["tokens"].shape == (2, 65) and batch["teacher_tokens"].shape == (2, 49)
    assert batch["student_chunk_id"].shape == (2, 65) and batch["chunk_valid"].shape == (2, 65)
    assert int(batch["num_bytes"][0]) > 0

    path = tmp_path / "plan.npz"
    save_plan(plan, str(path))
    again = load_plan(str(path), plan.key)
    assert np.array_equal(again.pieces, plan.pieces)
    assert np.array_equal(again.sample_offsets, plan.sample_offsets)
    assert load_plan(str(path), "other-key") is None
    with np.load(path, allow_pickle=False) as blob:  # plain arrays: no pickled objects
        assert sorted(blob.files) == ["key", "pieces", "sample_offsets", "version"]
    path.write_bytes(path.read_bytes()[:100])  # a cut-short cache file is built again
    assert load_plan(str(path), plan.key) is None


@needs_assets
def test_blended_sources_start_documents_in_their_weights_shares(tokenizers, tmp_path):
    """``--data-path 0.6 A 0.3 B 0.1 C``: documents are drawn in that proportion (the sources'
    documents of different counts). Counted over the documents a packed plan starts, each
    source's share is its weight within three binomial standard errors, and every document of
    every source is drawn."""
    lines = {name: (ASSETS / "corpora" / f"{name}.jsonl").read_text().splitlines()
             for name in ("enwiki_val", "enwiki_train", "shakespeare")}
    texts = [[json.loads(x)["text"][:300] for x in lines[name][:n] if json.loads(x)["text"]]
             for name, n in (("enwiki_val", 9), ("enwiki_train", 5), ("shakespeare", 3))]
    weights = [0.6, 0.3, 0.1]
    items = []
    for k, (w, docs) in enumerate(zip(weights, texts, strict=True)):
        items += [str(w), _docs_jsonl(tmp_path, docs, name=f"source{k}.jsonl")]
    sources = parse_data_path(items)
    documents, counts = load_documents(sources, "text")
    plan = build_plan(documents, sources, counts, tokenizers, 64, [48], seed=4, num_samples=300,
                      log=lambda m: None)
    started = np.asarray(check_pieces_tile(plan.pieces, documents))
    source = np.searchsorted(np.cumsum(counts), started, side="right")
    n = len(started)
    assert n >= 200
    for k, w in enumerate(weights):
        share = float((source == k).mean())
        assert abs(share - w) <= 3 * (w * (1 - w) / n) ** 0.5, f"source {k}: {share} of {n}"
    assert set(started.tolist()) == set(range(len(documents)))


def test_globs_and_hf_datasets_folders_in_the_data_path(tmp_path):
    """Unweighted --data-path items may be globs (sorted matches) or `datasets` save_to_disk
    folders (their Arrow files, read through the stream reader); a DatasetDict folder, a plain
    folder, a glob with no match and a glob with a weight are refused by name."""
    import pyarrow as pa

    for i in (2, 1):
        _docs_jsonl(tmp_path, [f"shard {i}"], name=f"shard-{i}.jsonl")
    ds = tmp_path / "hf_ds"
    ds.mkdir()
    table = pa.table({"text": ["from arrow 0", "from arrow 1"], "id": [0, 1]})
    with pa.OSFile(str(ds / "data-00000-of-00001.arrow"), "wb") as sink:
        with pa.ipc.new_stream(sink, table.schema) as writer:  # the layout `datasets` writes
            writer.write_table(table)
    (ds / "state.json").write_text(json.dumps({"_data_files": [
        {"filename": "data-00000-of-00001.arrow"}]}))
    sources = parse_data_path([str(tmp_path / "shard-*.jsonl"), str(ds)])
    assert [Path(s.path).name for s in sources] == [
        "shard-1.jsonl", "shard-2.jsonl", "data-00000-of-00001.arrow"]
    assert [d for s in sources for d in read_documents(s.path)] == [
        "shard 1", "shard 2", "from arrow 0", "from arrow 1"]

    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(ValueError, match=r"DatasetDict with splits \['train', 'test'\]; pass one"):
        parse_data_path([str(tmp_path / "dd")])
    with pytest.raises(ValueError, match="not a Hugging Face datasets folder"):
        parse_data_path([str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"no file matches .*nothing-\*\.jsonl"):
        parse_data_path([str(tmp_path / "nothing-*.jsonl")])
    with pytest.raises(ValueError, match="read without weights only"):
        parse_data_path(["0.5", str(tmp_path / "shard-*.jsonl"), "0.5", str(ds)])


def _megatron_indexed(prefix: Path, texts: list[str], tokenizer_dir: Path) -> None:
    """Write ``texts`` as Megatron-LM's preprocess_data.py does (--append-eod), with
    Megatron-Core's own IndexedDatasetBuilder."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_xdistill.align import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        builder.add_document(torch.tensor(ids, dtype=torch.int32), [len(ids)])
    builder.finalize(str(prefix) + ".idx")


@needs_assets
def test_megatron_indexed_datasets_are_read_back_as_their_text(tmp_path):
    """A PREFIX.bin/.idx made by Megatron-Core's builder gives back the documents' text (real
    tokenizers, real text with non-ASCII characters), blends with other files by weight, and
    is refused by name without its tokenizer or with another one."""
    from megatron_xdistill.data.packing import load_documents

    texts = [json.loads(line)["text"] for line in
             (ASSETS / "corpora" / "enwiki_val.jsonl").read_text().splitlines()[:40]]
    texts = [t for t in texts if t.strip()][:25]
    assert any(ord(c) > 127 for t in texts for c in t)  # the round trip covers non-ASCII text
    qwen = ASSETS / "tokenizers" / "qwen2"
    prefix = tmp_path / "corpus_text_document"
    _megatron_indexed(prefix, texts, qwen)

    sources = parse_data_path([str(prefix)])
    documents, counts = load_documents(sources, "text", str(qwen))
    assert documents == texts and counts == [len(texts)]
    other = _docs_jsonl(tmp_path, ["plain file"])
    blended = parse_data_path(["0.3", str(prefix), "0.7", other])
    assert load_documents(blended, "text", str(qwen))[1] == [len(texts), 1]

    with pytest.raises(ValueError, match="--data-tokenizer-model"):
        read_documents(str(prefix))
    with pytest.raises(ValueError, match=r"holds token id \d+ but the tokenizer .*smollm2 has"):
        read_documents(str(prefix), data_tokenizer=str(ASSETS / "tokenizers" / "smollm2"))


def test_indexed_data_tokenizer_defaults_to_the_student_tokenizer(tmp_path):
    """As in Megatron-LM, --tokenizer-model made the indexed data unless
    --data-tokenizer-model says otherwise; without indexed data no tokenizer is involved (the
    packing cache keys of text data stay as they were)."""
    from argparse import Namespace

    from megatron_xdistill.training.run_data import data_tokenizer as _data_tokenizer

    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    indexed = [DataSource(str(tmp_path / "d"))]
    text = [DataSource(_docs_jsonl(tmp_path, ["x"]))]
    args = Namespace(tokenizer_model="student_tok", data_tokenizer_model=None)
    assert _data_tokenizer(args, indexed) == "student_tok"
    assert _data_tokenizer(args, text) is None
    args.data_tokenizer_model = "teacher_tok"
    assert _data_tokenizer(args, indexed + text) == "teacher_tok"


def test_split_ranges_follow_megatron_lm():
    """Hand-computed Megatron-LM parts: part i of n documents is [round(b_i n), round(e_i n)) of
    the normalised shares; an empty share is no part."""
    from megatron_xdistill.data.split import split_ranges

    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("80,20", 7) == [(0, 6), (6, 7), None]  # round(5.6) = 6
    assert split_ranges("98,2,0", 10) == [(0, 10), (10, 10), None]
    assert split_ranges("1", 5) == [(0, 5), None, None]


def test_split_parts_per_source_and_refusals(tmp_path):
    from megatron_xdistill.data.split import check_split, split_loaded

    a, b = DataSource("a.jsonl"), DataSource("b.jsonl")
    docs = [f"a{i}" for i in range(10)] + [f"b{i}" for i in range(4)]
    train, valid = split_loaded(([a, b], docs, [10, 4]), "75,25")
    assert train[1:] == ([f"a{i}" for i in range(8)] + ["b0", "b1", "b2"], [8, 3])
    assert valid[1:] == (["a8", "a9", "b3"], [2, 1])
    weighted = [DataSource("a.jsonl", 0.5), DataSource("b.jsonl", 0.5)]
    with pytest.raises(ValueError, match="leaves b.jsonl no validation documents"):
        split_loaded((weighted, docs[:10] + ["b0"], [10, 1]), "90,10")
    with pytest.raises(ValueError, match="leaves no validation documents"):
        split_loaded(([a], docs[:3], [3]), "99,1")
    with pytest.raises(ValueError, match="gives training no documents"):
        check_split("0,1,0")
    with pytest.raises(ValueError, match="train,valid,test"):
        check_split("90,5,3,2")
