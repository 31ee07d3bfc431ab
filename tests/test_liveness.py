"""PeerWatch: a peer whose heartbeat stops is dead (the process exits naming it); a live peer
is waited for however long its step takes, with a line saying so."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from megatron_xdistill.transport.liveness import EXIT_CODE, PeerWatch


def _beat(store: dist.Store, rank: int, seconds: float) -> threading.Thread:
    def run() -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            store.add(f"xdistill/alive/{rank}", 1)
            time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _watch(store: dist.Store, exits: list, lines: list) -> PeerWatch:
    return PeerWatch(store, rank=0, dead_after_s=0.6, interval_s=0.1, report_every_s=0.4,
                     exit=exits.append, log=lines.append)


def test_a_peer_that_stops_beating_is_dead_and_named():
    store, exits, lines = dist.HashStore(), [], []
    _beat(store, 1, 0.5)  # peer 1 lives for half a second, then freezes (no more beats)
    watch = _watch(store, exits, lines)
    with watch.waiting([1], step=7, what="release of its slot by student ranks [1]"):
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
    watch.close()
    assert exits == [EXIT_CODE]
    dead = [x for x in lines if "is dead" in x]
    assert dead and dead[0].startswith("rank 0: step 7: release of its slot by student ranks [1]: "
                                       "peer rank 1 sent no heartbeat for")


def test_a_live_peer_is_waited_for_past_the_dead_limit():
    store, exits, lines = dist.HashStore(), [], []
    beating = _beat(store, 1, 2.0)
    watch = _watch(store, exits, lines)
    with watch.waiting([1], step=3, what="payloads from teacher ranks [1]"):
        beating.join()  # a 2 s wait: more than three times the dead limit
    time.sleep(0.3)  # not waiting any more: nothing is judged
    watch.close()
    assert exits == []
    assert any(x.startswith("rank 0: step 3: still waiting for payloads from teacher ranks [1]")
               and "alive (a slow step, not a dead rank)" in x for x in lines), lines
