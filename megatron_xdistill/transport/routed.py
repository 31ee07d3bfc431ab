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


def _node_index() -> int:
    return int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", "0")))


def node_of_ranks(group: dist.ProcessGroup | None = None) -> list[int]:
    """Node index of every rank (torchrun's ``GROUP_RANK``; 0 without torchrun). Collective."""
    nodes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(nodes, _node_index(), group=group)
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


def rank_places(device: torch.device | str) -> tuple[list[int], list[str | None]]:
    """Node index (``GROUP_RANK``) and GPU id (host and UUID, None on CPU) of every rank, in one
    all-gather over the default group (collective). A run gathers them once and hands them to
    every transport it builds (``nodes=``, ``gpus=``)."""
    places: list = [None] * dist.get_world_size()
    dist.all_gather_object(places, (_node_index(), _gpu_id(torch.device(device))))
    return [int(n) for n, _ in places], [g for _, g in places]


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
    every rank of the world builds it, in the same order).

    One rank's work is one pass over the ranks and one over the routes: every node's members and
    same-node routes are grouped in that pass, and each node's group is entered with that node's
    members only (torch's ``new_group`` costs a rank outside the group O(len(ranks)) bookkeeping
    and no store operation, unless ``TORCH_DIST_INIT_BARRIER=1``). ``nodes`` and ``gpus`` (one
    entry per rank) come from one all-gather over the default group when not given.
    ``backend``: the cross-node group's (default NCCL on a GPU device, else gloo)."""

    def __init__(self, routes: Sequence[Route], nodes: Sequence[int] | None,
                 use_shared_memory: bool, device: torch.device,
                 group_timeout: datetime.timedelta | None = None,
                 gpus: Sequence[str | None] | None = None, backend: str | None = None) -> None:
        rank = dist.get_rank()
        self.device = device
        self.p2p_backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        nccl = self.p2p_backend == "nccl"
        if nodes is None or (nccl and gpus is None):
            found_nodes, found_gpus = rank_places(device)
            nodes = found_nodes if nodes is None else nodes
            gpus = found_gpus if gpus is None else gpus
        self.nodes = list(nodes)
        self.local: list[Route] = []
        self.same_node: list[Route] = []
        self.remote: list[Route] = []
        routes_of_node: dict[int, list[Route]] = {}
        for route in routes:
            if route.src == route.dst:
                self.local.append(route)
            elif use_shared_memory and self.nodes[route.src] == self.nodes[route.dst]:
                self.same_node.append(route)
                routes_of_node.setdefault(self.nodes[route.src], []).append(route)
            else:
                self.remote.append(route)
        members: dict[int, list[int]] = {}
        for r, node in enumerate(self.nodes):
            members.setdefault(node, []).append(r)
        mine = self.nodes[rank]
        self.node_routes: list[Route] = routes_of_node.get(mine, [])  # this node's
        self.node_group: dist.ProcessGroup | None = None
        for node in sorted(routes_of_node):  # every rank enters these groups, in this order
            group = dist.new_group(members[node], backend="gloo", timeout=group_timeout)
            if node == mine:
                self.node_group = group
        # The cross-node group: exactly the ranks with cross-node routes (NCCL on GPUs).
        self.p2p_members = sorted({r.src for r in self.remote} | {r.dst for r in self.remote})
        self.p2p_group = None
        if self.p2p_members:
            if nccl:
                check_one_rank_per_gpu(self.p2p_members, gpus)
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
    node index per rank (default: from torchrun's environment); ``gpus``: GPU id per rank
    (default: gathered with the nodes). ``device``: where payloads live (CPU: shared memory +
    gloo; CUDA: CUDA IPC + NCCL); ``backend`` overrides the cross-node group's.
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 nodes: Sequence[int] | None = None, use_shared_memory: bool = True,
                 device: torch.device | str = "cpu", gpus: Sequence[str | None] | None = None,
                 backend: str | None = None) -> None:
        self.rank = dist.get_rank()
        self.numel, self.dtype = numel, dtype
        self.device = torch.device(device)
        split = _Split(routes, nodes, use_shared_memory, self.device, gpus=gpus,
                       backend=backend)
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
                 num_stats: int = 1, watch=None, gpus: Sequence[str | None] | None = None,
                 backend: str | None = None) -> None:
        local = [r for r in routes if r.src == r.dst]
        if local:
            raise ValueError(f"RoutedStream moves payloads between different ranks; "
                             f"{len(local)} route(s) stay on one rank (e.g. {local[0]})")
        self.rank = dist.get_rank()
        self.device = torch.device(device)
        # With a PeerWatch the waits are untimed (a slow peer is waited for, a dead one is
        # detected by its heartbeat): the groups' own timeout must not end them first.
        group_timeout = UNTIMED_GROUP_TIMEOUT if watch is not None else None
        split = _Split(routes, nodes, use_shared_memory, self.device, group_timeout, gpus,
                       backend)
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
