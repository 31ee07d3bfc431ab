"""The teacher on this rank: its model shard (forward only, never updated) and the payloads it
makes for a global batch.

A rank holds a ``TeacherSide`` whether or not it runs a teacher shard (a CE-only run, a run that
reads a teacher cache, a disaggregated student rank): ``model`` is None then and nothing is run.
With several teachers a rank holds one per teacher, each in its own layout.
"""

from __future__ import annotations

import math

import torch

from megatron_xdistill import models as models_api
from megatron_xdistill.data.dataset import collate_samples, teacher_view
from megatron_xdistill.parallel.layout import ModelParallelGroups
from megatron_xdistill.parallel.teacher_batches import TeacherBatching
from megatron_xdistill.training.kd_adapter import KDObjective
from megatron_xdistill.training.pipeline import run_schedule
from megatron_xdistill.training.side_config import TeacherSideConfig


def trimmed(batch: dict, width: int) -> dict:
    """A teacher micro-batch cut to ``width`` positions: the tokens (``width + 1``, the inputs
    and the last label) and their chunk ids; the pad tokens past them are never run."""
    return dict(batch, teacher_tokens=batch["teacher_tokens"][:, : width + 1],
                teacher_chunk_id=batch["teacher_chunk_id"][:, : width + 1])


class TeacherSide:
    """Teacher model shard of this rank and its forward pass over its block of a global batch."""

    def __init__(self, config: TeacherSideConfig, info: models_api.ModelInfo,
                 groups: ModelParallelGroups, *, runs: bool, device: torch.device,
                 dtype: torch.dtype, world=None) -> None:
        """``runs``: this rank builds and runs a teacher shard (loaded from ``config.load``).
        ``world``: the teacher ranks' group for the checkpoint load (None: the whole world)."""
        self.side_config, self.info, self.groups, self.device = config, info, groups, device
        self.model = self.config = None
        if runs:
            self.model, self.config = models_api.build_model_for_layout(
                info, groups, dtype, seed=config.seed, **config.model_options)
            models_api.load_megatron_checkpoint(self.model, config.load,
                                                groups.pg_collection, process_group=world)
            # LongRoPE: the factors of the configured width, not of a trimmed micro-batch's
            models_api.decide_longrope_at(self.model, config.seq_length)
            self.model.eval()
            for param in self.model.parameters():
                param.requires_grad_(False)
        layout = groups.layout
        per_replica = config.global_batch_size // layout.dp
        # The largest micro-batch that divides both the student's and this teacher's share.
        self.micro_batch_size = math.gcd(config.micro_batch_size, per_replica)
        self.batching = TeacherBatching(
            config.global_batch_size, layout.dp, self.micro_batch_size, config.seq_length,
            multiple=layout.sequence_multiple(
                bool(config.model_options.get("sequence_parallel", False))),
            pipelined=layout.pp > 1)

    @property
    def runs(self) -> bool:
        return self.model is not None

    @property
    def writes_payloads(self) -> bool:
        """This rank's shard ends the teacher's pipeline: the payloads are made here."""
        return self.runs and self.groups.is_last_stage

    def forward(self, samples: dict[int, dict], kd: KDObjective,
                index: int = 0) -> dict[int, torch.Tensor]:
        """Flat payload rows by sample position of this replica's block (last stage; other
        stages return an empty dict). ``index``: which of the run's teachers this is (its
        tokens and chunks in the samples)."""
        dp_rank = self.groups.coords["dp"]
        micro = self.batching.microbatches(dp_rank)
        lengths = {i: samples[i]["teachers"][index]["teacher_length"]
                   for ids in micro for i in ids}
        widths = self.batching.widths(dp_rank, lengths)
        rows: list[torch.Tensor] = []

        def payload_rows(batch, logits):
            rows.append(kd.teacher_payload(logits, batch))
            return torch.zeros(()), {}

        run_schedule(self.model, self.config, self.groups,
                     [trimmed(teacher_view(collate_samples([samples[i] for i in ids]), index),
                              width) for ids, width in zip(micro, widths, strict=True)],
                     tokens=lambda batch: batch["teacher_tokens"], loss_func=payload_rows,
                     seq_length=max(widths), micro_batch_size=self.micro_batch_size,
                     device=self.device, forward_only=True)
        payloads: dict[int, torch.Tensor] = {}
        for ids, flat in zip(micro, rows):
            for row, sample in enumerate(ids):
                payloads[sample] = flat[row]
        return payloads

    def cache_rows(self, payloads: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The payloads this rank records in a teacher cache: one writer per replica, the last
        stage's TP rank 0 and CP rank 0 (the other TP / CP ranks hold the same rows; they all
        send to the students, as the routing plan deals them)."""
        coords = self.groups.coords
        return payloads if coords["tp"] == 0 and coords["cp"] == 0 else {}
