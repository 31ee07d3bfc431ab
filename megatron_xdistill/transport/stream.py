"""Disaggregated teacher -> student payloads across nodes: non-blocking, double-buffered p2p.

With ``--teacher-placement disaggregated`` teacher ranks and student ranks are different
processes, so the teacher can compute global batch k+1 while the student trains on batch k.
:class:`P2PStream` carries the routes between nodes (ranks of one node use the slot stream of
:mod:`.slot_stream`; :class:`~.routed.RoutedStream` picks per route):

* the teacher packs the rows it owes each student rank into a persistent send buffer (one per
  destination and slot, slot = step % 2) and posts non-blocking sends, then moves on to the next
  batch at once. Before it refills a slot (step k+2) it waits for that slot's sends of step k, so
  at most two steps are in flight and the buffers are never reallocated;
* a student rank receives into persistent buffers of its own (same two slots). Once step k's rows
  have arrived it posts the receives of step k+1 into the other slot before it trains on k, so
  the transfer of k+1 overlaps the student step too (a point-to-point send only completes once
  its receive is posted: gloo and NCCL both rendezvous).

Each message ends with a small trailer of sender statistics (the teacher's forward seconds of
that step), so the student's progress line can report the teacher's time without a collective
that would couple the two sides. Every wait has a timeout; the error names this rank, the step
and the peer ranks that did not answer. Works with any backend that has isend/irecv (gloo on CPU;
NCCL between GPUs, where ``device`` puts the buffers on this rank's GPU).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.waits import wait_works

NUM_SLOTS = 2


class P2PStream:
    """Moves one step's payloads from teacher ranks to student ranks without blocking the sender.

    ``routes`` is the routing plan (every rank passes the same one; no route may stay on one
    rank). ``numel``/``dtype`` give one sample's payload, ``num_stats`` the floats of the sender's
    trailer. ``group`` carries only these transfers (a dedicated group keeps them apart from the
    models' collectives) and holds exactly the ranks that have routes; construction is collective
    over it (a rank without routes does nothing). ``timeout_s`` bounds every wait.
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype = torch.float32,
                 group: dist.ProcessGroup | None = None, timeout_s: float = 600.0,
                 num_stats: int = 1, device: torch.device | str = "cpu", watch=None) -> None:
        local = [r for r in routes if r.src == r.dst]
        if local:
            raise ValueError(f"P2PStream moves payloads between different ranks; "
                             f"{len(local)} route(s) stay on one rank (e.g. {local[0]})")
        self.rank = dist.get_rank()
        self.numel, self.dtype, self.group = numel, dtype, group
        self.timeout_s, self.num_stats = timeout_s, num_stats
        self.watch = watch  # a liveness.PeerWatch: untimed waits while the peers are alive
        self.send_to: dict[int, list[int]] = {}  # dst -> samples, in plan order
        self.recv_from: dict[int, list[int]] = {}  # src -> samples, in plan order
        for route in routes:
            if route.src == self.rank:
                self.send_to.setdefault(route.dst, []).append(route.sample)
            if route.dst == self.rank:
                self.recv_from.setdefault(route.src, []).append(route.sample)

        def buffers(peers: dict[int, list[int]]) -> list[dict[int, torch.Tensor]]:
            return [{peer: torch.zeros(len(rows) * numel + num_stats, dtype=dtype, device=device)
                     for peer, rows in peers.items()} for _ in range(NUM_SLOTS)]

        self._send_buffers = buffers(self.send_to)
        self._recv_buffers = buffers(self.recv_from)
        self._sends: list[tuple[int, list]] = [(-1, []) for _ in range(NUM_SLOTS)]
        self._recvs: dict[int, list] = {}  # step -> works of its posted receives
        self.seconds = 0.0  # spent in this object (packing, posting, waiting)
        if self.send_to or self.recv_from:  # every rank has its buffers (and NCCL its communicator)
            dist.barrier(group=group)

    # ---------------------------------------------------------------- sender (teacher ranks)
    def send(self, step: int, outgoing: dict[int, torch.Tensor],
             stats: Sequence[float] = ()) -> None:
        """Pack and post the sends of ``step`` (``outgoing``: payload by sample); returns without
        waiting for the receivers, except for the sends of ``step - 2`` whose slot it reuses."""
        if not self.send_to:
            return
        start = time.perf_counter()
        slot = step % NUM_SLOTS
        previous, works = self._sends[slot]
        self._wait(works, previous, f"sends to student ranks {sorted(self.send_to)}")
        ops = []
        for dst, samples in self.send_to.items():
            buffer = self._send_buffers[slot][dst]
            for row, sample in enumerate(samples):
                payload = outgoing[sample].reshape(-1)
                if payload.numel() != self.numel:
                    raise ValueError(f"rank {self.rank}: payload of sample {sample} has "
                                     f"{payload.numel()} elements, the plan says {self.numel}")
                buffer[row * self.numel:(row + 1) * self.numel].copy_(payload)
            self._write_stats(buffer, stats)
            ops.append(dist.P2POp(dist.isend, buffer, dst, group=self.group))
        self._sends[slot] = (step, dist.batch_isend_irecv(ops))
        self.seconds += time.perf_counter() - start

    def _write_stats(self, buffer: torch.Tensor, stats: Sequence[float]) -> None:
        if len(stats) > self.num_stats:
            raise ValueError(f"{len(stats)} stats but the trailer holds {self.num_stats}")
        trailer = buffer[len(buffer) - self.num_stats:]
        trailer.zero_()
        if len(stats):
            trailer[:len(stats)] = torch.tensor(list(stats), dtype=self.dtype)

    # ---------------------------------------------------------------- receiver (student ranks)
    def prefetch(self, step: int) -> None:
        """Post the receives of ``step`` into its slot (idempotent). The views that
        :meth:`receive` returned for ``step - 2`` are overwritten from now on."""
        if not self.recv_from or step in self._recvs:
            return
        slot = step % NUM_SLOTS
        ops = [dist.P2POp(dist.irecv, self._recv_buffers[slot][src], src, group=self.group)
               for src in self.recv_from]
        self._recvs[step] = dist.batch_isend_irecv(ops)

    def receive(self, step: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Wait for ``step``'s payloads (posting the receives first if :meth:`prefetch` did not);
        returns views of them by sample (valid until ``prefetch(step + 2)``) and the senders'
        stats, ``[senders, num_stats]``."""
        if not self.recv_from:
            return {}, torch.zeros(0, self.num_stats)
        start = time.perf_counter()
        self.prefetch(step)
        self._wait(self._recvs.pop(step), step,
                   f"payloads from teacher ranks {sorted(self.recv_from)}")
        slot = step % NUM_SLOTS
        received, stats = {}, []
        for src, samples in self.recv_from.items():
            buffer = self._recv_buffers[slot][src]
            for row, sample in enumerate(samples):
                received[sample] = buffer[row * self.numel:(row + 1) * self.numel]
            stats.append(buffer[len(buffer) - self.num_stats:].float())
        self.seconds += time.perf_counter() - start
        return received, torch.stack(stats)

    # ---------------------------------------------------------------- both
    def _wait(self, works: list, step: int, what: str) -> None:
        wait_works(works, self.timeout_s, self.rank, step, what, self.watch,
                   sorted(set(self.send_to) | set(self.recv_from)))

    def finish(self) -> None:
        """Wait for every posted send and receive (call before shutdown or a checkpoint that
        must not race the transfers)."""
        for slot in range(NUM_SLOTS):
            step, works = self._sends[slot]
            self._wait(works, step, f"sends to student ranks {sorted(self.send_to)}")
            self._sends[slot] = (-1, [])
        for step in sorted(self._recvs):
            self._wait(self._recvs.pop(step), step,
                       f"payloads from teacher ranks {sorted(self.recv_from)}")
