"""The step-time benchmark's 'ideal' step (benchmarks/bench_teachers.py): what its rows are judged
against, so its arithmetic is checked here on hand-made phase times."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_teachers  # noqa: E402


def _phases(teacher: float, student: float, optimizer: float, wall: float, **each) -> dict:
    return dict(teacher=teacher, route=0.0, student=student, loss=0.1, optimizer=optimizer,
                wall=wall, **each)


ROWS = [
    (["qwen"], "colocated", _phases(4.0, 3.0, 0.5, 7.5, qwen=4.0)),
    (["gemma"], "colocated", _phases(2.0, 3.0, 0.5, 5.5, gemma=2.0)),
    (["qwen", "gemma"], "colocated", _phases(6.0, 3.2, 0.5, 9.7, qwen=4.0, gemma=2.0)),
    (["qwen"], "disaggregated", _phases(4.4, 3.3, 0.5, 4.4, qwen=4.4)),
    (["gemma"], "disaggregated", _phases(2.2, 3.3, 0.5, 3.8, gemma=2.2)),
    (["qwen", "gemma"], "disaggregated", _phases(9.0, 5.0, 0.5, 6.0, qwen=8.0, gemma=5.0)),
]


def _args(**kw) -> SimpleNamespace:
    base = dict(random_weights=True, nproc=1, threads_per_rank=1, teacher_ranks=1,
                seq_length=128, train_iters=4)
    return SimpleNamespace(**(base | kw))


def _work() -> dict:
    return {"qwen": 4.0, "gemma": 2.0, ("qwen",): 3.5, ("gemma",): 3.5, ("qwen", "gemma"): 3.7}


def test_colocated_ideal_is_every_phase_in_turn():
    m = ROWS[2][2]
    assert bench_teachers.ideal(["qwen", "gemma"], "colocated", m, _work(), _args(), 2) == \
        pytest.approx(4.0 + 2.0 + 3.7)


@pytest.mark.parametrize("cores, expected", [
    (16, 4.0),                          # a core per rank: the slowest side (qwen)
    (2, (3.7 + 4.0 + 2.0) / 2),         # three ranks on two cores: all work over the cores
])
def test_disaggregated_ideal_is_the_slowest_side_or_the_cores_limit(cores, expected):
    m = ROWS[5][2]  # its own (contended) phase times must not be used where colocated ones exist
    got = bench_teachers.ideal(["qwen", "gemma"], "disaggregated", m, _work(), _args(), cores)
    assert got == pytest.approx(expected)


def test_ideal_counts_every_rank_and_thread():
    m = ROWS[3][2]
    args = _args(nproc=2, teacher_ranks=2, threads_per_rank=2)
    # (3.5 x 2 student ranks + 4.0 x 2 teacher ranks) x 2 threads over 4 cores
    assert bench_teachers.ideal(["qwen"], "disaggregated", m, _work(), args, 4) == \
        pytest.approx(7.5)


def test_table_rows_use_the_colocated_phase_times():
    text = bench_teachers.table(ROWS, _args(), cores=2)
    lines = [ln for ln in text.splitlines() if ln.startswith("| qwen + gemma | disaggregated")]
    cells = [c.strip() for c in lines[0].strip("|").split("|")]
    assert cells[-2:] == [f"{(3.7 + 4.0 + 2.0) / 2:.2f}", f"{6.0 / ((3.7 + 4.0 + 2.0) / 2):.2f}"]
    assert "2 CPU cores" in text
