"""Pick a transport per route: same rank -> reference, same node -> shared slots, else p2p.

Node membership comes from torchrun's environment (``GROUP_RANK``, the node index), gathered once,
so two torchrun "nodes" on one machine exercise the cross-node path. On CPU the same-node routes go
through POSIX shared memory and the rest through gloo; with ``device`` a GPU they go through CUDA
IPC and NCCL. Each node gets a gloo control group of its own (the per-step signals couple only
the ranks of one node); the NCCL group holds only ranks with cross-node routes and is refused when
two of them share a GPU (NCCL cannot connect them).

:class:`RoutedTransport` exchanges synchronously (colocated placement: every rank is a teacher and
a student rank); :class:`RoutedStream` streams from teacher ranks that do not wait for their
students (disaggregated placement).
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_xdistill.transport.p2p import P2PTransport
from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.shm import SharedMemorySlots
from megatron_xdistill.transport.slot_stream import SlotStream
from megatron_xdistill.transport.slots import SlotMemory, SlotTransport
from megatron_xdistill.transport.stream import P2PStream


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


def _slot_memory_class(device: torch.device) -> type:
    if device.type == "cuda":
        from megatron_xdistill.transport.cuda_ipc import CudaIpcSlots

        return CudaIpcSlots
    return SharedMemorySlots


def slot_memory(device: torch.device) -> SlotMemory:
    """Where same-node slots live: CUDA IPC buffers on a GPU, POSIX shared memory on the CPU."""
    memory_class = _slot_memory_class(device)
    return memory_class(device) if device.type == "cuda" else memory_class()


class _Split:
    """The routes of a plan by locality, the node groups and the cross-node group (collective:
    every rank of the world builds it, in the same order)."""

    def __init__(self, routes: Sequence[Route], nodes: Sequence[int] | None,
                 use_shared_memory: bool, device: torch.device,
                 group_timeout: datetime.timedelta | None = None) -> None:
        rank = dist.get_rank()
        self.device = device
        gpu = device.type == "cuda"
        self.p2p_backend = "nccl" if gpu else "gloo"
        control = dist.new_group(backend="gloo") if gpu else None  # host-side signals
        self.nodes = list(nodes) if nodes is not None else node_of_ranks(control)
        same_node = [r for r in routes if r.src != r.dst
                     and self.nodes[r.src] == self.nodes[r.dst]] if use_shared_memory else []
        shm_set = set(same_node)
        self.local = [r for r in routes if r.src == r.dst]
        self.same_node = same_node
        self.remote = [r for r in routes if r.src != r.dst and r not in shm_set]
        mine = self.nodes[rank]
        self.node_routes: list[Route] = []  # this node's same-node routes
        self.node_group: dist.ProcessGroup | None = None
        for node in sorted(set(self.nodes)):  # every rank makes every node's group, in order
            members = [r for r, n in enumerate(self.nodes) if n == node]
            node_routes = [r for r in same_node if self.nodes[r.src] == node]
            if not node_routes:
                continue
            group = dist.new_group(members, backend="gloo", timeout=group_timeout)
            if node == mine:
                self.node_routes, self.node_group = node_routes, group
        # The cross-node group: exactly the ranks with cross-node routes (NCCL on GPUs).
        self.p2p_members = sorted({r.src for r in self.remote} | {r.dst for r in self.remote})
        self.p2p_group = None
        if self.p2p_members:
            if gpu:
                check_one_rank_per_gpu(self.p2p_members, gpu_of_ranks(device, control))
            self.p2p_group = dist.new_group(self.p2p_members, backend=self.p2p_backend,
                                            timeout=group_timeout)

    def describe(self) -> str:
        """One line for the log: how many routes take which path (the same on every rank)."""
        return (f"{len(self.local)} in-process, {len(self.same_node)} within a node "
                f"({_slot_memory_class(self.device).kind}), {len(self.remote)} across nodes "
                f"({self.p2p_backend.replace('nccl', 'NCCL')}) over {len(set(self.nodes))} "
                f"node(s)")


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
        split = _Split(routes, nodes, use_shared_memory, self.device)
        self.local, self.remote = split.local, split.remote
        self.shm: SlotTransport | None = None
        if split.node_routes:
            self.shm = SlotTransport(split.node_routes, numel, dtype, slot_memory(self.device),
                                     split.node_group)
        self.p2p = P2PTransport(self.remote, group=split.p2p_group, device=self.device)
        self.bytes_moved = 0
        self.seconds = 0.0
        itemsize = torch.empty((), dtype=dtype).element_size()
        self._moved_per_step = sum(1 for r in routes if r.src == self.rank and r.dst != self.rank
                                   ) * numel * itemsize
        self.summary = split.describe()

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


UNTIMED_GROUP_TIMEOUT = datetime.timedelta(days=7)


class RoutedStream:
    """Disaggregated teacher -> student payloads along a routing plan, split by locality: routes
    within a node through slot memory (:class:`~.slot_stream.SlotStream`: shared memory on CPU,
    CUDA IPC on GPUs), routes across nodes point-to-point (:class:`~.stream.P2PStream`: gloo,
    NCCL on GPUs). No route may stay on one rank (teacher and student ranks differ).

    Same calls as either part: teacher ranks :meth:`send` each step without waiting for the
    students (two steps in flight at most); student ranks :meth:`prefetch` / :meth:`receive`.
    Construction is collective over the whole world.
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 nodes: Sequence[int] | None = None, use_shared_memory: bool = True,
                 device: torch.device | str = "cpu", timeout_s: float = 600.0,
                 num_stats: int = 1, watch=None) -> None:
        local = [r for r in routes if r.src == r.dst]
        if local:
            raise ValueError(f"RoutedStream moves payloads between different ranks; "
                             f"{len(local)} route(s) stay on one rank (e.g. {local[0]})")
        self.rank = dist.get_rank()
        self.device = torch.device(device)
        # With a PeerWatch the waits are untimed (a slow peer is waited for, a dead one is
        # detected by its heartbeat): the groups' own timeout must not end them first.
        group_timeout = UNTIMED_GROUP_TIMEOUT if watch is not None else None
        split = _Split(routes, nodes, use_shared_memory, self.device, group_timeout)
        self.slots: SlotStream | None = None
        if split.node_routes:
            self.slots = SlotStream(split.node_routes, numel, dtype, slot_memory(self.device),
                                    split.node_group, timeout_s=timeout_s, num_stats=num_stats,
                                    watch=watch)
        mine = self.rank in split.p2p_members
        self.p2p = P2PStream(split.remote if mine else [], numel, dtype,
                             group=split.p2p_group, timeout_s=timeout_s, num_stats=num_stats,
                             device=self.device, watch=watch)
        self.summary = split.describe()

    @property
    def same_node_kind(self) -> str | None:
        """"shared memory", "CUDA IPC", or None when this rank's node has no such routes."""
        return None if self.slots is None else self.slots.memory.kind

    def send(self, step: int, outgoing: dict[int, torch.Tensor],
             stats: Sequence[float] = ()) -> None:
        """Teacher rank: post ``step``'s payloads (by sample); see the parts' ``send``."""
        if self.slots is not None:
            self.slots.send(step, outgoing, stats)
        self.p2p.send(step, outgoing, stats)

    def prefetch(self, step: int) -> None:
        """Student rank: post the receives of ``step`` (idempotent)."""
        if self.slots is not None:
            self.slots.prefetch(step)
        self.p2p.prefetch(step)

    def receive(self, step: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Student rank: ``step``'s payloads by sample (valid until ``prefetch(step + 2)``) and
        the senders' stats ``[senders, num_stats]``."""
        self.prefetch(step)  # both parts' receives in flight before waiting for either
        received, stats = self.p2p.receive(step)
        if self.slots is not None:
            near, near_stats = self.slots.receive(step)
            received.update(near)
            stats = torch.cat([stats, near_stats])
        return received, stats

    def finish(self) -> None:
        """Wait for every transfer and signal still in flight (before shutdown)."""
        if self.slots is not None:
            self.slots.finish()
        self.p2p.finish()

    def close(self) -> None:
        """Release the slot buffers (shared memory, CUDA IPC mappings); idempotent."""
        if self.slots is not None:
            self.slots.close()
