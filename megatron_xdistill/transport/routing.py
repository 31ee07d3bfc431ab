"""Routing plan: which rank sends which sample's teacher payload to which ranks.

Computed from sizes only (global batch, micro-batch sizes, both layouts), so every rank derives
the same plan without communication. Every rank of the student replica's last stage that owns
a sample (all its TP and CP ranks) receives its own copy of the sample's teacher payload. That
payload exists on every TP and CP rank of the teacher replica's last pipeline stage (identical
there after the vocab-parallel and CP reductions, at no extra cost), so all of them send: a
receiving rank that is itself one of them keeps its own copy (no transfer), and the replica's
other copies are split into equal, contiguous runs (in sample, receiver order), one run per
sender. The busiest sender then carries 1 / (TP x CP) of what one sender would, and each
sample sits in the send buffers of at most a few senders.
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


def last_stage_ranks(layout: ParallelLayout, offset: int, dp: int) -> list[int]:
    """Global ranks of replica ``dp``'s last pipeline stage, TP fastest then CP."""
    return [layout_rank(layout, offset, tp, cp, dp, layout.pp - 1)
            for cp in range(layout.cp) for tp in range(layout.tp)]


def routing_plan(global_batch_size: int, micro_batch_size: int, student: ParallelLayout,
                 teacher: ParallelLayout, student_offset: int = 0,
                 teacher_offset: int = 0) -> list[Route]:
    """All routes of one global batch, ordered by (sample, dst); senders as the module says."""
    wanted: dict[int, list[tuple[int, int]]] = {}  # teacher replica -> its (sample, dst) copies
    for sample in range(global_batch_size):
        t_dp = teacher_replica_of(sample, global_batch_size, teacher.dp)
        s_dp, _ = student_replica_of(sample, micro_batch_size, student.dp)
        wanted.setdefault(t_dp, []).extend(
            (sample, dst) for dst in last_stage_ranks(student, student_offset, s_dp))
    routes = []
    for t_dp, copies in wanted.items():
        senders = last_stage_ranks(teacher, teacher_offset, t_dp)
        holders = set(senders)
        moved = [c for c in copies if c[1] not in holders]
        routes += [Route(sample, dst, dst) for sample, dst in copies if dst in holders]
        # sender k sends moved[k * n // S : (k + 1) * n // S]: equal runs, in order
        n, count = len(moved), len(senders)
        for k, src in enumerate(senders):
            routes += [Route(sample, src, dst)
                       for sample, dst in moved[k * n // count:(k + 1) * n // count]]
    routes.sort(key=lambda r: (r.sample, r.dst))
    return routes


def teacher_samples(rank: int, global_batch_size: int, teacher: ParallelLayout,
                    teacher_offset: int = 0) -> list[int]:
    """Samples (indices within the global batch) whose teacher forward runs on ``rank``."""
    return teacher_block(global_batch_size, teacher.dp, teacher.coords(rank - teacher_offset)["dp"])
