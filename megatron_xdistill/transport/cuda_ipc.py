"""Same-node transport between GPU processes through CUDA IPC.

:class:`CudaIpcTransport` is the slot transport of :mod:`.slots` over device buffers: each sender
allocates one persistent buffer on its GPU and publishes its IPC handle once (torch's own CUDA IPC
reduction, the mechanism ``torch.multiprocessing`` uses, exchanged over the gloo control group).
A receiver maps it once; each step it gets zero-copy views of its rows when it shares the
sender's GPU, or one peer-to-peer copy of just those rows to its own GPU otherwise.

Per step each rank synchronises its current stream before the control barrier: the sender's
writes are complete when receivers look, and a receiver's reads of step ``k`` are complete before
the sender rewrites that slot at step ``k + 2``. The driver frees IPC allocations with the
process that made them, and a receiver's mapping with the receiver, so a dying rank leaks no
device memory; :meth:`~.slots.SlotTransport.close` drops the mappings and returns the buffer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.slots import SlotTransport


class CudaIpcSlots:
    """Slot memory in device buffers shared through CUDA IPC handles."""

    kind = "CUDA IPC"

    def __init__(self, device: torch.device | int | str | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA IPC transport needs a CUDA device; use the shared-memory "
                               "transport on CPU")
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        self._owned = False

    def create(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)
        self._owned = True
        return buffer, reduce_tensor(buffer)

    def open(self, handle: Any) -> torch.Tensor:
        rebuild, args = handle
        with torch.cuda.device(self.device):
            return rebuild(*args)

    def sealed(self) -> None:
        """IPC handles name no file: nothing to drop."""

    def settle(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def deliver(self, view: torch.Tensor) -> torch.Tensor:
        if view.device == self.device:
            return view
        return view.to(self.device, non_blocking=True)

    def release(self) -> None:
        if self._owned and torch.cuda.is_initialized():
            torch.cuda.ipc_collect()  # frees blocks receivers have let go of


class CudaIpcTransport(SlotTransport):
    """Same-node routes through CUDA IPC (see the module docstring). ``group`` must be a CPU
    (gloo) group: the per-step barrier is a host-side signal."""

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None,
                 device: torch.device | int | str | None = None) -> None:
        super().__init__(routes, numel, dtype, CudaIpcSlots(device), group)
