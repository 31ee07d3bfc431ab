"""Disaggregated teacher: teacher ranks apart from student ranks, the same losses as colocated.

``--teacher-placement disaggregated --teacher-ranks 2`` on 4 ranks: ranks 0-1 hold only the
student, ranks 2-3 only the teacher, which sends each global batch's payloads without waiting
and computes the next batch while the student trains. The first steps must reproduce
test_e2e's colocated single-rank reference (rel 1e-5); resume and evaluation stay with the
student ranks. The streaming transport itself: sends do not wait for the receiver (two steps
in flight, the third waits for its slot), and a missing payload times out naming rank and step.
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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_first_steps_match_colocated_reference(e2e_setup, e2e_reference, e2e_pool, name):
    root, s_tok, t_tok = e2e_setup
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, name, DISAGGREGATED + LAYOUTS[name]))
    assert_losses_match(_losses(root, name), e2e_reference, name)
    records = [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]
    for record in records:  # the progress line's transport figures
        assert record["payload_bytes_per_token"] > 0 and record["shipped_bytes_per_token"] > 0
        assert record["time_teacher"] > 0 and record["time_route"] >= 0


def _records(root, name: str) -> list[dict]:
    return [json.loads(x) for x in (root / f"{name}.jsonl").read_text().splitlines()]


def test_resume_and_evaluation_run_on_student_ranks(e2e_setup, e2e_pool):
    root, s_tok, t_tok = e2e_setup
    extra = DISAGGREGATED + LAYOUTS["disagg_student_tp2_teacher_tp2"] + [
        "--save-interval", "1", "--valid-data-path", str(root / "train.jsonl"),
        "--eval-interval", "2", "--eval-iters", "1"]
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dfull", extra + ["--save", str(root / "dfull")]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dpart",
                              extra + ["--save", str(root / "dpart"), "--exit-interval", "1"]))
    e2e_pool.run(_run_main, _argv(root, s_tok, t_tok, "dpart", extra + ["--save", str(root / "dpart")]))
    assert _losses(root, "dpart") == _losses(root, "dfull")
    evals = {name: [(r["iteration"], r["eval_ce"]) for r in _records(root, name) if "eval_ce" in r]
             for name in ("dfull", "dpart")}
    assert [it for it, _ in evals["dfull"]] == [0, 2, 3]
    assert evals["dpart"][-2:] == evals["dfull"][-2:]  # after the resume: identical evaluations
    # Teacher ranks (2, 3) hold no checkpointed state and write nothing.
    saved = sorted(p.name for p in (root / "dfull" / "iter_0000003").glob("rng_rank*"))
    assert saved == ["rng_rank00000.pt", "rng_rank00001.pt"]


# ---------------------------------------------------------------- the streaming transport
def _stream(student_sleep: float, steps: int, timeout_s: float) -> dict:
    """Ranks 0-1: students (DP 2); ranks 2-3: teachers (DP 2); global batch 4."""
    import torch
    import torch.distributed as dist

    from megatron_xdistill.parallel.layout import ParallelLayout
    from megatron_xdistill.transport.routing import routing_plan, teacher_samples
    from megatron_xdistill.transport.stream import StreamingTransport

    layout = ParallelLayout.for_world(2)
    routes = routing_plan(4, 1, layout, layout, student_offset=0, teacher_offset=2)
    group = dist.new_group(list(range(4)))
    stream = StreamingTransport(routes, numel=3, group=group, timeout_s=timeout_s)
    rank = dist.get_rank()
    start = time.perf_counter()
    out: dict = {"returned": [], "payloads": [], "stats": []}
    if rank >= 2:
        for step in range(steps):
            mine = {i: torch.full((3,), 100.0 * step + i) for i in teacher_samples(rank, 4, layout, 2)}
            stream.send(step, mine, stats=[float(rank)])
            out["returned"].append(time.perf_counter() - start)
    else:
        time.sleep(student_sleep)  # a long student step: the teacher must not wait for it
        for step in range(steps):
            payloads, stats = stream.receive(step)
            if step + 1 < steps:
                stream.prefetch(step + 1)
            out["payloads"].append({i: p.tolist() for i, p in payloads.items()})
            out["stats"].append(stats[:, 0].tolist())
    stream.finish()
    return out


def test_stream_sends_without_waiting_and_double_buffers(e2e_pool):
    sleep, steps = 2.0, 4
    results = e2e_pool.run(_stream, sleep, steps, 60.0)
    for rank in (0, 1):  # DP rank r trains samples r and r + 2
        got = results[rank]
        for step in range(steps):
            assert got["payloads"][step] == {i: [100.0 * step + i] * 3 for i in (rank, rank + 2)}
            assert sorted(got["stats"][step]) == [2.0, 3.0]
    for rank in (2, 3):
        returned = results[rank]["returned"]
        # Steps 0 and 1 go out at once (two slots) although no student receives yet ...
        assert returned[1] < sleep / 2, returned
        # ... step 2 reuses step 0's slot, so it waits until the students took step 0.
        assert returned[2] >= sleep * 0.9, returned


def test_missing_payload_times_out_naming_rank_and_step():
    with RankPool(4) as ranks, pytest.raises(RankError) as err:
        ranks.run(_receive_without_sender, timeout=60)
    text = str(err.value)
    assert "rank 0: step 0: payloads from teacher ranks [2, 3] did not complete within 1 s" in text


def _receive_without_sender() -> None:
    import torch.distributed as dist

    from megatron_xdistill.parallel.layout import ParallelLayout
    from megatron_xdistill.transport.routing import routing_plan
    from megatron_xdistill.transport.stream import StreamingTransport

    layout = ParallelLayout.for_world(2)
    routes = routing_plan(4, 1, layout, layout, student_offset=0, teacher_offset=2)
    stream = StreamingTransport(routes, numel=3, group=dist.new_group(list(range(4))),
                                timeout_s=1.0)
    if dist.get_rank() < 2:
        stream.receive(0)  # the teacher ranks never send
    else:
        time.sleep(3.0)
