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

from megatron_xdistill import mcore_compat
from megatron_xdistill.parallel.group_scope import run_process_groups


def init_distributed(timeout_minutes: float) -> bool:
    """torch.distributed from torchrun's environment (a single process works without torchrun).

    Returns whether it created the process group (an existing one, e.g. a launcher's, is used).
    """
    if dist.is_initialized():
        return False
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    backend = mcore_compat.default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend=backend,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return True


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(message, flush=True)


def _tokenizers(args):
    """The student's and every teacher's tokenizer (each directory loaded once)."""
    from megatron_xdistill.align import load_tokenizer
    from megatron_xdistill.data.tokenizations import SampleTokenizers

    loaded: dict[str, object] = {}

    def get(path: str):
        if path not in loaded:
            loaded[path] = load_tokenizer(path)
        return loaded[path]

    return SampleTokenizers(get(args.tokenizer_model),
                            [get(spec.tokenizer_model) for spec in args.teachers])


def _check_vocabularies(args, tokenizers) -> None:
    """Each checkpoint against its tokenizer, before anything is built."""
    from megatron_xdistill import models as models_api

    sides = [("student", args.load, tokenizers.student_tokenizer, args.tokenizer_model)]
    several = len(args.teachers) > 1
    for spec, tokenizer in zip(args.teachers, tokenizers.teacher_tokenizers, strict=True):
        if spec.load is not None:
            sides.append((f"teacher {spec.name!r}" if several else "teacher", spec.load,
                          tokenizer, spec.tokenizer_model))
    for who, ckpt, tokenizer, tokenizer_path in sides:
        models_api.check_tokenizer_fits(models_api.load_model_info(ckpt), len(tokenizer), ckpt,
                                        tokenizer_path, who)


def _documents(args, paths, what: str):
    """``(sources, documents, documents per source)`` of ``--data-path`` / ``--valid-data-path``."""
    from megatron_xdistill.data.packing import load_documents
    from megatron_xdistill.data.sources import parse_data_path

    sources = parse_data_path(paths, "--data-path" if what == "train" else "--valid-data-path")
    return (sources, *load_documents(sources, args.text_field, _data_tokenizer(args, sources)))


def _data_tokenizer(args, sources) -> str | None:
    """The tokenizer that decodes the Megatron indexed datasets among ``sources`` (None when
    there are none): --data-tokenizer-model, else --tokenizer-model as in Megatron-LM."""
    from megatron_xdistill.data.indexed import is_indexed_prefix

    if not any(is_indexed_prefix(s.path) for s in sources):
        return None
    return args.data_tokenizer_model or args.tokenizer_model


def _derive_teacher_lengths(args, documents, tokenizers) -> list[int]:
    """Each teacher's sequence length: given, the student's for a teacher with the student's
    tokenizer, else derived from the data (rank 0, which holds the documents; :func:`_corpus`
    hands the lengths to the others)."""
    from megatron_xdistill.data.lengths import teacher_length_from_data
    from megatron_xdistill.training.argument_checks import sequence_multiple

    lengths = []
    several = len(args.teachers) > 1
    for k, spec in enumerate(args.teachers):
        aligner = tokenizers.aligners[k]
        if aligner is None:  # the student's tokenizer: the student's tokens, the student's length
            if spec.seq_length not in (None, args.seq_length):
                raise ValueError(
                    f"teacher {spec.name!r} uses the student's tokenizer, so it reads the "
                    f"student's tokens: its seq_length must be --seq-length {args.seq_length} "
                    f"(or unset), got {spec.seq_length}")
            lengths.append(args.seq_length)
        elif spec.seq_length is not None:
            lengths.append(spec.seq_length)
        else:
            view = spec.view(args)
            choice = teacher_length_from_data(documents, aligner, args.seq_length,
                                              multiple=sequence_multiple(view, "teacher"))
            lengths.append(choice.teacher_seq_length)
            _log(f"> {'teacher ' + repr(spec.name) + ': ' if several else ''}"
                 f"{choice.describe()}")
    return lengths


def _set_teacher_lengths(args, lengths: list[int]) -> None:
    """Record each teacher's length in its spec (``--teacher-seq-length``: the first's),
    checked against its layout."""
    from megatron_xdistill.training.argument_checks import check_sequence_length

    args.teachers = [spec.with_seq_length(n) for spec, n in zip(args.teachers, lengths,
                                                                strict=True)]
    args.teacher_seq_length = lengths[0]
    for spec in args.teachers:
        check_sequence_length(spec.view(args), "teacher", spec.seq_length)


def _on_rank0(fn):
    """``fn()`` on rank 0; its result, or the error it raised on bad input, on every rank (the
    others wait in the broadcast instead of each reading the inputs themselves)."""
    import pickle

    box = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - every rank must leave the broadcast
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001 - an error that cannot travel: its text does
                exc = RuntimeError(f"rank 0: {type(exc).__name__}: {exc}")
            box[0] = ("error", exc)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def _corpus(args, tokenizers) -> tuple[dict, object, object]:
    """Rank 0 reads ``--data-path`` (and ``--valid-data-path``) whole, splits it (``--split``)
    and derives the teacher's length; every rank gets the numbering of the planned documents.
    Returns (rank 0's documents for planning, or {} elsewhere; the training numbering; the
    validation numbering or None)."""
    from megatron_xdistill.data.document_share import DocumentNumbering
    from megatron_xdistill.data.sources import parse_data_path
    from megatron_xdistill.data.split import split_loaded, split_ranges

    loaded: dict = {}

    def read() -> dict:
        if args.on_policy:  # --data-path holds prompts (onpolicy.prompts), not documents
            valid = _documents(args, args.valid_data_path, "valid") \
                if args.valid_data_path else None
            loaded["train"], loaded["valid"] = None, valid
            return {"train": None, "valid": None if valid is None else valid[2],
                    "teacher_seq_lengths": _derive_teacher_lengths(args, [], tokenizers)}
        train = _documents(args, args.data_path, "train")
        loaded["train"], loaded["valid"] = train, None
        if args.split is not None:
            loaded["train"], loaded["valid"] = split_loaded(train, args.split)
            _log(f"> --split {args.split}: {len(loaded['train'][1])} training and "
                 f"{len(loaded['valid'][1])} validation documents of --data-path")
        elif args.valid_data_path:
            loaded["valid"] = _documents(args, args.valid_data_path, "valid")
        lengths = _derive_teacher_lengths(args, loaded["train"][1], tokenizers)
        valid = loaded["valid"]
        return {"train": train[2], "valid": None if args.split or valid is None else valid[2],
                "teacher_seq_lengths": lengths}

    meta = _on_rank0(read)
    _set_teacher_lengths(args, meta["teacher_seq_lengths"])
    if args.split is not None:
        sources = parse_data_path(args.data_path)
        parts = [split_ranges(args.split, c) for c in meta["train"]]
        train = DocumentNumbering(sources, [p[0] or (0, 0) for p in parts])
        valid = DocumentNumbering(sources, [p[1] or (0, 0) for p in parts])
        return loaded, train, valid
    train = None if args.on_policy else DocumentNumbering.whole(parse_data_path(args.data_path),
                                                                meta["train"])
    valid = None if meta["valid"] is None else DocumentNumbering.whole(
        parse_data_path(args.valid_data_path, "--valid-data-path"), meta["valid"])
    return loaded, train, valid


def _plan(args, numbering, tokenizers, num_samples: int, what: str, loaded=None):
    """Packing plan of the documents of ``numbering``: rank 0 builds it from ``loaded`` (its
    documents, read whole) or finds it in the cache, and writes it; the others read it."""
    from megatron_xdistill.data.packing import build_plan, load_plan, plan_key, save_plan

    sources = numbering.sources
    key = plan_key(sources, args.text_field, args.tokenizer_model,
                   [spec.tokenizer_model for spec in args.teachers], args.seq_length,
                   _teacher_lengths(args), args.seed, num_samples,
                   _data_tokenizer(args, sources), args.split)
    cache = args.data_cache_path
    path = os.path.join(cache, f"{what}_plan_{key}.npz")
    if dist.get_rank() == 0:
        plan = load_plan(path, key)
        if plan is None:
            _, documents, counts = loaded
            _log(f"> packing {what} data ({len(documents)} documents) into {num_samples} samples")
            plan = build_plan(documents, sources, counts, tokenizers, args.seq_length,
                              _teacher_lengths(args), args.seed, num_samples, key=key,
                              log=_log)
            save_plan(plan, path)
    dist.barrier()
    plan = load_plan(path, key)
    if plan is None:
        raise RuntimeError(f"rank {dist.get_rank()}: packing plan {path} missing after rank 0 wrote it "
                           f"(is {cache} on a shared file system?)")
    return plan


def _plan_size(args) -> int:
    """Samples of the training plan (training wraps around it): --samples-per-epoch, default
    --train-iters x --global-batch-size, or the plan of the teachers' complete caches (which
    must agree with each other and with --samples-per-epoch), which a run reading them trains
    on."""
    from megatron_xdistill.teacher_cache import TeacherCache

    sizes = {}
    for spec in args.teachers:
        if spec.cache is not None:
            cache = TeacherCache(spec.cache)
            if cache.reading:
                sizes[spec.cache] = cache.manifest.num_samples
    if len(set(sizes.values())) > 1:
        raise SystemExit(f"the teachers' complete caches hold plans of different sizes "
                         f"({sizes}): they were not filled for the same run; refill one")
    wanted = args.samples_per_epoch
    if sizes and wanted is not None and wanted not in sizes.values():
        path, held = next(iter(sizes.items()))
        raise SystemExit(f"--samples-per-epoch {wanted} differs from the plan of the complete "
                         f"teacher cache {path} ({held} samples): give --samples-per-epoch "
                         f"{held} (or drop it), or fill a new cache for {wanted} samples")
    if sizes:
        return next(iter(sizes.values()))
    return wanted if wanted is not None else args.train_iters * args.global_batch_size


def _teacher_lengths(args) -> list[int]:
    return [spec.seq_length for spec in args.teachers]


def _share(args, numbering, plan, samples, loaded=None):
    """This rank's documents: those the plan cuts ``samples`` from (see document_share), read
    from their files, or taken from ``loaded`` (rank 0's documents, read whole to plan)."""
    from megatron_xdistill.data.document_share import DocumentShare, documents_of_samples

    ids = documents_of_samples(plan, samples)
    if loaded is not None:
        share = DocumentShare.take(loaded[1], ids)
    else:
        share = DocumentShare.read(numbering, ids, args.text_field,
                                   _data_tokenizer(args, numbering.sources))
    _log(f"> rank 0 holds {len(share)} of {share.total} documents")
    return share


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: returns the process exit code. Arguments are parsed and checked first
    (``--help`` and every argument error come before torch.distributed or Megatron start)."""
    from megatron_xdistill.training.argument_checks import parse_args

    started = time.monotonic()
    world = dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", "1"))
    try:
        args = parse_args(list(argv) if argv is not None else sys.argv[1:], world)
    except ValueError as exc:  # ours; argparse's own errors have exited with usage already
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"pretrain_xdistill.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    mcore_compat.install()
    created = init_distributed(args.distributed_timeout_minutes)
    try:
        with run_process_groups():  # the run's layouts and transports end with it
            return _train(args, started)
    finally:
        if created:
            dist.destroy_process_group()


def _resume_source(args) -> str | None:
    """The training root to resume: --save if it holds a run, else --load if that is a run
    (not with --finetune, which takes only --load's weights, as in Megatron-LM); None: --load is
    a model (converted, or a Megatron-LM 'release') and training starts at iteration 0."""
    from megatron_xdistill.training.checkpointing import (
        is_training_checkpoint,
        written_by_this_trainer,
    )

    candidates = [("--save", args.save)] + ([] if args.finetune else [("--load", args.load)])
    for flag, path in candidates:
        if path and is_training_checkpoint(path):
            if not written_by_this_trainer(path):
                raise SystemExit(
                    f"{flag} {path}: a Megatron-LM training checkpoint, not one of this trainer's "
                    f"runs; pass --finetune to start distilling from its weights at iteration 0 "
                    f"(its optimizer and data position belong to the Megatron-LM run)")
            return path
    return None


def _train(args, started: float) -> int:
    from megatron_xdistill.training.distiller import Distiller
    from megatron_xdistill.training.teacher_cache_run import open_teacher_cache

    torch.manual_seed(args.seed)
    tokenizers = _tokenizers(args)
    _check_vocabularies(args, tokenizers)
    loaded, train_numbering, valid_numbering = _corpus(args, tokenizers)
    resume_from = None if args.teacher_cache_only else _resume_source(args)
    num_samples = _plan_size(args)
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

    if args.on_policy:
        steps = _rollout_steps(args, tokenizers, distiller, iteration)
    else:
        steps = _training_batches(args, tokenizers, distiller, caches, train_numbering, loaded,
                                  num_samples, iteration)
    if isinstance(steps, int):  # the teacher-only cache pass ran instead: its exit code
        return steps
    eval_batches = _evaluation_batches(args, tokenizers, distiller, valid_numbering, loaded)
    loaded.clear()  # rank 0's whole corpus: planned, no longer needed
    return _loop(args, distiller, steps, eval_batches, caches, iteration, started)


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
    builder = SampleBuilder(tokenizers, records, args.seq_length, _teacher_lengths(args),
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
    """Off-policy runs: the packed training data, each step's samples from a DataLoader; a
    --teacher-cache-only pass runs here instead and gives its exit code."""
    from megatron_xdistill.data.dataset import DistillationDataset
    from megatron_xdistill.data.document_share import step_samples
    from megatron_xdistill.data.loader import StepBatches, StepSampler
    from megatron_xdistill.training.teacher_cache_run import fill_teacher_cache

    rank = dist.get_rank()
    plan = _plan(args, train_numbering, tokenizers, num_samples, "train", loaded.get("train"))
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
    documents = _share(args, train_numbering, plan, samples, loaded.get("train"))
    dataset = DistillationDataset(documents, plan, tokenizers, args.seq_length,
                                  _teacher_lengths(args))
    if args.teacher_cache_only:
        return fill_teacher_cache(args, distiller, caches, dataset, _log)
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
        v_plan = _plan(args, valid_numbering, tokenizers, n_eval, "valid", loaded.get("valid"))
        mine = []
        if distiller.has_student:  # evaluation runs on the student ranks only
            mine = student_samples(min(n_eval, len(v_plan)), args.micro_batch_size,
                                   distiller.student_layout.dp, s_dp)
        v_share = _share(args, valid_numbering, v_plan, mine, loaded.get("valid"))
        v_set = DistillationDataset(v_share, v_plan, tokenizers, args.seq_length,
                                    _teacher_lengths(args))
        mbs = args.micro_batch_size
        eval_batches = [collate_samples([v_set[i] for i in mine[k : k + mbs]])
                        for k in range(0, len(mine), mbs)] if distiller.has_student else None
    return eval_batches


def _loop(args, distiller, steps, eval_batches, caches, iteration: int, started: float) -> int:
    """The training loop: steps, logging, evaluation, checkpoints, stopping."""
    from megatron_xdistill.training.metrics import MetricsWriter
    from megatron_xdistill.training.preemption import StopRequest

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
    if eval_batches is not None and iteration == 0:
        writer.write({"iteration": 0, **distiller.evaluate(eval_batches)})
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
                writer.write(record)
                last, tokens_since, steps_since = now, 0, 0
            if eval_batches is not None and args.eval_interval and (
                    iteration % args.eval_interval == 0 or iteration == args.train_iters):
                writer.write({"iteration": iteration, **distiller.evaluate(eval_batches)})
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                path = distiller.save(args.save, iteration,
                                      {"consumed_samples": iteration * args.global_batch_size})
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
        path = distiller.save(args.save, iteration,
                              {"consumed_samples": iteration * args.global_batch_size})
        _log(f"> saved checkpoint {path}")
    return 0
