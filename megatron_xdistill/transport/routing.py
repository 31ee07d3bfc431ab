"""Routing plan: which rank sends which sample's teacher payload to which ranks.

Computed from sizes only (global batch, micro-batch sizes, both layouts), so every rank derives
the same plan without communication. The teacher's payload for a sample exists on its replica's
last pipeline stage (identical on every TP/CP rank there after the teacher-side reduction); one of
those ranks (TP 0, CP 0) is the sender. Every rank of the student replica's last stage that owns
the sample (all its TP and CP ranks) receives it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.parallel.sample_owners import (
    student_replica_of,
    teacher_block,
    teacher_replica_of,
)


def layout_rank(layout: ParallelLayout, offset: int, tp: int, cp: int, dp: int, pp: int) -> int:
    """Global rank of layout coordinates (Megatron order tp-cp-dp-pp, TP fastest)."""
    return offset + tp + layout.tp * (cp + layout.cp * (dp + layout.dp * pp))


@dataclass(frozen=True)
class Route:
    """One sample's payload: from ``src`` to ``dst`` (equal ranks mean a local copy)."""

    sample: int
    src: int
    dst: int


def routing_plan(global_batch_size: int, micro_batch_size: int, student: ParallelLayout,
                 teacher: ParallelLayout, student_offset: int = 0,
                 teacher_offset: int = 0) -> list[Route]:
    """All routes of one global batch, ordered by (sample, dst)."""
    routes = []
    for sample in range(global_batch_size):
        t_dp = teacher_replica_of(sample, global_batch_size, teacher.dp)
        src = layout_rank(teacher, teacher_offset, 0, 0, t_dp, teacher.pp - 1)
        s_dp, _ = student_replica_of(sample, micro_batch_size, student.dp)
        for cp in range(student.cp):
            for tp in range(student.tp):
                dst = layout_rank(student, student_offset, tp, cp, s_dp, student.pp - 1)
                routes.append(Route(sample, src, dst))
    return routes


def teacher_samples(rank: int, global_batch_size: int, teacher: ParallelLayout,
                    teacher_offset: int = 0) -> list[int]:
    """Samples (indices within the global batch) whose teacher forward runs on ``rank``."""
    return teacher_block(global_batch_size, teacher.dp, teacher.coords(rank - teacher_offset)["dp"])
