"""Which data-parallel replica owns which sample of a global batch, on either side.

The one home of the rule (the data loader, the routing plan, the student's microbatches and
evaluation all ask here). Student: Megatron's sampler order, micro-batches dealt round-robin over
the DP ranks. Teacher: contiguous blocks, one per DP rank (its micro-batch size may differ).
"""

from __future__ import annotations


def student_replica_of(sample: int, micro_batch_size: int, dp: int) -> tuple[int, int]:
    """(DP rank, micro-batch index) of a sample within a global batch (Megatron's sampler)."""
    return (sample // micro_batch_size) % dp, sample // (micro_batch_size * dp)


def student_samples(count: int, micro_batch_size: int, dp: int, dp_rank: int) -> list[int]:
    """The samples among ``[0, count)`` that student replica ``dp_rank`` trains on (or
    evaluates), in its micro-batch order: ``micro_batch_size`` consecutive ones per micro-batch."""
    return [i for i in range(count) if (i // micro_batch_size) % dp == dp_rank]


def teacher_replica_of(sample: int, global_batch_size: int, dp: int) -> int:
    """Teacher DP rank that computes a sample: contiguous blocks of the global batch."""
    return sample // (global_batch_size // dp)


def teacher_block(global_batch_size: int, dp: int, dp_rank: int) -> list[int]:
    """The samples of a global batch whose teacher forward runs on replica ``dp_rank``."""
    per = global_batch_size // dp
    return list(range(dp_rank * per, (dp_rank + 1) * per))
