"""Same-node transport through POSIX shared memory: the CPU counterpart of CUDA IPC.

Each sender owns one persistent buffer, created once and published once (names exchanged over the
control group at construction, never per step). It holds two slots per routed sample; step ``k``
writes slot ``k % 2``, so a sender can write step ``k + 1`` while receivers still read their
zero-copy views of step ``k``. One barrier per step is the "written" signal. Receivers map the senders'
buffers once and read only their own rows. Buffers are unlinked on :meth:`close`, at interpreter
exit, and when the object is collected, so a failing rank leaks no shared memory.
"""

from __future__ import annotations

import atexit
import sys
import time
import uuid
import weakref
from collections.abc import Sequence
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route

_DTYPES = {torch.float32: np.float32, torch.bfloat16: np.uint16, torch.float16: np.float16}


def _release(own: shared_memory.SharedMemory | None,
             attached: list[shared_memory.SharedMemory]) -> None:
    for shm in attached:
        try:
            shm.close()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
    if own is not None:
        try:
            own.close()
            own.unlink()
        except FileNotFoundError:
            pass


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map another rank's segment without letting this process's resource tracker own it.

    Before Python 3.13 attaching registers the segment with the tracker, which unlinks it when
    *this* process exits (under the owner's feet, with a warning at exit); the owner alone
    unlinks (on close, or its own tracker if it dies)."""
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    from multiprocessing import resource_tracker

    shm = shared_memory.SharedMemory(name=name, create=False)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 - the registered name
    return shm


class SharedMemoryTransport:
    """Routes between different ranks of one node through shared memory.

    ``routes`` are the same-node, different-rank routes of the plan (all ranks pass the same
    list). ``numel``/``dtype`` give one sample's payload. ``group`` is the control group used for
    the one-time name exchange and the per-step barrier (every rank of it must call exchange).
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported payload dtype {dtype}; use one of {list(_DTYPES)}")
        self.routes = [r for r in routes if r.src != r.dst]
        self.numel, self.dtype, self.group = numel, dtype, group
        self.rank = dist.get_rank()
        self.step = 0
        self.seconds = 0.0
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._slot_bytes = numel * itemsize
        # Each sender's slot index per sample it sends (deduplicated: one copy per sample).
        self._slot_of: dict[int, dict[int, int]] = {}
        for route in self.routes:
            slots = self._slot_of.setdefault(route.src, {})
            slots.setdefault(route.sample, len(slots))
        mine = self._slot_of.get(self.rank, {})
        self._own = None
        name = None
        if mine:
            name = f"xdistill_{uuid.uuid4().hex[:16]}_{self.rank}"
            self._own = shared_memory.SharedMemory(
                name=name, create=True, size=max(2 * len(mine) * self._slot_bytes, 1))
        names: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(names, name, group=group)
        senders = {r.src for r in self.routes if r.dst == self.rank}
        group_ranks = dist.get_process_group_ranks(group) if group is not None else \
            list(range(dist.get_world_size()))
        self._views: dict[int, shared_memory.SharedMemory] = {}
        for sender in senders:
            self._views[sender] = _attach(names[group_ranks.index(sender)])
        self._finalizer = weakref.finalize(self, _release, self._own, list(self._views.values()))
        atexit.register(self._finalizer)

    def _tensor(self, shm: shared_memory.SharedMemory, slot: int) -> torch.Tensor:
        offset = slot * self._slot_bytes
        array = np.ndarray((self.numel,), dtype=_DTYPES[self.dtype], buffer=shm.buf,
                           offset=offset)
        tensor = torch.from_numpy(array)
        return tensor.view(self.dtype) if self.dtype == torch.bfloat16 else tensor

    def exchange(self, outgoing: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Write this rank's payloads, signal, and return zero-copy views of the received ones.

        A returned view stays valid until this rank calls :meth:`exchange` again.
        """
        start = time.perf_counter()
        parity = self.step % 2
        mine = self._slot_of.get(self.rank, {})
        for sample, slot in mine.items():
            payload = outgoing[sample].reshape(-1)
            if payload.numel() != self.numel:
                raise ValueError(f"rank {self.rank}: payload of sample {sample} has "
                                 f"{payload.numel()} elements, the plan says {self.numel}")
            self._tensor(self._own, 2 * slot + parity).copy_(payload.to(self.dtype))
        dist.barrier(group=self.group)  # every sender has written step `self.step`
        received = {}
        for route in self.routes:
            if route.dst == self.rank:
                slot = self._slot_of[route.src][route.sample]
                received[route.sample] = self._tensor(self._views[route.src], 2 * slot + parity)
        self.step += 1
        self.seconds += time.perf_counter() - start
        return received

    def close(self) -> None:
        """Unmap every buffer and unlink this rank's own (idempotent)."""
        self._finalizer()
