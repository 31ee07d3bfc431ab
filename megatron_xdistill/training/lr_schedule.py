"""The learning-rate schedule: Megatron-Core's ``OptimizerParamScheduler`` from Megatron-LM's flags.

``--lr-decay-style`` constant | linear | cosine | inverse-square-root | WSD (warmup, stable, then
``--lr-wsd-decay-style`` over the last ``--lr-wsd-decay-iters``), linear warmup from
``--lr-warmup-init`` over ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` of the decay length.

As in Megatron-LM the scheduler counts *samples*: each iteration steps it by the global batch
size, an iteration-based schedule (``--train-iters``, ``--lr-decay-iters``, ...) is its lengths
times the global batch size and a sample-based one (``--train-samples``, ``--lr-decay-samples``,
...) is taken as given. A checkpoint's ``opt_param_scheduler`` is therefore what Megatron-LM
writes and reads for the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

#: The fields of a schedule, what a user changes to change each, and the unit it counts in.
FIELD_FLAGS = {
    "max_lr": ("--lr", None),
    "min_lr": ("--min-lr", None),
    "init_lr": ("--lr-warmup-init", None),
    "warmup_steps": ("--lr-warmup-iters / --lr-warmup-fraction / --lr-warmup-samples",
                     "samples"),
    "decay_steps": ("--lr-decay-iters / --lr-decay-samples (default: --train-iters / "
                    "--train-samples)", "samples"),
    "decay_style": ("--lr-decay-style", None),
    "wsd_decay_steps": ("--lr-wsd-decay-iters / --lr-wsd-decay-samples", "samples"),
    "wsd_decay_style": ("--lr-wsd-decay-style", None),
    "weight_decay": ("--weight-decay", None),
}


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's settings in ``OptimizerParamScheduler``'s terms, lengths in samples
    (``step_size`` samples an iteration); weight decay stays constant over the run."""

    init_lr: float
    max_lr: float
    min_lr: float
    warmup_steps: float
    decay_steps: int
    decay_style: str
    weight_decay: float
    wd_incr_steps: int
    wsd_decay_steps: int | None
    wsd_decay_style: str
    step_size: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LRSchedule:
        """From validated run arguments, as Megatron-LM's ``get_optimizer_param_scheduler``
        reads them: iteration lengths times ``--global-batch-size``, sample lengths as they are,
        ``--lr-warmup-fraction`` of the decay length."""
        gbs = args.global_batch_size
        if getattr(args, "train_samples", None) is not None:
            decay = args.lr_decay_samples or args.train_samples
            warmup_given = args.lr_warmup_samples
            wsd = args.lr_wsd_decay_samples
            total = args.train_samples
        else:
            decay = args.lr_decay_iters * gbs
            warmup_given = args.lr_warmup_iters * gbs
            wsd = None if args.lr_wsd_decay_iters is None else args.lr_wsd_decay_iters * gbs
            total = args.train_iters * gbs
        fraction = args.lr_warmup_fraction
        warmup = fraction * decay if fraction is not None else warmup_given
        return cls(init_lr=args.lr_warmup_init if warmup else args.lr,
                   max_lr=args.lr, min_lr=args.min_lr, warmup_steps=warmup,
                   decay_steps=decay, decay_style=args.lr_decay_style,
                   weight_decay=args.weight_decay, wd_incr_steps=total,
                   wsd_decay_steps=wsd, wsd_decay_style=args.lr_wsd_decay_style,
                   step_size=gbs)

    def to_dict(self) -> dict:
        """Plain values (kept in a training checkpoint's common state)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> LRSchedule:
        return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})

    def shaping_fields(self) -> dict:
        """The fields that decide the learning rate and weight decay of some step: the WSD
        ones only with WSD, the warmup's start only with a warmup (the length of Megatron's
        weight-decay ramp is not one: the decay here is constant)."""
        out = {name: getattr(self, name) for name in FIELD_FLAGS}
        if self.decay_style != "WSD":
            del out["wsd_decay_steps"], out["wsd_decay_style"]
        if not self.warmup_steps:
            del out["init_lr"]
        return out

    def lr_at(self, samples: int) -> float:
        """The learning rate after ``samples`` consumed samples (the scheduler's own formula)."""
        from types import SimpleNamespace

        group = {"lr": 0.0}
        scheduler = self.build(SimpleNamespace(param_groups=[group]))
        scheduler.step(samples)
        return group["lr"]

    def build(self, optimizer):
        """The scheduler of ``optimizer`` (Megatron's, or any with ``param_groups``). Its
        values are this schedule's: a resumed run reconciles them with its checkpoint's before
        (:mod:`.resume_schedule`), so loading a state only sets the step count."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(
            optimizer, init_lr=self.init_lr, max_lr=self.max_lr, min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_steps, lr_decay_steps=self.decay_steps,
            lr_decay_style=self.decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=self.wd_incr_steps,
            wd_incr_style="constant", wsd_decay_steps=self.wsd_decay_steps,
            lr_wsd_decay_style=self.wsd_decay_style,
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
