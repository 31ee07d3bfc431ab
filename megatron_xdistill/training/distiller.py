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

Disaggregated placement (``--teacher-placement disaggregated --teacher-ranks N``): the last N
ranks hold only the teacher (its layout spans those N ranks), the others only the student. Teacher
ranks run step 1 and send the payloads without waiting (transport.routed.RoutedStream: shared
memory / CUDA IPC slots within a node, gloo / NCCL point-to-point across nodes), so they compute
global batch k+1 while the student ranks run step 3 on batch k; student ranks receive batch k's
payloads (posted one step ahead) and run step 3. The payloads are the same numbers as colocated,
so are the losses.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from megatron_xdistill import mcore_compat

mcore_compat.install()

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import (  # noqa: E402
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator  # noqa: E402

from megatron_xdistill.data.dataset import collate_samples  # noqa: E402
from megatron_xdistill.loss import total_loss  # noqa: E402
from megatron_xdistill.parallel.context_parallel import slice_for_cp_rank  # noqa: E402
from megatron_xdistill.parallel.layout import (  # noqa: E402
    ModelParallelGroups,
    ParallelLayout,
    build_model_parallel_groups,
)
from megatron_xdistill.parallel.placement import Placement  # noqa: E402
from megatron_xdistill.training import arguments, kd_adapter  # noqa: E402
from megatron_xdistill.training.lr_schedule import build_lr_scheduler  # noqa: E402
from megatron_xdistill.transport.liveness import PeerWatch, default_store  # noqa: E402
from megatron_xdistill.transport.routed import (  # noqa: E402
    RoutedStream,
    RoutedTransport,
    check_one_rank_per_gpu,
    gpu_of_ranks,
)
from megatron_xdistill.transport.routing import (  # noqa: E402
    routing_plan,
    student_replica_of,
    teacher_samples,
)


@dataclass
class PhaseTimes:
    """Seconds spent per phase since the last log. ``loss`` (the cross-tokenizer loss, forward
    and backward) is part of ``student`` (forward + backward of the whole student step).

    ``route`` is the transport: the exchange (colocated), or on disaggregated student ranks the
    wait for the step's payloads (near zero when the teacher keeps ahead), on teacher ranks the
    packing and posting of the sends. With a disaggregated teacher the student ranks' ``teacher``
    is the teacher ranks' forward time, reported with the payloads (it overlaps the student)."""

    teacher: float = 0.0
    route: float = 0.0
    student: float = 0.0
    loss: float = 0.0
    optimizer: float = 0.0

    def reset(self) -> dict[str, float]:
        out = {f"time_{k}": round(v, 4) for k, v in vars(self).items()}
        for key in vars(self):
            setattr(self, key, 0.0)
        return out


def _now(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished its queued work: CUDA kernels run
    asynchronously, so without the sync a phase's GPU time would be billed to the next phase."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class _LossClockStop(torch.autograd.Function):
    """Identity on the logits; its backward runs after the loss's own backward: clock stops."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.times.loss += _now(grad.device) - ctx.clock.started
        return grad, None


class _LossClockStart(torch.autograd.Function):
    """Identity on the loss; its backward runs first: clock starts."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        return x.clone()  # a scalar; the schedule divides it in place (no view allowed)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.started = _now(grad.device)
        return grad, None


class _LossClock:
    """Times the loss's forward and backward inside the pipeline schedule's autograd pass.

    ``enter`` wraps the logits and ``leave`` the loss in identity autograd functions: backward
    reaches ``leave`` first (clock starts) and ``enter`` after the loss's own backward (clock
    stops), so the loss's recomputing backward is timed without hooks into Megatron.
    """

    def __init__(self, times: PhaseTimes) -> None:
        self.times = times
        self.started = 0.0

    def enter(self, logits: torch.Tensor) -> torch.Tensor:
        return _LossClockStop.apply(logits, self)

    def leave(self, loss: torch.Tensor) -> torch.Tensor:
        return _LossClockStart.apply(loss, self)


_SETUP_DONE = "xdistill: student setup done"


def _world_gathers_of_student_setup(has_student: bool) -> None:
    """Disaggregated: let the student ranks' optimizer setup gather over the whole world.

    Megatron's ``get_megatron_optimizer`` aligns param-group keys with ``all_gather_object`` on
    the default group (once per group of model chunks; between MIMO's disjoint module grids each
    rank contributes its own module's keys). A teacher rank has nothing to optimise: it joins
    those gathers with no keys until the student ranks, their setup done, gather a marker.
    """
    gathered: list = [None] * dist.get_world_size()
    if has_student:
        dist.all_gather_object(gathered, _SETUP_DONE)
        return
    while _SETUP_DONE not in gathered:
        dist.all_gather_object(gathered, [])


class Distiller:
    """Builds both models, the optimizer and the transport; runs steps and evaluation."""

    def __init__(self, args, init_weights: bool = True, log=print, cache=None,
                 teacher_only: bool = False) -> None:
        """``cache``: the run's ``teacher_cache.TeacherCache`` (read: no teacher is built;
        write: the sending teacher ranks also record the payloads). ``teacher_only``: no
        student (the teacher-only pass that fills a cache)."""
        from megatron_xdistill import models as models_api

        self.args = args
        self.log = log
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        # Where models, inputs and collective buffers live: this rank's GPU, else the CPU.
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.placement = placement = Placement.from_args(args, world)
        self.student_layout = ParallelLayout.for_world(
            placement.student_size, args.tensor_model_parallel_size, args.context_parallel_size,
            args.pipeline_model_parallel_size, who="student")
        self.teacher_layout = ParallelLayout.for_world(
            placement.teacher_size, args.teacher_tensor_model_parallel_size,
            args.teacher_context_parallel_size, args.teacher_pipeline_model_parallel_size,
            who="teacher")
        # Sequence parallelism gathers into Megatron's global scratch buffer, which
        # initialize_model_parallel would make; these layouts come from pg_collections instead.
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        # Group creation is collective over the world: every rank builds both sides' groups.
        self.student_groups = build_model_parallel_groups(self.student_layout,
                                                          placement.student_offset)
        self.teacher_groups = build_model_parallel_groups(self.teacher_layout,
                                                          placement.teacher_offset)
        self.cache = cache
        self.reads_cache = cache is not None and cache.reading
        self.teacher_only = teacher_only
        self.has_student = placement.is_student(self.rank) and not teacher_only
        # --kd-weight 0 (without dynamic scaling) trains on CE alone: the teacher's output
        # would be multiplied by 0, so it is neither loaded nor run.
        self.ce_only = kd_adapter.trains_ce_only(args)
        self.has_teacher = (placement.is_teacher(self.rank) and not self.ce_only
                            and not self.reads_cache)
        # Disaggregated: each side's own "world" (checkpoint loads; the student's metrics and
        # evaluation). None: the whole world.
        self.student_world = self.teacher_world = None
        if placement.disaggregated:
            if self.device.type == "cuda":  # the world's group is NCCL: one rank per GPU
                check_one_rank_per_gpu(range(world), gpu_of_ranks(self.device))
            self.student_world = dist.new_group(placement.student_global_ranks())
            self.teacher_world = dist.new_group(placement.teacher_global_ranks())
            first_t = placement.teacher_offset
            log(f"> teacher placement disaggregated: student on ranks 0-{first_t - 1} "
                f"({self._describe(self.student_layout)}), teacher on ranks {first_t}-{world - 1} "
                f"({self._describe(self.teacher_layout)})")
        dtype = torch.bfloat16 if args.bf16 else torch.float32

        # Teacher: forward only, never updated.
        self.teacher_info = (models_api.ModelInfo.from_dict(cache.manifest.teacher_model)
                             if self.reads_cache else models_api.load_model_info(args.teacher_load))
        self.teacher = self.teacher_config = None
        if self.has_teacher:
            self.teacher, self.teacher_config = models_api.build_model_for_layout(
                self.teacher_info, self.teacher_groups, dtype, seed=args.seed,
                **arguments.model_options(args, "teacher"))
            models_api.load_megatron_checkpoint(self.teacher, args.teacher_load,
                                                self.teacher_groups.pg_collection,
                                                process_group=self.teacher_world)
            self.teacher.eval()
            for param in self.teacher.parameters():
                param.requires_grad_(False)

        self.student_info = models_api.load_model_info(args.load)
        self.models_api = models_api
        self.student = self.student_config = self.optimizer = self.scheduler = None
        if self.has_student:
            self._build_student(models_api, dtype, init_weights)
        if placement.disaggregated:
            _world_gathers_of_student_setup(self.has_student)

        self.kd = kd_adapter.KDObjective(args, self.student_info, self.teacher_info,
                                         self.student_groups, self.teacher_groups, log=log)
        self.routes = routing_plan(args.global_batch_size, args.micro_batch_size,
                                   self.student_layout, self.teacher_layout,
                                   placement.student_offset, placement.teacher_offset)
        self.transport = self.stream = None
        self.watch = None
        if placement.disaggregated:
            # Teacher and students wait on each other for as long as the other's step takes;
            # a peer is dead after --distributed-timeout-minutes (at most a minute) without a
            # heartbeat, not after a step that outlasts that limit.
            timeout_s = 60.0 * args.distributed_timeout_minutes
            self.watch = PeerWatch(default_store(), self.rank,
                                   dead_after_s=max(5.0, min(timeout_s, 60.0)),
                                   report_every_s=timeout_s)
            self.stream = RoutedStream(self.routes, numel=self.kd.payload_numel,
                                       timeout_s=timeout_s, device=self.device, watch=self.watch)
        elif not (self.ce_only or self.reads_cache or teacher_only):  # nothing to route
            self.transport = RoutedTransport(self.routes, numel=self.kd.payload_numel,
                                             device=self.device)
        routed = self.stream if self.stream is not None else self.transport
        if routed is not None:
            log(f"> teacher -> student payload routes: {routed.summary}")
        # Bytes that cross between ranks per global batch (same-rank routes cost nothing).
        self.shipped_bytes_per_step = 0 if self.ce_only else self.kd.spec.nbytes * sum(
            1 for r in self.routes if r.src != r.dst)
        if self.ce_only:
            log("> --kd-weight 0: training on CE alone; the teacher is not loaded or run")
        self.times = PhaseTimes()
        self._loss_clock = _LossClock(self.times)
        self.step = 0  # steps run by this process (both sides count alike)
        self.mbs = args.micro_batch_size
        self.num_microbatches = args.global_batch_size // (self.mbs * self.student_layout.dp)
        per_teacher = args.global_batch_size // self.teacher_layout.dp
        self.teacher_mbs = math.gcd(self.mbs, per_teacher)

    @staticmethod
    def _describe(layout: ParallelLayout) -> str:
        return f"TP{layout.tp} CP{layout.cp} PP{layout.pp} DP{layout.dp}"

    def _build_student(self, models_api, dtype, init_weights: bool) -> None:
        """Student: DDP + Megatron optimizer + LR schedule."""
        args = self.args
        model, self.student_config = models_api.build_model_for_layout(
            self.student_info, self.student_groups, dtype, seed=args.seed,
            **arguments.model_options(args, "student"))
        if init_weights:  # else a training checkpoint is restored by resume()
            models_api.load_megatron_checkpoint(model, args.load, self.student_groups.pg_collection,
                                                process_group=self.student_world)
        self.student_config.finalize_model_grads_func = finalize_model_grads
        self.student_config.grad_scale_func = None
        self.ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            bucket_size=args.ddp_bucket_size,
        )
        self.student = DistributedDataParallel(self.student_config, self.ddp_config, model,
                                               pg_collection=self.student_groups.pg_collection)
        if args.overlap_grad_reduce:  # the schedule holds the reduce until the last microbatch
            self.student_config.no_sync_func = self.student.no_sync
            self.student_config.grad_sync_func = self.student.start_grad_sync
        if args.overlap_param_gather:  # the next forward waits for each bucket's gather
            self.student_config.param_sync_func = self.student.start_param_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer=args.optimizer, sgd_momentum=args.sgd_momentum, lr=args.lr,
                min_lr=args.min_lr, weight_decay=args.weight_decay,
                adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                clip_grad=args.clip_grad, bf16=args.bf16, params_dtype=dtype,
                use_distributed_optimizer=args.use_distributed_optimizer,
            ),
            [self.student],
            use_gloo_process_groups=False,  # with a pg_collection Megatron needs this off
            pg_collection=self.student_groups.pg_collection,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, args)

    # ------------------------------------------------------------------ step pieces
    def _model_inputs(self, tokens: torch.Tensor, groups: ModelParallelGroups
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """This CP rank's slice of ``tokens`` [b, s] and of their positions, on the device."""
        cp, cp_rank = groups.layout.cp, groups.coords["cp"]
        positions = torch.arange(tokens.size(1)).expand(tokens.size(0), -1)
        return (slice_for_cp_rank(tokens, 1, cp_rank, cp).to(self.device),
                slice_for_cp_rank(positions, 1, cp_rank, cp).to(self.device))

    def _teacher_forward(self, samples: dict[int, dict]) -> dict[int, torch.Tensor]:
        """Teacher forward on this rank's teacher block; flat payload rows by sample (last
        stage only; other stages return an empty dict)."""
        groups = self.teacher_groups
        mine = teacher_samples(self.rank, self.args.global_batch_size, self.teacher_layout,
                               self.placement.teacher_offset)
        micro = [mine[i : i + self.teacher_mbs] for i in range(0, len(mine), self.teacher_mbs)]
        batches = [collate_samples([samples[i] for i in ids]) for ids in micro]
        rows: list[torch.Tensor] = []

        def payload_func(batch, logits):
            rows.append(self.kd.teacher_payload(logits, batch))
            return torch.zeros(()), {}

        def forward_step(data_iterator, module):
            batch = next(data_iterator)
            tokens = batch["teacher_tokens"][:, :-1]
            local, pos = self._model_inputs(tokens, groups)
            return module(local, pos, None), partial(payload_func, batch)

        with torch.no_grad():
            get_forward_backward_func(pp_size=self.teacher_layout.pp)(
                forward_step_func=forward_step, data_iterator=iter(batches),
                model=[self.teacher], num_microbatches=len(batches),
                seq_length=self.args.teacher_seq_length,  # the schedule divides by CP
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

    def _sent_payloads(self, outgoing: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """The payloads this rank sends: the teacher's last stage at TP rank 0 and CP rank 0
        (the other TP / CP ranks hold the same rows)."""
        coords = self.teacher_groups.coords
        return outgoing if coords["tp"] == 0 and coords["cp"] == 0 else {}

    def _local_positions(self, samples: dict[int, dict]) -> list[int]:
        """Positions in the global batch of the samples this student replica trains on."""
        s_dp = self.student_groups.coords["dp"]
        return [i for i in samples
                if student_replica_of(i, self.mbs, self.student_layout.dp)[0] == s_dp]

    def _global_counts(self, samples: dict[int, dict]) -> tuple[float, float, float]:
        """Valid chunks, label tokens and the teacher's fill (the share of its sample's token
        slots that hold real tokens, not padding) in the whole global batch (over DP)."""
        local = [samples[i] for i in self._local_positions(samples)]
        batch = collate_samples(local)
        counts = torch.tensor([float(self.kd.count_chunks(batch)),
                               float(batch["loss_mask"].sum()),
                               float(sum(s["teacher_length"] for s in local)),
                               float(len(local) * (self.args.teacher_seq_length + 1))],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(counts, group=self.student_groups.pg_collection.dp)
        return counts[0].item(), counts[1].item(), counts[2].item() / max(counts[3].item(), 1)

    def _student_microbatches(self, samples, payloads) -> list[dict]:
        s_dp = self.student_groups.coords["dp"]
        batches = []
        for j in range(self.num_microbatches):
            ids = [j * self.mbs * self.student_layout.dp + s_dp * self.mbs + k
                   for k in range(self.mbs)]
            batch = collate_samples([samples[i] for i in ids])
            if self.student_groups.is_last_stage and not self.ce_only:
                batch["payload"] = torch.stack([payloads[i] for i in ids]).float()
            batches.append(batch)
        return batches

    def _student_loss(self, batch: dict, n_chunks: float, n_tokens: float, logits: torch.Tensor):
        """This rank's share of the global-batch loss (normalised by global counts)."""
        layout = self.student_layout
        clock = self._loss_clock
        t0 = _now(self.device)
        terms = self.kd.student_terms(clock.enter(logits), batch, with_kd=not self.ce_only)
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
        self.times.loss += _now(self.device) - t0
        return scaled, torch.tensor(1, dtype=torch.int), {"report": report}

    # ------------------------------------------------------------------ public
    def train_step(self, samples: dict[int, dict], next_step: bool = False) -> dict[str, float]:
        """One optimizer step on the global batch whose local samples are ``samples``.

        Disaggregated placement: on teacher ranks this computes and sends the batch's payloads
        and returns at once (no metrics); on student ranks it waits for them and trains.
        ``next_step`` says whether this run takes another step after this one: student ranks
        then post its receives first, so that transfer overlaps this step.
        """
        step = self.step
        self.step += 1
        if not self.has_student:
            return self._teacher_only_step(step, samples)
        teacher_seconds = 0.0
        t0 = t1 = _now(self.device)
        if self.ce_only:
            payloads = {}
        elif self.reads_cache:  # the last stage reads its own samples' payloads from disk
            mine = self._local_positions(samples) if self.student_groups.is_last_stage else []
            payloads = self.cache.fetch(samples, mine, self.device)
        elif self.stream is None:  # colocated: this rank runs its teacher shard first
            sender = self._sent_payloads(self._teacher_forward(samples))
            t1 = _now(self.device)
            self.times.teacher += t1 - t0
            if self.cache is not None:
                self.cache.record(samples, sender)
            payloads = self.transport.exchange(sender)
        else:
            payloads, stats = self.stream.receive(step)
            if next_step:
                self.stream.prefetch(step + 1)
            if len(stats):
                teacher_seconds = float(stats[:, 0].max())
        t2 = _now(self.device)
        self.times.route += t2 - t1
        return self._student_step(samples, payloads, teacher_seconds)

    def _teacher_only_step(self, step: int, samples: dict[int, dict]) -> dict[str, float]:
        """Disaggregated teacher rank: forward, then send without waiting for the students."""
        t0 = _now(self.device)
        outgoing = self._teacher_forward(samples)
        t1 = _now(self.device)
        if self.cache is not None:
            self.cache.record(samples, self._sent_payloads(outgoing))
        if self.stream is None:  # teacher-only pass: the cache is the only receiver
            self.times.teacher += t1 - t0
            return {}
        self.stream.send(step, outgoing, stats=[t1 - t0])
        self.times.teacher += t1 - t0
        self.times.route += _now(self.device) - t1
        return {}

    def _student_step(self, samples: dict[int, dict], payloads: dict[int, torch.Tensor],
                      teacher_seconds: float) -> dict[str, float]:
        """Student forward/backward and optimizer step, given this rank's payloads."""
        t2 = _now(self.device)
        n_chunks, n_tokens, teacher_fill = self._global_counts(samples)
        batches = self._student_microbatches(samples, payloads)
        groups = self.student_groups
        self.student.zero_grad_buffer()
        self.optimizer.zero_grad()

        def forward_step(data_iterator, module):
            batch = next(data_iterator)
            tokens = batch["tokens"][:, :-1]
            local, pos = self._model_inputs(tokens, groups)
            logits = module(local, pos, None)
            return logits, partial(self._student_loss, batch, n_chunks, n_tokens)

        reduced = get_forward_backward_func(pp_size=self.student_layout.pp)(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[self.student],
            num_microbatches=len(batches), seq_length=self.args.seq_length,
            micro_batch_size=self.mbs, forward_only=False,
            p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp,
                                             config=self.student_config),
            pg_collection=groups.pg_collection,
        )
        t3 = _now(self.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)
        t4 = _now(self.device)
        self.times.student += t3 - t2
        self.times.optimizer += t4 - t3
        report = torch.zeros(4, dtype=torch.float64, device=self.device)
        if groups.is_last_stage and groups.coords["tp"] == 0:
            report[:3] = torch.stack([r["report"] for r in reduced]).double().sum(0)
            if groups.coords["cp"] == 0 and groups.coords["dp"] == 0:
                report[3] = teacher_seconds  # as told by the teacher rank serving replica 0
        # Sums over DP x CP shares (and the last stage only), over the student ranks.
        dist.all_reduce(report, group=self.student_world)
        if self.stream is not None:
            self.times.teacher += report[3].item()
        nan = float("nan")  # CE alone: no KD term was computed
        return {"kd": nan if self.ce_only else report[0].item(), "ce": report[1].item(),
                "top1_agree": nan if self.ce_only else report[2].item() / max(n_chunks, 1.0),
                "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                "lr": lr, "skipped": int(not ok),
                "chunks": int(n_chunks), "tokens": int(n_tokens),
                "teacher_fill": round(teacher_fill, 4),
                "shipped_bytes_per_token": round(self.shipped_bytes_per_step / max(n_tokens, 1.0),
                                                 1)}

    @contextlib.contextmanager
    def _whole_parameters(self):
        """With --overlap-param-gather the updated parameters arrive bucket by bucket during the
        next training forward: gather them all now (evaluation, checkpoints), as Megatron-LM
        does, and restore the overlap afterwards."""
        if not (self.has_student and self.args.overlap_param_gather):
            yield
            return
        self.student.disable_forward_pre_hook()
        try:
            yield
        finally:
            self.student.enable_forward_pre_hook()

    def evaluate(self, batches) -> dict[str, float]:
        """Student CE and bits per byte on held-out batches (forward only; collective over the
        student ranks, nothing to do on disaggregated teacher ranks)."""
        with self._whole_parameters():
            return self._evaluate(batches)

    def _evaluate(self, batches) -> dict[str, float]:
        if not self.has_student:
            return {}
        groups = self.student_groups
        cp_rank = groups.coords["cp"]
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, tokens, bytes
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
                local, pos = self._model_inputs(tokens, groups)
                return module(local, pos, None), partial(loss_func, b)

            with torch.no_grad():
                reduced = get_forward_backward_func(pp_size=self.student_layout.pp)(
                    forward_step_func=forward_step, data_iterator=iter([batch]),
                    model=[self.student], num_microbatches=1,
                    seq_length=self.args.seq_length, micro_batch_size=batch["tokens"].size(0),
                    forward_only=True,
                    p2p_communicator=P2PCommunicator(pp_group=groups.pg_collection.pp,
                                                     config=self.student_config),
                    pg_collection=groups.pg_collection,
                )
            if groups.is_last_stage and groups.coords["tp"] == 0:
                totals[:2] += reduced[0]["sum"]
                if cp_rank == 0:
                    totals[2] += batch["num_bytes"].sum().double().to(self.device)
        self.student.train()
        dist.all_reduce(totals, group=self.student_world)
        nats, tokens, num_bytes = totals.tolist()
        return {"eval_ce": nats / max(tokens, 1.0),
                "eval_bpb": nats / (math.log(2) * max(num_bytes, 1.0)), "eval_tokens": int(tokens)}

    def save(self, root: str, iteration: int, common: dict) -> str:
        """Collective over the world: the student's training checkpoint (disaggregated teacher
        ranks join the collective save and write nothing)."""
        from megatron_xdistill.training.checkpointing import save_checkpoint

        partial_world = self.placement.disaggregated
        if self.cache is not None:  # every step this checkpoint covers is on disk first
            self.cache.flush()
        if not self.has_student:
            return save_checkpoint(root, iteration, None, None, None, None, common,
                                   partial_world=partial_world)
        if self.rank == 0:  # the model description travels with the run (resume needs no flags)
            self.models_api.save_model_info(self.student_info, root)
            self.models_api.keep_hf_files(root, self.args.load, self.args.tokenizer_model)
        with self._whole_parameters():
            return save_checkpoint(root, iteration, self.student.module, self.optimizer,
                                   self.scheduler, self.student_groups.pg_collection.dp_cp,
                                   common, partial_world=partial_world)

    def resume(self, root: str) -> dict:
        """Restore the student from a training checkpoint (collective over the student ranks);
        disaggregated teacher ranks only read where the run stands."""
        from megatron_xdistill.training.checkpointing import load_checkpoint, load_position

        if not self.has_student:
            return load_position(root)
        return load_checkpoint(root, self.student.module, self.optimizer, self.scheduler,
                               self.student_groups.pg_collection.dp_cp,
                               process_group=self.student_world)

    def finish(self) -> None:
        """Wait for the payload transfers still in flight (disaggregated), e.g. before exit."""
        if self.stream is not None:
            self.stream.finish()

    def close(self) -> None:
        """Release the transport's shared buffers (shared memory, CUDA IPC); idempotent. Also
        on errors: a rank that stops early leaves no segment or mapping behind."""
        for transport in (self.transport, self.stream):
            if transport is not None:
                transport.close()
        if self.watch is not None:
            self.watch.close()
            self.watch = None


def is_training_checkpoint(path: str) -> bool:
    from megatron_xdistill.training.checkpointing import TRACKER

    return os.path.exists(os.path.join(path, TRACKER))
