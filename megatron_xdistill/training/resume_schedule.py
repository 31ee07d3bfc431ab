"""A resumed run's learning-rate schedule: its arguments' or its checkpoint's, never a silent mix.

A run resumed with other schedule flags than the ones its checkpoint was trained with (most often
a longer ``--train-iters``, which the decay length follows) would otherwise continue on the
checkpoint's schedule: past its end, at ``--min-lr`` (0 by default), without a word. Megatron-LM
refuses that unless told which to follow, and so does this: ``--override-opt_param-scheduler``
follows the arguments from the checkpoint's step on, ``--use-checkpoint-opt_param-scheduler``
keeps the checkpoint's schedule. Checked before any model is built (``preflight``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from megatron_xdistill.training.lr_schedule import FIELD_FLAGS, LRSchedule

#: Key of the full schedule in a training checkpoint's ``common`` state (Megatron's own
#: ``opt_param_scheduler`` beside it lacks the warmup's start and the WSD settings).
SCHEDULE_KEY = "lr_schedule"

#: Megatron's ``opt_param_scheduler`` fields and ours.
_MEGATRON_FIELDS = {"max_lr": "max_lr", "min_lr": "min_lr", "lr_warmup_steps": "warmup_steps",
                    "lr_decay_steps": "decay_steps", "lr_decay_style": "decay_style",
                    "start_wd": "weight_decay"}

OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


@dataclass(frozen=True)
class SavedSchedule:
    """The schedule a checkpoint was trained with and how far it had stepped (in samples)."""

    schedule: LRSchedule
    num_steps: int
    iteration: int
    complete: bool  # False: an older checkpoint of this trainer, only Megatron's fields known


def saved_schedule(common_state: dict, now: LRSchedule) -> SavedSchedule | None:
    """The schedule in a training checkpoint's common state (None without one). Checkpoints
    written before the schedule counted samples hold Megatron's fields in iterations: they are
    converted with the run's global batch size (consumed samples / iteration); the fields they
    lack are taken from ``now``."""
    megatron = _megatron_state(common_state)
    if megatron is None:
        return None
    common = common_state.get("common", {})
    iteration = int(common_state.get("iteration", 0))
    per_iteration = _samples_per_step(common_state)
    num_steps = int(megatron["num_steps"]) * per_iteration
    if SCHEDULE_KEY in common:
        return SavedSchedule(LRSchedule.from_dict(common[SCHEDULE_KEY]), num_steps, iteration,
                             True)
    values = {ours: megatron[theirs] for theirs, ours in _MEGATRON_FIELDS.items()
              if theirs in megatron}
    for name in ("warmup_steps", "decay_steps"):
        if name in values:
            values[name] = values[name] * per_iteration
    return SavedSchedule(replace(now, **values), num_steps, iteration, False)


def _megatron_state(common_state: dict) -> dict | None:
    return common_state.get("opt_param_scheduler", common_state.get("scheduler"))


def _samples_per_step(common_state: dict) -> int:
    """What one of the checkpoint's scheduler steps counts: 1 sample (Megatron-LM's unit, and
    this trainer's), or a whole global batch in checkpoints this trainer wrote before it
    counted samples (no full schedule kept, steps = iterations)."""
    common = common_state.get("common", {})
    iteration = int(common_state.get("iteration", 0))
    consumed = int(common.get("consumed_samples", 0))
    megatron = _megatron_state(common_state)
    if (SCHEDULE_KEY in common or megatron is None or not iteration or not consumed
            or int(megatron["num_steps"]) != iteration):
        return 1
    return consumed // iteration


def scheduler_state(common_state: dict) -> dict | None:
    """The checkpoint's ``opt_param_scheduler`` with its step count in samples, for
    ``OptimizerParamScheduler.load_state_dict`` (whose other values a scheduler built by
    ``LRSchedule.build`` overrides with its own)."""
    megatron = _megatron_state(common_state)
    if megatron is None:
        return None
    return {**megatron, "num_steps": int(megatron["num_steps"]) * _samples_per_step(common_state)}


def _describe(name: str, value, step_size: int) -> str:
    unit = FIELD_FLAGS[name][1]
    if unit is None or value is None:
        return repr(value) if isinstance(value, str) else f"{value:g}" if isinstance(
            value, float) else str(value)
    iterations = value / step_size
    shown = f"{iterations:g}" if iterations != int(iterations) else str(int(iterations))
    return f"{value:g} samples ({shown} iterations)"


def schedule_differences(saved: LRSchedule, now: LRSchedule, complete: bool = True) -> list[str]:
    """One line per field that differs: its name, both values and the flags that set it."""
    a, b = saved.shaping_fields(), now.shaping_fields()
    names = [n for n in FIELD_FLAGS if (n in a or n in b)]
    if not complete:  # an older checkpoint: only Megatron's fields are known
        names = [n for n in names if n in _MEGATRON_FIELDS.values()]
    lines = []
    for name in names:
        old, new = a.get(name), b.get(name)
        if old != new:
            lines.append(f"  {name}: checkpoint {_describe(name, old, saved.step_size)}, "
                         f"arguments {_describe(name, new, now.step_size)} "
                         f"[{FIELD_FLAGS[name][0]}]")
    return lines


def resolve_schedule(args: argparse.Namespace, now: LRSchedule, saved: SavedSchedule,
                     where: str) -> tuple[LRSchedule, list[str]]:
    """The schedule a resumed run follows and what to log about it. Raises ValueError naming
    the fields that differ and both flags when the arguments' schedule is not the checkpoint's
    and neither flag says which to follow. ``where``: the flag and path the run resumes from."""
    override = bool(getattr(args, "override_opt_param_scheduler", False))
    keep = bool(getattr(args, "use_checkpoint_opt_param_scheduler", False))
    differences = schedule_differences(saved.schedule, now, saved.complete)
    if not differences:
        return now, []
    at = saved.iteration
    past = _past_decay(saved.schedule, saved.num_steps, at, args.train_iters)
    if not override and not keep:
        new_lr = now.lr_at(saved.num_steps)  # what iteration at + 1 trains at
        old_lr = saved.schedule.lr_at(saved.num_steps)
        raise ValueError(
            f"{where}: the learning-rate schedule of these arguments differs from the one the "
            f"checkpoint (iteration {at}) was trained with:\n" + "\n".join(differences) + "\n"
            f"Say which to follow, as Megatron-LM asks: {OVERRIDE_FLAG} follows the arguments "
            f"from iteration {at} on (lr {new_lr:.3g} at iteration {at + 1}), "
            f"{USE_CHECKPOINT_FLAG} keeps the checkpoint's (lr {old_lr:.3g} at iteration "
            f"{at + 1}" + (f"; {past} would be past its decay and train at its min lr "
                           f"{saved.schedule.min_lr:g}" if past else "") + ")")
    if override:
        return now, [f"> {OVERRIDE_FLAG}: following these arguments' learning-rate schedule "
                     f"from iteration {at} on, not the checkpoint's:"] + differences
    lines = [f"> {USE_CHECKPOINT_FLAG}: keeping the checkpoint's learning-rate schedule, not "
             f"these arguments':"] + differences
    if past:
        lines.append(f"> warning: {past} are past the checkpoint schedule's decay: they train "
                     f"at its min lr {saved.schedule.min_lr:g}")
    return saved.schedule, lines


def _past_decay(schedule: LRSchedule, num_steps: int, iteration: int, end: int) -> str:
    """Which of the run's coming iterations lie past ``schedule``'s decay (at its min lr):
    "iterations 5-6", or "" for none."""
    steps = schedule.decay_steps
    if schedule.decay_style == "constant":
        return ""
    first = iteration + 1 + max(0, -(-(steps - num_steps) // schedule.step_size))
    if first > end:
        return ""
    return f"iteration {first}" if first == end else f"iterations {first}-{end}"


__all__ = ["OVERRIDE_FLAG", "SCHEDULE_KEY", "USE_CHECKPOINT_FLAG", "SavedSchedule",
           "resolve_schedule", "saved_schedule", "schedule_differences", "scheduler_state"]
