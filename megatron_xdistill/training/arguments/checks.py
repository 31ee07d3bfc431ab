"""Validation of ``pretrain_xdistill.py``'s arguments: everything that can be checked before any
model is built (sizes, layouts, paths, the teacher caches), each message saying what to change;
and :func:`parse_args`, which parses (:mod:`.parser`) and validates."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from megatron_xdistill.onpolicy.arguments import check_onpolicy_args
from megatron_xdistill.parallel.placement import Placement
from megatron_xdistill.parallel.shape import ParallelLayout
from megatron_xdistill.teachers.spec import (
    GOLD_PAYLOAD_DEFAULTS,
    PKL_PAYLOAD_DEFAULTS,
    teachers_from_args,
)
from megatron_xdistill.training.arguments.megatron_lm import check_megatron_lm_arguments
from megatron_xdistill.training.arguments.parser import (
    KD_LOSSES,
    TOPK_MODES,
    parse_command_line,
    trains_ce_only,
)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def validate_args(args: argparse.Namespace, world_size: int) -> argparse.Namespace:
    """Check sizes and paths up front; fill derived values. Messages say what to change."""
    _check_schedule(args)
    check_megatron_lm_arguments(args, _check)
    full = args.recompute_granularity == "full"
    _check(not full or (args.recompute_method is not None
                        and args.recompute_num_layers is not None),
           "--recompute-granularity full needs --recompute-method (uniform|block) and "
           "--recompute-num-layers N")
    _check(full or (args.recompute_method is None and args.recompute_num_layers is None),
           "--recompute-method / --recompute-num-layers apply to --recompute-granularity full "
           "only")
    _check(args.recompute_num_layers is None or args.recompute_num_layers >= 1,
           f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    args.teachers, args.teacher_combination = teachers_from_args(args)  # checks payload sizes
    for key, value in (PKL_PAYLOAD_DEFAULTS | GOLD_PAYLOAD_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    several = len(args.teachers) > 1
    placement = Placement.from_args(args, world_size)  # raises with what to change
    dp_student = _check_layout(args, "student", placement, world_size)
    _check(args.global_batch_size % (args.micro_batch_size * dp_student) == 0,
           f"--global-batch-size {args.global_batch_size} must be a multiple of "
           f"--micro-batch-size x student data-parallel size = {args.micro_batch_size} x "
           f"{dp_student}")
    for k, spec in enumerate(args.teachers):
        view = spec.view(args)
        who = f"teacher {spec.name!r}" if several else "teacher"
        dp_teacher = _check_layout(view, "teacher", placement, world_size, who,
                                   ranks=placement.teacher_size_of(k))
        _check(args.global_batch_size % dp_teacher == 0,
               f"--global-batch-size {args.global_batch_size} must be a multiple of the "
               f"{who}'s data-parallel size {dp_teacher}")
        _check(spec.seq_length is None or spec.seq_length >= args.seq_length // 2,
               f"{'--teacher-seq-length' if not several else who + ': seq_length'} "
               f"{spec.seq_length} is too short for --seq-length "
               f"{args.seq_length}: the teacher must cover the student's text (use about "
               f"1-2 x --seq-length depending on the tokenizers)")
        _check(spec.kd_temperature > 0, f"{who}: --kd-temperature must be > 0")
        _check(not spec.kd_first_token or (spec.kd_loss == "pkl" and spec.kd_topk > 0
                                           and spec.kd_topk_mode == "chunk"),
               f"{who}: --kd-first-token moves the teacher's mass within chunk top-k payloads: "
               f"it needs --kd-loss pkl, --kd-topk > 0 and --kd-topk-mode chunk (got "
               f"{spec.kd_loss}, {spec.kd_topk}, {spec.kd_topk_mode})")
        _check(spec.gkd_beta is None or 0.0 <= spec.gkd_beta <= 1.0,
               f"{who}: --gkd-beta {spec.gkd_beta} must be in [0, 1] (0: forward KL, "
               f"1: reverse KL)")
        _check(spec.gkd_beta is None or not spec.kd_reverse or spec.gkd_beta == 1.0,
               f"{who}: --kd-reverse is --gkd-beta 1; drop one of --kd-reverse and --gkd-beta "
               f"{spec.gkd_beta}")
        _check(spec.kd_topk >= 0, f"{who}: --kd-topk must be >= 0 (0 = full teacher vocabulary)")
        _check(spec.kd_gold_topk >= 0 and spec.kd_gold_uncommon_topk >= 0,
               f"{who}: --kd-gold-topk {spec.kd_gold_topk} and --kd-gold-uncommon-topk "
               f"{spec.kd_gold_uncommon_topk} must be >= 0 (0 = all)")
        _check(spec.kd_loss in KD_LOSSES, f"{who}: kd_loss must be one of {list(KD_LOSSES)}, "
               f"got {spec.kd_loss!r}")
        _check(spec.kd_topk_mode in TOPK_MODES, f"{who}: kd_topk_mode must be one of "
               f"{list(TOPK_MODES)}, got {spec.kd_topk_mode!r}")
        _check(spec.tokenizer_model is not None,
               "--teacher-tokenizer-model is required (the teacher's HF tokenizer directory), "
               "unless --teachers-config names each teacher's")
        _check(not several or spec.weight > 0,
               f"{who}: weight {spec.weight} must be > 0 (drop a teacher that should not teach)")
        for key, name, path in (("load", "--teacher-load", spec.load),
                                ("tokenizer_model", "--teacher-tokenizer-model",
                                 spec.tokenizer_model)):
            _check(path is None or os.path.isdir(path),
                   f"{f'{who}: {key}' if several else name}: no such directory: {path}")
        _check(spec.projection_path is None or os.path.isfile(spec.projection_path),
               f"{f'{who}: projection_path' if several else '--projection-path'}: no such "
               f"file: {spec.projection_path}")
    _check(several or args.teacher_combination == "sum",
           "--teacher-combination select picks one of several teachers per sample: give "
           "--teachers-config with two or more teachers")
    _check(not (args.optimizer == "sgd" and args.use_distributed_optimizer),
           "--optimizer sgd does not work with --use-distributed-optimizer: Megatron-Core's "
           "distributed optimizer shards Adam's state only (use --optimizer adam, or drop "
           "--use-distributed-optimizer)")
    _check(not args.overlap_param_gather or (args.use_distributed_optimizer
                                              and args.overlap_grad_reduce),
           "--overlap-param-gather needs --use-distributed-optimizer and --overlap-grad-reduce "
           "(as in Megatron-LM)")
    _check(0 <= args.sgd_momentum < 1, f"--sgd-momentum {args.sgd_momentum} must be in [0, 1)")
    _check(args.lr >= 0, "--lr must be >= 0")
    _check(args.samples_per_epoch is None or args.samples_per_epoch >= args.global_batch_size,
           f"--samples-per-epoch {args.samples_per_epoch} must be at least --global-batch-size "
           f"{args.global_batch_size} (one step's samples)")
    _check(args.samples_per_epoch is None or not getattr(args, "on_policy", False),
           "--samples-per-epoch sizes the packed training plan; --on-policy trains on the "
           "student's own rollouts of the prompts instead: drop --samples-per-epoch")
    _check(args.kd_weight > 0 or args.ce_weight > 0 or args.kd_dynamic_scaling,
           "--kd-weight and --ce-weight are both 0: nothing to train")
    _check(not (trains_ce_only(args)
                and getattr(args, "teacher_placement", "colocated") == "disaggregated"),
           "--kd-weight 0 trains on CE alone and runs no teacher: drop "
           "--teacher-placement disaggregated (its teacher ranks would idle)")
    _check(args.split is None or args.valid_data_path is None,
           "--split holds validation documents out of --data-path; drop --valid-data-path (or "
           "--split)")
    if args.split is not None:
        from megatron_xdistill.data.split import check_split

        check_split(args.split)
    _check(args.load is not None or args.teacher_cache_only,
           "--load is required: the student's checkpoint (a converted model, xdistill-convert "
           "hf-to-mcore, or a run to resume); only --teacher-cache-only runs without a student")
    _check_teacher_cache(args)
    check_onpolicy_args(args, _check)
    for flag, path in (("--load", args.load), ("--tokenizer-model", args.tokenizer_model),
                       ("--data-tokenizer-model", args.data_tokenizer_model)):
        _check(path is None or os.path.isdir(path), f"{flag}: no such directory: {path}")
    if args.save_interval is not None:
        _check(args.save is not None, "--save-interval needs --save")
    _check(args.keep_last_checkpoints is None or (args.save is not None
                                                  and args.keep_last_checkpoints >= 1),
           f"--keep-last-checkpoints needs --save and N >= 1, got "
           f"{args.keep_last_checkpoints}")
    if args.eval_interval is not None:
        _check(args.valid_data_path is not None or args.split is not None or args.eval_tasks,
               "--eval-interval needs --valid-data-path or --split (held-out text) or "
               "--eval-tasks")
    _check(args.eval_limit is None or (args.eval_tasks and args.eval_limit >= 1),
           f"--eval-limit needs --eval-tasks and N >= 1, got {args.eval_limit}")
    if args.data_cache_path is None:
        args.data_cache_path = (os.path.join(args.save, "data_cache") if args.save else
                                os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(
                                    os.path.expanduser("~"), ".cache"), "megatron-xdistill",
                                    "data"))
    return args


def _check_schedule(args: argparse.Namespace) -> None:
    """The run's length and learning-rate schedule, in iterations (``--train-iters``) or in
    samples (``--train-samples``, as Megatron-LM: its ``-samples`` schedule flags); fills
    ``train_iters`` and the decay length's default."""
    _check((args.train_iters is None) != (args.train_samples is None),
           "give the run's length as --train-iters N (iterations) or --train-samples N "
           "(samples), one of them")
    _check(not (args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler),
           "--override-opt_param-scheduler follows the arguments' schedule, "
           "--use-checkpoint-opt_param-scheduler the checkpoint's: give one of them")
    if args.lr_warmup_fraction is not None:
        _check(0 <= args.lr_warmup_fraction < 1, "--lr-warmup-fraction must be in [0, 1)")
    unit = "iters" if args.train_samples is None else "samples"
    other = "samples" if unit == "iters" else "iters"
    given = [f"--lr-{name}-{other}" for name in ("decay", "warmup", "wsd-decay")
             if getattr(args, f"lr_{name.replace('-', '_')}_{other}") not in (None, 0)]
    flags = f"--lr-decay-{unit} / --lr-warmup-{unit} / --lr-wsd-decay-{unit}"
    _check(not given, f"--train-samples counts the schedule in samples: give {flags} instead of "
           f"{', '.join(given)}" if unit == "samples" else
           f"{', '.join(given)} count samples and need --train-samples (with --train-iters: "
           f"{flags})")
    total = args.train_iters if unit == "iters" else args.train_samples
    _check(total > 0, f"--train-{unit} must be > 0, got {total}")
    if unit == "samples":
        _check(args.train_samples >= args.global_batch_size,
               f"--train-samples {args.train_samples} is less than one global batch "
               f"(--global-batch-size {args.global_batch_size})")
        args.train_iters = args.train_samples // args.global_batch_size
    decay_flag, warmup_flag = f"lr_decay_{unit}", f"lr_warmup_{unit}"
    if getattr(args, decay_flag) is None:
        setattr(args, decay_flag, total)
    decay, warmup = getattr(args, decay_flag), getattr(args, warmup_flag)
    if args.lr_warmup_fraction is not None:
        _check(warmup == 0, f"give --lr-warmup-{unit} or --lr-warmup-fraction, not both")
        warmup = args.lr_warmup_fraction * decay
        if unit == "iters":  # the warmup in iterations, for the checks and the log
            args.lr_warmup_iters = int(warmup)
    if args.lr_decay_style == "WSD":
        wsd = getattr(args, f"lr_wsd_decay_{unit}")
        _check(wsd is not None and 0 < wsd <= decay - warmup,
               f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N with 0 < N <= decay length "
               f"- warmup ({decay} - {warmup:g})")
    _check(0 <= warmup < decay,
           f"--lr-warmup-{unit} {warmup:g} must be >= 0 and smaller than the decay "
           f"length ({decay}: --lr-decay-{unit}, default --train-{unit})")


def _check_layout(args: argparse.Namespace, side: str, placement: Placement, world_size: int,
                  who: str | None = None, ranks: int | None = None) -> int:
    """One side's TP / PP / CP against its ranks and its sequence length; returns its DP.
    ``side``: "student" or "teacher" (then ``args`` is a teacher's view, ``ranks`` its ranks);
    ``who`` names it."""
    who = who or side
    prefix = "" if side == "student" else "teacher_"
    tp = getattr(args, f"{prefix}tensor_model_parallel_size")
    pp = getattr(args, f"{prefix}pipeline_model_parallel_size")
    cp = getattr(args, f"{prefix}context_parallel_size")
    ep = getattr(args, f"{prefix}expert_model_parallel_size", 1)
    flag = "--" + prefix.replace("_", "-")
    _check(min(tp, pp, cp, ep) >= 1, f"{who}: parallel sizes must be >= 1")
    flags = (f"{flag}tensor-model-parallel-size / {flag}pipeline-model-parallel-size / "
             f"{flag}context-parallel-size" + (f" / {flag}expert-model-parallel-size"
                                               if ep > 1 else ""))
    if ranks is None:
        ranks = placement.student_size if side == "student" else placement.teacher_size
    if placement.disaggregated:
        split = (("its 'ranks'" if placement.teacher_split else "--teacher-ranks")
                 if side == "teacher" else
                 f"world size {world_size} - --teacher-ranks {placement.teacher_size}")
        subject = f"the {who}'s {ranks} ranks ({split}) are"
        fix = f"{flags}, --teacher-ranks or the number of ranks (torchrun --nproc-per-node)"
    else:
        subject = f"world size {world_size} is"
        fix = f"{flags} or the number of ranks (torchrun --nproc-per-node)"
    dp = ParallelLayout.for_world(ranks, tp, cp, pp, who=who, ranks=subject, fix=fix, ep=ep).dp
    if getattr(args, f"{prefix}sequence_parallel"):
        _check(tp > 1, f"{flag}sequence-parallel needs {flag}tensor-model-parallel-size > 1 "
               f"(it splits the sequence over the TP ranks)")
    seq = args.seq_length if side == "student" else args.teacher_seq_length
    if seq is not None:  # None: the teacher's length is derived from the data later
        check_sequence_length(args, side, seq)
    return dp


def sequence_multiple(args: argparse.Namespace, who: str) -> int:
    """What a side's sequence length must be a multiple of (``ParallelLayout.sequence_multiple``)."""
    prefix = "" if who == "student" else "teacher_"
    layout = ParallelLayout(tp=getattr(args, f"{prefix}tensor_model_parallel_size"),
                            cp=getattr(args, f"{prefix}context_parallel_size"))
    return layout.sequence_multiple(bool(getattr(args, f"{prefix}sequence_parallel")))


def check_sequence_length(args: argparse.Namespace, who: str, seq: int) -> None:
    """A side's sequence length against its context / sequence parallelism."""
    prefix = "" if who == "student" else "teacher_"
    flag = "--" + prefix.replace("_", "-")
    cp = getattr(args, f"{prefix}context_parallel_size")
    tp = getattr(args, f"{prefix}tensor_model_parallel_size")
    _check(seq % (2 * cp) == 0 if cp > 1 else True,
           f"{who} sequence length {seq} must be divisible by 2 x context-parallel size "
           f"({2 * cp})")
    parts = sequence_multiple(args, who)
    if getattr(args, f"{prefix}sequence_parallel"):
        _check(seq % parts == 0,
               f"{who} sequence length {seq} must be divisible by {parts} with "
               f"{flag}sequence-parallel (TP {tp}" + (f" x 2 x CP {cp})" if cp > 1 else ")"))


def _check_teacher_cache(args: argparse.Namespace) -> None:
    """--teacher-cache / --teacher-cache-only / --teacher-load together (each teacher's cache,
    load and name with several teachers)."""
    _check(args.teacher_cache_shard_mib >= 1, "--teacher-cache-shard-mib must be >= 1")
    _check(args.teacher_cache_commit_seconds > 0, "--teacher-cache-commit-seconds must be > 0")
    _check(args.wandb_project is not None or (args.wandb_exp_name is None
                                               and args.wandb_save_dir is None
                                               and args.wandb_entity is None),
           "--wandb-exp-name / --wandb-save-dir / --wandb-entity need --wandb-project")
    _check(args.exit_duration_in_mins is None or args.exit_duration_in_mins >= 0,
           "--exit-duration-in-mins must be >= 0")
    several = len(args.teachers) > 1
    if several:
        dirs = [os.path.abspath(spec.cache) for spec in args.teachers if spec.cache is not None]
        _check(len(set(dirs)) == len(dirs),
               "each teacher needs a cache directory of its own (its 'cache' in "
               "--teachers-config; --teacher-cache alone would give them all the same one)")
    for spec in args.teachers:
        _check_one_cache(args, spec, f"teacher {spec.name!r}: " if several else "")


def _check_one_cache(args: argparse.Namespace, spec, who: str) -> None:
    from megatron_xdistill.teacher_cache import cache_is_complete

    cache = spec.cache
    flag = f"{who}cache" if who else "--teacher-cache"
    _check(not args.teacher_cache_only or cache is not None,
           f"--teacher-cache-only fills each teacher's cache: {who[:-2]} has none (give it "
           f"'cache: DIR' in --teachers-config)" if who else
           "--teacher-cache-only needs --teacher-cache DIR (where the payloads go)")
    if cache is None:
        _check(spec.load is not None,
               f"--teachers-config: {who}no load (its checkpoint)" if who else
               "--teacher-load is required (the teacher checkpoint), unless --teacher-cache "
               "holds a complete cache")
        return
    _check(not trains_ce_only(args),
           "--teacher-cache with --kd-weight 0: CE alone uses no teacher payloads")
    if cache_is_complete(cache):
        _check(getattr(args, "teacher_placement", "colocated") == "colocated",
               f"{flag} {cache} is complete: no teacher runs, so there are no teacher "
               f"ranks to place; drop --teacher-placement disaggregated")
    else:
        _check(spec.load is not None,
               f"{flag} {cache} is not complete: filling it needs the teacher "
               f"({'its load' if who else '--teacher-load'})")
    _check(not (args.teacher_cache_only
                and getattr(args, "teacher_placement", "colocated") != "colocated"),
           "--teacher-cache-only: every rank serves the teacher; drop --teacher-placement")


def parse_args(argv: Sequence[str] | None, world_size: int) -> argparse.Namespace:
    """Parse (:func:`parse_command_line`) and validate; ours raise ValueError."""
    return validate_args(parse_command_line(argv), world_size)
