"""A complete chunk top-K cache read by a run that asks for fewer columns (top-k, k < K), or
a compact gold cache by a run that asks for fewer pairs or uncommon probabilities.

A chunk top-K payload holds each chunk's K most probable teacher tokens in descending order, so
its first k columns are what a top-k teacher ships, and the rest of the mass joins the tail
(``TeacherPayload.narrowed``). One teacher pass at a large k then serves runs at any smaller k
(the payload top-k knob of a study costs no further teacher work). Nothing else may differ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload


@dataclass(frozen=True)
class Narrowing:
    """How a cached row (``cached`` spec, then ``extra`` trailing values that pass unchanged,
    e.g. the selection CE of several teachers) becomes the run's (``run`` spec)."""

    cached: PayloadSpec
    run: PayloadSpec
    extra: int

    @property
    def run_numel(self) -> int:
        return self.run.numel + self.extra

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """Flat cached rows [B, cached numel + extra] -> the run's [B, run numel + extra]."""
        n = self.cached.numel
        payload = TeacherPayload.from_flat(rows[:, :n], self.cached).narrowed(
            self.run.width, self.run.uncommon if self.run.form == "gold_topk" else None)
        return torch.cat([payload.to_flat(), rows[:, n:]], dim=1)


def narrowing(cached_key: dict, run_key: dict, cached_numel: int) -> Narrowing | None:
    """The narrowing a reading run asks for: both keys chunk top-k, the run's k smaller than
    the cache's and the run's payload size what that k gives (else None: the keys are then
    compared as they are, and the differing fields named)."""
    have, want = cached_key.get("payload", {}), run_key.get("payload", {})
    if have.get("form") == want.get("form") == "gold_topk":
        return _gold_narrowing(have, want, int(run_key["data"]["seq_length"]) + 1)
    if not (have.get("form") == want.get("form") == "chunk_topk"
            and 0 < int(want.get("topk") or 0) < int(have.get("topk") or 0)):
        return None
    chunks = int(run_key["data"]["seq_length"]) + 1  # a chunk slot per student position
    cached = PayloadSpec("chunk_topk", chunks, int(have["topk"]))
    extra = cached_numel - cached.numel
    plan = Narrowing(cached, PayloadSpec("chunk_topk", chunks, int(want["topk"])), extra)
    if extra < 0 or want.get("numel") != plan.run_numel:
        return None
    return plan


def _gold_narrowing(have: dict, want: dict, chunks: int) -> Narrowing | None:
    """Compact gold: the run's pairs and uncommon probabilities at most the cache's, one of
    them fewer, the same ranks n and common pairs M (``payload.gold_topk`` = [k, k', n, M])."""
    (k0, u0, n0, m0), (k1, u1, n1, m1) = have.get("gold_topk"), want.get("gold_topk")
    if (n0, m0) != (n1, m1) or not (0 < k1 <= k0 and u1 <= u0) or (k1, u1) == (k0, u0):
        return None
    cached = PayloadSpec("gold_topk", chunks, k0, u0, span=n0, pairs=m0)
    run = PayloadSpec("gold_topk", chunks, k1, u1, span=n1, pairs=m1)
    plan = Narrowing(cached, run, int(have["numel"]) - cached.numel)
    if plan.extra < 0 or want.get("numel") != plan.run_numel:
        return None
    return plan
