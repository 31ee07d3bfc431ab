"""Process groups that live exactly as long as one run.

A run builds many groups (two layouts' TP/CP/PP/DP..., the transport's node and p2p groups, the
disaggregated worlds); each gloo group holds sockets and threads of its own. torchrun's processes
end with the run, but a process that runs several trainings in one world (a notebook, a sweep
driver, the test suite's rank pools) would keep every earlier run's groups: hundreds of threads
per rank after a dozen runs, which slowed the later runs of one test module 20-fold.
:func:`run_process_groups` destroys, when a run returns, the groups created inside it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist


def _live_groups() -> list[dist.ProcessGroup]:
    return list(dist.distributed_c10d._world.pg_map)


@contextmanager
def run_process_groups() -> Iterator[None]:
    """Collective on the way out (a barrier over the default group, then each new group is
    destroyed locally). Every rank must leave it the same way: when the body raises, nothing is
    destroyed (the other ranks may still wait in a collective), so a failed run leaks its groups
    rather than hanging."""
    if not dist.is_initialized():
        yield
        return
    before = {id(pg) for pg in _live_groups()}
    yield
    dist.barrier()  # every rank is past its last collective on the groups below
    for pg in [pg for pg in _live_groups() if id(pg) not in before]:
        dist.destroy_process_group(pg)


__all__ = ["run_process_groups"]
