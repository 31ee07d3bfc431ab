"""Same-node transport through persistent, double-buffered slots in memory every rank can map.

The logic shared by the CPU (POSIX shared memory) and the GPU (CUDA IPC) transports.
:class:`SlotBuffers` is the memory layout: each sender owns one buffer, created once and
published once (handles exchanged over the control group at construction, never per step). It
holds two slots per routed sample; step ``k`` writes slot ``k % 2``, so a sender can write step
``k + 1`` while receivers still read their zero-copy views of step ``k``. Receivers map the
senders' buffers once and read only their own rows.

:class:`SlotTransport` signals synchronously (colocated placement): one barrier of the control
group per step is the "written" signal; before it every rank waits for its own queued device work
(the sender's writes of this step, the receiver's reads of the previous one), so a slot is never
rewritten while it is read. The streaming counterpart for a disaggregated teacher, whose sender
does not wait for its receivers, is :mod:`.slot_stream`.

A :class:`SlotMemory` supplies the memory: ``create`` a buffer and a picklable handle for it,
``open`` a handle another rank published, ``sealed`` once every receiver has opened its
senders' buffers (a named buffer can drop its name then), ``settle`` queued device work,
``deliver`` a view to this rank's device, ``release`` everything at close.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route


class SlotMemory(Protocol):
    """Where the slots live (see the module docstring)."""

    kind: str

    def create(self, nbytes: int) -> tuple[torch.Tensor, Any]: ...

    def open(self, handle: Any) -> torch.Tensor: ...

    def sealed(self) -> None: ...

    def settle(self) -> None: ...

    def deliver(self, view: torch.Tensor) -> torch.Tensor: ...

    def release(self) -> None: ...


class PayloadSignalError(RuntimeError):
    """A rank did not reach a step's "written" signal (it died, hangs or fell behind)."""


class SlotBuffers:
    """Each sender's persistent buffer (two slots per sample it sends) and its receivers' mappings.

    ``routes``: the same-node routes between different ranks (every rank of ``group`` passes the
    same list). ``numel``/``dtype``: one sample's payload. ``group``: the control group (a CPU
    backend such as gloo; None = the default group) over which construction exchanges the
    handles once; construction is collective over it.
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype,
                 memory: SlotMemory, group: dist.ProcessGroup | None = None) -> None:
        self.routes = [r for r in routes if r.src != r.dst]
        self.numel, self.dtype, self.group, self.memory = numel, dtype, group, memory
        self.rank = dist.get_rank()
        self._slot_bytes = numel * torch.empty((), dtype=dtype).element_size()
        # Each sender's slot index per sample it sends (one copy per sample, however many
        # ranks receive it).
        self._slot_of: dict[int, dict[int, int]] = {}
        for route in self.routes:
            slots = self._slot_of.setdefault(route.src, {})
            slots.setdefault(route.sample, len(slots))
        mine = self._slot_of.get(self.rank, {})
        self._own = None
        handle = None
        if mine:
            self._own, handle = memory.create(max(2 * len(mine) * self._slot_bytes, 1))
        group_ranks = (dist.get_process_group_ranks(group) if group is not None
                       else list(range(dist.get_world_size())))
        handles: list = [None] * len(group_ranks)
        dist.all_gather_object(handles, handle, group=group)
        senders = sorted({r.src for r in self.routes if r.dst == self.rank})
        self._buffers = {s: memory.open(handles[group_ranks.index(s)]) for s in senders}
        dist.barrier(group=group)  # every receiver holds its mappings: handles are spent
        memory.sealed()

    @property
    def senders(self) -> list[int]:
        """Ranks whose buffers this rank reads."""
        return sorted({r.src for r in self.routes if r.dst == self.rank})

    @property
    def receivers(self) -> list[int]:
        """Ranks that read this rank's buffer."""
        return sorted({r.dst for r in self.routes if r.src == self.rank})

    def _view(self, buffer: torch.Tensor, slot: int) -> torch.Tensor:
        start = slot * self._slot_bytes
        return buffer[start: start + self._slot_bytes].view(self.dtype)

    def write(self, parity: int, outgoing: dict[int, torch.Tensor]) -> None:
        """Copy this rank's payloads (by sample) into its slots of ``parity`` (0 or 1)."""
        for sample, slot in self._slot_of.get(self.rank, {}).items():
            payload = outgoing[sample].reshape(-1)
            if payload.numel() != self.numel:
                raise ValueError(f"rank {self.rank}: payload of sample {sample} has "
                                 f"{payload.numel()} elements, the plan says {self.numel}")
            self._view(self._own, 2 * slot + parity).copy_(payload)

    def read(self, parity: int) -> dict[int, torch.Tensor]:
        """This rank's payloads in slots of ``parity``: views of the senders' buffers (or, on
        another GPU, copies of just these rows), by sample."""
        received = {}
        for route in self.routes:
            if route.dst == self.rank:
                slot = self._slot_of[route.src][route.sample]
                view = self._view(self._buffers[route.src], 2 * slot + parity)
                received[route.sample] = self.memory.deliver(view)
        return received

    def close(self) -> None:
        """Drop every mapping and release this rank's own buffer (idempotent)."""
        self._buffers.clear()
        self._own = None
        self.memory.release()


class SlotTransport(SlotBuffers):
    """Routes between different ranks of one node, one synchronous exchange per step.

    Every rank of ``group`` must call :meth:`exchange` every step (colocated placement: every
    rank is a teacher and a student rank, so all take part in each step anyway).
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype,
                 memory: SlotMemory, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(routes, numel, dtype, memory, group)
        self.step = 0
        self.seconds = 0.0

    def exchange(self, outgoing: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Write this rank's payloads, signal, and return views of the received ones.

        A returned view stays valid until this rank calls :meth:`exchange` again.
        """
        start = time.perf_counter()
        parity = self.step % 2
        self.write(parity, outgoing)
        self.memory.settle()  # our writes of this step and reads of the last one are done
        try:
            dist.barrier(group=self.group)
        except Exception as exc:  # noqa: BLE001 - backends raise RuntimeError subclasses
            raise PayloadSignalError(
                f"rank {self.rank}: step {self.step}: same-node payload signal ({self.memory.kind})"
                f" failed: a rank of the node died, hangs or fell behind ({exc})") from exc
        received = self.read(parity)
        self.step += 1
        self.seconds += time.perf_counter() - start
        return received
