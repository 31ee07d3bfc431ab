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

    previous = sys.gettrace()  # coverage's tracer under `make coverage`: put it back after
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(previous)
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


def _compare(pool: RankPool, scenario: Scenario, senders: set[int] | None = None) -> None:
    """The real run's groups, collectives and bytes sent per rank equal the simulation's;
    ``senders``: the ranks that send payload bytes in the real run."""
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
    if senders is not None:
        assert {r for r, got in enumerate(real) if got["sent"]} == senders


def _nodes_of(world: int, per_node: int) -> list[dict]:
    return [{"GROUP_RANK": str(r // per_node), "LOCAL_RANK": str(r % per_node),
             "LOCAL_WORLD_SIZE": str(per_node)} for r in range(world)]


SMALL = {"seq_length": 7, "form": "chunk_topk", "topk": 2, "micro_batches": 2}


def test_simulation_equals_a_real_four_rank_run():
    """Colocated, disaggregated and two disaggregated teachers on 4 gloo ranks in two "nodes":
    every rank's groups (ranks, backend, membership, order), its construction collectives and
    the payload bytes it sends in one step equal the simulation's. The TP2 teachers' sends
    leave from both TP ranks of their last stage; an MoE teacher (EP2) adds its expert groups."""
    colocated = Scenario(4, student_tp=2, teachers=(TeacherSetup("qwen3-8b", tp=2, pp=2),),
                         gpus_per_node=2, **SMALL)
    disaggregated = Scenario(4, teachers=(TeacherSetup("qwen3-8b", tp=2, ranks=2),),
                             placement="disaggregated", gpus_per_node=2, **SMALL)
    two = Scenario(4, teachers=(TeacherSetup("qwen3-8b", ranks=1),
                                TeacherSetup("qwen3-32b", ranks=1)),
                   placement="disaggregated", gpus_per_node=2, **SMALL)
    moe = Scenario(4, student_tp=2, teachers=(TeacherSetup("qwen3-30b-a3b", tp=2, ep=2),),
                   gpus_per_node=2, **SMALL)
    with RankPool(4, rank_env=_nodes_of(4, 2)) as pool:
        for scenario in (colocated, disaggregated, two):
            _compare(pool, scenario, senders={2, 3})  # both TP ranks of a TP2 last stage
        _compare(pool, moe, senders={0, 1, 2, 3})  # its expert groups too


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


def test_spread_sends_divide_the_busiest_link_by_the_teachers_last_stage():
    """A TP8 PP2 teacher on 16 of 64 GPUs (disaggregated; 8 per node), TP1 and TP4 students:
    every rank of a teacher replica's last stage sends, so the busiest GPU NIC carries 1/8 of
    what the replica's TP rank 0 alone would (the same copies, each student rank its own)."""
    from megatron_xdistill.transport.simulate import one_sender_plans

    for student_tp in (1, 4):
        scenario = Scenario(64, student_tp=student_tp, placement="disaggregated",
                            teachers=(TeacherSetup("qwen3-32b", tp=8, pp=2, ranks=16),), **SMALL)
        plans = construct(scenario, 0).routes
        alone = one_sender_plans(scenario, plans)
        assert sorted((r.sample, r.dst) for r in plans[0]) == \
            sorted((r.sample, r.dst) for r in alone[0])
        # payload bytes only (num_stats=0: no trailer per sender-receiver pair)
        spread, single = (step_traffic(scenario, p, num_stats=0) for p in (plans, alone))
        assert [r for r, b in enumerate(spread.out_bytes) if b] == list(range(56, 64))
        assert [r for r, b in enumerate(single.out_bytes) if b] == [56]  # TP 0 of the stage
        assert spread.in_bytes == single.in_bytes  # each student rank gets the same bytes
        assert max(single.out_bytes) == 8 * max(spread.out_bytes)


def test_an_moe_teachers_expert_groups_are_counted():
    """An EP4 teacher (TP2, 32 ranks colocated on 32): the simulated construction enters the
    expert grid's groups (TP x EP x expert DP x PP: EP, expert DP, TP x EP, TP x EP x PP) on
    top of the dense teacher's, as Megatron-Core's parallel_state makes them."""
    dense = Scenario(32, teachers=(TeacherSetup("qwen3-30b-a3b", tp=2),), **SMALL)
    moe = Scenario(32, teachers=(TeacherSetup("qwen3-30b-a3b", tp=2, ep=4),), **SMALL)
    tp, ep, world = 2, 4, 32
    expert_dp = world // tp // ep
    extra = world // ep + world // expert_dp + world // (tp * ep) + world // (tp * ep)
    for rank in (0, 5, 31):
        groups = [construct(s, rank).record for s in (dense, moe)]
        assert len(groups[1].groups) - len(groups[0].groups) == extra
        mine = {(g.ranks, g.backend) for g in groups[1].member_groups} - \
            {(g.ranks, g.backend) for g in groups[0].member_groups}
        first = rank % tp + tp * ep * (rank // (tp * ep))
        assert (tuple(range(first, first + tp * ep, tp)), "nccl") in mine  # its EP group
        start = rank - rank % (tp * ep)
        assert (tuple(range(start, start + tp * ep)), "nccl") in mine  # its TP x EP group


def test_compact_gold_payload_bytes_and_traffic_follow_its_sizes():
    """The compact gold form (gold_topk, 64 / 256 by default): per chunk slot the k pairs' log-
    probs and columns, their bucket, the k' sorted uncommon probabilities, their tail and the
    has-teacher flag, 2k + k' + 3 floats; k' capped at the n = min(8,192, V_t - M, V_s - M)
    ranks the loss compares (the student's vocabulary from the model). The step's traffic is
    routes x those bytes, so the report scales with the form against chunk top-k's 2k + 2."""
    from megatron_xdistill.transport.simulate import simulate

    chunks = SMALL["seq_length"] + 1
    for k, k_unc in ((64, 256), (16, 32)):
        scenario = Scenario(16, form="gold_topk", seq_length=4096, gold_topk=k,
                            gold_uncommon_topk=k_unc)
        assert scenario.payload_numel(scenario.teachers[0]) == 4097 * (2 * k + k_unc + 3)
    # 100 uncommon student tokens (V_s = 128,256, Llama-3): k' = 256 is cut to 100
    tight = Scenario(16, form="gold_topk", num_common=128256 - 100, seq_length=4096)
    assert tight.payload_numel(tight.teachers[0]) == 4097 * (2 * 64 + 100 + 3)

    scenario = Scenario(16, student_tp=2, teachers=(TeacherSetup("qwen3-8b", tp=2, pp=2),),
                        gpus_per_node=4, **SMALL)
    chunk, gold = simulate(scenario, forms=("chunk_topk", "gold_topk"), memory=False)
    assert gold["payload_bytes_per_sample"] == [4 * chunks * (2 * 64 + 256 + 3)]
    assert chunk["payload_bytes_per_sample"] == [4 * chunks * (2 * SMALL["topk"] + 2)]
    plans = construct(scenario, 0).routes
    nodes, _ = places_of(16, 4)
    crossing = sum(1 for r in plans[0] if nodes[r.src] != nodes[r.dst])
    assert crossing > 0
    for report in (chunk, gold):
        assert report["traffic"]["cross_node_bytes"] == \
            crossing * report["payload_bytes_per_sample"][0]
    ratio = gold["payload_bytes_per_sample"][0] / chunk["payload_bytes_per_sample"][0]
    assert gold["traffic"]["busiest_gpu_nic_bytes"] == \
        ratio * chunk["traffic"]["busiest_gpu_nic_bytes"]
    assert gold["transfer_s"] == pytest.approx(ratio * chunk["transfer_s"], rel=1e-12)


def test_qwen3_235b_a22b_active_parameters_and_its_smallest_worlds():
    """The Qwen3-235B-A22B-like teacher's active parameters from its published config (94
    layers, hidden 4,096, 64 query / 4 KV heads of 128, 8 of 128 experts of intermediate
    1,536, vocabulary 151,936, untied), written out per weight here; its TP8 PP4 EP8 layout
    needs TP x PP = 32 GPUs a replica and EP 8 over the data-parallel ranks: 256 teacher GPUs,
    so 256 GPUs colocated and 1,024 disaggregated on a quarter."""
    from megatron_xdistill.transport.scale_costs import MODELS

    q = o = 4096 * 8192
    k = v = 4096 * 512
    router = 4096 * 128
    experts = 8 * (4096 * 1536 * 2 + 1536 * 4096)  # gate, up; down
    norms = 128 + 128 + 4096 + 4096  # q_norm, k_norm, input and post-attention layer norms
    layer = q + k + v + o + router + experts + norms
    assert layer == 222_830_848
    total = 94 * layer + 151936 * 4096 * 2 + 4096  # embeddings, output layer, final norm
    shape = MODELS["qwen3-235b-a22b"]
    assert shape.active_params == total == 22_190_763_520  # "22B activated"
    assert (shape.layers, shape.attention_width, shape.vocab) == (94, 8192, 151936)

    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_scale.py"
    spec = importlib.util.spec_from_file_location("xdistill_bench_scale", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for placement, fits in (("colocated", 256), ("disaggregated", 1024)):
        assert bench._scenario(fits // 2, "llama-3.2-1b", 1, placement,
                               "qwen3-235b-a22b")[1] is not None
        assert bench._scenario(fits, "llama-3.2-1b", 1, placement,
                               "qwen3-235b-a22b")[1] is None
        assert bench.smallest_world("llama-3.2-1b", 1, placement, "qwen3-235b-a22b", 64) == fits
