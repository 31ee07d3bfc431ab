"""The distillation runtime: two models in their own layouts, one training step at a time.

Per step (colocated placement: every rank holds a student shard and a teacher shard):
1. teacher forward-only through its pipeline on its data-parallel block of the global batch; on
   its last stage the teacher-side reduction turns logits into per-chunk payloads
   (:class:`~.teacher_side.TeacherSide`);
2. route: each sample's payload goes from the teacher rank that made it to the student ranks that
   train on it (in-process when they coincide, point-to-point otherwise);
3. student forward/backward through Megatron's pipeline schedule with the cross-tokenizer loss
   (vocab-parallel over the student's TP, CP-aware), then the Megatron optimizer step
   (:class:`~.student_side.StudentSide`).

Disaggregated placement (``--teacher-placement disaggregated --teacher-ranks N``): the last N
ranks hold only the teacher (its layout spans those N ranks), the others only the student. Teacher
ranks run step 1 and send the payloads without waiting (transport.routed.RoutedStream: shared
memory / CUDA IPC slots within a node, gloo / NCCL point-to-point across nodes), so they compute
global batch k+1 while the student ranks run step 3 on batch k; student ranks receive batch k's
payloads (posted one step ahead) and run step 3. The payloads are the same numbers as colocated,
so are the losses.

Several teachers (``--teachers-config``): each is a lane (:class:`TeacherLane`: its layout,
groups, side, loss glue, routes and transport). Colocated, every rank runs the teachers' shards
one after the other; disaggregated, each teacher has its own ranks after the student's (its
``ranks``), and all of them stream batch k+1 while the student trains on batch k.

This module only sets the run up (layouts, groups, the two sides, the transport) and routes a
step between the sides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_xdistill import models as models_api
from megatron_xdistill.parallel.layout import (
    ModelParallelGroups,
    ParallelLayout,
    build_model_parallel_groups,
)
from megatron_xdistill.parallel.placement import Placement
from megatron_xdistill.teachers.combination import Combination
from megatron_xdistill.teachers.spec import single_teacher
from megatron_xdistill.training import kd_adapter
from megatron_xdistill.training.arguments import trains_ce_only
from megatron_xdistill.training.checkpointing import load_position, save_checkpoint
from megatron_xdistill.training.clocks import PhaseTimes, device_now
from megatron_xdistill.training.side_config import (
    StudentSideConfig,
    TeacherSideConfig,
    params_dtype,
)
from megatron_xdistill.training.student_side import StepReport, StudentSide
from megatron_xdistill.training.teacher_side import TeacherSide
from megatron_xdistill.transport.liveness import PeerWatch, default_store
from megatron_xdistill.transport.routed import (
    RoutedStream,
    RoutedTransport,
    check_one_rank_per_gpu,
    rank_places,
)
from megatron_xdistill.transport.routing import routing_plan

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


def _describe(layout: ParallelLayout) -> str:
    return f"TP{layout.tp} CP{layout.cp} PP{layout.pp} DP{layout.dp}"


@dataclass
class TeacherLane:
    """One teacher of the run: its layout and groups, its side on this rank, its loss glue, its
    routes to the student and (colocated) its transport; ``seconds``: its forward time since
    the metrics last took it."""

    name: str
    layout: ParallelLayout
    groups: ModelParallelGroups
    side: TeacherSide
    kd: kd_adapter.KDObjective
    routes: list
    index: int = 0
    cache: object | None = None  # its teacher_cache.TeacherCache
    transport: RoutedTransport | RoutedStream | None = None
    seconds: float = 0.0
    fill_from: int = 0  # teacher-only pass: the first step its cache does not hold

    @property
    def reads_cache(self) -> bool:
        return self.cache is not None and self.cache.reading


@dataclass(frozen=True)
class _StudentVocabulary:
    """The student's vocabulary where no student model is loaded (a ``--teacher-cache-only``
    pass without ``--load``): what the teachers' payloads need of the student."""

    vocab_size: int

    def padded_vocab_size(self, tp: int) -> int:
        """As ``ModelInfo.padded_vocab_size`` at its default multiple (no student model
        reads it in a cache pass; the loss's shapes are built from it all the same)."""
        multiple = 128 * tp
        return -(-self.vocab_size // multiple) * multiple


def _vocabulary_of(tokenizer_model: str) -> _StudentVocabulary:
    from megatron_xdistill.align import load_tokenizer

    return _StudentVocabulary(len(load_tokenizer(tokenizer_model)))


class Distiller:
    """Sets up both sides and the transport between them; runs steps and evaluation."""

    def __init__(self, args, init_weights: bool = True, log=print, caches=None,
                 teacher_only: bool = False, same_tokenizer: list[bool] | None = None) -> None:
        """``caches[k]``: teacher k's ``teacher_cache.TeacherCache`` or None (read: that
        teacher is not built; write: its sending ranks also record the payloads).
        ``teacher_only``: no student (the teacher-only pass that fills the caches).
        ``same_tokenizer[k]``: teacher k uses the student's tokenizer (``args.teachers``,
        default one teacher from the flags)."""
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
            args.pipeline_model_parallel_size, who="student",
            ep=args.expert_model_parallel_size)
        specs = getattr(args, "teachers", None) or [single_teacher(args)]
        self.combination = Combination.of(specs, getattr(args, "teacher_combination", "sum"))
        same_tokenizer = same_tokenizer or [False] * len(specs)
        views = [spec.view(args) for spec in specs]
        teacher_layouts = [ParallelLayout.for_world(
            placement.teacher_size_of(k), v.teacher_tensor_model_parallel_size,
            v.teacher_context_parallel_size, v.teacher_pipeline_model_parallel_size,
            who=f"teacher {v.teacher_name!r}", ep=v.teacher_expert_model_parallel_size)
            for k, v in enumerate(views)]
        # Sequence parallelism gathers into Megatron's global scratch buffer, which
        # initialize_model_parallel would make; these layouts come from pg_collections instead.
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        # Group creation is collective over the world: every rank builds both sides' groups.
        self.student_groups = build_model_parallel_groups(self.student_layout,
                                                          placement.student_offset)
        teacher_groups = [build_model_parallel_groups(layout, placement.teacher_offset_of(k))
                          for k, layout in enumerate(teacher_layouts)]
        caches = caches or [None] * len(views)
        reads = [cache is not None and cache.reading for cache in caches]
        has_student = placement.is_student(self.rank) and not teacher_only
        # --kd-weight 0 (without dynamic scaling) trains on CE alone: the teacher's output
        # would be multiplied by 0, so it is neither loaded nor run.
        self.ce_only = trains_ce_only(args)
        runs = [placement.is_teacher_of(self.rank, k) and not self.ce_only and not reads[k]
                for k in range(len(views))]
        # Disaggregated: each side's own "world" (checkpoint loads; the student's metrics and
        # evaluation), one per teacher. None: the whole world.
        student_world = None
        teacher_worlds = [None] * len(views)
        # Every rank's node and GPU, gathered once for the checks and every lane's transport.
        self.places = rank_places(self.device)
        if placement.disaggregated:
            if self.device.type == "cuda":  # the world's group is NCCL: one rank per GPU
                check_one_rank_per_gpu(range(world), self.places[1])
            student_world = dist.new_group(placement.student_global_ranks())
            teacher_worlds = [dist.new_group(placement.teacher_global_ranks_of(k))
                              for k in range(len(views))]
            where = ", ".join(
                f"{'teacher' if len(views) == 1 else repr(v.teacher_name)} on ranks "
                f"{placement.teacher_offset_of(k)}-"
                f"{placement.teacher_offset_of(k) + placement.teacher_size_of(k) - 1} "
                f"({_describe(teacher_layouts[k])})" for k, v in enumerate(views))
            log(f"> teacher placement disaggregated: student on ranks "
                f"0-{placement.teacher_offset - 1} ({_describe(self.student_layout)}), {where}")
        dtype = params_dtype(args)
        self.times = PhaseTimes()

        infos = [models_api.ModelInfo.from_dict(cache.manifest.teacher_model) if read
                 else models_api.load_model_info(v.teacher_load)
                 for v, cache, read in zip(views, caches, reads, strict=True)]
        sides = [TeacherSide(TeacherSideConfig.from_args(v), info, groups, runs=run,
                             device=self.device, dtype=dtype,
                             world=teacher_world)
                 for v, info, groups, run, teacher_world in zip(
                     views, infos, teacher_groups, runs, teacher_worlds, strict=True)]
        student_info = (models_api.load_model_info(args.load) if args.load is not None
                        else _vocabulary_of(args.tokenizer_model))  # --teacher-cache-only
        self.student = None
        if has_student:
            self.student = StudentSide(StudentSideConfig.from_args(args), student_info,
                                       self.student_groups, device=self.device,
                                       init_weights=init_weights, times=self.times,
                                       world=student_world)
        if placement.disaggregated:
            _world_gathers_of_student_setup(has_student)

        selects = self.combination.selects
        self.lanes = []
        for k, view in enumerate(views):
            if len(views) > 1:
                kind = ("the student's tokenizer: token-level KL" if same_tokenizer[k]
                        else "cross-tokenizer")
                log(f"> teacher {view.teacher_name!r}: {_describe(teacher_layouts[k])}, {kind}, "
                    f"weight {specs[k].weight:g}")
            kd = kd_adapter.KDObjective(
                specs[k], student_info, infos[k], self.student_groups, teacher_groups[k],
                student_tokenizer=args.tokenizer_model, seq_length=args.seq_length,
                ce_only=self.ce_only, log=log, same_tokenizer=same_tokenizer[k],
                ships_text_nats=selects)
            routes = routing_plan(args.global_batch_size, args.micro_batch_size,
                                  self.student_layout, teacher_layouts[k],
                                  placement.student_offset, placement.teacher_offset_of(k))
            self.lanes.append(TeacherLane(view.teacher_name, teacher_layouts[k],
                                          teacher_groups[k], sides[k], kd, routes, index=k,
                                          cache=caches[k]))
        self.watch = None
        self.streams = False  # disaggregated: each lane streams its payloads
        if placement.disaggregated:
            # Teacher and students wait on each other for as long as the other's step takes;
            # a peer is dead after --distributed-timeout-minutes (at most a minute) without a
            # heartbeat, not after a step that outlasts that limit.
            timeout_s = 60.0 * args.distributed_timeout_minutes
            self.watch = PeerWatch(default_store(), self.rank,
                                   dead_after_s=max(5.0, min(timeout_s, 60.0)),
                                   report_every_s=timeout_s)
            self.streams = True
            for lane in self.lanes:  # collective over the world, in lane order
                lane.transport = RoutedStream(lane.routes, numel=lane.kd.payload_numel,
                                              timeout_s=timeout_s, device=self.device,
                                              watch=self.watch, nodes=self.places[0],
                                              gpus=self.places[1])
        elif not (self.ce_only or teacher_only):  # nothing to route
            for lane in self.lanes:
                if not lane.reads_cache:
                    lane.transport = RoutedTransport(lane.routes, numel=lane.kd.payload_numel,
                                                     device=self.device, nodes=self.places[0],
                                                     gpus=self.places[1])
        for lane in self.lanes:
            if lane.transport is not None:
                which = f" {lane.name!r}" if len(self.lanes) > 1 else ""
                log(f"> teacher{which} -> student payload routes: {lane.transport.summary}")
        # Bytes that cross between ranks per global batch (same-rank routes cost nothing).
        self.shipped_bytes_per_step = 0 if self.ce_only else sum(
            lane.kd.payload_numel * 4 * sum(1 for r in lane.routes if r.src != r.dst)
            for lane in self.lanes)
        if self.ce_only:
            log("> --kd-weight 0: training on CE alone; the teacher is not loaded or run")
        self.step = 0  # steps run by this process (both sides count alike)

    @property
    def has_student(self) -> bool:
        return self.student is not None

    # The first (with --teacher-* flags: the only) teacher, for the paths that serve one
    # teacher: the payload cache and the disaggregated stream.
    @property
    def teacher(self) -> TeacherSide:
        return self.lanes[0].side

    @property
    def teacher_groups(self) -> ModelParallelGroups:
        return self.lanes[0].groups

    @property
    def teacher_layout(self) -> ParallelLayout:
        return self.lanes[0].layout

    @property
    def kd(self) -> kd_adapter.KDObjective:
        return self.lanes[0].kd

    @property
    def kds(self) -> list[kd_adapter.KDObjective]:
        return [lane.kd for lane in self.lanes]

    @property
    def payload_bytes_per_token(self) -> float:
        """Teacher payload bytes per student token, all teachers together."""
        return sum(lane.kd.payload_bytes_per_token for lane in self.lanes)

    # ------------------------------------------------------------------ the step
    def train_step(self, samples: dict[int, dict], next_step: bool = False,
                   source_metrics: dict[str, float] | None = None) -> dict[str, float]:
        """One optimizer step on the global batch whose local samples are ``samples``.

        Disaggregated placement: on teacher ranks this computes and sends the batch's payloads
        and returns at once (no metrics); on student ranks it waits for them and trains.
        ``next_step`` says whether this run takes another step after this one: student ranks
        then post its receives first, so that transfer overlaps this step.
        ``source_metrics``: what the step's sample source measured (on-policy rollouts: their
        generation, and ``tokens``, the response tokens the step trains on), merged into the
        step's metrics.
        """
        step = self.step
        self.step += 1
        if self.student is None:
            self._teacher_only_step(step, samples)
            return {}
        teacher_seconds = 0.0
        payloads: list[dict[int, torch.Tensor]] | None
        if self.ce_only:
            payloads = None
        elif not self.streams:  # colocated: this rank runs its teacher shards first
            payloads = [self._cached_payloads(lane, samples) if lane.reads_cache
                        else self._colocated_payloads(lane, samples) for lane in self.lanes]
        else:
            t0 = device_now(self.device)
            payloads = []
            for lane in self.lanes:  # every teacher's receives are posted a step ahead
                received, stats = lane.transport.receive(step)
                payloads.append(received)
                if next_step:
                    lane.transport.prefetch(step + 1)
                if len(stats):
                    lane.seconds += float(stats[:, 0].max())
                    teacher_seconds = max(teacher_seconds, float(stats[:, 0].max()))
            self.times.route += device_now(self.device) - t0
        report = self.student.train_step(samples, payloads, self.kds, self.combination,
                                         [lane.side.batching for lane in self.lanes],
                                         teacher_seconds)
        if self.streams:  # the step waited for the slowest teacher
            self.times.teacher += report.teacher_seconds
        return self._metrics(report, source_metrics or {})

    def _cached_payloads(self, lane: TeacherLane, samples: dict[int, dict]
                         ) -> dict[int, torch.Tensor]:
        """A teacher's payloads from its complete cache: the last stage reads its own
        samples'."""
        mine = self.student.positions() if self.student_groups.is_last_stage else []
        t0 = device_now(self.device)
        payloads = lane.cache.fetch(samples, mine, self.device)
        self.times.route += device_now(self.device) - t0
        return payloads

    def _colocated_payloads(self, lane: TeacherLane, samples: dict[int, dict]
                            ) -> dict[int, torch.Tensor]:
        """One teacher's forward on this rank, then its payloads routed to the student ranks
        that train on them."""
        t0 = device_now(self.device)
        rows = lane.side.forward(samples, lane.kd, lane.index)  # every last-stage rank sends
        t1 = device_now(self.device)
        self.times.teacher += t1 - t0
        lane.seconds += t1 - t0
        if lane.cache is not None:
            lane.cache.record(samples, lane.side.cache_rows(rows))
        payloads = lane.transport.exchange(rows)
        self.times.route += device_now(self.device) - t1
        return payloads

    def _metrics(self, report: StepReport, source: dict[str, float]) -> dict[str, float]:
        """The step's metrics; ``source``'s ``tokens`` (what an on-policy step trains on: CE
        may count none of them) replaces the labelled tokens in the per-token figures."""
        tokens = source.get("tokens", report.tokens)
        out = {"kd": report.kd, "ce": report.ce, "top1_agree": report.top1_agree,
               "grad_norm": report.grad_norm, "lr": report.lr, "skipped": int(report.skipped),
               "chunks": int(report.chunks), "tokens": int(report.tokens)}
        if report.load_balancing_loss is not None:  # an MoE student, as Megatron-LM logs it
            out["load_balancing_loss"] = report.load_balancing_loss
        if not self.ce_only:  # CE only: no teacher ran, no positions to fill
            out["teacher_fill"] = round(report.teacher_fill, 4)
        out.update(source, shipped_bytes_per_token=round(
            self.shipped_bytes_per_step / max(tokens, 1.0), 1))
        if report.teachers:  # several: each teacher's agreement below, none combined
            del out["top1_agree"]
        for lane, teacher in zip(self.lanes, report.teachers or [], strict=False):
            name = teacher["name"]
            out.update({f"kd/{name}": teacher["kd"], f"top1_agree/{name}": teacher["top1_agree"],
                        f"chunks/{name}": int(teacher["chunks"]),
                        f"payload_bytes_per_token/{name}": round(
                            lane.kd.payload_bytes_per_token, 1)})
            if not self.ce_only:
                out[f"teacher_fill/{name}"] = round(teacher["teacher_fill"], 4)
            if self.combination.selects:
                out[f"selected/{name}"] = teacher["samples"] / max(self.args.global_batch_size, 1)
        return out

    def teacher_times(self) -> dict[str, float]:
        """Seconds each teacher's forward took since the last call (several teachers), reset."""
        if len(self.lanes) < 2:
            return {}
        out = {f"time_teacher/{lane.name}": round(lane.seconds, 4) for lane in self.lanes}
        for lane in self.lanes:
            lane.seconds = 0.0
        return out

    def _teacher_only_step(self, step: int, samples: dict[int, dict]) -> None:
        """Disaggregated teacher rank (it serves one teacher): forward, then send without
        waiting for the students; the teacher-only pass: forward into the cache."""
        for lane in self.lanes:
            if not lane.side.runs or step < lane.fill_from:  # (a cache that holds the step)
                continue
            t0 = device_now(self.device)
            outgoing = lane.side.forward(samples, lane.kd, lane.index)
            t1 = device_now(self.device)
            if lane.cache is not None:
                lane.cache.record(samples, lane.side.cache_rows(outgoing))
            self.times.teacher += t1 - t0
            lane.seconds += t1 - t0
            if not self.streams:  # teacher-only pass: the cache is the only receiver
                continue
            lane.transport.send(step, outgoing, stats=[t1 - t0])
            self.times.route += device_now(self.device) - t1

    def evaluate(self, batches) -> dict[str, float]:
        """Student CE and bits per byte on held-out batches (forward only; collective over the
        student ranks, nothing to do on disaggregated teacher ranks)."""
        return {} if self.student is None else self.student.evaluate(batches, self.kds[0])

    def evaluate_tasks(self, tasks: list[str], limit: int | None, tokenizer) -> dict[str, float]:
        """lm-eval task scores of the student (collective over the student ranks; nothing on
        disaggregated teacher ranks)."""
        return {} if self.student is None else self.student.evaluate_tasks(tasks, limit,
                                                                           tokenizer)

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str, iteration: int, common: dict) -> str:
        """Collective over the world: the student's training checkpoint (disaggregated teacher
        ranks join the collective save and write nothing)."""
        partial_world = self.placement.disaggregated
        for lane in self.lanes:  # every step this checkpoint covers is on disk first
            if lane.cache is not None:
                lane.cache.flush()
        if self.student is None:
            return save_checkpoint(root, iteration, None, None, None, None, common,
                                   partial_world=partial_world)
        return self.student.save(root, iteration, common, partial_world,
                                 getattr(self.args, "keep_last_checkpoints", None))

    def resume(self, root: str) -> dict:
        """Restore the student from a training checkpoint (collective over the student ranks);
        disaggregated teacher ranks only read where the run stands."""
        return load_position(root) if self.student is None else self.student.resume(root)

    def finish(self) -> None:
        """Wait for the payload transfers still in flight (disaggregated), e.g. before exit."""
        if self.streams:
            for lane in self.lanes:
                lane.transport.finish()

    def close(self) -> None:
        """Release the transport's shared buffers (shared memory, CUDA IPC); idempotent. Also
        on errors: a rank that stops early leaves no segment or mapping behind."""
        for lane in self.lanes:
            if lane.transport is not None:
                lane.transport.close()
        if self.watch is not None:
            self.watch.close()
            self.watch = None
