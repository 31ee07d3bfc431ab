"""``pretrain_xdistill.py``'s main: set up, train with logging, evaluation and checkpoints."""

from __future__ import annotations

import datetime
import os
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from megatron_xdistill.mcore import compat as mcore_compat
from megatron_xdistill.parallel.group_scope import run_process_groups
from megatron_xdistill.training.run_data import (
    document_share,
    load_tokenizers,
    packing_plan,
    plan_size,
    read_corpus,
    teacher_lengths,
)
from megatron_xdistill.training.run_data import log as _log


def init_distributed(timeout_minutes: float, backend: str | None = None) -> bool:
    """torch.distributed from torchrun's environment (a single process works without torchrun);
    ``backend``: ``--distributed-backend`` (default: nccl with CUDA, gloo without).

    Returns whether it created the process group (an existing one, e.g. a launcher's, is used).
    """
    if dist.is_initialized():
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = backend or mcore_compat.default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the process exit code. Arguments are parsed and checked first
    (``--help`` and every argument error come before torch.distributed or Megatron start)."""
    from megatron_xdistill.training.arguments.checks import parse_args
    from megatron_xdistill.training.run_log import quiet_known_warnings

    started = time.monotonic()
    quiet_known_warnings()  # before Megatron-Core's import-time warnings
    world = dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse_args(list(argv) if argv is not None else sys.argv[1:], world)
    except ValueError as exc:  # ours; argparse's own errors have exited already
        from megatron_xdistill.training.user_errors import InputError, report

        return report(InputError(str(exc)))
    from megatron_xdistill.training.preflight import check_model_shapes, run_preflight
    from megatron_xdistill.training.user_errors import InputError, report

    try:
        found = check_model_shapes(args)  # before Megatron-Core is imported: in a moment
        mcore_compat.install()
        run_preflight(args, found)
    except InputError as exc:
        return report(exc)
    if args.dry_run:
        _print_dry_run(found, time.monotonic() - started)
        return 0
    created = init_distributed(args.distributed_timeout_minutes, args.distributed_backend)
    try:
        with run_process_groups():  # the run's layouts and transports end with it
            from megatron_xdistill.training.run_log import arguments_block

            _log(arguments_block(args))
            for line in found.notes:
                _log(line)
            return _train(args, started)
    except InputError as exc:  # found while reading the inputs (rank 0's corpus, packing)
        return report(exc, dist.get_rank())
    finally:
        if created:
            dist.destroy_process_group()


def _print_dry_run(found, seconds: float) -> None:
    """``--dry-run``: what was checked, on rank 0."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    print("> dry run: every input checked, nothing built or trained", flush=True)
    for line in found.notes:
        print(line, flush=True)
    for what, spent in found.checked:
        print(f"  ok  {what} ({spent:.1f} s)", flush=True)
    print(f"> dry run passed in {seconds:.1f} s", flush=True)


def checkpoint_common(args, iteration: int) -> dict:
    """What a checkpoint's common state keeps of the run (every rank has the same): the data
    position and the learning-rate schedule the run follows (a resumed run checks its own
    against it)."""
    from megatron_xdistill.training.resume_schedule import SCHEDULE_KEY

    return {"consumed_samples": iteration * args.global_batch_size,
            SCHEDULE_KEY: args.lr_schedule.to_dict()}


def _train(args, started: float) -> int:
    from megatron_xdistill.training.distiller import Distiller
    from megatron_xdistill.training.teacher_cache_run import open_teacher_cache
    from megatron_xdistill.training.user_errors import reading_inputs

    torch.manual_seed(args.seed)
    # Every rank computes the same here (rank 0's read of the corpus reaches all of them): an
    # error is reported by rank 0 alone.
    with reading_inputs():  # the tokenizers, rank 0's read of the corpus, the caches' keys
        tokenizers = load_tokenizers(args)  # loaded by the preflight already: kept per process
        loaded, train_numbering, valid_numbering = read_corpus(args, tokenizers)
        resume_from = args.resume_from  # preflight.check_resume
        num_samples = plan_size(args)
        caches = [None if spec.cache is None else open_teacher_cache(
            spec.view(args), tokenizers, _log, k, num_samples)[0]
            for k, spec in enumerate(args.teachers)]
    distiller = Distiller(args, init_weights=resume_from is None, log=_log, caches=caches,
                          teacher_only=args.teacher_cache_only,
                          same_tokenizer=tokenizers.same_tokenizer)
    iteration = 0
    if resume_from is not None:
        iteration = distiller.resume(resume_from)["iteration"]
        _log(f"> resumed from {resume_from} at iteration {iteration}")

    with reading_inputs(shared=False):  # the prompts; the packing; this rank's documents
        if args.on_policy:
            steps = _rollout_steps(args, tokenizers, distiller, iteration)
        else:
            steps = _training_batches(args, tokenizers, distiller, caches, train_numbering,
                                      loaded, num_samples, iteration)
    if args.teacher_cache_only:  # the teacher-only pass fills the caches instead: its exit code
        from megatron_xdistill.training.teacher_cache_run import fill_teacher_cache

        return fill_teacher_cache(args, distiller, caches, steps, _log)
    eval_batches = _evaluation_batches(args, tokenizers, distiller, valid_numbering, loaded)
    loaded.clear()  # rank 0's whole corpus: planned, no longer needed
    return _loop(args, distiller, steps, eval_batches, caches, iteration, started,
                 tokenizers.student_tokenizer)


def _rollout_steps(args, tokenizers, distiller, iteration: int):
    """On-policy runs: the prompts, and each step's samples rolled out by the student."""
    from megatron_xdistill.data.loader import StepSampler
    from megatron_xdistill.onpolicy.arguments import RolloutConfig
    from megatron_xdistill.onpolicy.prompts import PromptFields, check_answers, read_prompts
    from megatron_xdistill.onpolicy.rollout import RolloutSteps
    from megatron_xdistill.onpolicy.samples import SampleBuilder

    fields = PromptFields(prompt=args.prompt_field, messages=args.messages_field,
                          answer=args.answer_field, tests=args.tests_field)
    records = read_prompts(args.data_path[0], fields)
    if args.gkd_lambda < 1.0:
        check_answers(records, f"--gkd-lambda {args.gkd_lambda} (its off-policy steps)")
    _log(f"> on-policy: {len(records)} prompts from {args.data_path[0]}; lambda "
         f"{args.gkd_lambda}, up to {args.max_new_tokens} new tokens, temperature "
         f"{args.sampling_temperature}, top-p {args.sampling_top_p}, top-k {args.sampling_top_k}")
    builder = SampleBuilder(tokenizers, records, args.seq_length, teacher_lengths(args),
                            chat_template=not args.no_chat_template)
    # A disaggregated teacher rank generates nothing: it receives the replicas' rollouts in the
    # step's exchange and builds the samples of the positions its teacher serves.
    s_dp = distiller.student_groups.coords["dp"] if distiller.has_student else None
    served = [(lane.groups.coords["dp"] if lane.side.runs else None, lane.layout)
              for lane in distiller.lanes]
    positions = StepSampler(args.global_batch_size, iteration, args.global_batch_size,
                            args.micro_batch_size, s_dp, distiller.student_layout,
                            more_teachers=served).local
    student = distiller.student if distiller.has_student else None
    return RolloutSteps(RolloutConfig.from_args(args), records, builder, student, positions,
                        iteration, _log)


def _training_batches(args, tokenizers, distiller, caches, train_numbering, loaded,
                      num_samples: int, iteration: int):
    """Off-policy runs: the packed training data, each step's samples from a DataLoader (a
    --teacher-cache-only pass: the dataset of every sample)."""
    from megatron_xdistill.data.dataset import DistillationDataset
    from megatron_xdistill.data.document_share import step_samples
    from megatron_xdistill.data.loader import StepBatches, StepSampler

    rank = dist.get_rank()
    plan = packing_plan(args, train_numbering, tokenizers, num_samples, "train",
                        loaded.get("train"))
    for lane in distiller.lanes:  # rank 0 starts a new cache's manifest; writer / reader
        if lane.cache is not None:
            lane.cache.attach(
                lane.side.info.to_dict(), num_samples, lane.kd.payload_numel, rank,
                writer=lane.side.writes_payloads,
                reader=distiller.has_student and distiller.student_groups.is_last_stage,
                barrier=dist.barrier, shard_bytes=args.teacher_cache_shard_mib << 20,
                commit_seconds=args.teacher_cache_commit_seconds)
    # A disaggregated rank loads only the samples of the model it serves.
    s_dp = distiller.student_groups.coords["dp"] if distiller.has_student else None
    served = [(lane.groups.coords["dp"] if lane.side.runs else None, lane.layout)
              for lane in distiller.lanes]
    sampler = StepSampler(len(plan), iteration, args.global_batch_size, args.micro_batch_size,
                          s_dp, distiller.student_layout, more_teachers=served)
    if args.teacher_cache_only:  # the teacher-only pass reads every sample
        samples = np.arange(len(plan))
    else:
        samples = step_samples(sampler.local, iteration, args.train_iters,
                               args.global_batch_size, len(plan))
    documents = document_share(args, train_numbering, plan, samples, loaded.get("train"))
    dataset = DistillationDataset(documents, plan, tokenizers, args.seq_length,
                                  teacher_lengths(args))
    if args.teacher_cache_only:
        return dataset
    return StepBatches(dataset, sampler, args.num_workers)


def _evaluation_batches(args, tokenizers, distiller, valid_numbering, loaded):
    """The held-out micro-batches of this rank's student replica (None without held-out
    data, and on ranks without a student)."""
    from megatron_xdistill.data.dataset import DistillationDataset, collate_samples
    from megatron_xdistill.parallel.sample_owners import student_samples

    eval_batches = None
    s_dp = distiller.student_groups.coords["dp"] if distiller.has_student else None
    if valid_numbering is not None:
        n_eval = args.eval_iters * args.global_batch_size  # Megatron-LM: global batches
        v_plan = packing_plan(args, valid_numbering, tokenizers, n_eval, "valid",
                              loaded.get("valid"))
        mine = []
        if distiller.has_student:  # evaluation runs on the student ranks only
            mine = student_samples(min(n_eval, len(v_plan)), args.micro_batch_size,
                                   distiller.student_layout.dp, s_dp)
        v_share = document_share(args, valid_numbering, v_plan, mine, loaded.get("valid"))
        v_set = DistillationDataset(v_share, v_plan, tokenizers, args.seq_length,
                                    teacher_lengths(args))
        mbs = args.micro_batch_size
        eval_batches = [collate_samples([v_set[i] for i in mine[k : k + mbs]])
                        for k in range(0, len(mine), mbs)] if distiller.has_student else None
    return eval_batches


def _loop(args, distiller, steps, eval_batches, caches, iteration: int, started: float,
          student_tokenizer=None) -> int:
    """The training loop: steps, logging, evaluation, checkpoints, stopping. Evaluation (the
    held-out text, the --eval-tasks) comes at iteration 0 of a fresh run, every
    --eval-interval iterations and at the last one; a resumed run starts after its
    checkpoint's iteration, whose evaluation came before the checkpoint was saved."""
    from megatron_xdistill.training.metrics import MetricsWriter
    from megatron_xdistill.training.preemption import StopRequest
    from megatron_xdistill.training.run_log import IterationLog, validation_line

    rank = dist.get_rank()
    wandb = None if args.wandb_project is None else {
        "project": args.wandb_project, "name": args.wandb_exp_name, "dir": args.wandb_save_dir,
        "entity": args.wandb_entity, "config": {
            **{k: v for k, v in vars(args).items()
               if isinstance(v, (int, float, str, bool)) or (
                   isinstance(v, list) and all(isinstance(x, (int, float, str)) for x in v))},
            "teachers": [dict(vars(spec)) for spec in args.teachers]}}
    writer = MetricsWriter(args.metrics_file, args.tensorboard_dir, enabled=rank == 0,
                           wandb=wandb)
    student = distiller.student
    lines = IterationLog(args, iteration, dist.get_world_size(),
                         student.info if student is not None else None,
                         [lane.side.info for lane in distiller.lanes])

    evaluates = eval_batches is not None or bool(args.eval_tasks)

    def evaluate() -> None:
        record = {"iteration": iteration, **distiller.evaluate(eval_batches)}
        if args.eval_tasks:
            record.update(distiller.evaluate_tasks(args.eval_tasks, args.eval_limit,
                                                   student_tokenizer))
        writer.write(record, line=validation_line(record))

    if evaluates and iteration == 0:
        evaluate()
    last = time.perf_counter()
    tokens_since, steps_since = 0, 0
    end = args.train_iters  # where this run stops
    if args.exit_interval:
        end = min(end, (iteration // args.exit_interval + 1) * args.exit_interval)
    stopper = StopRequest(args.exit_signal_handler, args.exit_duration_in_mins, started, _log)
    try:
        while iteration < args.train_iters:
            stop = stopper.agreed()  # every rank stops after the same step (the teacher's too)
            samples = next(steps)
            metrics = distiller.train_step(samples,
                                           next_step=iteration + 1 < end and stop is None,
                                           source_metrics=getattr(steps, "metrics", None))
            iteration += 1
            steps_since += 1
            tokens_since += metrics.get("tokens", 0)  # disaggregated teacher ranks: no metrics
            if iteration % args.log_interval == 0 or iteration == args.train_iters:
                now = time.perf_counter()
                record = {"iteration": iteration, "train_iters": args.train_iters, **metrics,
                          "elapsed_ms_per_iteration": round(1e3 * (now - last) / steps_since, 1),
                          "tokens_per_s": round(tokens_since / (now - last), 1),
                          "consumed_samples": iteration * args.global_batch_size,
                          **distiller.times.reset(), **distiller.teacher_times()}
                record["payload_bytes_per_token"] = round(distiller.payload_bytes_per_token, 1)
                if args.fp16 and student is not None:  # after the step, as Megatron-LM logs it
                    record["loss_scale"] = float(student.optimizer.get_loss_scale())
                record.update(lines.figures(record, iteration))
                writer.write(record, line=lines.line(record))
                last, tokens_since, steps_since = now, 0, 0
            if evaluates and (iteration == args.train_iters or (
                    args.eval_interval and iteration % args.eval_interval == 0)):
                evaluate()
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                path = distiller.save(args.save, iteration, checkpoint_common(args, iteration))
                _log(f"> saved checkpoint {path}")
            if args.exit_interval and iteration % args.exit_interval == 0:
                _log(f"> exiting at iteration {iteration} (--exit-interval)")
                break
            if stop is not None:
                _log(f"> {stop}: exiting at iteration {iteration}"
                     + ("" if args.save else " (no --save: nothing is saved)"))
                break
        distiller.finish()
        for cache in caches:
            if cache is not None:
                cache.close(rank, dist.barrier, log=_log)
    finally:
        stopper.close()
        writer.close()
        distiller.close()
    if args.save and (not args.save_interval or iteration % args.save_interval):
        path = distiller.save(args.save, iteration, checkpoint_common(args, iteration))
        _log(f"> saved checkpoint {path}")
    if not args.save:
        _log(f"> no --save: the model trained to iteration {iteration} is not kept")
    return 0
