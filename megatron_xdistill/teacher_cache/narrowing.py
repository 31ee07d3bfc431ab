"""A complete chunk top-K cache read by a run that asks for fewer columns (top-k, k < K).

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
        payload = TeacherPayload.from_flat(rows[:, :n], self.cached).narrowed(self.run.width)
        return torch.cat([payload.to_flat(), rows[:, n:]], dim=1)


def narrowing(cached_key: dict, run_key: dict, cached_numel: int) -> Narrowing | None:
    """The narrowing a reading run asks for: both keys chunk top-k, the run's k smaller than
    the cache's and the run's payload size what that k gives (else None: the keys are then
    compared as they are, and the differing fields named)."""
    have, want = cached_key.get("payload", {}), run_key.get("payload", {})
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
