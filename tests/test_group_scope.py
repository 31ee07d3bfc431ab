"""run_process_groups: a run's process groups end with the run (ranks that run many trainings,
as the test pools do, otherwise gather gloo threads and sockets run after run)."""

from __future__ import annotations

import threading

from megatron_xdistill.testing.multirank import RankPool


def _groups_and_threads_after_runs(runs: int, fail_last: bool) -> tuple[int, int, int, int]:
    import torch
    import torch.distributed as dist

    from megatron_xdistill.parallel.group_scope import run_process_groups

    def live() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    before_groups, before_threads = live(), threading.active_count()
    for _ in range(runs):  # a "run": a few groups, a collective on each
        with run_process_groups():
            for members in ([0, 1], [0], [1], [0, 1]):
                group = dist.new_group(members)
                if dist.get_rank() in members:
                    dist.all_reduce(torch.ones(1), group=group)
    if fail_last:
        try:
            with run_process_groups():
                dist.new_group([0, 1])
                raise RuntimeError("the run failed")
        except RuntimeError:
            pass
    return before_groups, live(), before_threads, threading.active_count()


def test_groups_created_in_a_run_are_destroyed_when_it_returns():
    with RankPool(2) as pool:
        results = pool.run(_groups_and_threads_after_runs, 5, False)
    for before_groups, after_groups, before_threads, after_threads in results:
        assert after_groups == before_groups
        assert after_threads <= before_threads + 1


def test_a_failed_run_keeps_its_groups_rather_than_waiting_for_the_others():
    with RankPool(2) as pool:
        results = pool.run(_groups_and_threads_after_runs, 1, True)
    for before_groups, after_groups, _, _ in results:
        assert after_groups == before_groups + 1
