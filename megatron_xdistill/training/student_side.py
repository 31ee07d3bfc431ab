"""The student on this rank: its model shard under Megatron's DDP and optimizer, one training
step given the teacher payloads, evaluation, and its training checkpoints.

Losses are normalised by global counts (valid chunks and label tokens over the whole global
batch), so every layout computes the same loss and gradients.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer

from megatron_xdistill import models as models_api
from megatron_xdistill.data.dataset import collate_samples, teacher_view
from megatron_xdistill.loss import KDTerms, combined_loss
from megatron_xdistill.models.megatron_lm import megatron_lm_args
from megatron_xdistill.parallel.layout import ModelParallelGroups
from megatron_xdistill.parallel.sample_owners import student_samples
from megatron_xdistill.parallel.teacher_batches import TeacherBatching
from megatron_xdistill.teachers.combination import Combination, choose_teachers
from megatron_xdistill.training.checkpointing import load_checkpoint, save_checkpoint
from megatron_xdistill.training.clocks import LossClock, PhaseTimes, device_now
from megatron_xdistill.training.kd_adapter import KDObjective
from megatron_xdistill.training.pipeline import run_schedule
from megatron_xdistill.training.side_config import StudentSideConfig


@dataclass
class Microbatch:
    """One student micro-batch: the collated samples and, on the last stage of a run that
    distils, each teacher's payload rows [b, numel_k] (and, when teachers are selected per
    sample, the chosen teacher of each sample)."""

    batch: dict
    payloads: list[torch.Tensor] | None = None
    choice: torch.Tensor | None = None

    def taught_by(self, k: int) -> torch.Tensor | None:
        """bool [b]: the samples teacher k teaches (None: all of them)."""
        return None if self.choice is None else self.choice == k


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
    teachers: list[dict] | None = None  # several teachers: each one's kd, top1, chunks, fill
    #: An MoE student's load-balancing loss (per MoE layer, mean over micro-batches and DP, as
    #: Megatron-LM logs it; its gradient is in the step's); None for a dense student.
    load_balancing_loss: float | None = None


class StudentSide:
    """Student model shard of this rank: DDP, Megatron optimizer, LR schedule, step, evaluation."""

    def __init__(self, config: StudentSideConfig, info: models_api.ModelInfo,
                 groups: ModelParallelGroups, *, device: torch.device, init_weights: bool,
                 times: PhaseTimes, world=None) -> None:
        """``init_weights``: load ``config.load`` now (else a training checkpoint is restored
        by :meth:`resume`). ``world``: the student ranks' group (None: the whole world)."""
        self.side_config, self.info, self.groups, self.device = config, info, groups, device
        self.world = world
        self.times = times
        self.loss_clock = LossClock(times)
        self.mbs = config.micro_batch_size
        self.num_microbatches = config.global_batch_size // (self.mbs * groups.layout.dp)
        model, self.config = models_api.build_model_for_layout(
            info, groups, config.optimizer.params_dtype, seed=config.seed,
            **config.model_options)
        if init_weights:
            models_api.load_megatron_checkpoint(model, config.load, groups.pg_collection,
                                                process_group=world)
        self.config.finalize_model_grads_func = finalize_model_grads
        self.model = DistributedDataParallel(self.config, config.ddp, model,
                                             pg_collection=groups.pg_collection)
        if config.ddp.overlap_grad_reduce:  # the schedule holds the reduce until the last one
            self.config.no_sync_func = self.model.no_sync
            self.config.grad_sync_func = self.model.start_grad_sync
        if config.ddp.overlap_param_gather:  # the next forward waits for each bucket's gather
            self.config.param_sync_func = self.model.start_param_sync
        self.optimizer = get_megatron_optimizer(
            config.optimizer, [self.model],
            use_gloo_process_groups=False,  # with a pg_collection Megatron needs this off
            pg_collection=groups.pg_collection,
        )
        self.scheduler = config.schedule.build(self.optimizer)
        # --fp16: Megatron's schedule multiplies each loss by the optimizer's loss scale before
        # its backward (the optimizer unscales, and skips a step whose gradients overflowed).
        self.config.grad_scale_func = self.optimizer.scale_loss if config.optimizer.fp16 else None

    # ------------------------------------------------------------------ the step
    def positions(self) -> list[int]:
        """Positions in the global batch of the samples this replica trains on, in micro-batch
        order."""
        return student_samples(self.side_config.global_batch_size, self.mbs, self.groups.layout.dp,
                               self.groups.coords["dp"])

    def microbatches(self, samples: dict[int, dict],
                     payloads: list[dict[int, torch.Tensor]] | None,
                     kds: list[KDObjective], combination: Combination) -> list[Microbatch]:
        """This replica's micro-batches, each collated once; ``payloads``: per teacher, its rows
        by sample position (None: CE alone, or a stage before the last)."""
        mine = self.positions()
        out = []
        for start in range(0, len(mine), self.mbs):
            ids = mine[start : start + self.mbs]
            rows = choice = None
            if payloads is not None:
                rows = [torch.stack([p[i] for i in ids]).float() for p in payloads]
                if combination.selects:
                    choice = choose_teachers([r[:, -1] for r in rows])
            out.append(Microbatch(collate_samples([samples[i] for i in ids]), rows, choice))
        return out

    def _global_counts(self, samples: dict[int, dict], micro: list[Microbatch],
                       kds: list[KDObjective], combination: Combination,
                       batchings: Sequence[TeacherBatching]) -> torch.Tensor:
        """Over the whole global batch (over DP), float64: label tokens, then per teacher its
        counted chunks (of the samples it teaches), the positions its forward needs and the
        positions it runs (the teacher's fill: the share that is not padding; ``batchings``:
        how each teacher runs the batch) and the samples it teaches."""
        mine = self.positions()
        values = [float(sum(m.batch["loss_mask"].sum() for m in micro))]
        for k, kd in enumerate(kds):
            values += [float(sum(kd.count_chunks(teacher_view(m.batch, k), m.taught_by(k))
                                 for m in micro)),
                       float(sum(len(m.batch["tokens"]) if m.choice is None
                                 else int((m.choice == k).sum()) for m in micro))]
        # Each teacher's sample lengths by position in the batch: the teacher's micro-batches
        # mix samples of several student replicas.
        lengths = torch.zeros(len(kds), self.side_config.global_batch_size, dtype=torch.float64)
        for k in range(len(kds)):
            lengths[k, mine] = torch.tensor(
                [float(samples[i]["teachers"][k]["teacher_length"]) for i in mine],
                dtype=torch.float64)
        counts = torch.cat([torch.tensor(values, dtype=torch.float64), lengths.flatten()])
        counts = counts.to(self.device)
        dist.all_reduce(counts, group=self.groups.pg_collection.dp)
        counts = counts.cpu()
        lengths = counts[len(values):].view(len(kds), -1).long().tolist()
        out = [counts[0].item()]
        for k, batching in enumerate(batchings):
            chunks, taught = counts[1 + 2 * k : 3 + 2 * k].tolist()
            out += [chunks, float(batching.positions_predicting(lengths[k])),
                    float(batching.positions_run(lengths[k])), taught]
        return torch.tensor(out, dtype=torch.float64)

    def _loss(self, kds: list[KDObjective], combination: Combination, denominators: list[float],
              n_tokens: float, micro: Microbatch, logits: torch.Tensor):
        """This rank's share of the global-batch loss (normalised by global counts)."""
        layout, clock, cfg = self.groups.layout, self.loss_clock, self.side_config
        t0 = device_now(self.device)
        logits = clock.enter(logits)
        if micro.payloads is None:  # CE alone
            terms = [kds[0].student_terms(logits, teacher_view(micro.batch, 0),
                                          grad_into_logits=True)]
            weights, denominators = [0.0], [None]
        else:
            weights = list(combination.weights)
            terms = self._teachers_terms(kds, micro, logits,
                                         self._loss_weights(weights, denominators, n_tokens))
        loss, _ = combined_loss(terms, kd_weights=weights, ce_weight=cfg.ce_weight,
                                dynamic_scaling=cfg.kd_dynamic_scaling,
                                kd_denominators=denominators, ce_denominator=n_tokens,
                                dp_cp_group=self.groups.pg_collection.dp_cp,
                                shared_denominator=combination.selects)
        # The schedule divides by num_microbatches; DDP averages gradients over DP x CP.
        scaled = clock.leave(loss * (self.num_microbatches * layout.dp * layout.cp))
        report = [sum(t.ce_sum.detach().double() for t in terms) / max(n_tokens, 1.0)]
        for t, n in zip(terms, denominators, strict=True):
            report += [t.kd_sum.detach().double() / max(n or 0.0, 1.0), t.top1.double()]
        self.times.loss += device_now(self.device) - t0
        return scaled, torch.tensor(1, dtype=torch.int), {"report": torch.stack(report)}

    def _loss_weights(self, weights: list[float], denominators: list[float | None],
                      n_tokens: float) -> list[tuple[float, float]] | None:
        """Per teacher, the weights :func:`combined_loss` puts on its KD sum and on the CE sum
        (teacher 0's call takes the CE; the others' CE weight is 0), known before the loss
        calls (global-batch denominators, no dynamic scaling): a call given them writes its
        gradient in the forward and its backward recomputes nothing. None with dynamic
        scaling (the weights come from the microbatch's sums) or a denominator not known."""
        if self.side_config.kd_dynamic_scaling or any(d is None for d in denominators):
            return None
        ce = self.side_config.ce_weight / max(float(n_tokens), 1.0)
        return [(w / max(float(d), 1.0), ce if k == 0 else 0.0)
                for k, (w, d) in enumerate(zip(weights, denominators, strict=True))]

    def _teachers_terms(self, kds: list[KDObjective], micro: Microbatch, logits: torch.Tensor,
                        ahead: list[tuple[float, float]] | None) -> list[KDTerms]:
        """Every teacher's KD sums of a micro-batch, in teacher order. Teacher 0's call (it
        takes the CE) writes the logits' gradient over them, so it must be their last reader:
        made last, forward-written (``ahead``), where every call surely writes its gradient in
        the forward and so reads no logits in its backward (the exact / image / gold forms,
        one CP rank: no call recomputes anything); otherwise made first with the recomputing
        backward, which autograd runs after every later-made call's (nodes run in reverse order
        of creation; were it ever earlier, their backward would raise on the logits' bumped
        version, not read a gradient). Teachers 1.. write their gradients into buffers of
        their own: in the forward where ``ahead`` is known and their kernel can (each buffer,
        [micro-batch, V_local], then lives from its forward to the backward: with two or
        three teachers no higher a peak than the recomputing backwards' two)."""
        if ahead is None:
            ahead = [None] * len(kds)
        zero_last = len(kds) > 1 and ahead[0] is not None and all(
            kd.writes_gradient_in_forward() for kd in kds)
        order = [*range(1, len(kds)), 0] if zero_last else list(range(len(kds)))
        made = {}
        for k in order:
            weights = ahead[k] if (k > 0 or zero_last or len(kds) == 1) else None
            made[k] = self._teacher_terms(kds[k], k, micro, logits, over_logits=k == 0,
                                          loss_weights=weights)
        return [made[k] for k in range(len(kds))]

    @staticmethod
    def _teacher_terms(kd: KDObjective, k: int, micro: Microbatch, logits: torch.Tensor,
                       over_logits: bool = False, loss_weights: tuple[float, float] | None = None):
        """Teacher k's KD sums of a micro-batch (teacher 0's call also takes the CE); under
        selection only over the samples it teaches, and no work when it teaches none.
        ``loss_weights``: this teacher's of :meth:`_loss_weights`."""
        view = teacher_view(micro.batch, k)
        taught = micro.taught_by(k)
        if taught is not None:
            if not bool(taught.any()) and k > 0:
                zero = logits.new_zeros((), dtype=torch.float32)
                return KDTerms(zero, zero.detach(), zero.detach(), zero, zero.detach())
            view = dict(view, chunk_valid=view["chunk_valid"] & taught[:, None])
        return kd.student_terms(logits, view, micro.payloads[k], with_ce=k == 0,
                                grad_into_logits=over_logits, loss_weights=loss_weights)

    def train_step(self, samples: dict[int, dict], payloads: list[dict[int, torch.Tensor]] | None,
                   kds: list[KDObjective], combination: Combination,
                   batchings: Sequence[TeacherBatching],
                   teacher_seconds: float = 0.0) -> StepReport:
        """Forward/backward over this replica's micro-batches and the optimizer step.
        ``payloads``: per teacher, its rows by sample position (None: CE alone);
        ``batchings``: how each teacher runs a global batch (for its fill)."""
        t0 = device_now(self.device)
        groups = self.groups
        micro = self.microbatches(samples, payloads if groups.is_last_stage else None, kds,
                                  combination)
        counts = self._global_counts(samples, micro, kds, combination, batchings)
        n_tokens = counts[0].item()
        per_teacher = counts[1:].view(len(kds), 4)
        chunks = per_teacher[:, 0].tolist()
        # Selection: the chosen teachers' chunks share one denominator.
        denominators = [sum(chunks)] * len(kds) if combination.selects else chunks
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

        def loss_func(m: Microbatch, logits: torch.Tensor):
            return self._loss(kds, combination, denominators, n_tokens, m, logits)

        reduced = run_schedule(self.model, self.config, groups, micro,
                               tokens=lambda m: m.batch["tokens"], loss_func=loss_func,
                               seq_length=self.side_config.seq_length, micro_batch_size=self.mbs,
                               device=self.device, forward_only=False)
        balance = self._load_balancing_loss()
        t1 = device_now(self.device)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step uses
        ok, grad_norm, _ = self.optimizer.step()
        if ok:  # as Megatron-LM: a skipped step (fp16 overflow) does not advance the schedule
            self.scheduler.step(increment=self.side_config.schedule.step_size)
        t2 = device_now(self.device)
        self.times.student += t1 - t0
        self.times.optimizer += t2 - t1
        n_kd = len(kds) if payloads is not None else 1
        width = 1 + 2 * n_kd
        report = torch.zeros(width + 1 + 2 * len(kds), dtype=torch.float64, device=self.device)
        if groups.is_last_stage and groups.coords["tp"] == 0:
            report[:width] = torch.stack([r["report"] for r in reduced]).double().sum(0)
            if groups.coords["cp"] == 0 and groups.coords["dp"] == 0:
                report[width] = teacher_seconds  # as told by the teacher serving replica 0
                # Global counts as the last stage has them (only it sees the choices).
                report[width + 1:] = per_teacher[:, [0, 3]].reshape(-1).to(report)
        # Sums over DP x CP shares (and the last stage only), over the student ranks.
        dist.all_reduce(report, group=self.world)
        step = self._report(report.cpu(), width, per_teacher, combination, n_tokens,
                            distils=payloads is not None, lr=lr, ok=ok, grad_norm=grad_norm)
        return dataclasses.replace(step, load_balancing_loss=balance)

    def _load_balancing_loss(self) -> float | None:
        """The MoE routers' load-balancing loss of the step just run, from Megatron-Core's MoE
        metrics tracker as Megatron-LM's training log reads it (scaled by 1 / micro-batches,
        averaged over MoE layers and DP; collective over the student's ranks); None for a
        dense student or a zero coefficient. The loss itself entered the gradients through the
        routers' ``MoEAuxLossAutoScaler`` during the backward, as in Megatron-LM."""
        if not self.info.num_moe_experts or not self.config.moe_aux_loss_coeff:
            return None
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        totals: dict = {}
        get_moe_metrics_tracker().report(
            loss_scale=1.0 / self.num_microbatches, iteration=0,
            track_names=["load_balancing_loss"], num_layers=self.config.num_layers,
            moe_layer_freq=self.config.moe_layer_freq, force_initialize=True,
            total_loss_dict=totals, pg_collection=self.groups.pg_collection)
        return float(totals["load_balancing_loss"])

    @staticmethod
    def _report(report: torch.Tensor, width: int, per_teacher: torch.Tensor,
                combination: Combination, n_tokens: float, *, distils: bool, lr: float,
                ok: bool, grad_norm) -> StepReport:
        """The step's numbers from the reduced report: CE, then per teacher (KD share, top-1
        count), the teacher's seconds, then per teacher (counted chunks, samples taught)."""
        nan = float("nan")
        counts = report[width + 1:].view(-1, 2)
        pooled = float(counts[:, 0].sum())
        teachers = []
        for k, name in enumerate(combination.names):
            chunks = float(counts[k, 0])
            denominator = pooled if combination.selects else chunks
            teachers.append({
                "name": name, "kd": float(report[1 + 2 * k]) if distils else nan,
                "top1_agree": float(report[2 + 2 * k]) / max(denominator, 1.0) if distils else nan,
                "chunks": chunks, "samples": float(counts[k, 1]),
                "teacher_fill": float(per_teacher[k, 1]) / max(float(per_teacher[k, 2]), 1.0)})
        first = teachers[0]
        several = len(teachers) > 1
        kd = sum(w * t["kd"] for w, t in zip(combination.weights, teachers)) if several else \
            first["kd"]
        return StepReport(
            kd=kd, ce=float(report[0]), top1_agree=nan if several else first["top1_agree"],
            grad_norm=float(grad_norm) if grad_norm is not None else nan, lr=lr,
            skipped=not ok, chunks=pooled, tokens=n_tokens, teacher_fill=first["teacher_fill"],
            teacher_seconds=float(report[width]), teachers=teachers if several else None)

    # ------------------------------------------------------------------ evaluation
    @contextlib.contextmanager
    def whole_parameters(self):
        """With --overlap-param-gather the updated parameters arrive bucket by bucket during the
        next training forward: gather them all now (evaluation, checkpoints), as Megatron-LM
        does, and restore the overlap afterwards."""
        if not self.side_config.ddp.overlap_param_gather:
            yield
            return
        self.model.disable_forward_pre_hook()
        try:
            yield
        finally:
            self.model.enable_forward_pre_hook()

    def evaluate(self, batches: list[dict], kd: KDObjective) -> dict[str, float]:
        """CE and bits per byte on held-out batches (forward only; collective over the student
        ranks); nothing without held-out data."""
        if batches is None:
            return {}
        groups = self.groups
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)  # nats, tokens, bytes

        def ce_sums(batch: dict, logits: torch.Tensor):
            terms = kd.student_terms(logits, teacher_view(batch, 0))
            return terms.ce_sum, torch.tensor(1, dtype=torch.int), {
                "sum": torch.stack([terms.ce_sum.detach().double(), terms.ce_count.double()])}

        with self.whole_parameters():
            self.model.eval()
            for batch in batches:
                reduced = run_schedule(self.model, self.config, groups, [batch],
                                       tokens=lambda b: b["tokens"], loss_func=ce_sums,
                                       seq_length=self.side_config.seq_length,
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

    def evaluate_tasks(self, tasks: list[str], limit: int | None, tokenizer) -> dict[str, float]:
        """lm-eval task scores of the student in its training layout (every student rank runs
        the harness in lockstep; :mod:`megatron_xdistill.evaluation.lm_eval_backend`)."""
        from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
        from megatron_xdistill.evaluation.lm_eval_tasks import evaluate_tasks
        from megatron_xdistill.evaluation.parallel_model import ParallelModel

        model = ParallelModel(self.model, self.groups, self.info.vocab_size,
                              self.info.max_position_embeddings, self.device)
        lm = XDistillLM(model=model, tokenizer=tokenizer, batch_size=max(self.mbs, 1))
        with self.whole_parameters():
            return evaluate_tasks(lm, tasks, limit)

    # ------------------------------------------------------------------ checkpoints
    def save(self, root: str, iteration: int, common: dict, partial_world: bool,
             keep_last: int | None = None) -> str:
        """The training checkpoint (collective over the world, see ``save_checkpoint``); rank 0
        also keeps the model description and HF files at the run root (resume and export need
        no flags) and, with ``keep_last``, only that many newest checkpoints."""
        if dist.get_rank() == 0:
            models_api.save_model_info(self.info, root)
            models_api.keep_hf_files(root, self.side_config.load, self.side_config.tokenizer_model)
        layout = self.groups.layout
        megatron_args = megatron_lm_args(
            self.info, tp=layout.tp, pp=layout.pp, cp=layout.cp,
            seq_length=self.side_config.seq_length,
            bf16=self.side_config.optimizer.bf16, fp16=self.side_config.optimizer.fp16,
            iteration=iteration,
            consumed_samples=int(common.get("consumed_samples", 0)))
        with self.whole_parameters():
            return save_checkpoint(root, iteration, self.model.module, self.optimizer,
                                   self.scheduler, self.groups.pg_collection.dp_cp, common,
                                   partial_world=partial_world, megatron_args=megatron_args,
                                   keep_last=keep_last)

    def resume(self, root: str) -> dict:
        """Model, optimizer, scheduler and RNG from a training checkpoint (collective over the
        student ranks; ``--no-load-optim`` / ``--no-load-rng`` keep this run's own); returns
        where the run stands."""
        keep_optim = not self.side_config.load_optim
        return load_checkpoint(root, self.model.module,
                               None if keep_optim else self.optimizer,
                               None if keep_optim else self.scheduler,
                               self.groups.pg_collection.dp_cp, process_group=self.world,
                               load_rng=self.side_config.load_rng)
