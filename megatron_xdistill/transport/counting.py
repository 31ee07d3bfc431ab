"""What one rank asks of torch.distributed, counted: the groups it enters, the collectives it joins,
the payload bytes it sends.

Two ways in, one record (:class:`DistRecord`):

* :func:`simulated_rank` plays one rank of a world that does not exist: ``torch.distributed``'s
  group creation and collectives are replaced by fakes that record the call and return at once
  (groups are :class:`FakeGroup`; a rank outside a group gets ``GroupMember.NON_GROUP_MEMBER``,
  as from torch). The project's own plan and construction code runs unchanged on top, so a
  16,384-GPU world's construction can be counted on one CPU.
* :func:`recorded` wraps a real, initialised ``torch.distributed`` (a gloo test run) and records
  the same things while they happen, so the two records can be compared.

torch's ``new_subgroups_by_enumeration`` (which Megatron-Core's ``HyperCommGrid`` calls) runs for
real in both: it calls ``new_group`` once per group, which is where the record is taken.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


@dataclass(frozen=True)
class GroupEntry:
    """One ``new_group`` call as this rank saw it: the sorted ranks, the backend, membership."""

    ranks: tuple[int, ...]
    backend: str
    member: bool


@dataclass(frozen=True)
class CollectiveEntry:
    """One collective this rank joined: its kind and the size of its group."""

    kind: str
    group_size: int


@dataclass
class DistRecord:
    """What one rank asked of torch.distributed (see the module docstring)."""

    rank: int
    world_size: int
    groups: list[GroupEntry] = field(default_factory=list)
    collectives: list[CollectiveEntry] = field(default_factory=list)
    sent_bytes: dict[int, int] = field(default_factory=dict)  # peer -> payload bytes (p2p)

    @property
    def member_groups(self) -> list[GroupEntry]:
        return [g for g in self.groups if g.member]

    @property
    def nonmember_rank_entries(self) -> int:
        """Ranks listed in the groups this rank entered without being a member: what torch's
        ``new_group`` walks for it (sorting, duplicate and range checks), its only work there."""
        return sum(len(g.ranks) for g in self.groups if not g.member)

    def summary(self) -> dict:
        """Counts for a report (JSON-ready)."""
        kinds: dict[str, int] = {}
        for c in self.collectives:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        return {"groups_entered": len(self.groups), "groups_member": len(self.member_groups),
                "nonmember_rank_entries": self.nonmember_rank_entries,
                "collectives": kinds, "p2p_bytes_sent": sum(self.sent_bytes.values())}


class FakeGroup:
    """A process group of a simulated world (ranks in group order, backend)."""

    def __init__(self, ranks: list[int], backend: str) -> None:
        self.ranks, self.backend = ranks, backend

    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"FakeGroup({self.backend}, {len(self.ranks)} ranks)"


def _backend_name(backend, default: str) -> str:
    return str(backend).lower() if backend else default


@contextmanager
def _patched(targets: dict[str, Callable]) -> Iterator[None]:
    """Replace these names in both ``torch.distributed`` and its ``distributed_c10d`` module."""
    saved = []
    for name, fn in targets.items():
        for module in (dist, c10d):
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, fn)
    try:
        yield
    finally:
        for module, name, fn in reversed(saved):
            setattr(module, name, fn)


@contextmanager
def simulated_rank(rank: int, world_size: int, default_backend: str = "nccl",
                   gathered: Callable[[int, object], object] | None = None
                   ) -> Iterator[DistRecord]:
    """Play ``rank`` of a ``world_size`` world (module docstring); yields its record.

    ``gathered(r, obj)``: what rank ``r`` contributes to an ``all_gather_object`` to which this
    rank contributes ``obj`` (default: ``obj``, every rank alike). ``WORLD_SIZE`` is set
    meanwhile (Megatron-Core's ``HyperCommGrid`` reads it)."""
    record = DistRecord(rank, world_size)

    def group_ranks(group) -> list[int]:
        return list(range(world_size)) if group is None else group.ranks

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None,
                  use_local_synchronization=False, group_desc=None, device_id=None,
                  sort_ranks=True):
        members = list(range(world_size)) if ranks is None else (
            sorted(ranks) if sort_ranks else list(ranks))
        name = _backend_name(backend, default_backend)
        member = rank in members
        if use_local_synchronization and not member:  # torch returns before any bookkeeping
            return None
        record.groups.append(GroupEntry(tuple(members), name, member))
        return FakeGroup(members, name) if member else dist.GroupMember.NON_GROUP_MEMBER

    def collective(kind: str, group) -> None:
        record.collectives.append(CollectiveEntry(kind, len(group_ranks(group))))

    def all_gather_object(object_list, obj, group=None):
        collective("all_gather_object", group)
        for i, r in enumerate(group_ranks(group)):
            object_list[i] = gathered(r, obj) if gathered is not None else obj

    def barrier(group=None, async_op=False, device_ids=None):
        collective("barrier", group)

    def get_rank(group=None):
        return rank if group is None else group.ranks.index(rank)

    def get_world_size(group=None):
        return len(group_ranks(group))

    targets = {
        "new_group": new_group, "all_gather_object": all_gather_object, "barrier": barrier,
        "get_rank": get_rank, "get_world_size": get_world_size,
        "get_process_group_ranks": group_ranks, "is_initialized": lambda: True,
    }
    previous = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        with _patched(targets):
            yield record
    finally:
        if previous is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = previous


@contextmanager
def recorded() -> Iterator[DistRecord]:
    """Record this rank's group creation, collectives and point-to-point payload bytes on a real
    (initialised) torch.distributed while the body runs; the calls still happen."""
    record = DistRecord(dist.get_rank(), dist.get_world_size())
    real = {name: getattr(c10d, name) for name in
            ("new_group", "all_gather_object", "barrier", "batch_isend_irecv")}
    default_backend = str(dist.get_backend()).lower()

    def new_group(ranks=None, *args, **kwargs):
        members = list(range(record.world_size)) if ranks is None else sorted(ranks)
        name = _backend_name(kwargs.get("backend", args[1] if len(args) > 1 else None),
                             default_backend)
        record.groups.append(GroupEntry(tuple(members), name, record.rank in members))
        return real["new_group"](ranks, *args, **kwargs)

    def size_of(group) -> int:
        return dist.get_world_size(group)

    def all_gather_object(object_list, obj, group=None):
        record.collectives.append(CollectiveEntry("all_gather_object", size_of(group)))
        return real["all_gather_object"](object_list, obj, group=group)

    def barrier(group=None, *args, **kwargs):
        record.collectives.append(CollectiveEntry("barrier", size_of(group)))
        return real["barrier"](group, *args, **kwargs)

    def batch_isend_irecv(ops):
        for op in ops:
            if op.op is c10d.isend:
                peer = op.peer  # the project passes global ranks
                nbytes = op.tensor.numel() * op.tensor.element_size()
                record.sent_bytes[peer] = record.sent_bytes.get(peer, 0) + nbytes
        return real["batch_isend_irecv"](ops)

    with _patched({"new_group": new_group, "all_gather_object": all_gather_object,
                   "barrier": barrier, "batch_isend_irecv": batch_isend_irecv}):
        yield record
