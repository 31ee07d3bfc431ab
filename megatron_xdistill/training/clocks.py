"""Where a step's time goes: per-phase seconds, and the loss's share timed inside autograd."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class PhaseTimes:
    """Seconds spent per phase since the last log. ``loss`` (the cross-tokenizer loss, forward
    and backward) is part of ``student`` (forward + backward of the whole student step).

    ``route`` is the transport: the exchange (colocated), or on disaggregated student ranks the
    wait for the step's payloads (near zero when the teacher keeps ahead), on teacher ranks the
    packing and posting of the sends. With a disaggregated teacher the student ranks' ``teacher``
    is the teacher ranks' forward time, reported with the payloads (it overlaps the student)."""

    teacher: float = 0.0
    route: float = 0.0
    student: float = 0.0
    loss: float = 0.0
    optimizer: float = 0.0

    def reset(self) -> dict[str, float]:
        out = {f"time_{k}": round(v, 4) for k, v in vars(self).items()}
        for key in vars(self):
            setattr(self, key, 0.0)
        return out


def device_now(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work: CUDA kernels run
    asynchronously, so without the sync a phase's GPU time would be billed to the next phase."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _LossClockStop(torch.autograd.Function):
    """Identity on the logits; its backward runs after the loss's own backward: clock stops."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.times.loss += device_now(grad.device) - ctx.clock.started
        return grad, None


class _LossClockStart(torch.autograd.Function):
    """Identity on the loss; its backward runs first: clock starts."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.clone()  # a scalar; the schedule divides it in place (no view allowed)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.started = device_now(grad.device)
        return grad, None


class LossClock:
    """Times the loss's forward and backward inside the pipeline schedule's autograd pass.

    ``enter`` wraps the logits and ``leave`` the loss in identity autograd functions: backward
    reaches ``leave`` first (clock starts) and ``enter`` after the loss's own backward (clock
    stops), so the loss's recomputing backward is timed without hooks into Megatron.
    """

    def __init__(self, times: PhaseTimes) -> None:
        self.times = times
        self.started = 0.0

    def enter(self, logits: torch.Tensor) -> torch.Tensor:
        return _LossClockStop.apply(logits, self)

    def leave(self, loss: torch.Tensor) -> torch.Tensor:
        return _LossClockStart.apply(loss, self)
