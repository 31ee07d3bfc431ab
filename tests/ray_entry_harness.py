"""Harness for launcher tests: a local multi-node Ray cluster, and one job run under Ray or torchrun.

A distillation-equivalence test is then a few lines::

    with local_cluster():   # or the module fixture in test_launch_ray.py
        ref = run_torchrun([str(REPO / "pretrain_xdistill.py"), *args_a], nproc=4)
        got = run_ray(args_b, entry_point=DEFAULT_ENTRY_POINT)
    assert ref.returncode == 0 and got.code == 0, got.err
    # ...then compare the two runs' metrics files
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from megatron_xdistill.launch.config import LaunchConfig
from megatron_xdistill.launch.rank_env import forwarded_env

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
TEST_ENTRY = "ray_entry:main"


@contextlib.contextmanager
def local_cluster(num_nodes: int = 2, cpus_per_node: int = 2) -> Iterator[Path]:
    """Start ``num_nodes`` Ray nodes on this machine and connect to them; yields the temp dir.

    Every process of the cluster has that directory on its command line: whatever is left of
    them afterwards (also after a failed start) is killed.
    """
    import ray
    from ray.cluster_utils import Cluster

    temp_dir = Path(tempfile.mkdtemp(prefix="xd_ray_", dir="/tmp"))  # short: socket paths
    # Ray (2.60) writes the cluster's address to <RAY_TMPDIR | TMPDIR | /tmp>/ray even when the
    # head node has a temp_dir of its own, and fails when that folder does not exist yet (a
    # fresh machine that never ran Ray).
    system_temp = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
    os.makedirs(os.path.join(system_temp, "ray"), exist_ok=True)
    cluster = Cluster(initialize_head=False)
    try:
        cluster.add_node(num_cpus=cpus_per_node, include_dashboard=False,
                         temp_dir=str(temp_dir))
        for _ in range(num_nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node)
        cluster.wait_for_nodes(timeout=120)
        ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
        yield temp_dir
    finally:
        ray.shutdown()
        cluster.shutdown()
        kill_matching(str(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)


def kill_matching(text: str) -> list[int]:
    """SIGKILL every process whose command line mentions ``text``; returns their pids."""
    victims = []
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if text in " ".join(proc.info["cmdline"] or ()):
                proc.kill()
                victims.append(proc)
    psutil.wait_procs(victims, timeout=10)
    return [p.pid for p in victims]


def processes_mentioning(text: str) -> list[int]:
    """Live (non-zombie) processes whose command line mentions ``text``."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            if (proc.info["status"] != psutil.STATUS_ZOMBIE
                    and text in " ".join(proc.info["cmdline"] or ())):
                found.append(proc.pid)
    return found


@dataclass
class RayRun:
    """What a launch returned and printed."""

    code: int
    out: str
    err: str
    config: LaunchConfig


def ray_config(entry_args: Sequence[str], entry_point: str = TEST_ENTRY, num_nodes: int = 2,
               ranks_per_node: int = 2, **overrides: object) -> LaunchConfig:
    """A CPU job on the local cluster; actors import from tests/ (PYTHONPATH)."""
    pythonpath = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    config = LaunchConfig(num_nodes=num_nodes, ranks_per_node=ranks_per_node,
                          entry_args=[str(a) for a in entry_args], entry_point=entry_point,
                          env=forwarded_env(os.environ, [f"PYTHONPATH={pythonpath}"]),
                          working_dir=str(REPO), placement_timeout_s=120,
                          startup_timeout_s=300, stop_timeout_s=60)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def run_ray(entry_args: Sequence[str], **kwargs: object) -> RayRun:
    """Launch on the connected cluster (see :func:`ray_config`), capturing the driver's output."""
    return run_config(ray_config(entry_args, **kwargs))


def run_config(config: LaunchConfig) -> RayRun:
    """Launch ``config`` on the connected cluster, capturing the driver's output."""
    from megatron_xdistill.launch.runner import launch

    out, err = io.StringIO(), io.StringIO()
    code = launch(config, out=out, err=err)
    return RayRun(code, out.getvalue(), err.getvalue(), config)


def free_port() -> int:
    """A TCP port that is free right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_torchrun(argv: Sequence[str], nproc: int,
                 timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node nproc argv...`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *map(str, argv)]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)


def records(out_dir: Path, event: str) -> dict[int, list[dict]]:
    """``ray_entry`` output: rank -> that rank's records of one kind, in order."""
    result = {}
    for path in sorted(out_dir.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        lines = [json.loads(x) for x in path.read_text().splitlines()]
        result[rank] = [r for r in lines if r["event"] == event]
    return result


def final_steps(out_dir: Path) -> dict[int, dict[int, dict]]:
    """rank -> step -> the last record written for that step (a restart rewrites some)."""
    return {rank: {r["step"]: r for r in steps}
            for rank, steps in records(out_dir, "step").items()}


def alive(procs: Iterable[Sequence[float]]) -> list[int]:
    """Those of ``(pid, create_time)`` pairs still running (zombies count as gone: nothing
    reaps orphans on some machines). The start time tells a process from one reusing its pid."""
    live = []
    for pid, created in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc = psutil.Process(int(pid))
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                live.append(int(pid))
    return live


def wait_gone(procs: Iterable[Sequence[float]], timeout_s: float = 30) -> list[int]:
    """Wait for processes to end; returns the pids still alive at the deadline."""
    procs = list(procs)
    end = time.monotonic() + timeout_s
    while (left := alive(procs)) and time.monotonic() < end:
        time.sleep(0.2)
    return left
