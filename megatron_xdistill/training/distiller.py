"""The distillation runtime: two models in their own layouts, one training step at a time.

Per step (colocated placement: every rank holds a student shard and a teacher shard):
1. teacher forward-only through its pipeline on its data-parallel block of the global batch; on
   its last stage the teacher-side reduction turns logits into per-chunk payloads;
2. route: each sample's payload goes from the teacher rank that made it to the student ranks that
   train on it (in-process when they coincide, point-to-point otherwise);
3. student forward/backward through Megatron's pipeline schedule with the cross-tokenizer loss
   (vocab-parallel over the student's TP, CP-aware), then the Megatron optimizer step.
Losses are normalised by global counts (valid chunks and label tokens over the whole global
batch), so every layout computes the same loss and gradients.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_xdistill import mcore_compat

mcore_compat.install()

from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402

from megatron_xdistill.data.dataset import collate_samples  # noqa: E402
from megatron_xdistill.loss import total_loss  # noqa: E402
from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank  # noqa: E402
from megatron_xdistill.parallel.layout import (  # noqa: E402
    ModelParallelGroups,
    ParallelLayout,
    build_model_parallel_groups,
)
from megatron_xdistill.training import kd_adapter  # noqa: E402
from megatron_xdistill.transport.hybrid import RoutedTransport  # noqa: E402
from megatron_xdistill.transport.routing import (  # noqa: E402
    routing_plan,
    student_replica_of,
    teacher_samples,
)


@dataclass
class PhaseTimes:
    """Seconds spent per phase since the last log. ``loss`` (the cross-tokenizer loss, forward
    and backward) is part of ``student`` (forward + backward of the whole student step)."""

    teacher: float = 0.0
    route: float = 0.0
    student: float = 0.0
    loss: float = 0.0
    optimizer: float = 0.0


class _LossClock:
    """Times the loss's forward and backward inside the pipeline schedule's autograd pass.

    ``enter`` wraps the logits and ``leave`` the loss in identity autograd functions: backward
    reaches ``leave`` first (clock starts) and ``enter`` after the loss's own backward (clock
    stops), so the loss's recomputing backward is timed without hooks into Megatron.
    """

    def __init__(self, times: PhaseTimes) -> None:
        self.times = times
        self.started = 0.0
        clock = self

        class _Enter(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                clock.times.loss += time.perf_counter() - clock.started
                return grad

        class _Leave(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                clock.started = time.perf_counter()
                return grad

        self.enter, self.leave = _Enter.apply, _Leave.apply

    def reset(self) -> dict[str, float]:
        out = {f"time_{k}": round(v, 4) for k, v in vars(self).items()}
        for key in vars(self):
            setattr(self, key, 0.0)
        return out


def _sharded_metadata(groups: ModelParallelGroups) -> dict:
    return {"dp_cp_group": groups.pg_collection.dp_cp}


class Distiller:
    """Builds both models, the optimizer and the transport; runs steps and evaluation."""

    def __init__(self, args, init_weights: bool = True, log=print) -> None:
        from megatron_xdistill import models as models_api

        self.args = args
        self.log = log
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        self.student_layout = ParallelLayout.for_world(
            world, args.tensor_model_parallel_size, args.context_parallel_size,
            args.pipeline_model_parallel_size, who="student")
        self.teacher_layout = ParallelLayout.for_world(
            world, args.teacher_tensor_model_parallel_size, args.teacher_context_parallel_size,
            args.teacher_pipeline_model_parallel_size, who="teacher")
        self.student_groups = build_model_parallel_groups(self.student_layout)
        self.teacher_groups = build_model_parallel_groups(self.teacher_layout)
        dtype = torch.bfloat16 if args.bf16 else torch.float32

        # Teacher: forward only, never updated.
        self.teacher_info = models_api.load_model_info(args.teacher_load)
        self.teacher, self.teacher_config = self._build(models_api, self.teacher_info,
                                                        self.teacher_groups, dtype, seed=args.seed)
        models_api.load_megatron_checkpoint(self.teacher, args.teacher_load,
                                            self.teacher_groups.pg_collection)
        self.teacher.eval()
        for param in self.teacher.parameters():
            param.requires_grad_(False)

        # Student: DDP + Megatron optimizer + LR schedule.
        self.student_info = models_api.load_model_info(args.load)
        model, self.student_config = self._build(models_api, self.student_info,
                                                 self.student_groups, dtype, seed=args.seed)
        if init_weights:  # else a training checkpoint is restored by resume()
            models_api.load_megatron_checkpoint(model, args.load, self.student_groups.pg_collection)
        self.models_api = models_api
        self.student_config.finalize_model_grads_func = finalize_model_grads
        self.student_config.grad_scale_func = None
        self.ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            grad_reduce_in_fp32=True,
        )
        self.student = DistributedDataParallel(self.student_config, self.ddp_config, model,
                                               pg_collection=self.student_groups.pg_collection)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=dtype,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ),
            [self.student],
            use_gloo_process_groups=False,  # with a pg_collection Megatron needs this off
            pg_collection=self.student_groups.pg_collection,
        )
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if args.lr_warmup_iters else args.lr, max_lr=args.lr,
            min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
            lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
            start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
            wd_incr_style="constant",
        )
        self.kd = kd_adapter.KDLoss(args, self.student_info, self.teacher_info,
                                    self.student_groups, self.teacher_groups, log=log)
        self.routes = routing_plan(args.global_batch_size, args.micro_batch_size,
                                   self.student_layout, self.teacher_layout)
        self.transport = RoutedTransport(self.routes, numel=self.kd.payload_numel)
        self.times = PhaseTimes()
        self._loss_clock = _LossClock(self.times)
        self.mbs = args.micro_batch_size
        self.num_microbatches = args.global_batch_size // (self.mbs * self.student_layout.dp)
        per_teacher = args.global_batch_size // self.teacher_layout.dp
        self.teacher_mbs = math.gcd(self.mbs, per_teacher)

    # ------------------------------------------------------------------ construction
    def _build(self, models_api, info, groups: ModelParallelGroups, dtype, seed: int):
        layout = groups.layout
        model_parallel_cuda_manual_seed(seed, tp_rank=groups.coords["tp"], ep_rank=0,
                                        etp_rank=0, force_reset_rng=True)
        config = models_api.transformer_config(info, tp=layout.tp, pp=layout.pp, cp=layout.cp,
                                               dtype=dtype)
        model = models_api.build_gpt_model(info, config, pre_process=groups.is_first_stage,
                                           post_process=groups.is_last_stage,
                                           pg_collection=groups.pg_collection)
        return model, config

    # ------------------------------------------------------------------ step pieces
    def _positions(self, batch_rows: int, seq: int, groups: ModelParallelGroups) -> torch.Tensor:
        layout = groups.layout
        return slice_for_cp_rank(torch.arange(seq).expand(batch_rows, seq), 1,
                                 groups.coords["cp"], layout.cp)

    def _teacher_forward(self, samples: dict[int, dict]) -> dict[int, torch.Tensor]:
        """Teacher forward on this rank's teacher block; flat payload rows by sample (last
        stage only; other stages return an empty dict)."""
        groups = self.teacher_groups
        mine = teacher_samples(self.rank, self.args.global_batch_size, self.teacher_layout)
        micro = [mine[i : i + self.teacher_mbs] for i in range(0, len(mine), self.teacher_mbs)]
        batches = [collate_samples([samples[i] for i in ids]) for ids in micro]
        cp, cp_rank = self.teacher_layout.cp, groups.coords["cp"]
        rows: list[torch.Tensor] = []

        def payload_func(batch, logits):
            rows.append(self.kd.teacher_payload(logits, batch))
            return torch.zeros(()), {}

        def forward_step(data_iterator, module):
            batch = next(data_iterator)
            tokens = batch["teacher_tokens"][:, :-1]
            local = slice_for_cp_rank(tokens, 1, cp_rank, cp)
            pos = self._positions(tokens.size(0), tokens.size(1), groups)
            return module(local, pos, None), partial(payload_func, batch)

        with torch.no_grad():
            get_forward_backward_func(pp_size=self.teacher_layout.pp)(
                forward_step_func=forward_step, data_iterator=iter(batches),
                model=[self.teacher], num_microbatches=len(batches),
                seq_length=self.args.teacher_seq_length // cp,
                micro_batch_size=self.teacher_mbs, forward_only=True,
                p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp,
                                                 config=self.teacher_config),
                pg_collection=groups.pg_collection,
            )
        payloads: dict[int, torch.Tensor] = {}
        for ids, flat in zip(micro, rows):
            for row, sample in enumerate(ids):
                payloads[sample] = flat[row]
        return payloads

    def _global_counts(self, samples: dict[int, dict]) -> tuple[float, float]:
        """Valid chunks and label tokens in the whole global batch (all-reduced over DP)."""
        s_dp = self.student_groups.coords["dp"]
        local = [i for i in samples
                 if student_replica_of(i, self.mbs, self.student_layout.dp)[0] == s_dp]
        batch = collate_samples([samples[i] for i in local])
        counts = torch.tensor([float(self.kd.count_chunks(batch)),
                               float(batch["loss_mask"].sum())], dtype=torch.float64)
        dist.all_reduce(counts, group=self.student_groups.pg_collection.dp)
        return counts[0].item(), counts[1].item()

    def _student_microbatches(self, samples, payloads) -> list[dict]:
        s_dp = self.student_groups.coords["dp"]
        batches = []
        for j in range(self.num_microbatches):
            ids = [j * self.mbs * self.student_layout.dp + s_dp * self.mbs + k
                   for k in range(self.mbs)]
            batch = collate_samples([samples[i] for i in ids])
            if self.student_groups.is_last_stage:
                batch["payload"] = torch.stack([payloads[i] for i in ids]).float()
            batches.append(batch)
        return batches

    def _student_loss(self, batch: dict, n_chunks: float, n_tokens: float, logits: torch.Tensor):
        """This rank's share of the global-batch loss (normalised by global counts)."""
        layout = self.student_layout
        clock = self._loss_clock
        t0 = time.perf_counter()
        terms = self.kd.student_terms(clock.enter(logits), batch)
        args = self.args
        loss, _ = total_loss(terms, kd_weight=args.kd_weight, ce_weight=args.ce_weight,
                             dynamic_scaling=args.kd_dynamic_scaling, kd_denominator=n_chunks,
                             ce_denominator=n_tokens,
                             dp_cp_group=self.student_groups.pg_collection.dp_cp)
        # The schedule divides by num_microbatches; DDP averages gradients over DP x CP.
        scaled = clock.leave(loss * (self.num_microbatches * layout.dp * layout.cp))
        report = torch.stack([terms.kd_sum.detach().double() / max(n_chunks, 1.0),
                              terms.ce_sum.detach().double() / max(n_tokens, 1.0),
                              terms.top1.double()])
        self.times.loss += time.perf_counter() - t0
        return scaled, torch.tensor(1, dtype=torch.int), {"report": report}

    # ------------------------------------------------------------------ public
    def train_step(self, samples: dict[int, dict]) -> dict[str, float]:
        """One optimizer step on the global batch whose local samples are ``samples``."""
        t0 = time.perf_counter()
        outgoing = self._teacher_forward(samples)
        t1 = time.perf_counter()
        sender = {i: p for i, p in outgoing.items()
                  if self.teacher_groups.coords["tp"] == 0 and self.teacher_groups.coords["cp"] == 0}
        payloads = self.transport.exchange(sender)
        t2 = time.perf_counter()
        n_chunks, n_tokens = self._global_counts(samples)
        batches = self._student_microbatches(samples, payloads)
        groups = self.student_groups
        cp, cp_rank = self.student_layout.cp, groups.coords["cp"]
        self.student.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data_iterator, module):
            batch = next(data_iterator)
            tokens = batch["tokens"][:, :-1]
            local = slice_for_cp_rank(tokens, 1, cp_rank, cp)
            pos = self._positions(tokens.size(0), tokens.size(1), groups)
            logits = module(local, pos, None)
            return logits, partial(self._student_loss, batch, n_chunks, n_tokens)

        reduced = get_forward_backward_func(pp_size=self.student_layout.pp)(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.student],
            num_microbatches=len(batches), seq_length=self.args.seq_length // cp,
            micro_batch_size=self.mbs, forward_only=False,
            p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp,
                                             config=self.student_config),
            pg_collection=groups.pg_collection,
        )
        t3 = time.perf_counter()
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        t4 = time.perf_counter()
        self.times.teacher += t1 - t0
        self.times.route += t2 - t1
        self.times.student += t3 - t2
        self.times.optimizer += t4 - t3
        report = torch.zeros(3, dtype=torch.float64)
        if groups.is_last_stage and groups.coords["tp"] == 0:
            report = torch.stack([r["report"] for r in reduced]).double().sum(0)
        dist.all_reduce(report)  # sums over DP x CP shares (and the last stage only)
        return {"kd": report[0].item(), "ce": report[1].item(),
                "top1_agree": report[2].item() / max(n_chunks, 1.0),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": lr, "skipped": int(not ok),
                "chunks": int(n_chunks), "tokens": int(n_tokens)}

    def evaluate(self, batches) -> dict[str, float]:
        """Student CE and bits per byte on held-out batches (forward only)."""
        groups = self.student_groups
        cp, cp_rank = self.student_layout.cp, groups.coords["cp"]
        totals = torch.zeros(3, dtype=torch.float64)  # nats, tokens, bytes
        self.student.eval()
        for batch in batches:
            def loss_func(b, logits):
                terms = self.kd.student_terms(logits, b, with_kd=False)
                return terms.ce_sum, torch.tensor(1, dtype=torch.int), {
                    "sum": torch.stack([terms.ce_sum.detach().double(),
                                        terms.ce_count.double()])}

            def forward_step(it, module, batch=batch):
                b = next(it)
                tokens = b["tokens"][:, :-1]
                local = slice_for_cp_rank(tokens, 1, cp_rank, cp)
                pos = self._positions(tokens.size(0), tokens.size(1), groups)
                return module(local, pos, None), partial(loss_func, b)

            with torch.no_grad():
                reduced = get_forward_backward_func(pp_size=self.student_layout.pp)(
                    forward_step_func=forward_step, data_iterator=iter([batch]),
                    model=[self.student], num_microbatches=1,
                    seq_length=self.args.seq_length // cp, micro_batch_size=batch["tokens"].size(0),
                    forward_only=True,
                    p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp,
                                                     config=self.student_config),
                    pg_collection=groups.pg_collection,
                )
            if groups.is_last_stage and groups.coords["tp"] == 0:
                totals[:2] += reduced[0]["sum"]
                if cp_rank == 0:
                    totals[2] += batch["num_bytes"].sum().double()
        self.student.train()
        dist.all_reduce(totals)
        nats, tokens, num_bytes = totals.tolist()
        return {"eval_ce": nats / max(tokens, 1.0),
                "eval_bpb": nats / (math.log(2) * max(num_bytes, 1.0)), "eval_tokens": int(tokens)}

    def save(self, root: str, iteration: int, common: dict) -> str:
        from megatron_xdistill.training.checkpointing import save_checkpoint

        if self.rank == 0:  # the model description travels with the run (resume needs no flags)
            self.models_api.save_model_info(self.student_info, root)
        return save_checkpoint(root, iteration, self.student.module, self.optimizer, self.scheduler,
                               self.student_groups.pg_collection.dp_cp, common)

    def resume(self, root: str) -> dict:
        from megatron_xdistill.training.checkpointing import load_checkpoint

        return load_checkpoint(root, self.student.module, self.optimizer, self.scheduler,
                               self.student_groups.pg_collection.dp_cp)


def is_training_checkpoint(path: str) -> bool:
    from megatron_xdistill.training.checkpointing import TRACKER

    return os.path.exists(os.path.join(path, TRACKER))
