"""xdistill-ray on a local Ray cluster of two simulated nodes x two CPU ranks (world size 4).

The job is tests/ray_entry.py (data-parallel SGD over gloo): under Ray it must produce exactly
torchrun's values; a rank that fails or whose actor is killed ends the run with an error naming
it and leaves no process behind; --max-restarts resumes from the job's checkpoint; an
interrupted driver stops everything.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest
from scratch import scratch_dir

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]'")

from ray_entry_harness import (  # noqa: E402 - after the importorskip above
    TESTS,
    final_steps,
    local_cluster,
    processes_mentioning,
    ray_config,
    records,
    run_config,
    run_ray,
    run_torchrun,
    wait_gone,
)

from megatron_xdistill.launch.rank_env import LAUNCH_ID_VAR  # noqa: E402
from megatron_xdistill.launch.runner import LaunchError, launch  # noqa: E402

STEPS = 3
WORLD = 4
pytestmark = pytest.mark.timeout(420)


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(num_nodes=2, cpus_per_node=2) as temp_dir:
        yield ray.get_runtime_context().gcs_address
    assert processes_mentioning(str(temp_dir)) == [], "Ray processes outlived the cluster"


@pytest.fixture(scope="module")
def reference(request, tmp_path_factory):
    out = scratch_dir(request, tmp_path_factory, "torchrun")
    done = run_torchrun([TESTS / "ray_entry.py", "--out", out, "--steps", STEPS], nproc=WORLD,
                        timeout_s=300)
    assert done.returncode == 0, done.stderr
    return final_steps(out)


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.2)


def _assert_cleaned_up(out, launch_id: str) -> None:
    """Actors and their children are gone, names released, placement groups' CPUs free."""
    starts = [r for rs in records(out, "start").values() for r in rs]
    procs = [r["proc"] for r in starts] + [r["child"] for r in starts if r["child"]]
    assert procs and wait_gone(procs, 30) == []
    mine = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.environ().get(LAUNCH_ID_VAR) == launch_id:
                mine.append(proc.pid)
        except psutil.Error:
            continue
    assert mine == []
    for rank in range(WORLD):
        with pytest.raises(ValueError):
            ray.get_actor(f"xdistill-{launch_id}-rank{rank}")
    _wait_for(lambda: ray.available_resources().get("CPU") == 4.0, 30, "CPUs to be released")


def test_same_values_as_torchrun_with_rank_prefixed_output(cluster, reference, tmp_path):
    run = run_ray(["--out", tmp_path, "--steps", STEPS, "--spawn-child"])
    assert run.code == 0, run.err
    assert final_steps(tmp_path) == reference
    envs = {rank: rs[0]["env"] for rank, rs in records(tmp_path, "start").items()}
    assert [(e["RANK"], e["GROUP_RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["WORLD_SIZE"])
            for _, e in sorted(envs.items())] == [
        ("0", "0", "0", "2", "4"), ("1", "0", "1", "2", "4"),
        ("2", "1", "0", "2", "4"), ("3", "1", "1", "2", "4")]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs.values()}) == 1
    nodes = [line.split("(ray node ")[1] for line in run.err.splitlines() if "(ray node " in line]
    assert len(nodes) == 2 and nodes[0] != nodes[1], run.err  # two Ray nodes, one per group
    for rank in range(WORLD):
        assert f"[rank {rank}] step {STEPS} loss" in run.out
        assert f"[rank {rank}] child of rank {rank} says hi" in run.out  # a child's output
        assert f"[rank {rank}] rank {rank} writes to fd 2" in run.err  # fd-level stderr
    _assert_cleaned_up(tmp_path, run.config.launch_id)


def test_failing_rank_stops_all_and_sets_the_exit_status(cluster, tmp_path):
    run = run_ray(["--out", tmp_path, "--steps", 20, "--spawn-child", "--crash-rank", 2,
                   "--crash-step", 1, "--crash-mode", "exit"], failure_grace_s=1.0)
    assert run.code == 3, run.err  # the failing rank's sys.exit(3)
    assert "rank 2 failed (node 1, " in run.err and "exit code 3: SystemExit(3)" in run.err
    steps = records(tmp_path, "step")
    assert len(steps[2]) == 1 and all(len(s) <= 1 for s in steps.values())
    _assert_cleaned_up(tmp_path, run.config.launch_id)


def test_killed_actor_ends_the_run_with_a_clear_error(cluster, tmp_path):
    config = ray_config(["--out", tmp_path, "--steps", 200, "--step-sleep", 0.2,
                         "--spawn-child"], failure_grace_s=1.0)
    killed = []

    def kill_rank_1() -> None:
        _wait_for(lambda: len(records(tmp_path, "step").get(1, [])) >= 1, 300, "rank 1's step")
        ray.kill(ray.get_actor(config.actor_name(1)))
        killed.append(time.monotonic())

    killer = threading.Thread(target=kill_rank_1, daemon=True)
    killer.start()
    run = run_config(config)
    killer.join(10)
    assert killed, "the actor was never killed"
    assert run.code == 1
    assert "rank 1 failed (node 0, " in run.err and "its actor died" in run.err, run.err
    assert len(records(tmp_path, "step")[0]) < 200
    _assert_cleaned_up(tmp_path, config.launch_id)


def test_max_restarts_resumes_from_the_checkpoint(cluster, reference, tmp_path):
    run = run_ray(["--out", tmp_path, "--steps", STEPS, "--ckpt", tmp_path / "ckpt",
                   "--crash-rank", 3, "--crash-step", 2, "--crash-mode", "raise"],
                  max_restarts=1, failure_grace_s=1.0)
    assert run.code == 0, run.err
    assert "rank 3 failed (node 1, " in run.err and "restarting (1/1)" in run.err
    assert "Traceback" in run.err and "RuntimeError: injected failure on rank 3 at step 2" in run.err
    assert "[rank 0] resumed at step 2" in run.out
    assert final_steps(tmp_path) == reference
    for rank, starts in records(tmp_path, "start").items():
        assert [s["env"]["TORCHELASTIC_RESTART_COUNT"] for s in starts] == ["0", "1"], rank
    _assert_cleaned_up(tmp_path, run.config.launch_id)


def test_placement_that_cannot_fit_fails_and_frees_everything(cluster):
    config = ray_config(["--out", "/nonexistent"], num_nodes=3, placement_timeout_s=3)
    with pytest.raises(LaunchError, match="1 of 3 nodes not placed"):
        launch(config)
    _wait_for(lambda: ray.available_resources().get("CPU") == 4.0, 30, "CPUs to be released")


def test_interrupted_driver_stops_all_ranks(cluster, tmp_path):
    launch_id = uuid.uuid4().hex[:12]
    cmd = [sys.executable, "-m", "megatron_xdistill.launch.cli", "--address", cluster,
           "--num-nodes", "2", "--gpus-per-node", "0", "--ranks-per-node", "2",
           "--entry-point", "ray_entry:main", "--env", f"PYTHONPATH={TESTS}",
           "--launch-id", launch_id, "--",
           "--out", str(tmp_path), "--steps", "500", "--step-sleep", "0.2", "--spawn-child"]
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # two step records per rank: each printed its step-1 line a step (0.2 s) before
        _wait_for(lambda: sum(len(v) >= 2 for v in records(tmp_path, "step").values()) == WORLD
                  or driver.poll() is not None, 300, "all ranks to take two steps")
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert driver.returncode == 130, err
    assert "interrupted; all ranks stopped" in err
    assert "[rank 3] step 1 loss" in out
    _assert_cleaned_up(tmp_path, launch_id)
