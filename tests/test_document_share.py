"""Each rank reads only the documents of its own samples (data/document_share.py): random access
per file format against the whole-file readers, the share of a DP rank against the eager
document list, and --split numbering."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from megatron_xdistill.data.document_share import (
    DocumentNumbering,
    DocumentShare,
    documents_of_samples,
    step_samples,
)
from megatron_xdistill.data.packing import PackingPlan, load_documents
from megatron_xdistill.data.sources import parse_data_path, read_documents, read_documents_at
from megatron_xdistill.data.split import split_loaded, split_ranges


def _corpus(tmp_path: Path) -> dict[str, list[str]]:
    """The same kind of corpus in every format: JSONL with blank lines, Parquet in several row
    groups (with a null text), Arrow, plain text."""
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    texts = [f"document {i} " + "é" * (i % 5) for i in range(23)]
    lines = []
    for i, t in enumerate(texts):
        lines.append(json.dumps({"id": i, "text": t}))
        if i % 4 == 0:
            lines.append("   ")  # blank lines are not documents
        if i % 6 == 1:
            lines.append("\u00a0\u3000")  # nor lines of Unicode white space
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with_null = texts[:7] + [None] + texts[8:]
    pq.write_table(pa.table({"id": list(range(23)), "text": with_null}),
                   tmp_path / "b.parquet", row_group_size=5)
    feather.write_feather(pa.table({"text": texts}), tmp_path / "c.arrow")
    (tmp_path / "d.txt").write_text("one whole file")
    return {"a.jsonl": texts, "b.parquet": texts[:7] + [""] + texts[8:], "c.arrow": texts,
            "d.txt": ["one whole file"]}


def test_random_access_equals_the_whole_file_per_format(tmp_path, monkeypatch):
    """``read_documents_at`` gives exactly the whole-file reader's documents at those indices;
    Parquet reads only the row groups that hold them; bad indices are refused."""
    import pyarrow.parquet as pq

    expected = _corpus(tmp_path)
    groups = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, i, **kw: (groups.append(i), real(self, i, **kw))[1])
    for name, texts in expected.items():
        path = str(tmp_path / name)
        assert read_documents(path) == texts
        picks = [0] if name == "d.txt" else [1, 7, 8, 14, 22]
        assert read_documents_at(path, picks) == [texts[i] for i in picks], name
    assert groups == [0, 1, 2, 4]  # rows 1 | 7, 8 | 14 | 22 of row groups of 5
    with pytest.raises(IndexError, match=r"a.jsonl holds 23 documents, not 24"):
        read_documents_at(str(tmp_path / "a.jsonl"), [3, 23])
    with pytest.raises(IndexError, match=r"b.parquet holds 23 documents"):
        read_documents_at(str(tmp_path / "b.parquet"), [23])
    with pytest.raises(ValueError, match="ascend"):
        read_documents_at(str(tmp_path / "a.jsonl"), [5, 5])


def _plan(pieces_per_sample: list[list[int]]) -> PackingPlan:
    rows = [[d, 0, 1, 1, 1] for sample in pieces_per_sample for d in sample]
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in pieces_per_sample])])
    return PackingPlan(np.asarray(rows, np.int64).reshape(-1, 5), offsets.astype(np.int64), "k")


def test_a_rank_reads_only_the_documents_of_its_samples(tmp_path):
    """Two sources blended, --split applied: the share of a DP rank's samples holds those
    documents with the eager list's texts under the same ids, and no others."""
    _corpus(tmp_path)
    sources = parse_data_path([str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")])
    loaded = (sources, *load_documents(sources, "text"))
    (_, train_docs, train_counts), _ = split_loaded(loaded, "80,20")
    numbering = DocumentNumbering(sources, [split_ranges("80,20", c)[0] for c in loaded[2]])
    assert numbering.counts == train_counts and len(numbering) == len(train_docs)

    plan = _plan([[0, 5], [5], [18, 19], [35], [2], [30, 31, 0]])
    samples = step_samples([0, 1], 0, 2, 3, len(plan))  # positions 0, 1 of 3-sample batches
    assert samples.tolist() == [0, 1, 3, 4]
    ids = documents_of_samples(plan, samples)
    assert ids.tolist() == [0, 2, 5, 35]
    share = DocumentShare.read(numbering, ids, "text")
    assert dict(share) == {d: train_docs[d] for d in ids.tolist()}
    assert share.total == len(train_docs)
    with pytest.raises(KeyError, match=r"document 18 is not in this rank's share \(4 of 36"):
        share[18]


def test_step_samples_follow_the_sampler_and_wrap():
    """The samples a rank will read from step k on are what StepSampler yields from k."""
    from megatron_xdistill.data.loader import StepSampler
    from megatron_xdistill.parallel.layout import ParallelLayout

    layout = ParallelLayout(dp=2)
    sampler = StepSampler(20, 1, 8, 2, 1, layout, None, layout)
    it = iter(sampler)
    seen = sorted({i for _ in range(3) for i in next(it)})
    assert step_samples(sampler.local, 1, 4, 8, 20).tolist() == seen


def _rank0_reads(fail: bool):
    import torch.distributed as dist

    from megatron_xdistill.training.run_data import on_rank0 as _on_rank0

    def read():  # runs on rank 0 only
        if fail:
            raise ValueError("docs.jsonl:3: no field 'text'")
        return {"counts": [dist.get_rank() + 7]}

    try:
        return "ok", _on_rank0(read)
    except ValueError as exc:
        return "error", str(exc)


def test_rank0_reads_and_every_rank_gets_its_result_or_its_error():
    """Only rank 0 reads the corpus; the others get what it found, or the same error (never a
    hang in the broadcast while rank 0 has failed)."""
    from megatron_xdistill.testing.multirank import RankPool

    with RankPool(2) as pool:
        assert pool.run(_rank0_reads, False) == [("ok", {"counts": [7]})] * 2
        assert pool.run(_rank0_reads, True) == [("error", "docs.jsonl:3: no field 'text'")] * 2
