"""Point-to-point transport of routed payloads over torch.distributed (gloo on CPU, any backend).

Same-rank routes are plain references (no copy); the rest go as one batch of isend/irecv per
step. Payloads are flat tensors of a size every rank knows in advance (the plan is from sizes).
Gloo between CPU processes; between GPUs on different nodes the same code runs over an NCCL
group with device buffers (see :mod:`.routed`, which builds that group).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route


class P2PTransport:
    """Moves per-sample flat payloads along a routing plan with batched point-to-point ops."""

    def __init__(self, routes: Sequence[Route], group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        self.rank = dist.get_rank()
        # Only this rank's routes: a step's work grows with them, not with the plan.
        self.routes = [r for r in routes if self.rank in (r.src, r.dst)]
        self.group = group
        self.device = torch.device(device)
        self.bytes_sent = 0
        self.seconds = 0.0

    def exchange(self, outgoing: dict[int, torch.Tensor], numel: int,
                 dtype: torch.dtype = torch.float32) -> dict[int, torch.Tensor]:
        """Send this rank's payloads (by sample), return the ones routed to this rank.

        ``outgoing`` must hold every sample this rank is the source of; ``numel`` is the payload
        size of one sample (same on every rank).
        """
        start = time.perf_counter()
        received: dict[int, torch.Tensor] = {}
        ops = []
        for route in self.routes:
            if route.src == self.rank and route.dst == self.rank:
                received[route.sample] = outgoing[route.sample]
            elif route.src == self.rank:
                tensor = outgoing[route.sample].reshape(-1).contiguous()
                if tensor.numel() != numel:
                    raise ValueError(
                        f"rank {self.rank}: payload of sample {route.sample} has {tensor.numel()} "
                        f"elements, the plan says {numel}"
                    )
                ops.append(dist.P2POp(dist.isend, tensor, route.dst, group=self.group))
                self.bytes_sent += tensor.numel() * tensor.element_size()
            elif route.dst == self.rank:
                buffer = torch.empty(numel, dtype=dtype, device=self.device)
                received[route.sample] = buffer
                ops.append(dist.P2POp(dist.irecv, buffer, route.src, group=self.group))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        self.seconds += time.perf_counter() - start
        return received
