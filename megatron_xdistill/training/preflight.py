"""What a run checks from its arguments and files before torch.distributed starts or a model is
built, so that bad input is refused in seconds with one message instead of after the models.

Every rank computes the same here from the same files, so rank 0 alone reports an error
(:mod:`.user_errors`). ``pretrain_xdistill.py --dry-run`` runs these checks and exits.
"""

from __future__ import annotations

import argparse

from megatron_xdistill.training.lr_schedule import LRSchedule


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


__all__ = ["check_resume", "resume_source"]
