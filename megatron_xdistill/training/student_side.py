"""The student on this rank: its model shard under Megatron's DDP and optimizer, one training
step given the teacher payloads, evaluation, and its training checkpoints.

Losses are normalised by global counts (valid chunks and label tokens over the whole global
batch), so every layout computes the same loss and gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from megatron_xdistill import models as models_api
from megatron_xdistill.data.dataset import collate_samples
from megatron_xdistill.loss import total_loss
from megatron_xdistill.models.megatron_lm import megatron_lm_args
from megatron_xdistill.parallel.layout import ModelParallelGroups
from megatron_xdistill.parallel.sample_owners import student_samples
from megatron_xdistill.training import arguments
from megatron_xdistill.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_xdistill.training.clocks import LossClock, PhaseTimes, device_now
from megatron_xdistill.training.kd_adapter import KDObjective
from megatron_xdistill.training.lr_schedule import build_lr_scheduler
from megatron_xdistill.training.schedule import run_schedule


@dataclass
class Microbatch:
    """One student micro-batch: the collated samples and, on the last stage of a run that
    distils, their teacher payload rows [b, numel]."""

    batch: dict
    payload: torch.Tensor | None = None


@dataclass
class StepReport:
    """What one student step measured, over the whole global batch (every student rank holds
    the same numbers). ``kd`` and ``top1_agree`` are NaN when no KD term was computed."""

    kd: float
    ce: float
    top1_agree: float
    grad_norm: float
    lr: float
    skipped: bool
    chunks: float
    tokens: float
    teacher_fill: float
    teacher_seconds: float


class StudentSide:
    """Student model shard of this rank: DDP, Megatron optimizer, LR schedule, step, evaluation."""

    def __init__(self, args, info: models_api.ModelInfo, groups: ModelParallelGroups, *,
                 device: torch.device, dtype: torch.dtype, init_weights: bool,
                 times: PhaseTimes, world=None) -> None:
        """``init_weights``: load --load now (else a training checkpoint is restored by
        :meth:`resume`). ``world``: the student ranks' group (None: the whole world)."""
        self.args, self.info, self.groups, self.device = args, info, groups, device
        self.world = world
        self.times = times
        self.loss_clock = LossClock(times)
        self.mbs = args.micro_batch_size
        self.num_microbatches = args.global_batch_size // (self.mbs * groups.layout.dp)
        model, self.config = models_api.build_model_for_layout(
            info, groups, dtype, seed=args.seed, **arguments.model_options(args, "student"))
        if init_weights:
            models_api.load_megatron_checkpoint(model, args.load, groups.pg_collection,
                                                process_group=world)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = None
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            bucket_size=args.ddp_bucket_size,
        )
        self.model = DistributedDataParallel(self.config, ddp_config, model,
                                             pg_collection=groups.pg_collection)
        if args.overlap_grad_reduce:  # the schedule holds the reduce until the last microbatch
            self.config.no_sync_func = self.model.no_sync
            self.config.grad_sync_func = self.model.start_grad_sync
        if args.overlap_param_gather:  # the next forward waits for each bucket's gather
            self.config.param_sync_func = self.model.start_param_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=args.optimizer, sgd_momentum=args.sgd_momentum, lr=args.lr,
                min_lr=args.min_lr, weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=dtype,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ),
            [self.model],
            use_gloo_process_groups=False,  # with a pg_collection Megatron needs this off
            pg_collection=groups.pg_collection,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, args)

    # ------------------------------------------------------------------ the step
    def positions(self) -> list[int]:
        """Positions in the global batch of the samples this replica trains on, in micro-batch
        order."""
        return student_samples(self.args.global_batch_size, self.mbs, self.groups.layout.dp,
                               self.groups.coords["dp"])

    def microbatches(self, samples: dict[int, dict],
                     payloads: dict[int, torch.Tensor] | None) -> list[Microbatch]:
        """This replica's micro-batches, each collated once; ``payloads`` by sample position
        (None: CE alone, or a stage before the last)."""
        mine = self.positions()
        out = []
        for start in range(0, len(mine), self.mbs):
            ids = mine[start : start + self.mbs]
            rows = None if payloads is None else torch.stack([payloads[i] for i in ids]).float()
            out.append(Microbatch(collate_samples([samples[i] for i in ids]), rows))
        return out

    def _global_counts(self, samples: dict[int, dict], micro: list[Microbatch],
                       kd: KDObjective) -> tuple[float, float, float]:
        """Valid chunks, label tokens and the teacher's fill (the share of its sample's token
        slots that hold real tokens, not padding) in the whole global batch (over DP)."""
        mine = [samples[i] for i in self.positions()]
        counts = torch.tensor([float(sum(kd.count_chunks(m.batch) for m in micro)),
                               float(sum(m.batch["loss_mask"].sum() for m in micro)),
                               float(sum(s["teacher_length"] for s in mine)),
                               float(len(mine) * (self.args.teacher_seq_length + 1))],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.groups.pg_collection.dp)
        return counts[0].item(), counts[1].item(), counts[2].item() / max(counts[3].item(), 1)

    def _loss(self, kd: KDObjective, n_chunks: float, n_tokens: float, micro: Microbatch,
              logits: torch.Tensor):
        """This rank's share of the global-batch loss (normalised by global counts)."""
        layout, clock, args = self.groups.layout, self.loss_clock, self.args
        t0 = device_now(self.device)
        terms = kd.student_terms(clock.enter(logits), micro.batch, micro.payload)
        loss, _ = total_loss(terms, kd_weight=args.kd_weight, ce_weight=args.ce_weight,
                             dynamic_scaling=args.kd_dynamic_scaling, kd_denominator=n_chunks,
                             ce_denominator=n_tokens,
                             dp_cp_group=self.groups.pg_collection.dp_cp)
        # The schedule divides by num_microbatches; DDP averages gradients over DP x CP.
        scaled = clock.leave(loss * (self.num_microbatches * layout.dp * layout.cp))
        report = torch.stack([terms.kd_sum.detach().double() / max(n_chunks, 1.0),
                              terms.ce_sum.detach().double() / max(n_tokens, 1.0),
                              terms.top1.double()])
        self.times.loss += device_now(self.device) - t0
        return scaled, torch.tensor(1, dtype=torch.int), {"report": report}

    def train_step(self, samples: dict[int, dict], payloads: dict[int, torch.Tensor] | None,
                   kd: KDObjective, teacher_seconds: float = 0.0) -> StepReport:
        """Forward/backward over this replica's micro-batches and the optimizer step.
        ``payloads``: the teacher's rows by sample position (None: CE alone)."""
        t0 = device_now(self.device)
        groups = self.groups
        micro = self.microbatches(samples, payloads if groups.is_last_stage else None)
        n_chunks, n_tokens, teacher_fill = self._global_counts(samples, micro, kd)
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_func(m: Microbatch, logits: torch.Tensor):
            return self._loss(kd, n_chunks, n_tokens, m, logits)

        reduced = run_schedule(self.model, self.config, groups, micro,
                               tokens=lambda m: m.batch["tokens"], loss_func=loss_func,
                               seq_length=self.args.seq_length, micro_batch_size=self.mbs,
                               device=self.device, forward_only=False)
        t1 = device_now(self.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        t2 = device_now(self.device)
        self.times.student += t1 - t0
        self.times.optimizer += t2 - t1
        report = torch.zeros(4, dtype=torch.float64, device=self.device)
        if groups.is_last_stage and groups.coords["tp"] == 0:
            report[:3] = torch.stack([r["report"] for r in reduced]).double().sum(0)
            if groups.coords["cp"] == 0 and groups.coords["dp"] == 0:
                report[3] = teacher_seconds  # as told by the teacher rank serving replica 0
        # Sums over DP x CP shares (and the last stage only), over the student ranks.
        dist.all_reduce(report, group=self.world)
        nan = float("nan")
        distils = payloads is not None
        return StepReport(
            kd=report[0].item() if distils else nan, ce=report[1].item(),
            top1_agree=report[2].item() / max(n_chunks, 1.0) if distils else nan,
            grad_norm=float(grad_norm) if grad_norm is not None else nan, lr=lr,
            skipped=not ok, chunks=n_chunks, tokens=n_tokens, teacher_fill=teacher_fill,
            teacher_seconds=report[3].item())

    # ------------------------------------------------------------------ evaluation
    @contextlib.contextmanager
    def whole_parameters(self):
        """With --overlap-param-gather the updated parameters arrive bucket by bucket during the
        next training forward: gather them all now (evaluation, checkpoints), as Megatron-LM
        does, and restore the overlap afterwards."""
        if not self.args.overlap_param_gather:
            yield
            return
        self.model.disable_forward_pre_hook()
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    def evaluate(self, batches: list[dict], kd: KDObjective) -> dict[str, float]:
        """CE and bits per byte on held-out batches (forward only; collective over the student
        ranks)."""
        groups = self.groups
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, tokens, bytes

        def ce_sums(batch: dict, logits: torch.Tensor):
            terms = kd.student_terms(logits, batch)
            return terms.ce_sum, torch.tensor(1, dtype=torch.int), {
                "sum": torch.stack([terms.ce_sum.detach().double(), terms.ce_count.double()])}

        with self.whole_parameters():
            self.model.eval()
            for batch in batches:
                reduced = run_schedule(self.model, self.config, groups, [batch],
                                       tokens=lambda b: b["tokens"], loss_func=ce_sums,
                                       seq_length=self.args.seq_length,
                                       micro_batch_size=batch["tokens"].size(0),
                                       device=self.device, forward_only=True)
                if groups.is_last_stage and groups.coords["tp"] == 0:
                    totals[:2] += reduced[0]["sum"]
                    if groups.coords["cp"] == 0:
                        totals[2] += batch["num_bytes"].sum().double().to(self.device)
            self.model.train()
        dist.all_reduce(totals, group=self.world)
        nats, tokens, num_bytes = totals.tolist()
        return {"eval_ce": nats / max(tokens, 1.0),
                "eval_bpb": nats / (math.log(2) * max(num_bytes, 1.0)), "eval_tokens": int(tokens)}

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str, iteration: int, common: dict, partial_world: bool) -> str:
        """The training checkpoint (collective over the world, see ``save_checkpoint``); rank 0
        also keeps the model description and HF files at the run root (resume and export need
        no flags)."""
        if dist.get_rank() == 0:
            models_api.save_model_info(self.info, root)
            models_api.keep_hf_files(root, self.args.load, self.args.tokenizer_model)
        layout = self.groups.layout
        megatron_args = megatron_lm_args(
            self.info, tp=layout.tp, pp=layout.pp, cp=layout.cp, seq_length=self.args.seq_length,
            bf16=bool(self.args.bf16), iteration=iteration,
            consumed_samples=int(common.get("consumed_samples", 0)))
        with self.whole_parameters():
            return save_checkpoint(root, iteration, self.model.module, self.optimizer,
                                   self.scheduler, self.groups.pg_collection.dp_cp, common,
                                   partial_world=partial_world, megatron_args=megatron_args)

    def resume(self, root: str) -> dict:
        """Model, optimizer, scheduler and RNG from a training checkpoint (collective over the
        student ranks; ``--no-load-optim`` / ``--no-load-rng`` keep this run's own); returns
        where the run stands."""
        keep_optim = self.args.no_load_optim
        return load_checkpoint(root, self.model.module,
                               None if keep_optim else self.optimizer,
                               None if keep_optim else self.scheduler,
                               self.groups.pg_collection.dp_cp, process_group=self.world,
                               load_rng=not self.args.no_load_rng)
