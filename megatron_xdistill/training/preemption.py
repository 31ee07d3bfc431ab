"""Save and stop before a cluster kills the job: ``--exit-signal-handler``, ``--exit-duration-in-mins``.

Schedulers send SIGTERM some time before they kill a job (preemption, the end of an allocation),
and allocations have a wall-clock limit. Megatron-LM answers both by saving a checkpoint and
exiting cleanly; so does this run. A signal reaches the ranks at different moments (or only
some of them), so the decision is agreed: at the start of every iteration each rank offers what
it knows (signal seen here, time budget spent) and one MAX all-reduce over the world makes every
rank, teacher ranks included, stop after the same step. Without either flag nothing is installed
and no collective runs.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

REASONS = ("SIGTERM received (--exit-signal-handler)", "--exit-duration-in-mins reached")


class StopRequest:
    """Whether the run should save and stop after this step (see the module docstring)."""

    def __init__(self, on_signal: bool, duration_mins: float | None, started: float,
                 log=print) -> None:
        self.on_signal, self.duration_mins = on_signal, duration_mins
        self.started, self.log = started, log
        self.received = False
        self._previous = None
        if on_signal:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    @property
    def enabled(self) -> bool:
        return self.on_signal or self.duration_mins is not None

    def _handle(self, signum, frame) -> None:
        if not self.received:
            print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: SIGTERM received; "
                  f"the run saves and exits after the current step", flush=True)
        self.received = True

    def agreed(self) -> str | None:
        """Collective over the world when enabled (every rank, every iteration): the reason to
        stop after this step, the same on every rank, or None."""
        if not self.enabled:
            return None
        over = (self.duration_mins is not None
                and time.monotonic() - self.started >= 60.0 * self.duration_mins)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        flags = torch.tensor([float(self.received), float(over)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for reason, flag in zip(REASONS, flags.tolist()):
            if flag:
                return reason
        return None

    def close(self) -> None:
        """Put back the SIGTERM handler that was there before."""
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
