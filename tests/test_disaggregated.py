"""Disaggregated teacher: teacher ranks apart from student ranks, the same losses as colocated.

``--teacher-placement disaggregated --teacher-ranks 2`` on 4 ranks: ranks 0-1 hold only the
student, ranks 2-3 only the teacher, which sends each global batch's payloads without waiting
and computes the next batch while the student trains. The first steps must reproduce
test_e2e's colocated single-rank reference (rel 1e-5); resume and evaluation stay with the
student ranks. The streaming transport itself (shared-memory slots within a node, gloo across):
sends do not wait for the receiver (two steps in flight, the third waits for its slot), views
stay intact while the teacher writes ahead, and a missing payload or release times out naming
rank and step.
"""

from __future__ import annotations

import json
import time

import pytest
import test_e2e
from test_e2e import _argv, _losses, _run_main, assert_losses_match

from megatron_xdistill.testing.multirank import RankError, RankPool

pytestmark = test_e2e.pytestmark
DISAGGREGATED = ["--teacher-placement", "disaggregated", "--teacher-ranks", "2"]
LAYOUTS = {
    "disagg_student_tp2_teacher_tp2": ["--tensor-model-parallel-size", "2",
                                       "--teacher-tensor-model-parallel-size", "2"],
    "disagg_student_pp2_teacher_dp2": ["--pipeline-model-parallel-size", "2"],
}


@pytest.mark.parametrize("name", [
    "disagg_student_tp2_teacher_tp2",
    # its layout runs by default in test_two_nodes_match_colocated_reference (across nodes)
    pytest.param("disagg_student_pp2_teacher_dp2", marks=pytest.mark.slow)])
def test_first_steps_match_colocated_reference(e2e_setup, e2e_reference, e2e_pool, name):
    root, s_tok, t_tok = e2e_setup
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, name, DISAGGREGATED + LAYOUTS[name]))
    assert_losses_match(_losses(root, name), e2e_reference, name)
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    for record in records:  # the progress line's transport figures
        assert record["payload_bytes_per_token"] > 0 and record["shipped_bytes_per_token"] > 0
        assert record["time_teacher"] > 0 and record["time_route"] >= 0


@pytest.mark.slow  # the suite's 30 minutes: disaggregated training stays in the default run
# (test_first_steps_match_colocated_reference), the payloads across nodes too (the [two_nodes]
# stream tests here and test_transport's two-node test)
def test_two_nodes_match_colocated_reference(e2e_setup, e2e_reference):
    """Two torchrun "nodes" (GROUP_RANK = rank // 2): the teacher ranks sit on node 1, the
    student ranks on node 0, so every payload crosses nodes (point-to-point); same losses."""
    root, s_tok, t_tok = e2e_setup
    name = "disagg_two_nodes"
    env = [{"GROUP_RANK": str(r // 2), "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2"}
           for r in range(4)]
    with RankPool(4, rank_env=env) as ranks:
        ranks.run(_run_main, _argv(root, s_tok, t_tok, name,
                                   DISAGGREGATED + LAYOUTS["disagg_student_pp2_teacher_dp2"]))
    assert_losses_match(_losses(root, name), e2e_reference, name)


def _records(root, name: str) -> list[dict]:
    return [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]


def test_resume_and_evaluation_run_on_student_ranks(e2e_setup, e2e_pool, tmp_path):
    root, s_tok, t_tok = e2e_setup
    extra = DISAGGREGATED + LAYOUTS["disagg_student_tp2_teacher_tp2"] + [
        "--save-interval", "1", "--valid-data-path", str(root / "train.jsonl"),
        "--eval-interval", "2", "--eval-iters", "1"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dfull", extra + ["--save", str(tmp_path / "dfull")]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dpart",
                              extra + ["--save", str(tmp_path / "dpart"), "--exit-interval", "1"]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dpart", extra + ["--save", str(tmp_path / "dpart")]))
    assert _losses(root, "dpart") == _losses(root, "dfull")
    evals = {name: [(r["iteration"], r["eval_ce"]) for r in _records(root, name) if "eval_ce" in r]
             for name in ("dfull", "dpart")}
    assert [it for it, _ in evals["dfull"]] == [0, 2, 3]
    assert evals["dpart"][-2:] == evals["dfull"][-2:]  # after the resume: identical evaluations
    # Teacher ranks (2, 3) hold no checkpointed state and write nothing.
    saved = sorted(p.name for p in (tmp_path / "dfull" / "iter_0000003").glob("rng_rank*"))
    assert saved == ["rng_rank00000.pt", "rng_rank00001.pt"]


# ---------------------------------------------------------------- the streaming transport
# Ranks 0-1: students (DP 2); ranks 2-3: teachers (DP 2); global batch 4, micro-batch 1, so
# teacher 2 makes samples 0-1 and teacher 3 samples 2-3, student r trains samples r and r + 2.
# Node maps: one node (every route through shared-memory slots), torchrun's node-major two
# nodes (every route across, point-to-point) and a mix (each teacher has one of each).
NODES = {"one_node": [0, 0, 0, 0], "two_nodes": [0, 0, 1, 1], "mixed": [0, 1, 0, 1]}


def stream_steps(student_sleep: float, steps: int, timeout_s: float, nodes: list[int],
                 device: str = "cpu", watched: bool = False, tag: str = "stream") -> dict:
    """Teachers send ``steps`` steps at once. Students start receiving only once both teachers'
    sends of steps 0 and 1 have returned (a c10d-store gate: had those sends waited for a
    student, this would deadlock into the students' gate timeout), then take a ``student_sleep``
    seconds long step first. Times are ``time.monotonic()``, one clock for every process here.
    ``device="cuda"``: every rank on GPU 0, the slots in CUDA IPC buffers (tests/test_gpu.py).
    ``watched``: the waits last while the peers' heartbeats go on (liveness.PeerWatch).
    ``tag``: unique per call on one rank pool (the gate's store keys)."""
    import datetime

    import torch
    import torch.distributed as dist

    from megatron_xdistill.parallel.layout import ParallelLayout
    from megatron_xdistill.transport.routed import RoutedStream
    from megatron_xdistill.transport.routing import routing_plan, teacher_samples

    layout = ParallelLayout.for_world(2)
    routes = routing_plan(4, 1, layout, layout, student_offset=0, teacher_offset=2)
    if device == "cuda":
        torch.cuda.set_device(0)
        device = "cuda:0"
    watch = None
    if watched:
        from megatron_xdistill.transport.liveness import PeerWatch, default_store

        watch = PeerWatch(default_store(), dist.get_rank(), dead_after_s=5.0, interval_s=0.2)
    stream = RoutedStream(routes, numel=3, nodes=nodes, timeout_s=timeout_s, device=device,
                          watch=watch)
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    out: dict = {"returned_at": [], "payloads": [], "stats": [], "intact": [], "zero_copy": [],
                 "kind": stream.same_node_kind, "summary": stream.summary}
    if rank >= 2:
        for step in range(steps):
            mine = {i: torch.full((3,), 100.0 * step + i, device=device)
                    for i in teacher_samples(rank, 4, layout, 2)}
            stream.send(step, mine, stats=[float(rank)])
            out["returned_at"].append(time.monotonic())
            if step == 1:
                store.set(f"{tag}/sent_1/{rank}", "1")
    else:
        store.wait([f"{tag}/sent_1/{t}" for t in (2, 3)], datetime.timedelta(seconds=120))
        time.sleep(student_sleep)  # a long student step: the teacher must not wait for it
        out["woke_at"] = time.monotonic()
        views: dict = {}
        for step in range(steps):
            payloads, stats = stream.receive(step)
            # The last step's views stay intact until the next prefetch, although the teacher
            # may already have written this step and the next (into the other slot).
            out["intact"].append(all(v.tolist() == [100.0 * (step - 1) + i] * 3
                                     for i, v in views.items()))
            if step + 1 < steps:
                stream.prefetch(step + 1)
            views = payloads
            if stream.slots is not None:  # slot routes: views of the sender's buffer itself
                mapped = [(b.data_ptr(), b.data_ptr() + b.numel())
                          for b in stream.slots.buffers._buffers.values()]
                out["zero_copy"].append([any(lo <= v.data_ptr() < hi for lo, hi in mapped)
                                         and v.device == torch.device(device)
                                         for v in payloads.values()])
            out["payloads"].append({i: p.tolist() for i, p in payloads.items()})
            out["stats"].append(sorted(stats[:, 0].tolist()))
    stream.finish()
    stream.close()
    if watch is not None:
        watch.close()
    return out


def check_stream_steps(results: list[dict], sleep: float, steps: int, nodes: str) -> None:
    """What :func:`stream_steps` must show (also for CUDA IPC in tests/test_gpu.py)."""
    for rank in (0, 1):
        got = results[rank]
        for step in range(steps):
            assert got["payloads"][step] == {i: [100.0 * step + i] * 3 for i in (rank, rank + 2)}
            assert got["stats"][step] == [2.0, 3.0]
        assert all(got["intact"]), got["intact"]
        within = {"one_node": 2, "two_nodes": 0, "mixed": 1}[nodes]  # of the rank's 2 samples
        assert [sum(z) for z in got["zero_copy"]] == ([within] * steps if within else []), \
            got["zero_copy"]
    # Steps 0 and 1 went out while no student received (the students' gate); step 2 reuses
    # step 0's slot, so it returned only after the students woke and took step 0.
    woke = min(results[rank]["woke_at"] for rank in (0, 1))
    for rank in (2, 3):
        returned = results[rank]["returned_at"]
        assert returned[1] < woke <= returned[2], (returned, woke)


@pytest.mark.parametrize("nodes", list(NODES))
def test_stream_sends_without_waiting_and_double_buffers(e2e_pool, nodes):
    sleep, steps = 2.0, 4
    results = e2e_pool.run(stream_steps, sleep, steps, 60.0, NODES[nodes], "cpu", False,
                           f"double_buffers/{nodes}")
    check_stream_steps(results, sleep, steps, nodes)
    kinds = [r["kind"] for r in results]
    assert kinds == [None] * 4 if nodes == "two_nodes" else ["shared memory"] * 4
    within, across = {"one_node": (4, 0), "two_nodes": (0, 4), "mixed": (2, 2)}[nodes]
    assert f"{within} within a node (shared memory), {across} across nodes (gloo)" in \
        results[0]["summary"]


@pytest.mark.parametrize("nodes", ["one_node", "two_nodes"])
def test_a_slow_student_is_waited_for_not_timed_out(e2e_pool, nodes):
    """With the peer watch, a student step 3x longer than the stream's timeout (and than what a
    timed wait would allow) is waited for: the teacher's slot waits last while students live."""
    sleep, steps = 3.0, 4
    results = e2e_pool.run(stream_steps, sleep, steps, 1.0, NODES[nodes], "cpu", True,
                           f"slow_student/{nodes}")
    check_stream_steps(results, sleep, steps, nodes)


@pytest.mark.parametrize("nodes", ["one_node", "two_nodes"])
def test_missing_payload_times_out_naming_rank_and_step(nodes):
    with RankPool(4) as ranks, pytest.raises(RankError) as err:
        ranks.run(_one_side_missing, "teacher", NODES[nodes], timeout=60)
    text = str(err.value)
    assert "rank 0: step 0: payloads from teacher ranks [2, 3] did not complete within 1 s" in text


def test_sender_waits_for_release_of_its_slot_then_times_out():
    """A teacher two steps ahead of students that never come back names them and the step."""
    with RankPool(4) as ranks, pytest.raises(RankError) as err:
        ranks.run(_one_side_missing, "student", NODES["one_node"], timeout=60)
    assert "rank 2: step 0: release of its slot by student ranks [0, 1] did not complete " \
        "within 1 s" in str(err.value)


def _one_side_missing(missing: str, nodes: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from megatron_xdistill.parallel.layout import ParallelLayout
    from megatron_xdistill.transport.routed import RoutedStream
    from megatron_xdistill.transport.routing import routing_plan, teacher_samples

    layout = ParallelLayout.for_world(2)
    routes = routing_plan(4, 1, layout, layout, student_offset=0, teacher_offset=2)
    stream = RoutedStream(routes, numel=3, nodes=nodes, timeout_s=1.0)
    rank = dist.get_rank()
    if missing == "teacher" and rank < 2:
        stream.receive(0)  # the teacher ranks never send
    elif missing == "student" and rank >= 2:
        for step in range(3):  # step 2 needs step 0's slot back
            stream.send(step, {i: torch.zeros(3) for i in teacher_samples(rank, 4, layout, 2)})
    time.sleep(3.0)
