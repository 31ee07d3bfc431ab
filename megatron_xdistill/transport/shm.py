"""Same-node transport through POSIX shared memory: the CPU counterpart of CUDA IPC.

:class:`SharedMemoryTransport` is the slot transport of :mod:`.slots` over shared-memory segments.
A segment's name is unlinked as soon as every receiver has mapped it (the mappings stay valid), so
nothing is left under ``/dev/shm`` even when a rank is killed outright; the memory goes back to
the system when the last mapping does (at :meth:`~.slots.SlotTransport.close` or process exit).
"""

from __future__ import annotations

import atexit
import sys
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.slots import SlotTransport


def _release(own: list[shared_memory.SharedMemory],
             attached: list[shared_memory.SharedMemory]) -> None:
    for shm in attached + own:
        try:
            shm.close()
        except Exception:  # noqa: BLE001 - best effort at teardown (views may still exist)
            pass
    _unlink(own)


def _unlink(own: list[shared_memory.SharedMemory]) -> None:
    for shm in own:
        try:
            shm.unlink()
        except FileNotFoundError:  # already unlinked (sealed, or released before)
            pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map another rank's segment without letting this process's resource tracker own it.

    Before Python 3.13 attaching registers the segment with the tracker, which unlinks it when
    *this* process exits (under the owner's feet, with a warning at exit); the owner alone
    unlinks (on close, or its own tracker if it dies). Unregistering afterwards is no cure when
    owner and reader share one tracker (processes spawned by one parent): it drops the owner's
    registration too. So registration is skipped while attaching."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    from multiprocessing import resource_tracker

    register = resource_tracker.register
    resource_tracker.register = lambda name, rtype: None
    try:
        return shared_memory.SharedMemory(name=name, create=False)
    finally:
        resource_tracker.register = register


class SharedMemorySlots:
    """Slot memory in POSIX shared-memory segments (named, so the handle is the name)."""

    kind = "shared memory"

    def __init__(self) -> None:
        self._own: list[shared_memory.SharedMemory] = []
        self._attached: list[shared_memory.SharedMemory] = []
        self._finalizer = weakref.finalize(self, _release, self._own, self._attached)
        atexit.register(self._finalizer)

    def create(self, nbytes: int) -> tuple[torch.Tensor, str]:
        name = f"xdistill_{uuid.uuid4().hex[:16]}_{dist.get_rank()}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        self._own.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.uint8), name

    def open(self, handle: str) -> torch.Tensor:
        shm = _attach(handle)
        self._attached.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.uint8)

    def sealed(self) -> None:
        """Every receiver has mapped our segments: drop their names (see the module docstring)."""
        _unlink(self._own)

    def settle(self) -> None:
        """CPU copies are synchronous: nothing is queued."""

    def deliver(self, view: torch.Tensor) -> torch.Tensor:
        return view

    def release(self) -> None:
        self._finalizer()


class SharedMemoryTransport(SlotTransport):
    """Same-node routes through shared memory (see :class:`~.slots.SlotTransport`)."""

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__(routes, numel, dtype, SharedMemorySlots(), group)
