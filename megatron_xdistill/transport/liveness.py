"""Tell a slow peer from a dead one while waiting for it: heartbeats in the c10d store.

A disaggregated teacher waits for the students to release a payload slot for as long as a student
step takes, which may exceed any fixed timeout (a slow step is not a failure). A timed wait cannot
tell the two apart, and with gloo it cannot even be retried (a receive that times out closes the
connection). So the stream's waits are untimed and a watchdog thread judges the peers instead:

* every rank's :class:`PeerWatch` thread bumps a counter ``xdistill/alive/<rank>`` in the job's
  c10d store each ``interval_s`` (a thread: it beats through long compute and blocking waits);
* while the main thread waits for peers (:meth:`PeerWatch.waiting`), the thread reads their
  counters: a peer whose counter has not moved for ``dead_after_s`` is dead (killed, frozen,
  its node gone) and this process exits with an error naming its rank, the step, what it waited
  for and the peer; a live peer is waited for, with a line every ``report_every_s`` saying so.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence

import torch.distributed as dist

EXIT_CODE = 75  # the process ends with this code when a peer it waits for is dead
_KEY = "xdistill/alive/{rank}"


def default_store() -> dist.Store:
    """The job's c10d store (torchrun's or the launcher's), shared by every rank."""
    return dist.distributed_c10d._get_default_store()


class PeerWatch:
    """Heartbeat of this rank plus the watchdog of its waits (module docstring)."""

    def __init__(self, store: dist.Store, rank: int, dead_after_s: float = 60.0,
                 interval_s: float = 1.0, report_every_s: float = 600.0,
                 exit=os._exit, log=None) -> None:
        if dead_after_s <= 2 * interval_s:
            raise ValueError(f"dead_after_s {dead_after_s} must exceed 2 heartbeats "
                             f"({interval_s} s each)")
        self.store, self.rank = store, rank
        self.dead_after_s, self.interval_s, self.report_every_s = (dead_after_s, interval_s,
                                                                   report_every_s)
        self._exit = exit
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._waiting: tuple[tuple[int, ...], int, str, float] | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # peer -> (counter, when it last moved)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.store.add(_KEY.format(rank=rank), 1)
        self._thread = threading.Thread(target=self._run, name=f"xdistill-peerwatch-{rank}",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def waiting(self, peers: Sequence[int], step: int, what: str) -> Iterator[None]:
        """Mark the main thread as blocked on ``peers`` for ``step`` (``what`` for messages)."""
        now = time.monotonic()
        with self._lock:
            self._seen = {p: self._seen.get(p, (-1, now)) for p in peers}
            self._waiting = (tuple(peers), step, what, now)
        try:
            yield
        finally:
            with self._lock:
                self._waiting = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        last_report = time.monotonic()
        while not self._stop.wait(self.interval_s):
            try:
                self.store.add(_KEY.format(rank=self.rank), 1)
                with self._lock:
                    waiting = self._waiting
                if waiting is None:
                    last_report = time.monotonic()
                    continue
                last_report = self._check(waiting, last_report)
            except Exception as exc:  # noqa: BLE001 - the store went away: the job is ending
                self._log(f"rank {self.rank}: heartbeat stopped: {exc}")
                return

    def _check(self, waiting, last_report: float) -> float:
        peers, step, what, since = waiting
        now = time.monotonic()
        for peer in peers:
            count = self.store.add(_KEY.format(rank=peer), 0)
            seen, moved = self._seen.get(peer, (-1, since))
            if count != seen:
                self._seen[peer] = (count, now)
            elif now - max(moved, since) > self.dead_after_s:
                self._log(f"rank {self.rank}: step {step}: {what}: peer rank {peer} sent no "
                          f"heartbeat for {now - max(moved, since):.0f} s: it is dead (killed, "
                          f"frozen or its node is gone; see its log). Exiting with code "
                          f"{EXIT_CODE}.")
                self._exit(EXIT_CODE)
                return now
        if now - last_report >= self.report_every_s:
            self._log(f"rank {self.rank}: step {step}: still waiting for {what} after "
                      f"{now - since:.0f} s; peer ranks {list(peers)} are alive (a slow step, "
                      f"not a dead rank)")
            return now
        return last_report
