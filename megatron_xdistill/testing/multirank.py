"""Run a function on N ranks (spawned processes, gloo, free port) and collect per-rank results.

A :class:`RankPool` starts its ranks once and runs many functions on them, because starting ranks
costs seconds (``import megatron.core``) while a small distributed test costs well under one.
Every task has a timeout: a rank that hangs or dies gets the whole pool killed and the error
names the rank. A rank that raises makes :meth:`RankPool.run` raise with that rank's traceback.

Functions must be importable by reference (module-level) and their arguments picklable.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_DEFAULT_TIMEOUT_S = 300.0
_GRACE_AFTER_FAILURE_S = 10.0


class RankError(RuntimeError):
    """A rank raised, hung past the timeout, or died."""


def free_port() -> int:
    """A TCP port on the loopback interface that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    tasks: Any,
    results: Any,
    collective_timeout_s: float,
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "GROUP_RANK": "0",
        }
    )
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()
    try:
        dist.init_process_group(
            backend="gloo",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    except Exception:
        results.put((rank, -1, False, traceback.format_exc()))
        return
    results.put((rank, -1, True, None))
    parent = os.getppid()
    while True:
        try:
            item = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:  # the driver died: do not linger as an orphan
                break
            continue
        if item is None:
            break
        task_id, fn, args, kwargs = item
        try:
            value = fn(*args, **kwargs)
            results.put((rank, task_id, True, value))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, task_id, False, traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class RankPool:
    """N CPU ranks in a gloo process group, reused across tasks.

    ``env`` adds environment variables to every rank, ``rank_env[r]`` to rank ``r`` only (after
    the torchrun-style defaults, so it can model several "nodes": LOCAL_RANK, GROUP_RANK...). ``collective_timeout_s`` is gloo's own timeout,
    which turns a collective that some rank never joins into an error on the ranks that wait.
    """

    def __init__(
        self,
        world_size: int,
        env: dict[str, str] | None = None,
        collective_timeout_s: float = 120.0,
        start_timeout_s: float = 180.0,
        rank_env: list[dict[str, str]] | None = None,
    ) -> None:
        self.world_size = world_size
        self._env = dict(env or {})
        if rank_env is not None and len(rank_env) != world_size:
            raise ValueError(f"rank_env needs {world_size} entries, got {len(rank_env)}")
        self._rank_env = rank_env
        self._collective_timeout_s = collective_timeout_s
        self._start_timeout_s = start_timeout_s
        self._procs: list[Any] = []
        self._task_id = 0
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, self.world_size, port,
                      {**self._env, **(self._rank_env[r] if self._rank_env else {})},
                      self._tasks[r], self._results, self._collective_timeout_s),
                # Not daemonic: dist_checkpointing starts helper processes of its own.
                daemon=False,
            )
            for r in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()
        self._collect(-1, self._start_timeout_s, what="start-up")

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def run(
        self, fn: Callable[..., Any], *args: Any, timeout: float = _DEFAULT_TIMEOUT_S, **kwargs: Any
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank values in rank order."""
        if not self.alive:
            self.close()
            self._start()
        self._task_id += 1
        for q in self._tasks:
            q.put((self._task_id, fn, args, kwargs))
        name = getattr(fn, "__qualname__", repr(fn))
        return self._collect(self._task_id, timeout, what=name)

    def _collect(self, task_id: int, timeout: float, what: str) -> list[Any]:
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(failures) < self.world_size:
            now = time.monotonic()
            if failures:
                deadline = min(deadline, now + _GRACE_AFTER_FAILURE_S)
            try:
                rank, tid, ok, payload = self._results.get(timeout=min(1.0, max(deadline - now, 0.01)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()
                        and r not in values and r not in failures]
                for r in dead:
                    failures[r] = f"rank {r} died (exit code {self._procs[r].exitcode})"
                if time.monotonic() >= deadline:
                    break
                continue
            if tid != task_id:
                continue
            if ok:
                values[rank] = payload
            else:
                failures[rank] = payload
        missing = [r for r in range(self.world_size) if r not in values and r not in failures]
        if failures or missing:
            self.close()
            lines = [f"{what} failed on {self.world_size} ranks"]
            if missing and failures:
                lines.append(f"ranks {missing} were still running when the failure came")
            elif missing:
                lines.append(
                    f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock?)"
                )
            for rank in sorted(failures):
                lines.append(f"--- rank {rank} ---\n{failures[rank]}")
            raise RankError("\n".join(lines))
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """Stop all ranks (politely, then by force)."""
        for q, proc in zip(getattr(self, "_tasks", []), self._procs):
            if proc.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5.0)
        self._procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
