"""The scale simulation: one rank's construction work stays linear in the world (counted at a
simulated 1,024-node world), and the simulation's groups and bytes equal a real gloo run's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.transport.counting import simulated_rank
from megatron_xdistill.transport.simulate import (
    Scenario,
    TeacherSetup,
    _meta_slots,
    construct,
    places_of,
    step_traffic,
)

PACKAGE = str(Path(__file__).resolve().parents[1] / "megatron_xdistill")
DIST = str(Path(torch.distributed.__file__).parent)


def _opcodes(fn) -> int:
    """Bytecodes executed by the project's and torch.distributed's Python code in ``fn()``: a
    deterministic measure of one rank's work (not wall time)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
        return local

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name.startswith(PACKAGE) or name.startswith(DIST):
            frame.f_trace_opcodes = True
            return local
        return None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def _transport_work(nodes: int, rank: int) -> tuple[int, object]:
    """One rank's construction of a colocated transport over ``nodes`` nodes of 8 GPUs
    (student TP8, one replica per node; teacher TP8 PP2, its senders on the upper half's nodes;
    the cross-node group NCCL, as on GPUs). ``rank`` < 0 counts from the world's middle."""
    from megatron_xdistill.parallel.shape import ParallelLayout
    from megatron_xdistill.transport.routed import RoutedTransport
    from megatron_xdistill.transport.routing import routing_plan

    world = 8 * nodes
    student = ParallelLayout.for_world(world, tp=8)
    teacher = ParallelLayout.for_world(world, tp=8, pp=2)
    routes = routing_plan(student.dp, 1, student, teacher)
    node_of, gpus = places_of(world, 8)
    rank = rank if rank >= 0 else world // 2 - rank - 1
    with simulated_rank(rank, world, default_backend="gloo") as record, _meta_slots():
        work = _opcodes(lambda: RoutedTransport(routes, 16, nodes=node_of, gpus=gpus,
                                                device="meta", backend="nccl"))
    return work, record


def test_one_ranks_transport_construction_is_linear_in_the_world():
    """At 128 and 1,024 nodes (8 per node), a sender's and a receiver's construction: the Python
    work grows like the rank list (8x, not 64x as a loop over nodes x ranks would), the
    groups it is a member of, the store operations they need and the collectives it joins do
    not grow at all, and in the groups it is not a member of it only lists their ranks once."""
    from megatron_xdistill.transport.scale_costs import CostModel

    costs = CostModel()
    for rank in (-1, -10, 9):  # teacher sender (TP 0 of the last stage), ranks of other nodes
        small, small_record = _transport_work(128, rank)
        large, large_record = _transport_work(1024, rank)
        assert large / small < 10, (rank, small, large)
        assert small_record.collectives == large_record.collectives
        assert len(small_record.member_groups) == len(large_record.member_groups) <= 2
        assert costs.construction(small_record, 1024)["store_ops"] == \
            costs.construction(large_record, 8192)["store_ops"] <= 9
        assert large_record.nonmember_rank_entries <= 8 * 1024


# ---------------------------------------------------------------- against a real gloo run
def _real_construction(scenario: Scenario) -> dict:
    """What a Distiller builds for ``scenario`` on this rank (no models), recorded, plus one
    step's payloads sent along the plans."""
    import torch.distributed as dist

    from megatron_xdistill.parallel.group_scope import run_process_groups
    from megatron_xdistill.transport.construction import build_run_transports
    from megatron_xdistill.transport.counting import recorded

    rank = dist.get_rank()
    placement = scenario.placement_of()
    student, teachers = scenario.layouts()
    numels = [scenario.payload_numel(t) for t in scenario.teachers]
    with run_process_groups(), recorded() as record:
        run = build_run_transports(placement, student, teachers, scenario.global_batch_size(),
                                   scenario.micro_batch_size, numels)
        plans, transports, nodes = run.plans, run.transports, run.nodes
        built = (list(record.groups), list(record.collectives))
        for k, (routes, transport) in enumerate(zip(plans, transports, strict=True)):
            numel = scenario.payload_numel(scenario.teachers[k])
            outgoing = {r.sample: torch.zeros(numel) for r in routes if r.src == rank}
            if not placement.disaggregated:
                transport.exchange(outgoing)
            elif placement.is_teacher_of(rank, k):
                transport.send(0, outgoing, [0.0])
            elif placement.is_student(rank):
                transport.receive(0)
            if placement.disaggregated:
                transport.finish()
            transport.close()
        sent = dict(record.sent_bytes)
    return {"groups": built[0], "collectives": built[1], "sent": sent, "nodes": nodes}


def _compare(pool: RankPool, scenario: Scenario) -> None:
    real = pool.run(_real_construction, scenario)
    sim_nodes, _ = places_of(scenario.gpus, scenario.gpus_per_node)
    assert real[0]["nodes"] == sim_nodes
    simulated = [construct(scenario, r, backend="gloo") for r in range(scenario.gpus)]
    traffic = step_traffic(scenario, simulated[0].routes)
    for rank, (got, sim) in enumerate(zip(real, simulated, strict=True)):
        assert got["groups"] == sim.record.groups, f"rank {rank}"
        assert got["collectives"] == sim.record.collectives, f"rank {rank}"
        assert sum(got["sent"].values()) == traffic.out_bytes[rank], f"rank {rank}"
    assert sum(traffic.out_bytes) > 0


def _nodes_of(world: int, per_node: int) -> list[dict]:
    return [{"GROUP_RANK": str(r // per_node), "LOCAL_RANK": str(r % per_node),
             "LOCAL_WORLD_SIZE": str(per_node)} for r in range(world)]


SMALL = {"seq_length": 7, "form": "chunk_topk", "topk": 2, "micro_batches": 2}


def test_simulation_equals_a_real_four_rank_run():
    """Colocated, disaggregated and two disaggregated teachers on 4 gloo ranks in two "nodes":
    every rank's groups (ranks, backend, membership, order), its construction collectives and
    the payload bytes it sends in one step equal the simulation's."""
    colocated = Scenario(4, student_tp=2, teachers=(TeacherSetup("qwen3-8b", pp=2),),
                         gpus_per_node=2, **SMALL)
    disaggregated = Scenario(4, teachers=(TeacherSetup("qwen3-8b", pp=2, ranks=2),),
                             placement="disaggregated", gpus_per_node=2, **SMALL)
    two = Scenario(4, teachers=(TeacherSetup("qwen3-8b", ranks=1),
                                TeacherSetup("qwen3-32b", ranks=1)),
                   placement="disaggregated", gpus_per_node=2, **SMALL)
    with RankPool(4, rank_env=_nodes_of(4, 2)) as pool:
        for scenario in (colocated, disaggregated, two):
            _compare(pool, scenario)


@pytest.mark.slow
def test_simulation_equals_a_real_eight_rank_run():
    """8 ranks, two "nodes" of 4: colocated with PP2 teacher, and two disaggregated teachers
    whose ranks share node 1 with student ranks (slots within it, p2p across)."""
    colocated = Scenario(8, student_tp=2, teachers=(TeacherSetup("qwen3-8b", tp=2, pp=2),),
                         gpus_per_node=4, **SMALL)
    two = Scenario(8, teachers=(TeacherSetup("qwen3-8b", ranks=1),
                                TeacherSetup("qwen3-32b", pp=2, ranks=2)),
                   placement="disaggregated", gpus_per_node=4, **SMALL)
    with RankPool(8, rank_env=_nodes_of(8, 4)) as pool:
        for scenario in (colocated, two):
            _compare(pool, scenario)
