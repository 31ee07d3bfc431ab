"""Routing plan from sizes only, and the gloo point-to-point transport that follows it."""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.transport.routing import (
    layout_rank,
    routing_plan,
    student_replica_of,
    teacher_samples,
)

WORLD = 4


def test_plan_sends_each_sample_from_teacher_last_stage_to_student_last_stage():
    student = ParallelLayout.for_world(8, tp=2, pp=2)  # dp 2
    teacher = ParallelLayout.for_world(8, tp=1, pp=2)  # dp 4
    routes = routing_plan(8, 2, student, teacher)
    assert len(routes) == 8 * 2  # every sample to both TP ranks of one student replica
    for route in routes:
        t = teacher.coords(route.src)
        s = student.coords(route.dst)
        assert t["pp"] == 1 and t["tp"] == 0 and t["cp"] == 0
        assert route.sample in teacher_samples(route.src, 8, teacher)
        assert s["pp"] == 1 and s["dp"] == student_replica_of(route.sample, 2, 2)[0]
    assert layout_rank(student, 0, **student.coords(5)) == 5


def _exchange(student: tuple, teacher: tuple, gbs: int, mbs: int) -> dict:
    import torch.distributed as dist

    from megatron_xdistill.transport.gloo import P2PTransport

    s_layout = ParallelLayout.for_world(WORLD, *student)
    t_layout = ParallelLayout.for_world(WORLD, *teacher)
    rank = dist.get_rank()
    routes = routing_plan(gbs, mbs, s_layout, t_layout)
    outgoing = {}
    if t_layout.coords(rank)["pp"] == t_layout.pp - 1 and t_layout.coords(rank)["tp"] == 0 \
            and t_layout.coords(rank)["cp"] == 0:
        outgoing = {i: torch.full((5,), float(i)) for i in teacher_samples(rank, gbs, t_layout)}
    received = P2PTransport(routes).exchange(outgoing, numel=5)
    return {i: t[0].item() for i, t in received.items()}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.mark.parametrize("student,teacher", [((2, 1, 1), (1, 1, 2)), ((1, 2, 1), (4, 1, 1)),
                                             ((1, 1, 1), (2, 1, 2))])
def test_each_student_rank_receives_exactly_its_samples(pool, student, teacher):
    gbs, mbs = 8, 1
    got = pool.run(_exchange, student, teacher, gbs, mbs)
    s_layout = ParallelLayout.for_world(WORLD, *student)
    for rank, samples in enumerate(got):
        c = s_layout.coords(rank)
        expected = set()
        if c["pp"] == s_layout.pp - 1:
            expected = {i for i in range(gbs) if student_replica_of(i, mbs, s_layout.dp)[0] == c["dp"]}
        assert set(samples) == expected, f"rank {rank}"
        assert all(v == float(i) for i, v in samples.items())
