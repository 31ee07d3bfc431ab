"""What a run checks from its arguments and files before torch.distributed starts or a model is
built, so that bad input is refused in seconds with one message instead of after the models.

Every rank computes the same here from the same files, so rank 0 alone reports an error
(:mod:`.user_errors`). ``pretrain_xdistill.py --dry-run`` runs these checks and exits.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_xdistill.training.lr_schedule import LRSchedule
from megatron_xdistill.training.user_errors import InputError, reading_inputs


def _rank0_print(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


@dataclass
class Preflight:
    """What the checks found: lines for the run's log (printed once torch.distributed is up),
    the checks made with their seconds (``--dry-run`` prints them) and the loaded tokenizers
    (the run reuses them)."""

    notes: list[str] = field(default_factory=list)
    checked: list[tuple[str, float]] = field(default_factory=list)
    tokenizers: object | None = None

    def step(self, what: str, check: Callable[[], object]) -> object:
        t0 = time.monotonic()
        out = check()
        self.checked.append((what, time.monotonic() - t0))
        return out


def check_model_shapes(args: argparse.Namespace) -> Preflight:
    """The checks that read only arguments and model configurations (no Megatron-Core, no
    tokenizer: a second or two after start); bad input raises
    :class:`.user_errors.InputError` with one message."""
    found = Preflight()
    with reading_inputs():
        found.step("model configurations against the layouts and the architecture flags",
                   lambda: check_models(args))
    if not args.save and not args.teacher_cache_only and not args.dry_run:
        found.notes.append("> warning: no --save: the model this run trains will not be kept")
    if getattr(args, "use_checkpoint_args", False):
        found.notes.append("> --use-checkpoint-args: the model's shape comes from its checkpoint "
                           "(here it always does)")
    return found


def run_preflight(args: argparse.Namespace, found: Preflight) -> Preflight:
    """The rest of the checks of the run's inputs that need no process group and no model,
    in the order of their cost (checkpoints, then tokenizers, projections, data and caches),
    after :func:`check_model_shapes` and Megatron-Core's set-up; bad input raises
    :class:`.user_errors.InputError` with one message."""
    import importlib.util

    import torch

    from megatron_xdistill.training.metrics import missing_writer_package
    from megatron_xdistill.training.run_data import check_vocabularies, load_tokenizers

    if getattr(args, "distributed_backend", None) == "nccl" and not torch.cuda.is_available():
        raise InputError("--distributed-backend nccl needs CUDA GPUs, and none is visible here: "
                         "use gloo, or leave the flag out (nccl with CUDA, gloo without)")
    missing = missing_writer_package(args.tensorboard_dir, args.wandb_project)
    if missing is not None:  # an optional extra: refused now, not at the first metrics
        raise InputError(missing)
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is None:
        found.notes.append("> Transformer Engine is not installed: Megatron-Core's torch "
                           "fallbacks run (its warnings about it are not repeated)")
    with reading_inputs():
        found.notes += found.step("resume point and learning-rate schedule",
                                  lambda: check_resume(args))
        found.tokenizers = tokenizers = found.step("tokenizers", lambda: load_tokenizers(args))
        found.step("checkpoints' vocabularies against their tokenizers",
                   lambda: check_vocabularies(args, tokenizers))
        found.step("projections against both tokenizers and models",
                   lambda: check_projections(args, tokenizers))
        found.step("data files (first records)", lambda: check_data(args))
        found.step("teacher caches", lambda: check_teacher_caches(args, tokenizers))
        if args.eval_tasks:
            found.step("--eval-tasks' data on this machine", lambda: check_eval_tasks(args))
    return found


def check_eval_tasks(args: argparse.Namespace) -> None:
    """Every --eval-tasks task builds from data on this machine (the hub switched off), so a
    missing dataset is refused now and not at the first evaluation."""
    try:
        from megatron_xdistill.evaluation.lm_eval_tasks import TaskUnavailable, check_tasks_offline
    except ImportError as err:  # an optional extra
        raise InputError(f"--eval-tasks needs lm-evaluation-harness ({err}): pip install "
                         "'megatron-xdistill[eval]'") from err
    try:
        check_tasks_offline(args.eval_tasks)
    except TaskUnavailable as err:
        raise InputError(f"--eval-tasks: {err}") from err


def _sides(args: argparse.Namespace) -> list[tuple[str, str, str, argparse.Namespace]]:
    """``(who, checkpoint, flag prefix, arguments as that side sees them)`` of each model the
    run loads: the student (unless the run fills teacher caches only) and every teacher that
    runs (a complete cache stands for its teacher)."""
    from megatron_xdistill.teacher_cache import cache_is_complete
    from megatron_xdistill.training.arguments import trains_ce_only

    out = []
    if not args.teacher_cache_only and args.load is not None:
        out.append(("student", args.load, "--", args))
    if trains_ce_only(args):
        return out
    several = len(args.teachers) > 1
    for spec in args.teachers:
        if spec.load is None or (spec.cache is not None and cache_is_complete(spec.cache)):
            continue
        who = f"teacher {spec.name!r}" if several else "teacher"
        out.append((who, spec.load, f"{who}: " if several else "--teacher-", spec.view(args)))
    return out


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_models(args: argparse.Namespace) -> None:
    """Each model's configuration (its checkpoint's description) against its layout: attention
    heads and query groups divisible by TP, layers by PP, naming the flag to change."""
    from megatron_xdistill.models.description import load_model_info
    from megatron_xdistill.training.arguments.megatron_lm import architecture_mismatches

    for who, load, prefix, view in _sides(args):
        info = load_model_info(load)
        if who == "student":
            wrong = architecture_mismatches(args, info)
            if wrong:
                raise ValueError(
                    f"the student's checkpoint {load} decides the model's shape "
                    f"({info.architecture}); these flags disagree with it: " + "; ".join(wrong)
                    + ". Drop them, or --load a checkpoint of that shape")
        side = "" if who == "student" else "teacher_"
        tp = getattr(view, f"{side}tensor_model_parallel_size")
        pp = getattr(view, f"{side}pipeline_model_parallel_size")
        several = not prefix.startswith("--")
        ep = getattr(view, f"{side}expert_model_parallel_size", 1)
        for what, total, size, flag in (
                ("experts", info.num_moe_experts or 1, ep, "expert-model-parallel-size"),
                ("attention heads", info.num_attention_heads, tp, "tensor-model-parallel-size"),
                ("query groups (KV heads)", info.num_query_groups, tp,
                 "tensor-model-parallel-size"),
                ("layers", info.num_layers, pp, "pipeline-model-parallel-size")):
            if total % size:
                name = f"{prefix}{flag.replace('-', '_')}" if several else f"{prefix}{flag}"
                raise ValueError(
                    f"{name} {size}: the {who} ({info.architecture}, {load}) has {total} {what}, "
                    f"which {size} does not divide; use one of {_divisors(total)}")


def resume_source(args: argparse.Namespace) -> tuple[str, str] | None:
    """``(flag, path)`` of the training root to resume: --save if it holds a run, else --load
    if that is a run (not with --finetune, which takes only --load's weights, as in
    Megatron-LM); None: --load is a model (converted, or a Megatron-LM 'release') and training
    starts at iteration 0."""
    from megatron_xdistill.training.checkpointing import (
        is_training_checkpoint,
        written_by_this_trainer,
    )

    if args.teacher_cache_only:
        return None
    candidates = [("--save", args.save)] + ([] if args.finetune else [("--load", args.load)])
    for flag, path in candidates:
        if path and is_training_checkpoint(path):
            if not written_by_this_trainer(path):
                raise ValueError(
                    f"{flag} {path}: a Megatron-LM training checkpoint, not one of this "
                    f"trainer's runs; pass --finetune to start distilling from its weights at "
                    f"iteration 0 (its optimizer and data position belong to the Megatron-LM "
                    f"run)")
            return flag, path
    return None


def check_resume(args: argparse.Namespace) -> list[str]:
    """Set ``args.resume_from`` (the run root to resume, or None) and ``args.lr_schedule`` (the
    schedule the run follows: its arguments', or a resumed checkpoint's where
    ``--use-checkpoint-opt_param-scheduler`` says so). Raises ValueError when a resumed run's
    schedule flags differ from its checkpoint's and no flag says which to follow. Returns the
    lines to log."""
    from megatron_xdistill.training.checkpointing import read_common_state
    from megatron_xdistill.training.resume_schedule import resolve_schedule, saved_schedule

    source = resume_source(args)
    args.resume_from = None if source is None else source[1]
    args.lr_schedule = LRSchedule.from_args(args)
    if source is None or args.no_load_optim:  # a fresh schedule: nothing to reconcile
        return []
    flag, root = source
    saved = saved_schedule(read_common_state(root), args.lr_schedule)
    if saved is None:
        return []
    args.lr_schedule, lines = resolve_schedule(args, args.lr_schedule, saved,
                                               f"{flag} {root}")
    return lines


def check_projections(args: argparse.Namespace, tokenizers) -> None:
    """Each teacher's projection file against both tokenizers (the vocabulary hashes it was
    built with) and against both models' vocabularies, as the run will load it."""
    from megatron_xdistill.models.description import load_model_info
    from megatron_xdistill.projection import load_projection
    from megatron_xdistill.training.arguments import trains_ce_only

    if trains_ce_only(args):
        return
    several = len(args.teachers) > 1
    for k, spec in enumerate(args.teachers):
        if spec.projection_path is None or tokenizers.same_tokenizer[k]:
            continue
        flag = f"teacher {spec.name!r}: projection_path" if several else "--projection-path"
        matrix = load_projection(spec.projection_path, tokenizers.student_tokenizer,
                                 tokenizers.teacher_tokenizers[k])
        sizes = []
        if args.load is not None and not args.teacher_cache_only:
            sizes.append(("student", matrix.student_vocab_size,
                          load_model_info(args.load).vocab_size))
        if spec.load is not None:
            sizes.append(("teacher", matrix.teacher_vocab_size,
                          load_model_info(spec.load).vocab_size))
        for side, rows, vocab in sizes:
            if rows > vocab:
                raise ValueError(f"{flag} {spec.projection_path}: its {side} vocabulary has "
                                 f"{rows} tokens, the {side} model's {vocab}: was it built for "
                                 f"other tokenizers? (xdistill-projection build)")


def check_data(args: argparse.Namespace) -> None:
    """The first records of every data file: the text field is there and readable (the run's
    full read, on rank 0, finds a fault further in and names it the same way)."""
    from megatron_xdistill.data.sources import check_first_records, parse_data_path

    if getattr(args, "on_policy", False):
        return  # --data-path holds prompts: onpolicy.prompts reads and checks them
    for flag, paths in (("--data-path", args.data_path),
                        ("--valid-data-path", args.valid_data_path)):
        if paths:
            for source in parse_data_path(paths, flag):
                check_first_records(source.path, args.text_field)


def check_teacher_caches(args: argparse.Namespace, tokenizers) -> None:
    """Each teacher cache's key against this run's, where every teacher's length is known
    already (given, or the student's for a teacher with the student's tokenizer: all of them
    decide where samples are cut); otherwise the run checks the keys once the lengths are
    derived from the data."""
    import copy

    from megatron_xdistill.training.run_data import plan_size
    from megatron_xdistill.training.teacher_cache_run import open_teacher_cache

    if not any(spec.cache is not None for spec in args.teachers):
        return
    num_samples = plan_size(args)
    lengths = []
    for k, spec in enumerate(args.teachers):
        if spec.seq_length is None and not tokenizers.same_tokenizer[k]:
            return  # derived from the data on rank 0: checked by the run
        lengths.append(args.seq_length if spec.seq_length is None else spec.seq_length)
    known = copy.copy(args)
    known.teachers = [spec.with_seq_length(n) for spec, n in zip(args.teachers, lengths,
                                                                  strict=True)]
    known.teacher_seq_length = lengths[0]
    for k, spec in enumerate(known.teachers):
        if spec.cache is not None:
            open_teacher_cache(spec.view(known), tokenizers, lambda _: None, k, num_samples)


__all__ = ["Preflight", "check_data", "check_model_shapes", "check_models", "check_projections", "check_resume",
           "check_teacher_caches", "resume_source", "run_preflight"]
