"""Disaggregated teacher -> student payloads within a node: slots in shared memory / CUDA IPC.

The streaming counterpart of :class:`~.slots.SlotTransport`. Payload rows travel through the
senders' persistent slot buffers (POSIX shared memory on CPU, CUDA IPC on GPUs; see
:class:`~.slots.SlotBuffers`): a sender writes each sample once, however many student ranks (TP
x CP) read it, and a receiver on the sender's GPU reads it in place. Only small tokens go through
the control group (gloo point-to-point), so the teacher never waits for a barrier:

* ``written(k)``, sender -> receiver, after the sender wrote step ``k`` into slot ``k % 2`` and its
  device work is done; it carries the step and the sender's statistics (teacher forward seconds);
* ``free(k)``, receiver -> sender, once the receiver is done with its views of step ``k`` (when it
  posts step ``k + 2``, or at :meth:`SlotStream.finish`) and its device reads are done.

Before it rewrites a slot (step ``k + 2``) a sender waits for ``free(k)`` from every receiver of
that slot: at most two steps are in flight, as with :class:`~.stream.P2PStream`. Every wait has
a timeout whose error names the rank, the step and the peers; with a
:class:`~.liveness.PeerWatch` the waits last while the peers are alive (a slow student is not a
dead one) and a dead peer ends the process with an error naming it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_xdistill.transport.routing import Route
from megatron_xdistill.transport.slots import SlotBuffers, SlotMemory
from megatron_xdistill.transport.waits import PayloadStreamError, wait_works

NUM_SLOTS = 2


class SlotStream:
    """Streams one node's routes through slot memory with token signals (module docstring).

    ``routes``: the same-node routes between different ranks (every rank of ``group`` passes the
    same list). ``group``: a gloo group of this node's ranks; construction is collective over it.
    ``num_stats``: floats of sender statistics carried by each ``written`` token.
    """

    def __init__(self, routes: Sequence[Route], numel: int, dtype: torch.dtype,
                 memory: SlotMemory, group: dist.ProcessGroup | None = None,
                 timeout_s: float = 600.0, num_stats: int = 1, watch=None) -> None:
        self.buffers = SlotBuffers(routes, numel, dtype, memory, group)
        self.watch = watch  # a liveness.PeerWatch: untimed waits while the peers are alive
        self.rank, self.group, self.memory = dist.get_rank(), group, memory
        self.timeout_s, self.num_stats = timeout_s, num_stats
        self.receivers, self.senders = self.buffers.receivers, self.buffers.senders
        self.peers = sorted(set(self.receivers) | set(self.senders))
        self.seconds = 0.0

        def tokens(peers: list[int], size: int) -> list[dict[int, torch.Tensor]]:
            return [{p: torch.zeros(size, dtype=torch.float64) for p in peers}
                    for _ in range(NUM_SLOTS)]

        # Sender side: written tokens out, free tokens in (per slot and receiver).
        self._written_out = tokens(self.receivers, 1 + num_stats)
        self._free_in = tokens(self.receivers, 1)
        self._sent: list[tuple[int, list]] = [(-1, []) for _ in range(NUM_SLOTS)]
        self._frees_expected: dict[int, list] = {}  # step -> posted receives of free(step)
        # Receiver side: written tokens in, free tokens out.
        self._written_in = tokens(self.senders, 1 + num_stats)
        self._free_out = tokens(self.senders, 1)
        self._written_expected: dict[int, list] = {}  # step -> posted receives of written(step)
        self._freed: list[tuple[int, list]] = [(-1, []) for _ in range(NUM_SLOTS)]
        self._held: list[int] = []  # steps received whose slots are not released yet

    # ---------------------------------------------------------------- sender (teacher ranks)
    def send(self, step: int, outgoing: dict[int, torch.Tensor],
             stats: Sequence[float] = ()) -> None:
        """Write ``step``'s payloads (by sample) into their slots and signal the receivers;
        waits only for the release of the slot's step ``step - 2``."""
        if not self.receivers:
            return
        if len(stats) > self.num_stats:
            raise ValueError(f"{len(stats)} stats but the token holds {self.num_stats}")
        start = time.perf_counter()
        slot = step % NUM_SLOTS
        if step - NUM_SLOTS in self._frees_expected:
            self._wait(self._frees_expected.pop(step - NUM_SLOTS), step - NUM_SLOTS,
                       f"release of its slot by student ranks {self.receivers}")
            self._check_tokens(self._free_in[slot], step - NUM_SLOTS, "free")
        previous, works = self._sent[slot]
        self._wait(works, previous, f"signals to student ranks {self.receivers}")
        self.buffers.write(slot, outgoing)
        self.memory.settle()  # the rows are in memory before any receiver hears of them
        sends = []
        for dst in self.receivers:
            token = self._written_out[slot][dst]
            token.zero_()
            token[0] = step
            token[1:1 + len(stats)] = torch.tensor(list(stats), dtype=torch.float64)
            sends.append(dist.isend(token, dst, group=self.group))
        self._sent[slot] = (step, sends)
        self._frees_expected[step] = [dist.irecv(self._free_in[slot][dst], dst, group=self.group)
                                      for dst in self.receivers]
        self.seconds += time.perf_counter() - start

    # ---------------------------------------------------------------- receiver (student ranks)
    def prefetch(self, step: int) -> None:
        """Release the slots of steps up to ``step - 2`` (their views are overwritten from now
        on) and post the receive of ``step``'s signals (idempotent)."""
        if not self.senders or step in self._written_expected:
            return
        self._release(upto=step - NUM_SLOTS)
        slot = step % NUM_SLOTS
        self._written_expected[step] = [
            dist.irecv(self._written_in[slot][src], src, group=self.group) for src in self.senders]

    def receive(self, step: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
        """Wait for ``step``'s signals; return this rank's payloads (views of the senders' slots,
        valid until ``prefetch(step + 2)``) by sample, and the senders' stats
        ``[senders, num_stats]``."""
        if not self.senders:
            return {}, torch.zeros(0, self.num_stats)
        start = time.perf_counter()
        self.prefetch(step)
        self._wait(self._written_expected.pop(step), step,
                   f"payloads from teacher ranks {self.senders}")
        slot = step % NUM_SLOTS
        self._check_tokens(self._written_in[slot], step, "written")
        received = self.buffers.read(slot)
        self._held.append(step)
        stats = torch.stack([self._written_in[slot][src][1:] for src in self.senders]).float()
        self.seconds += time.perf_counter() - start
        return received, stats

    def _release(self, upto: int) -> None:
        """Tell the senders that this rank is done with the slots of steps <= ``upto``."""
        done = [step for step in self._held if step <= upto]
        if not done:
            return
        self.memory.settle()  # our reads (on a GPU: queued copies) of those slots are complete
        for step in done:
            slot = step % NUM_SLOTS
            previous, works = self._freed[slot]
            self._wait(works, previous, f"release signals to teacher ranks {self.senders}")
            sends = []
            for src in self.senders:
                self._free_out[slot][src].fill_(step)
                sends.append(dist.isend(self._free_out[slot][src], src, group=self.group))
            self._freed[slot] = (step, sends)
            self._held.remove(step)

    # ---------------------------------------------------------------- both
    def _check_tokens(self, tokens: dict[int, torch.Tensor], step: int, kind: str) -> None:
        for peer, token in tokens.items():
            if int(token[0].item()) != step:
                raise PayloadStreamError(
                    f"rank {self.rank}: step {step}: rank {peer}'s {kind} signal is for step "
                    f"{int(token[0].item())}: the two sides disagree on the step (did one side "
                    f"resume from another checkpoint or skip a step?)")

    def _wait(self, works: list, step: int, what: str) -> None:
        wait_works(works, self.timeout_s, self.rank, step, what, self.watch, self.peers)

    def finish(self) -> None:
        """Release every slot still held and wait for every posted signal (call on every rank of
        the stream before shutdown; both sides must have run the same steps)."""
        self._release(upto=max(self._held, default=-1))
        for step in sorted(self._written_expected):
            self._wait(self._written_expected.pop(step), step,
                       f"payloads from teacher ranks {self.senders}")
        for slot in range(NUM_SLOTS):
            for pending in (self._sent, self._freed):
                step, works = pending[slot]
                self._wait(works, step, "signals to the ranks of this node")
                pending[slot] = (-1, [])
        for step in sorted(self._frees_expected):
            self._wait(self._frees_expected.pop(step), step,
                       f"release of its slot by student ranks {self.receivers}")

    def close(self) -> None:
        """Drop the mappings and release this rank's buffer (idempotent)."""
        self.buffers.close()
