"""A tiny deterministic distributed job for the launcher tests; runs under torchrun or xdistill-ray.

Linear regression with data-parallel SGD over gloo: every rank draws its own batch per step,
gradients and the loss are averaged with all-reduce. Each rank appends JSON lines to
``OUT/rank{RANK}.jsonl``: a ``start`` record (its torchrun environment, pid, child pid, restart
count) and one ``step`` record per step. Rank 0 checkpoints after every step to ``--ckpt``;
a restarted job resumes from it. ``--crash-rank/--crash-step`` make one rank fail (only in the
first attempt unless ``--crash-always``), by raising, returning exit code 3, or SIGKILL.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
            "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
CRASH_EXIT_CODE = 3


def _parse(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--ckpt", type=Path, default=None)
    p.add_argument("--crash-rank", type=int, default=-1)
    p.add_argument("--crash-step", type=int, default=-1)
    p.add_argument("--crash-mode", choices=("raise", "exit", "kill"), default="raise")
    p.add_argument("--crash-always", action="store_true")
    p.add_argument("--spawn-child", action="store_true",
                   help="start a long-lived child process (stands in for DataLoader workers)")
    p.add_argument("--step-sleep", type=float, default=0.0)
    return p.parse_args(list(argv))


def _spawn_child(rank: int, out: Path) -> int:
    """A child that prints a line, then sleeps; returns once the line is written."""
    ready = out / f"child{rank}.ready"
    code = (f"import pathlib, time; print('child of rank {rank} says hi', flush=True); "
            f"pathlib.Path({str(ready)!r}).touch(); time.sleep(600)")
    pid = subprocess.Popen([sys.executable, "-c", code]).pid
    end = time.monotonic() + 120
    while not ready.exists() and time.monotonic() < end:
        time.sleep(0.05)
    return pid


def _identity(pid: int) -> list:
    """(pid, start time): tells a process from a later one that reuses its pid."""
    import psutil

    return [pid, psutil.Process(pid).create_time()]


def _write(out: Path, rank: int, record: dict) -> None:
    with open(out / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the job; returns its exit code."""
    args = _parse(sys.argv[1:] if argv is None else argv)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    child = _spawn_child(rank, args.out) if args.spawn_child else None
    _write(args.out, rank, {"event": "start", "proc": _identity(os.getpid()),
                            "child": _identity(child) if child else None,
                            "env": {k: os.environ.get(k) for k in ENV_KEYS},
                            "cwd": os.getcwd()})
    os.write(2, f"rank {rank} writes to fd 2\n".encode())

    target = torch.arange(1, 9, dtype=torch.float64).reshape(8, 1) / 8
    weight = torch.zeros(8, 1, dtype=torch.float64)
    first = 0
    ckpt = args.ckpt / "state.pt" if args.ckpt else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt)
        first, weight = state["step"], state["weight"]
        print(f"resumed at step {first}", flush=True)
    for step in range(first, args.steps):
        if (rank == args.crash_rank and step == args.crash_step
                and (args.crash_always or restart == 0)):
            _crash(args.crash_mode, rank, step)
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=gen, dtype=torch.float64)
        y = x @ target + 0.01 * torch.randn(16, 1, generator=gen, dtype=torch.float64)
        weight.requires_grad_(True)
        loss = ((x @ weight - y) ** 2).mean()
        (grad,) = torch.autograd.grad(loss, weight)
        stats = torch.cat([grad.flatten(), loss.detach().reshape(1)])
        dist.all_reduce(stats)
        stats /= world
        weight = (weight.detach() - 0.1 * stats[:-1].reshape(8, 1)).detach()
        record = {"event": "step", "step": step + 1, "loss": stats[-1].item(),
                  "weight_norm": weight.norm().item()}
        _write(args.out, rank, record)
        print(f"step {step + 1} loss {record['loss']:.6f}", flush=True)
        if ckpt is not None:
            if rank == 0:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"step": step + 1, "weight": weight}, ckpt.with_suffix(".tmp"))
                os.replace(ckpt.with_suffix(".tmp"), ckpt)
            dist.barrier()
        time.sleep(args.step_sleep)
    dist.destroy_process_group()
    return 0


def _crash(mode: str, rank: int, step: int) -> None:
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "exit":
        sys.exit(CRASH_EXIT_CODE)
    raise RuntimeError(f"injected failure on rank {rank} at step {step}")


if __name__ == "__main__":
    sys.exit(main())
