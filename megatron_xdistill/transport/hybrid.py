"""Pick a transport per route: same rank -> reference, same node -> shared slots, else p2p.

Node membership comes from torchrun's environment (``GROUP_RANK``, the node index), gathered once,
so two torchrun "nodes" on one machine exercise the cross-node path. On CPU the same-node routes go
through POSIX shared memory and the rest through gloo; with ``device`` a GPU they go through CUDA
IPC and NCCL. Each node gets a gloo control group of its own (the per-step "written" barrier
couples only the ranks of one node); the NCCL group holds only ranks with cross-node routes and
is refused when two of them share a GPU (NCCL cannot connect them).
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
from megatron_xdistill.transport.slots import SlotTransport


def node_of_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Node index of every rank (torchrun's ``GROUP_RANK``; 0 without torchrun). Collective."""
    node = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))
    nodes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, node, group=group)
    return [int(n) for n in nodes]


def _gpu_id(device: torch.device) -> str | None:
    if device.type != "cuda":
        return None
    return f"{os.uname().nodename}/{torch.cuda.get_device_properties(device).uuid}"


def gpu_of_ranks(device: torch.device | str, group: dist.ProcessGroup | None = None
                 ) -> list[str | None]:
    """Host and GPU UUID of every rank (None for CPU ranks). Collective."""
    ids: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ids, _gpu_id(torch.device(device)), group=group)
    return ids


def check_one_rank_per_gpu(ranks: Sequence[int], gpus: Sequence[str | None]) -> None:
    """Refuse an NCCL group in which two ranks drive the same GPU (``gpus``: one id per global
    rank, host and device UUID), naming them."""
    seen: dict[str, int] = {}
    for rank in ranks:
        gpu = gpus[rank]
        if gpu is None:
            continue
        if gpu in seen:
            raise ValueError(
                f"ranks {seen[gpu]} and {rank} both use GPU {gpu}, and the teacher -> student "
                f"payloads between them would need one NCCL communicator on it, which NCCL "
                f"refuses: run one process per GPU (torchrun --nproc-per-node <= GPUs; each rank "
                f"on cuda:LOCAL_RANK)")
        seen[gpu] = rank


class RoutedTransport:
    """One step's payload exchange along a routing plan, split by locality.

    Construction is collective over the whole world (it makes process groups). ``nodes``:
    node index per rank (default: from torchrun's environment). ``device``: where payloads live
    (CPU: shared memory + gloo; CUDA: CUDA IPC + NCCL).
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 nodes: Sequence[int] | None = None, use_shared_memory: bool = True,
                 device: torch.device | str = "cpu") -> None:
        self.rank = dist.get_rank()
        self.numel, self.dtype = numel, dtype
        self.device = torch.device(device)
        gpu = self.device.type == "cuda"
        control = dist.new_group(backend="gloo") if gpu else None  # host-side signals
        nodes = list(nodes) if nodes is not None else node_of_ranks(control)

        same_node = [r for r in routes if r.src != r.dst and nodes[r.src] == nodes[r.dst]]
        if not use_shared_memory:
            same_node = []
        shm_set = set(same_node)
        self.local = [r for r in routes if r.src == r.dst]
        self.remote = [r for r in routes if r.src != r.dst and r not in shm_set]
        self.shm: SlotTransport | None = None
        mine = nodes[self.rank]
        for node in sorted(set(nodes)):  # every rank makes every node's group, in order
            members = [r for r, n in enumerate(nodes) if n == node]
            node_routes = [r for r in same_node if nodes[r.src] == node]
            if not node_routes:
                continue
            group = dist.new_group(members, backend="gloo")
            if node == mine:
                self.shm = self._same_node(node_routes, group)
        p2p_group = None
        members = sorted({r.src for r in self.remote} | {r.dst for r in self.remote})
        if gpu and members:
            check_one_rank_per_gpu(members, gpu_of_ranks(self.device, control))
            p2p_group = dist.new_group(members, backend="nccl")
        self.p2p = P2PTransport(self.remote, group=p2p_group, device=self.device)
        self.bytes_moved = 0
        self.seconds = 0.0
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._moved_per_step = sum(1 for r in routes if r.src == self.rank and r.dst != self.rank
                                   ) * numel * itemsize

    def _same_node(self, routes: list[Route], group: dist.ProcessGroup) -> SlotTransport:
        if self.device.type == "cuda":
            from megatron_xdistill.transport.cuda_ipc import CudaIpcTransport

            return CudaIpcTransport(routes, self.numel, self.dtype, group=group,
                                    device=self.device)
        return SharedMemoryTransport(routes, self.numel, self.dtype, group=group)

    @property
    def same_node_kind(self) -> str | None:
        """"shared memory", "CUDA IPC", or None when this rank's node has no such routes."""
        return None if self.shm is None else self.shm.memory.kind

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
