"""Per-rank loading of a global batch: only the samples this rank's student or teacher needs.

Each training step ``g`` covers samples ``[g * GBS, (g + 1) * GBS)`` of the packing plan (wrapping
around). A rank needs the samples of its student replica (Megatron's micro-batch order) and of its
teacher replica (a contiguous block); the DataLoader's workers tokenise and align just those.
With a disaggregated teacher a rank serves one model only (the other DP rank is None).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from megatron_xdistill.parallel.layout import ParallelLayout
from megatron_xdistill.parallel.sample_owners import student_samples, teacher_block


class StepSampler(torch.utils.data.Sampler):
    """Yields, per step, the global sample ids (plan indices) this rank needs, in a fixed order."""

    def __init__(self, num_samples: int, start_step: int, global_batch_size: int,
                 micro_batch_size: int, student_dp_rank: int | None, student: ParallelLayout,
                 teacher_dp_rank: int | None = None, teacher: ParallelLayout | None = None,
                 more_teachers: Sequence[tuple[int | None, ParallelLayout]] = ()) -> None:
        """``*_dp_rank``: this rank's data-parallel rank in that model's layout (None: it does
        not serve that model). ``more_teachers``: (DP rank, layout) of further teachers."""
        self.num_samples = num_samples
        self.step = start_step
        self.gbs = global_batch_size
        mine = set()
        if student_dp_rank is not None:
            mine.update(student_samples(global_batch_size, micro_batch_size, student.dp,
                                        student_dp_rank))
        for dp_rank, layout in [(teacher_dp_rank, teacher), *more_teachers]:
            if dp_rank is not None:
                mine.update(teacher_block(global_batch_size, layout.dp, dp_rank))
        self.local = sorted(mine)

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            base = self.step * self.gbs
            yield [(base + i) % self.num_samples for i in self.local]
            self.step += 1

    def __len__(self) -> int:
        return 2**62


class StepBatches:
    """Iterator of ``{index in global batch: sample dict}`` per step, from a DataLoader."""

    def __init__(self, dataset, sampler: StepSampler, num_workers: int) -> None:
        self.positions = sampler.local
        self.loader = torch.utils.data.DataLoader(
            dataset, batch_sampler=sampler, num_workers=num_workers,
            collate_fn=lambda items: items, persistent_workers=num_workers > 0,
            prefetch_factor=2 if num_workers > 0 else None,
        )
        self._it = iter(self.loader)

    def __next__(self) -> dict[int, dict]:
        items = next(self._it)
        return dict(zip(self.positions, items))

    def __iter__(self) -> StepBatches:
        return self
