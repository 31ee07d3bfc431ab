"""How several teachers' KD terms make one loss.

*sum*: every teacher teaches every sample, L = sum_k w_k KD_k + w_ce CE, each KD_k normalised by
its own counted chunks (``loss.combined_loss``).

*select* (DESIGN.md's ``select_teacher``): each sample is taught by the one teacher with the
lowest CE on that sample's text, in nats summed over the teacher's own tokens (a sum, so teachers
whose tokenizers cut the text differently compare on the same text). The teachers compute it on
their side and ship it with the payload. The selected teachers' KD terms share one denominator
(all counted chunks of the selected teachers), so with equal weights the KD term is the mean over
every sample's chosen teacher.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_xdistill.teachers.spec import COMBINATIONS, TeacherSpec


@dataclass(frozen=True)
class Combination:
    """The run's teachers as the student's loss sees them: names, weights and the rule."""

    names: tuple[str, ...]
    weights: tuple[float, ...]
    mode: str = "sum"

    def __post_init__(self) -> None:
        if self.mode not in COMBINATIONS:
            raise ValueError(f"combination must be one of {COMBINATIONS}, got {self.mode!r}")
        if len(self.names) != len(self.weights) or not self.names:
            raise ValueError(f"need one weight per teacher, got {self.names} / {self.weights}")

    @classmethod
    def of(cls, specs: Sequence[TeacherSpec], mode: str) -> Combination:
        return cls(tuple(s.name for s in specs), tuple(float(s.weight) for s in specs), mode)

    @property
    def selects(self) -> bool:
        return self.mode == "select"

    def __len__(self) -> int:
        return len(self.names)


def choose_teachers(text_nats: Sequence[torch.Tensor]) -> torch.Tensor:
    """[b] index of the teacher with the lowest nats per sample (ties: the first listed).
    ``text_nats[k]``: [b] teacher k's CE of each sample's text."""
    stacked = torch.stack([n.detach().double().cpu() for n in text_nats])
    if torch.isnan(stacked).any():
        bad = sorted({int(k) for k in torch.nonzero(torch.isnan(stacked))[:, 0]})
        raise FloatingPointError(f"teacher(s) {bad} sent NaN text CE: cannot select a teacher "
                                 f"(check the teachers' checkpoints and --bf16)")
    return stacked.argmin(dim=0)
