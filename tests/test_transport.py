"""Routing plan from sizes only, and the gloo point-to-point transport that follows it."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.parallel.sample_owners import (
    student_replica_of,
    student_samples,
    teacher_block,
)
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.transport.routing import layout_rank, routing_plan, teacher_samples

WORLD = 4


@pytest.mark.parametrize("gbs,mbs,dp", [(8, 2, 2), (12, 1, 3), (8, 4, 1), (16, 2, 4)])
def test_sample_owners_follow_megatrons_sampler(gbs, mbs, dp):
    """Student: Megatron's pretraining sampler takes mbs x dp consecutive samples per step of the
    schedule and gives DP rank r the slice [r * mbs, (r + 1) * mbs); teacher: contiguous blocks."""
    for rank in range(dp):
        megatron = []
        for start in range(0, gbs, mbs * dp):
            megatron += list(range(start + rank * mbs, start + (rank + 1) * mbs))
        assert student_samples(gbs, mbs, dp, rank) == megatron
        assert all(student_replica_of(i, mbs, dp) == (rank, k // mbs)
                   for k, i in enumerate(megatron))
    blocks = [teacher_block(gbs, dp, r) for r in range(dp)]
    assert sum(blocks, []) == list(range(gbs)) and len({len(b) for b in blocks}) == 1


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


@pytest.mark.parametrize("world,student,teacher,t_offset", [
    (16, (1, 1, 1), (8, 1, 2), 0),  # colocated: TP8 PP2 teacher, DP16 student
    (16, (2, 2, 1), (4, 1, 1), 0),  # colocated: student TP2 CP2, teacher TP4
    (8, (4, 1, 1), (4, 1, 1), 0),  # colocated, one layout: a replica's own copies stay
    (12, (1, 1, 1), (2, 2, 1), 8),  # disaggregated: 8 student ranks, teacher TP2 CP2 on 4
])
def test_plan_spreads_a_replicas_sends_over_its_last_stage(world, student, teacher, t_offset):
    """Every student rank of a sample's replica (last stage) gets one copy of it, from a TP/CP
    rank of the teacher replica's last stage that holds it: from itself when it is one, the
    others' copies dealt evenly over all of them (the rule written out here, per replica)."""
    s_layout = ParallelLayout.for_world(t_offset or world, *student)
    t_layout = ParallelLayout.for_world(world - t_offset, *teacher)
    gbs, mbs = 4 * s_layout.dp * t_layout.dp, 1
    routes = routing_plan(gbs, mbs, s_layout, t_layout, 0, t_offset)
    expected, senders_of = set(), {}
    for sample in range(gbs):
        s_dp = (sample // mbs) % s_layout.dp
        t_dp = sample // (gbs // t_layout.dp)
        base = t_offset + (t_layout.pp - 1) * t_layout.dp * t_layout.tp * t_layout.cp
        senders_of[sample] = {base + t_dp * t_layout.tp * t_layout.cp + i
                              for i in range(t_layout.tp * t_layout.cp)}
        first = (s_layout.pp - 1) * s_layout.dp * s_layout.tp * s_layout.cp
        expected |= {(sample, first + s_dp * s_layout.tp * s_layout.cp + i)
                     for i in range(s_layout.tp * s_layout.cp)}
    assert sorted((r.sample, r.dst) for r in routes) == sorted(expected)
    assert [(r.sample, r.dst) for r in routes] == sorted((r.sample, r.dst) for r in routes)
    load: dict = {}
    for r in routes:
        assert r.src in senders_of[r.sample], r
        assert (r.src == r.dst) == (r.dst in senders_of[r.sample]), r
        if r.src != r.dst:
            load[r.src] = load.get(r.src, 0) + 1
    senders = {s for sample in range(gbs) for s in senders_of[sample]}
    assert set(load) == senders  # every last-stage rank sends, none more than 1 above another
    assert max(load.values()) - min(load.values()) <= 1
    assert max(load.values()) * len(senders) <= sum(load.values()) + len(senders)


def _exchange(student: tuple, teacher: tuple, gbs: int, mbs: int) -> dict:
    import torch.distributed as dist

    from megatron_xdistill.transport.p2p import P2PTransport

    s_layout = ParallelLayout.for_world(WORLD, *student)
    t_layout = ParallelLayout.for_world(WORLD, *teacher)
    rank = dist.get_rank()
    routes = routing_plan(gbs, mbs, s_layout, t_layout)
    outgoing = {}
    if t_layout.coords(rank)["pp"] == t_layout.pp - 1:  # every last-stage rank holds them
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


def _routed_steps(steps: int) -> dict:
    """Two "nodes" of two ranks (GROUP_RANK from the env): shm inside a node, gloo across."""
    import torch.distributed as dist

    from megatron_xdistill.transport.routed import RoutedTransport, node_of_ranks

    student = ParallelLayout.for_world(WORLD, tp=2)  # dp 2: replicas {0,1} and {2,3}
    teacher = ParallelLayout.for_world(WORLD, tp=1, pp=2)  # senders: ranks 2 and 3
    routes = routing_plan(8, 1, student, teacher)
    rank = dist.get_rank()
    nodes = node_of_ranks()
    transport = RoutedTransport(routes, numel=3, nodes=nodes)
    kinds = {"shm": len(transport.shm.routes) if transport.shm else 0,
             "p2p": len(transport.p2p.routes), "same_node": transport.same_node_kind}
    seen = []
    views = []
    for step in range(steps):
        if step >= 1:  # zero-copy views stay intact until this rank's next exchange, although
            # senders may already be writing this step (double buffering)
            assert all(t[1].item() == step - 1 for t in views[step - 1].values())
        outgoing = {i: torch.tensor([float(i), float(step), -1.0])
                    for i in (teacher_samples(rank, 8, teacher) if rank >= 2 else [])}
        received = transport.exchange(outgoing)
        views.append(dict(received))
        seen.append({i: t.tolist() for i, t in received.items()})
    transport.close()
    return {"nodes": nodes, "kinds": kinds, "seen": seen}


def test_two_nodes_use_shared_memory_within_and_p2p_across():
    env = [{"GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
           for r in range(WORLD)]
    with RankPool(WORLD, rank_env=env) as pool:
        out = pool.run(_routed_steps, 3)
    assert out[0]["nodes"] == [0, 0, 1, 1]
    # Senders are ranks 2 and 3 (node 1); node 1's replica is served through shared memory,
    # node 0's across the "nodes"; node 0 has no same-node routes, so no slots there.
    assert [o["kinds"]["same_node"] for o in out] == [None, None, "shared memory",
                                                      "shared memory"]
    assert out[2]["kinds"]["shm"] > 0 and out[0]["kinds"]["p2p"] > 0
    for rank, result in enumerate(out):
        dp = rank // 2
        expected = {i for i in range(8) if i % 2 == dp}
        for step, got in enumerate(result["seen"]):
            assert set(got) == expected, f"rank {rank} step {step}"
            assert all(v == [float(i), float(step), -1.0] for i, v in got.items())
    import glob

    assert not glob.glob("/dev/shm/xdistill_*"), "shared memory left behind"


def slot_steps(steps: int, dtype_name: str, device: str = "cuda") -> dict:
    """Rank 0 sends 3 samples to rank 1 through the slot transport for ``steps`` steps: shared
    memory on CPU, CUDA IPC with ``device="cuda"`` (tests/test_gpu.py)."""
    import torch.distributed as dist

    from megatron_xdistill.transport.routing import Route

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    numel = 1000
    routes = [Route(s, 0, 1) for s in range(3)]
    if device == "cuda":
        from megatron_xdistill.transport.cuda_ipc import CudaIpcTransport

        torch.cuda.set_device(0)
        transport = CudaIpcTransport(routes, numel, dtype)
    else:
        from megatron_xdistill.transport.shm import SharedMemoryTransport

        transport = SharedMemoryTransport(routes, numel, dtype)
    # Once every receiver has mapped it, a segment's name is gone (nothing for a killed rank
    # to leave in /dev/shm) while the mappings keep working.
    named = [s.name for s in getattr(transport.memory, "_own", [])
             if os.path.exists(f"/dev/shm/{s.name.lstrip('/')}")]
    seen, intact, zero_copy = [], [], []
    previous: dict = {}
    for step in range(steps):
        # Views of the last step stay intact until this rank's next exchange, while the sender
        # may already write this step (into the other slot).
        intact.append(all(bool((v == 10 * (step - 1) + s).all()) for s, v in previous.items()))
        outgoing = {s: torch.full((numel,), 10.0 * step + s, dtype=dtype, device=device)
                    for s in range(3)} if rank == 0 else {}
        got = transport.exchange(outgoing)
        if rank == 1:
            base = transport._buffers[0]
            lo, hi = base.data_ptr(), base.data_ptr() + base.numel()
            zero_copy.append(all(lo <= v.data_ptr() < hi and v.device.type == device
                                 for v in got.values()))
            seen.append({s: (v[0].item(), v[-1].item(), str(v.dtype)) for s, v in got.items()})
        previous = got
    transport.close()
    return {"seen": seen, "intact": intact, "zero_copy": zero_copy, "named": named}


def check_slot_steps(out: list, dtype: str) -> None:
    receiver = out[1]
    assert len(receiver["seen"]) == 4
    for step, got in enumerate(receiver["seen"]):
        assert got == {s: (10.0 * step + s, 10.0 * step + s, f"torch.{dtype}")
                       for s in range(3)}, f"step {step}"
    assert all(receiver["zero_copy"]), "receivers must read the sender's buffer (zero-copy)"
    assert all(receiver["intact"]), "a view changed before the receiver's next exchange"
    assert out[0]["named"] == [], "a mapped segment kept its name in /dev/shm"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shared_memory_slots_are_zero_copy_and_double_buffered(dtype):
    with RankPool(2) as ranks:
        check_slot_steps(ranks.run(slot_steps, 4, dtype, "cpu"), dtype)


def test_nccl_groups_refuse_two_ranks_on_one_gpu():
    from megatron_xdistill.transport.routed import check_one_rank_per_gpu

    gpus = ["host-a/GPU-0", "host-a/GPU-1", "host-b/GPU-0", "host-a/GPU-1", None, None]
    check_one_rank_per_gpu([0, 1, 2], gpus)  # distinct GPUs (same UUID text on two hosts)
    check_one_rank_per_gpu([4, 5], gpus)  # CPU ranks
    with pytest.raises(ValueError, match=r"ranks 1 and 3 both use GPU host-a/GPU-1"):
        check_one_rank_per_gpu([0, 1, 3], gpus)
