"""Bounded waits on posted point-to-point work, with errors that name the rank, step and peers.

Shared by the streaming transports (:mod:`.stream`, :mod:`.slot_stream`): a wait that outlives
its deadline, or a backend error, becomes a :class:`PayloadStreamError` instead of a hang.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence


class PayloadStreamError(RuntimeError):
    """A payload transfer failed or timed out; the message names the rank, step and peers."""


def wait_works(works: Sequence, timeout_s: float, rank: int, step: int, what: str,
               watch=None, peers: Sequence[int] = ()) -> None:
    """Wait for every work in ``works`` (posted for ``step``), or raise
    :class:`PayloadStreamError` saying ``rank {rank}: step {step}: {what} ...``.

    Without ``watch``: within ``timeout_s`` in all. With a :class:`~.liveness.PeerWatch`: for as
    long as ``peers`` are alive (a slow peer is waited for; the watch ends the process when one
    is dead); the works' group must then have a timeout longer than any step."""
    if not works:
        return
    deadline = time.monotonic() + timeout_s
    for work in works:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            if watch is None:
                work.wait(datetime.timedelta(seconds=left))
            else:
                with watch.waiting(peers, step, what):
                    work.wait()
        except Exception as exc:  # noqa: BLE001 - backends raise RuntimeError subclasses
            timed_out = watch is None and time.monotonic() >= deadline
            raise PayloadStreamError(
                f"rank {rank}: step {step}: {what} "
                + (f"did not complete within {timeout_s:.0f} s (a peer rank stopped, hangs or "
                   f"fell behind; see its log; the limit is --distributed-timeout-minutes)"
                   if timed_out else f"failed: {exc}")
            ) from exc
