"""Projection W without real tokenizers: packing, runtime form, common vocab, file formats."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_xdistill.projection import fileio
from megatron_xdistill.projection.fileio import RowKind
from megatron_xdistill.projection.nemo_rl import read_nemo_rl, write_nemo_rl
from megatron_xdistill.projection.runtime import (
    ProjectionMatrix,
    load_projection,
    save_projection,
)
from megatron_xdistill.projection.sparse_rows import pack_rows, unpack_rows


def _matrix(rows, cols, vals, vs, vt, k=3, kinds=None, renormalize=True):
    idx, w = pack_rows(
        np.array(rows), np.array(cols), np.array(vals), vs, k=k, renormalize=renormalize
    )
    kind = None if kinds is None else torch.tensor(kinds, dtype=torch.uint8)
    return ProjectionMatrix(torch.from_numpy(idx), torch.from_numpy(w), vs, vt, {"x": "y"}, kind)


# ----------------------------------------------------------------------------- pack_rows


def test_pack_rows_sums_duplicates_orders_and_cuts():
    rows = [0, 0, 0, 0, 0, 2]
    cols = [5, 3, 5, 7, 9, 1]
    vals = [0.25, 0.5, 0.25, 0.1, 0.1, 2.0]
    prio = [0, 0, 0, 1, 0, 0]
    idx, w = pack_rows(
        np.array(rows), np.array(cols), np.array(vals), 3, k=3, priority=np.array(prio)
    )
    # row 0: 5 -> 0.5 (summed), 3 -> 0.5, 9 -> 0.1 (prio 0 beats col 7's prio 1), 7 cut
    assert idx[0].tolist() == [3, 5, 9]
    np.testing.assert_allclose(w[0], [0.5, 0.5, 0.1])
    assert idx[1].tolist() == [-1, -1, -1] and w[1].tolist() == [0, 0, 0]
    assert idx[2].tolist() == [1, -1, -1]


def test_pack_rows_renormalizes_after_cut_and_drops_nonpositive():
    idx, w = pack_rows(
        np.array([0, 0, 0, 1]),
        np.array([1, 2, 3, 4]),
        np.array([3.0, 1.0, 0.5, 0.0]),
        2,
        k=2,
        renormalize=True,
    )
    np.testing.assert_allclose(w[0], [0.75, 0.25])
    assert idx[1].tolist() == [-1, -1]


def test_pack_rows_keeps_all_without_k_and_unpack_inverts():
    rows, cols, vals = (
        np.array([0, 1, 1, 1]),
        np.array([2, 0, 1, 2]),
        np.array([1.0, 0.2, 0.3, 0.5]),
    )
    idx, w = pack_rows(rows, cols, vals, 3)
    assert idx.shape == (3, 3)
    r, c, v = unpack_rows(idx, w)
    got = sorted(zip(r.tolist(), c.tolist(), np.round(v.astype(np.float64), 6).tolist()))
    assert got == sorted(zip(rows.tolist(), cols.tolist(), vals.tolist()))


def test_pack_rows_rejects_bad_input():
    with pytest.raises(ValueError, match="row ids"):
        pack_rows(np.array([3]), np.array([0]), np.array([1.0]), 2)
    with pytest.raises(ValueError, match="k must be"):
        pack_rows(np.array([0]), np.array([0]), np.array([1.0]), 2, k=0)


# ----------------------------------------------------------------------------- runtime form


def test_matrix_validates_indices_and_shapes():
    with pytest.raises(ValueError, match="outside"):
        ProjectionMatrix(torch.tensor([[5]]), torch.tensor([[1.0]]), 1, 5)
    with pytest.raises(ValueError, match="rows"):
        ProjectionMatrix(torch.tensor([[0]]), torch.tensor([[1.0]]), 2, 5)
    with pytest.raises(ValueError, match="finite"):
        ProjectionMatrix(torch.tensor([[0]]), torch.tensor([[float("nan")]]), 1, 5)


def test_local_shard_pads_megatron_rows_with_empty_entries():
    m = _matrix([0, 1, 2, 4], [1, 2, 3, 0], [1, 1, 1, 1], vs=5, vt=4, k=2)
    padded = 8  # e.g. make_vocab_size_divisible_by * TP
    shards = [m.local_shard(r * 2, r * 2 + 2) for r in range(padded // 2)]
    idx = torch.cat([s[0] for s in shards])
    w = torch.cat([s[1] for s in shards])
    assert idx.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(idx[:5], m.indices) and torch.equal(w[:5], m.weights)
    assert (idx[5:] == -1).all() and (w[5:] == 0).all()
    i, ww = m.local_shard(6, 8)  # entirely padding
    assert (i == -1).all() and (ww == 0).all()
    with pytest.raises(ValueError):
        m.local_shard(3, 2)


def test_to_dense_and_teacher_major_csr_agree():
    m = _matrix([0, 0, 1, 3, 3, 3], [2, 0, 2, 1, 2, 3], [0.9, 0.1, 1, 0.5, 0.3, 0.2], 4, 5, k=3)
    dense = m.to_dense(padded_student_vocab=6, padded_teacher_vocab=7)
    assert dense.shape == (6, 7)
    assert dense[4:].abs().sum() == 0 and dense[:, 5:].abs().sum() == 0
    np.testing.assert_allclose(dense.sum(1)[:4].numpy(), [1, 1, 0, 1], rtol=1e-6)
    crow, scol, wt = m.teacher_major_csr(padded_teacher_vocab=7)
    assert crow.shape == (8,) and crow[-1] == scol.numel() == 6
    rebuilt = torch.zeros(7, 6)
    for t in range(7):
        for j in range(int(crow[t]), int(crow[t + 1])):
            rebuilt[t, scol[j]] = wt[j]
        assert torch.all(scol[crow[t] : crow[t + 1]].diff() > 0)  # ascending student ids
    assert torch.equal(rebuilt, dense.T)
    sparse = m.to_sparse()
    assert sparse.is_coalesced() and sparse.shape == (4, 5)
    assert torch.equal(sparse.to_dense(), dense[:4, :5])
    with pytest.raises(ValueError):
        m.to_dense(padded_student_vocab=3)


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 9),
    st.integers(1, 4),
    st.lists(st.tuples(st.integers(0, 11), st.integers(0, 8), st.floats(0.01, 5.0)), max_size=40),
)
def test_runtime_views_match_dense_reference(vs, vt, k, entries):
    entries = [(r % vs, c % vt, v) for r, c, v in entries]
    rows = np.array([e[0] for e in entries], dtype=np.int64)
    cols = np.array([e[1] for e in entries], dtype=np.int64)
    vals = np.array([e[2] for e in entries], dtype=np.float64)
    m = _matrix(rows, cols, vals, vs, vt, k=k)
    dense = m.to_dense()
    # Each row: at most k entries, sums to 1 when non-empty, ordered by weight.
    nnz = (dense > 0).sum(1)
    assert (nnz <= k).all()
    sums = dense.sum(1)
    assert torch.allclose(sums[nnz > 0], torch.ones(int((nnz > 0).sum())), atol=1e-5)
    assert (m.weights[:, :-1] >= m.weights[:, 1:]).all()
    crow, scol, wt = m.teacher_major_csr()
    t_of = torch.repeat_interleave(torch.arange(vt), crow.diff())
    rebuilt = torch.zeros(vt, vs)
    rebuilt[t_of, scol] = wt
    assert torch.equal(rebuilt, dense.T)
    tp = 3
    padded = -(-vs // tp) * tp
    part = padded // tp
    idx = torch.cat([m.local_shard(r * part, (r + 1) * part)[0] for r in range(tp)])
    assert torch.equal(idx[:vs], m.indices) and (idx[vs:] == -1).all()


# ----------------------------------------------------------------------------- common vocab


def test_common_vocab_strict_drops_collisions_and_aliases():
    # rows: 0 -> 10 exact; 1 -> 11 exact; 2 -> 11 exact (collides with 1); 3 -> 12 alias of 4;
    # 4 -> 12 exact; 5 -> multi (0.9/0.1 on 13, 10); 6 -> special one-hot 14
    rows = [0, 1, 2, 3, 4, 5, 5, 6]
    cols = [10, 11, 11, 12, 12, 13, 10, 14]
    vals = [1, 1, 1, 1, 1, 0.9, 0.1, 1]
    kinds = [1, 1, 1, 6, 1, 2, 5]
    m = _matrix(rows, cols, vals, 7, 15, k=4, kinds=kinds)
    s, t = m.common_vocab("strict")
    assert s.tolist() == [0, 4, 6] and t.tolist() == [10, 12, 14]
    # Without row kinds the alias makes column 12 ambiguous too.
    m2 = ProjectionMatrix(m.indices, m.weights, 7, 15)
    s2, t2 = m2.common_vocab("strict")
    assert s2.tolist() == [0, 6] and t2.tolist() == [10, 14]


def test_common_vocab_xtoken_threshold_and_tie_breaks():
    rows = [0, 1, 1, 2, 2, 3, 3, 4, 5, 5]
    cols = [7, 7, 8, 8, 9, 8, 9, 6, 6, 2]
    vals = [1.0, 0.7, 0.3, 0.65, 0.35, 0.5, 0.5, 0.8, 0.8, 0.2]
    m = _matrix(rows, cols, vals, 6, 10, k=2)
    s, t = m.common_vocab("xtoken")
    # t=7: row 0 (1.0) beats row 1 (0.7); t=8: row 2 (0.65); row 3 below threshold;
    # t=6: rows 4 and 5 tie at 0.8 -> lowest id 4.
    assert list(zip(s.tolist(), t.tolist())) == [(0, 7), (2, 8), (4, 6)]
    assert s.dtype == t.dtype == torch.int64
    with pytest.raises(ValueError, match="strict"):
        m.common_vocab("loose")


def test_common_vocab_ignores_one_hot_rows_from_repeated_pieces():
    # row 0: "0" exact on 5; row 1: "00" -> "0" "0" merged, one-hot on 5 but a multi-token row.
    m = _matrix([0, 1, 2], [5, 5, 6], [1, 1, 1], 3, 7, k=2, kinds=[2, 1, 1])
    s, t = m.common_vocab("strict")
    assert list(zip(s.tolist(), t.tolist())) == [(1, 5), (2, 6)]
    s, t = m.common_vocab("xtoken")  # tie at weight 1: the exact row wins over the lower id
    assert list(zip(s.tolist(), t.tolist())) == [(1, 5), (2, 6)]


def test_common_vocab_empty():
    m = ProjectionMatrix(torch.full((3, 2), -1), torch.zeros(3, 2), 3, 4)
    for rule in ("strict", "xtoken"):
        s, t = m.common_vocab(rule)
        assert s.numel() == t.numel() == 0


def test_coverage_counts_kinds_or_shapes():
    m = _matrix([0, 1, 1], [0, 1, 2], [1, 1, 1], 3, 3, k=2, kinds=[1, 2, 0])
    cov = m.coverage()
    assert cov["exact"] == 1 and cov["multi_token"] == 1 and cov["empty"] == 1
    bare = ProjectionMatrix(m.indices, m.weights, 3, 3).coverage()
    assert bare == {"rows": 3, "one_hot": 1, "multi_entry": 1, "empty": 1}


# ----------------------------------------------------------------------------- safetensors file


def test_save_load_roundtrip_keeps_tensors_and_metadata(tmp_path):
    m = _matrix([0, 0, 2], [3, 1, 0], [0.9, 0.1, 1.0], 3, 4, k=2, kinds=[2, 0, 1])
    path = tmp_path / "w.safetensors"
    save_projection(m, path)
    back = load_projection(path)
    assert torch.equal(back.indices, m.indices) and torch.equal(back.weights, m.weights)
    assert torch.equal(back.row_kind, m.row_kind)
    assert back.metadata["x"] == "y" and back.metadata["top_k"] == "2"
    assert back.metadata["format"] == fileio.FORMAT_NAME
    tensors, _ = fileio.read_projection_file(path)
    assert tensors["indices"].dtype == torch.int32
    assert os.listdir(tmp_path) == ["w.safetensors"]  # no temp files left


def test_failed_write_keeps_old_file_and_no_temp(tmp_path, monkeypatch):
    m = _matrix([0], [1], [1.0], 1, 2, k=1)
    path = tmp_path / "w.safetensors"
    save_projection(m, path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_projection(_matrix([0], [0], [1.0], 1, 2, k=1), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["w.safetensors"]


def test_read_rejects_missing_field_and_bad_dtype(tmp_path):
    from safetensors.torch import save_file

    p = tmp_path / "bad.safetensors"
    save_file({"indices": torch.zeros(2, 2, dtype=torch.int32)}, str(p))
    with pytest.raises(ValueError, match=r"bad\.safetensors.*'weights'"):
        load_projection(p)
    save_file(
        {
            "indices": torch.zeros(2, 2, dtype=torch.int32),
            "weights": torch.zeros(2, 2, dtype=torch.float64),
        },
        str(p),
        metadata={"student_vocab_size": "2", "teacher_vocab_size": "3"},
    )
    with pytest.raises(ValueError, match="'weights' must be float32"):
        load_projection(p)
    save_file(
        {"indices": torch.zeros(2, 2, dtype=torch.int32), "weights": torch.zeros(2, 2)},
        str(p),
        metadata={"format_version": "99"},
    )
    with pytest.raises(ValueError, match="format_version"):
        load_projection(p)
    with pytest.raises(FileNotFoundError):
        load_projection(tmp_path / "missing.safetensors")


# ----------------------------------------------------------------------------- NeMo-RL files


@pytest.mark.parametrize("form", ["dense", "sparse"])
def test_nemo_rl_roundtrip(tmp_path, form):
    m = _matrix([0, 0, 1, 3, 3], [4, 2, 0, 1, 3], [0.7, 0.3, 1, 0.5, 0.5], 4, 5, k=2)
    path = tmp_path / f"{form}.pt"
    write_nemo_rl(path, m.indices, m.weights, form=form)
    raw = torch.load(path, weights_only=True)
    if form == "dense":
        assert set(raw) == {"indices", "likelihoods"} and (raw["indices"] >= 0).all()
    else:
        assert raw[(0, 4)] == pytest.approx(0.7)
    back = load_projection(path)
    assert back.metadata["source"] == f"nemo-rl-{form}:{form}.pt"
    assert torch.equal(back.indices, m.indices)
    assert torch.allclose(back.weights, m.weights)


def test_nemo_rl_dense_log_space_and_padding(tmp_path):
    idx = torch.tensor([[3, 1, 0], [2, 0, 0]])
    logp = torch.log(torch.tensor([[0.6, 0.4, 1e-30], [1.0, 1e-30, 1e-30]]))
    logp[0, 2] = float("-inf")
    torch.save({"indices": idx, "likelihoods": logp}, tmp_path / "log.pt")
    i, w, form = read_nemo_rl(tmp_path / "log.pt")
    assert form == "dense"
    assert i[0, :2].tolist() == [3, 1] and i[1, 0] == 2
    np.testing.assert_allclose(w[0, :2], [0.6, 0.4], rtol=1e-6)


def test_nemo_rl_rejects_bad_files(tmp_path):
    torch.save(
        {"indices": torch.tensor([[0, 1]]), "likelihoods": torch.tensor([[0.5, -0.5]])},
        tmp_path / "a.pt",
    )
    with pytest.raises(ValueError, match=r"a\.pt.*negative"):
        read_nemo_rl(tmp_path / "a.pt")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match=r"b\.pt: unrecognised NeMo-RL projection"):
        read_nemo_rl(tmp_path / "b.pt")
    with open(tmp_path / "c.pt", "wb") as f:
        pickle.dump({"indices": RowKind}, f, protocol=2)  # a class object: refused by weights_only
    with pytest.raises(ValueError, match=r"c\.pt.*weights_only"):
        read_nemo_rl(tmp_path / "c.pt")
    torch.save({"indices": torch.zeros(2, 2), "likelihoods": torch.zeros(2, 2)}, tmp_path / "d.pt")
    with pytest.raises(ValueError, match="integer"):
        read_nemo_rl(tmp_path / "d.pt")
