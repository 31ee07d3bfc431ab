"""The groups, routing plans and transports a distillation run builds before its first step, as
one function: the scale simulation (:mod:`.simulate`, torch.distributed counted) and the real
gloo runs that validate it (tests/test_scale.py, torch.distributed executed) both call it, so
the two cannot drift apart.

Its order is the Distiller's (training/distiller.py): both layouts' Megatron-Core groups, the
all-gather of every rank's node and GPU, the disaggregated worlds, then per teacher its routing
plan and its transport (:class:`~.routed.RoutedTransport` colocated,
:class:`~.routed.RoutedStream` disaggregated). Collective over the whole world.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_xdistill.parallel.layout import ParallelLayout, build_model_parallel_groups
from megatron_xdistill.parallel.placement import Placement
from megatron_xdistill.transport import routed
from megatron_xdistill.transport.routing import Route, routing_plan


@dataclass
class RunTransports:
    """What :func:`build_run_transports` built on this rank: each teacher's routing plan and
    transport, every rank's node, and the CPU seconds the plans took (``plan_seconds``)."""

    plans: list[list[Route]]
    transports: list
    nodes: list[int]
    plan_seconds: float


def build_run_transports(placement: Placement, student: ParallelLayout,
                         teachers: Sequence[ParallelLayout], global_batch_size: int,
                         micro_batch_size: int, numels: Sequence[int],
                         device: torch.device | str = "cpu",
                         backend: str | None = None) -> RunTransports:
    """Build a run's groups, plans and transports on this rank (module docstring).
    ``numels[k]``: teacher ``k``'s payload floats per sample. ``device``: where payloads live
    (``meta`` in the simulation: nothing allocated). ``backend``: the cross-node groups'
    (default NCCL on a GPU, else gloo)."""
    build_model_parallel_groups(student, placement.student_offset)
    for k, layout in enumerate(teachers):
        build_model_parallel_groups(layout, placement.teacher_offset_of(k))
    nodes, gpus = routed.rank_places(device)
    if placement.disaggregated:
        dist.new_group(placement.student_global_ranks())
        for k in range(len(teachers)):
            dist.new_group(placement.teacher_global_ranks_of(k))
    start = time.process_time()
    plans = [routing_plan(global_batch_size, micro_batch_size, student, layout,
                          placement.student_offset, placement.teacher_offset_of(k))
             for k, layout in enumerate(teachers)]
    plan_seconds = time.process_time() - start
    cls = routed.RoutedStream if placement.disaggregated else routed.RoutedTransport
    transports = [cls(routes, numel, nodes=nodes, gpus=gpus, device=device, backend=backend)
                  for routes, numel in zip(plans, numels, strict=True)]
    return RunTransports(plans, transports, nodes, plan_seconds)
