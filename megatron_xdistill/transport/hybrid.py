"""Pick a transport per route: same rank -> reference, same node -> shared memory, else p2p.

Node membership comes from torchrun's environment (``GROUP_RANK``, the node index), gathered once,
so two torchrun "nodes" on one machine exercise the cross-node path. On GPUs the same split
applies with CUDA IPC and NCCL in place of shared memory and gloo.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_xdistill.transport.gloo import P2PTransport
from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.shm import SharedMemoryTransport


def node_of_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Node index of every rank (torchrun's ``GROUP_RANK``; 0 without torchrun). Collective."""
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    nodes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, node, group=group)
    return [int(n) for n in nodes]


class RoutedTransport:
    """One step's payload exchange along a routing plan, split by locality."""

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 nodes: Sequence[int] | None = None, use_shared_memory: bool = True) -> None:
        self.rank = dist.get_rank()
        self.numel, self.dtype = numel, dtype
        nodes = list(nodes) if nodes is not None else node_of_ranks()
        same_node = [r for r in routes if r.src != r.dst and nodes[r.src] == nodes[r.dst]]
        if not use_shared_memory:
            same_node = []
        shm_set = set(same_node)
        self.local = [r for r in routes if r.src == r.dst]
        self.remote = [r for r in routes if r.src != r.dst and r not in shm_set]
        self.shm = SharedMemoryTransport(same_node, numel, dtype) if same_node else None
        self.p2p = P2PTransport(self.remote)
        self.bytes_moved = 0
        self.seconds = 0.0
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._moved_per_step = sum(1 for r in routes if r.src == self.rank and r.dst != self.rank
                                   ) * numel * itemsize

    def exchange(self, outgoing: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Send this rank's payloads (by sample); return the payloads routed to this rank."""
        start = time.perf_counter()
        received = {r.sample: outgoing[r.sample] for r in self.local if r.dst == self.rank}
        if self.shm is not None:
            received.update(self.shm.exchange(outgoing))
        received.update(self.p2p.exchange(outgoing, self.numel, self.dtype))
        self.bytes_moved += self._moved_per_step
        self.seconds += time.perf_counter() - start
        return received

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
