"""What runs on the cluster: one actor per rank, the log sink, and the per-node reaper."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

import ray

from megatron_xdistill.launch.capture import Batch, LineCapture
from megatron_xdistill.launch.rank_env import LAUNCH_ID_VAR, parse_entry_point


class RankWorker:
    """Runs the training entry point in-process, as one torchrun rank would."""

    def __init__(self, rank: int, sink: Any | None) -> None:
        self.rank = rank
        self._sink = sink

    def __repr__(self) -> str:  # Ray uses this in its own messages about the actor
        return f"RankWorker(rank={self.rank})"

    def info(self) -> dict[str, Any]:
        """Where this actor runs: Ray node id, pid, host name and the GPUs Ray gave it."""
        context = ray.get_runtime_context()
        return {"node_id": context.get_node_id(), "pid": os.getpid(),
                "hostname": socket.gethostname(), "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def free_port(self) -> int:
        """A TCP port that is free on this node right now (for MASTER_PORT)."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return sock.getsockname()[1]

    def run(self, entry_point: str, argv: Sequence[str], env: dict[str, str],
            cwd: str | None) -> dict[str, Any]:
        """Call ``entry_point(argv)`` with ``env`` set; stdout/stderr stream to the sink.

        Returns ``{"rank", "code", "error", "collective", "time"}``: the exit code (the return
        value, a ``SystemExit`` code, or 1 for an exception), the traceback if it raised,
        whether that exception was a torch.distributed communication error (most likely a
        consequence of another rank's failure), and when it ended.
        """
        os.environ.update(env)
        if cwd and os.path.isdir(cwd):
            os.chdir(cwd)
            if cwd not in sys.path:
                sys.path.insert(0, cwd)  # like ``python -m``: modules in the run directory import
        sent: list[Any] = []

        def push(batch: Batch) -> None:
            sent[:] = [self._sink.put.remote(self.rank, batch)]

        capture = LineCapture(push).start() if self._sink is not None else None
        error, collective = None, False
        try:
            module, function = parse_entry_point(entry_point)
            main = getattr(importlib.import_module(module), function)
            sys.argv = [module, *argv]
            code = _exit_code(main(list(argv)))
        except SystemExit as exc:
            code = _exit_code(exc.code)
            if code:
                error = f"SystemExit({exc.code!r})"
        except BaseException as exc:  # reported to the driver
            code, error, collective = 1, traceback.format_exc(), _is_collective_error(exc)
        ended = time.time()
        if capture is not None:
            capture.stop()
            if sent:
                ray.wait(sent, timeout=10)  # the last batch reached the sink before we return
        return {"rank": self.rank, "code": code, "error": error, "collective": collective,
                "time": ended}


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        return 1 if value else 0
    return value


# Messages of communication errors that do not use torch.distributed.DistError (gloo's are
# plain RuntimeErrors): a rank failing this way most likely lost a peer that failed first.
_COMM_ERROR_MARKERS = ("gloo/transport", "Connection closed by peer", "Connection reset by peer",
                       "ProcessGroupNCCL", "NCCL error", "NCCL communicator")


def _is_collective_error(exc: BaseException) -> bool:
    """A torch.distributed communication error anywhere in the exception's chain."""
    dist = sys.modules.get("torch.distributed")
    kinds = (dist.DistError,) if dist is not None and hasattr(dist, "DistError") else ()
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if (kinds and isinstance(current, kinds)) or any(
                marker in str(current) for marker in _COMM_ERROR_MARKERS):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


class LogSink:
    """Collects rank output for the driver, which long-polls :meth:`take` (an async actor)."""

    def __init__(self) -> None:
        self._items: list[tuple[int, str, str]] = []
        self._event = asyncio.Event()

    async def put(self, rank: int, batch: Batch) -> None:
        self._items.extend((rank, stream, line) for stream, line in batch)
        self._event.set()

    async def take(self, timeout_s: float) -> list[tuple[int, str, str]]:
        """Lines received so far; waits up to ``timeout_s`` for the first."""
        if not self._items:
            try:
                await asyncio.wait_for(self._event.wait(), timeout_s)
            except TimeoutError:
                pass
        items, self._items = self._items, []
        self._event.clear()
        return items


def reap(launch_id: str, timeout_s: float = 10.0) -> list[int]:
    """Kill every process on this node that a launch started (actors and their children).

    Found by the launch id in the process's initial environment: rank actors get it from their
    Ray runtime environment and every child inherits it, so orphans of a killed actor are found
    too. Returns the pids that were killed.
    """
    import psutil

    me = os.getpid()
    victims = []
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            if proc.environ().get(LAUNCH_ID_VAR) == launch_id:
                proc.send_signal(signal.SIGKILL)
                victims.append(proc)
        except (psutil.Error, OSError):
            continue
    psutil.wait_procs(victims, timeout=timeout_s)
    return [proc.pid for proc in victims]
