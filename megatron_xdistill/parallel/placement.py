"""Teacher placement: which global ranks serve the student and which the teacher.

Kept free of Megatron imports so argument validation can use it before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass

PLACEMENTS = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Placement:
    """Which global ranks serve the student and which the teacher.

    *Colocated*: both models span the whole world (every rank holds a shard of each).
    *Disaggregated*: the first ``world_size - teacher_ranks`` ranks are student ranks and the last
    ``teacher_ranks`` are teacher ranks, so global rank 0 (logging, checkpoint metadata, packing
    plans) is always a student rank, and with torchrun's node-major rank order the teacher fills
    the last nodes.
    """

    kind: str = "colocated"
    world_size: int = 1
    teacher_ranks: int | None = None
    # Disaggregated with several teachers: each teacher's own ranks, in order after the
    # student's (they sum to teacher_ranks); empty: one teacher on all teacher ranks.
    teacher_split: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in PLACEMENTS:
            raise ValueError(f"teacher placement must be one of {PLACEMENTS}, got {self.kind!r}")
        if self.kind == "colocated":
            if self.teacher_ranks not in (None, self.world_size):
                raise ValueError("--teacher-ranks applies to --teacher-placement disaggregated "
                                 "only (colocated: the teacher spans every rank)")
        elif self.world_size < 2:
            raise ValueError("--teacher-placement disaggregated needs at least 2 ranks (student "
                             "ranks and teacher ranks are different processes); world size is "
                             f"{self.world_size}")
        elif self.teacher_split and sum(self.teacher_split) >= self.world_size:
            raise ValueError(
                f"the teachers' ranks ({' + '.join(map(str, self.teacher_split))} = "
                f"{sum(self.teacher_split)}) leave no student rank in world size "
                f"{self.world_size}: lower their 'ranks' or add ranks (torchrun --nproc-per-node)")
        elif self.teacher_ranks is None or not 1 <= self.teacher_ranks < self.world_size:
            raise ValueError(
                f"--teacher-placement disaggregated needs --teacher-ranks N with 1 <= N <= "
                f"{self.world_size - 1} (world size {self.world_size}; at least one rank must "
                f"stay a student rank), got {self.teacher_ranks}")
        if self.teacher_split and (self.kind != "disaggregated" or min(self.teacher_split) < 1
                                   or sum(self.teacher_split) != self.teacher_ranks):
            raise ValueError(f"each teacher needs at least one rank of its own: got "
                             f"{list(self.teacher_split)} for {self.teacher_ranks} teacher ranks")

    @classmethod
    def from_args(cls, args, world_size: int) -> Placement:
        """From ``--teacher-placement`` / ``--teacher-ranks``; with several teachers
        (``args.teachers``) disaggregated, each teacher's ``ranks`` (default --teacher-ranks)."""
        kind = getattr(args, "teacher_placement", "colocated")
        ranks = getattr(args, "teacher_ranks", None)
        teachers = getattr(args, "teachers", None) or []
        if kind != "disaggregated" or len(teachers) < 2:
            if kind == "disaggregated" and teachers and teachers[0].ranks is not None:
                ranks = teachers[0].ranks  # one teacher's own 'ranks' (a key over the flag)
            return cls(kind, world_size, ranks)
        split = []
        for spec in teachers:
            own = spec.ranks if spec.ranks is not None else ranks
            if own is None or own < 1:
                raise ValueError(
                    f"--teacher-placement disaggregated with several teachers: teacher "
                    f"{spec.name!r} needs its own ranks (its 'ranks' in --teachers-config, or "
                    f"--teacher-ranks for every teacher), got {own}")
            split.append(int(own))
        return cls(kind, world_size, sum(split), tuple(split))

    def teacher_size_of(self, k: int) -> int:
        """Ranks of teacher ``k`` (colocated: the world)."""
        return self.teacher_split[k] if self.teacher_split else self.teacher_size

    def teacher_offset_of(self, k: int) -> int:
        """First global rank of teacher ``k``."""
        return self.teacher_offset + sum(self.teacher_split[:k])

    def teacher_global_ranks_of(self, k: int) -> list[int]:
        start = self.teacher_offset_of(k)
        return list(range(start, start + self.teacher_size_of(k)))

    def is_teacher_of(self, rank: int, k: int) -> bool:
        start = self.teacher_offset_of(k)
        return start <= rank < start + self.teacher_size_of(k)

    @property
    def disaggregated(self) -> bool:
        return self.kind == "disaggregated"

    @property
    def student_size(self) -> int:
        return self.world_size - self.teacher_ranks if self.disaggregated else self.world_size

    @property
    def teacher_size(self) -> int:
        return self.teacher_ranks if self.disaggregated else self.world_size

    @property
    def student_offset(self) -> int:
        return 0

    @property
    def teacher_offset(self) -> int:
        return self.student_size if self.disaggregated else 0

    def student_global_ranks(self) -> list[int]:
        return list(range(self.student_offset, self.student_offset + self.student_size))

    def teacher_global_ranks(self) -> list[int]:
        return list(range(self.teacher_offset, self.teacher_offset + self.teacher_size))

    def is_student(self, rank: int) -> bool:
        return self.student_offset <= rank < self.student_offset + self.student_size

    def is_teacher(self, rank: int) -> bool:
        return self.teacher_offset <= rank < self.teacher_offset + self.teacher_size
