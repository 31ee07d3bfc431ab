"""How a teacher runs its share of a global batch: which samples go in which micro-batch, and how
many positions each micro-batch's forward runs.

Every teacher position costs a full teacher forward, padded or not. The teacher sample is
``--teacher-seq-length`` wide (an upper bound for the text of a student sample), but a
micro-batch only needs as many positions as its longest sample's text: the forward runs that
many (rounded up to what context / sequence parallelism needs) and the rest of the width, pad
tokens, is never computed. Causal attention makes the logits of the real positions the same
either way. With a pipeline, all micro-batches of one schedule call share one width (the
tensors sent between stages have one shape), so the block's longest sample sets it.

The one home of the rule: the teacher's forward asks it for its widths, the student's metrics for
the positions the teacher ran (the teacher's fill).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from megatron_xdistill.parallel.sample_owners import teacher_block

# Teacher sample lengths by position in the global batch: a list of all, or a mapping that holds
# at least the positions asked for (a replica's own samples).
Lengths = Sequence[int] | Mapping[int, int]


def positions_needed(teacher_length: int) -> int:
    """Positions a sample of ``teacher_length`` real tokens needs: its next-token predictions
    (position i predicts token i + 1), at least one."""
    return max(teacher_length - 1, 1)


@dataclass(frozen=True)
class TeacherBatching:
    """A teacher's micro-batches and their widths over a global batch.

    ``micro_batch_size``: the teacher's (it divides its replica's block); ``seq_length``: the
    teacher sample's width (``--teacher-seq-length``), the most a forward runs; ``multiple``:
    what a width must be a multiple of (2 x CP with context parallelism, times TP with sequence
    parallelism); ``pipelined``: PP > 1, one width per replica block."""

    global_batch_size: int
    dp: int
    micro_batch_size: int
    seq_length: int
    multiple: int = 1
    pipelined: bool = False

    def __post_init__(self) -> None:
        per = self.global_batch_size // self.dp
        if per * self.dp != self.global_batch_size or per % self.micro_batch_size:
            raise ValueError(f"teacher micro-batch size {self.micro_batch_size} does not divide "
                             f"the replica block of {self.global_batch_size} // {self.dp} samples")
        if self.seq_length % self.multiple:
            raise ValueError(f"teacher sequence length {self.seq_length} is not a multiple of "
                             f"{self.multiple} (context / sequence parallelism)")

    def microbatches(self, dp_rank: int) -> list[list[int]]:
        """Positions in the global batch of replica ``dp_rank``'s micro-batches, in order."""
        block = teacher_block(self.global_batch_size, self.dp, dp_rank)
        mbs = self.micro_batch_size
        return [block[i : i + mbs] for i in range(0, len(block), mbs)]

    def width(self, teacher_lengths: Sequence[int]) -> int:
        """Positions a forward runs for samples with these real token counts: the longest's
        need, rounded up to ``multiple``, at most ``seq_length``."""
        need = max(positions_needed(int(n)) for n in teacher_lengths)
        return min(self.seq_length, math.ceil(need / self.multiple) * self.multiple)

    def widths(self, dp_rank: int, teacher_lengths: Lengths) -> list[int]:
        """Width of each of replica ``dp_rank``'s micro-batches; ``teacher_lengths`` by position
        in the global batch (only the replica's own are read)."""
        micro = self.microbatches(dp_rank)
        if self.pipelined:
            block = [teacher_lengths[i] for ids in micro for i in ids]
            return [self.width(block)] * len(micro)
        return [self.width([teacher_lengths[i] for i in ids]) for ids in micro]

    @staticmethod
    def positions_predicting(teacher_lengths: Sequence[int]) -> int:
        """Positions of a global batch that predict teacher text (a sample of n tokens has
        n - 1; an empty one none): the numerator of the teacher's fill."""
        return sum(max(int(n) - 1, 0) for n in teacher_lengths)

    def positions_run(self, teacher_lengths: Sequence[int]) -> int:
        """Teacher positions the forwards of a whole global batch run (all replicas, each
        sample counted at its micro-batch's width)."""
        return sum(width * len(ids)
                   for rank in range(self.dp)
                   for ids, width in zip(self.microbatches(rank),
                                         self.widths(rank, teacher_lengths), strict=True))


__all__ = ["TeacherBatching", "positions_needed"]
