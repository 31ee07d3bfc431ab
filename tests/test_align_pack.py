"""Packed batch form of alignments (no tokenizers needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_xdistill.align.chunks import Alignment
from megatron_xdistill.align.pack import pack_alignments, predicting_chunk_id


def test_pack_two_samples_with_padding() -> None:
    a = [(0, 1, 0, 2, True), (1, 3, 2, 3, False)]
    b = [(0, 2, 0, 1, True)]
    out = pack_alignments([a, b], [3, 2], [3, 1])
    assert out["student_chunk_id"].tolist() == [[0, 1, 1], [0, 0, -1]]
    assert out["teacher_chunk_id"].tolist() == [[0, 0, 1], [0, -1, -1]]
    assert out["chunk_valid"].tolist() == [[True, True], [True, False]]
    assert out["chunk_exact"].tolist() == [[True, False], [True, False]]
    assert out["student_span"].tolist() == [[[0, 1], [1, 3]], [[0, 2], [-1, -1]]]
    assert out["student_chunk_id"].dtype == torch.int64
    assert out["chunk_valid"].dtype == torch.bool


def test_pack_bos_offset_shifts_spans() -> None:
    chunks = [(0, 1, 0, 1, True), (1, 2, 1, 3, True)]
    out = pack_alignments([chunks], [2], [3], student_offset=1, teacher_offset=[1])
    assert out["student_chunk_id"].tolist() == [[-1, 0, 1]]
    assert out["teacher_chunk_id"].tolist() == [[-1, 0, 1, 1]]
    # With BOS the first chunk is predicted from the BOS position.
    assert predicting_chunk_id(out["student_chunk_id"]).tolist() == [[0, 1, -1]]


def test_pack_truncation_and_max_chunks() -> None:
    chunks = [(0, 2, 0, 1, True), (2, 4, 1, 3, True), (4, 5, 3, 4, True)]
    out = pack_alignments([chunks], [5], [4], student_width=3, max_chunks=2)
    assert out["student_chunk_id"].tolist() == [[0, 0, 1]]
    assert out["teacher_chunk_id"].tolist() == [[0, 1, 1, -1]]  # third chunk has no slot
    assert out["chunk_valid"].tolist() == [[True, False]]  # chunk 1 is cut by the width
    assert out["chunk_exact"].tolist() == [[True, False]]


def test_pack_empty_side_chunk_is_invalid() -> None:
    chunks = [(0, 1, 0, 1, True), (1, 1, 1, 2, False), (1, 2, 2, 3, True)]
    out = pack_alignments([chunks], [2], [3])
    assert out["chunk_valid"].tolist() == [[True, False, True]]
    assert out["teacher_chunk_id"].tolist() == [[0, 1, 2]]


def test_pack_accepts_alignments_and_empty_samples() -> None:
    al = Alignment(np.array([5, 6]), np.array([7]), np.array([[0, 2, 0, 1, 1]]))
    empty = Alignment(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, 5), np.int64))
    out = pack_alignments([al, empty])
    assert out["student_chunk_id"].tolist() == [[0, 0], [-1, -1]]
    assert out["chunk_valid"].tolist() == [[True], [False]]


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="reach past"):
        pack_alignments([[(0, 3, 0, 1, True)]], [2], [1])
    with pytest.raises(ValueError, match="rows"):
        pack_alignments([[(0, 1, 0)]], [1], [1])
    with pytest.raises(ValueError, match="one value per sample"):
        pack_alignments([[(0, 1, 0, 1, True)]], [1], [1], student_offset=[1, 2])


@st.composite
def _chunk_lists(draw):
    """Random ordered partitions of two sequences into chunks."""
    n = draw(st.integers(0, 12))
    sizes = draw(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3),
                                    st.booleans()).filter(lambda x: x[0] + x[1] > 0),
                          max_size=n))
    a = p = 0
    chunks = []
    for ls, lt, ex in sizes:
        chunks.append((a, a + ls, p, p + lt, ex and ls > 0 and lt > 0))
        a += ls
        p += lt
    return chunks, a, p


@given(st.lists(_chunk_lists(), min_size=1, max_size=4), st.integers(0, 2), st.integers(0, 2))
@settings(max_examples=150, deadline=None)
def test_pack_matches_direct_loop(samples, s_off, t_off) -> None:
    chunks = [c for c, _, _ in samples]
    out = pack_alignments(chunks, [n for _, n, _ in samples], [m for _, _, m in samples],
                          student_offset=s_off, teacher_offset=t_off)
    for b, (ch, _, _) in enumerate(samples):
        sid = out["student_chunk_id"][b].tolist()
        tid = out["teacher_chunk_id"][b].tolist()
        exp_s = [-1] * len(sid)
        exp_t = [-1] * len(tid)
        for c, (a, e, p, q, ex) in enumerate(ch):
            for i in range(a, e):
                exp_s[s_off + i] = c
            for j in range(p, q):
                exp_t[t_off + j] = c
            assert bool(out["chunk_valid"][b, c]) == (e > a and q > p)
            assert bool(out["chunk_exact"][b, c]) == ex
        assert sid == exp_s and tid == exp_t
        assert not out["chunk_valid"][b, len(ch):].any()
