"""The learning-rate schedule: Megatron-Core's ``OptimizerParamScheduler`` from Megatron-LM's flags.

``--lr-decay-style`` constant | linear | cosine | inverse-square-root | WSD (warmup, stable, then
``--lr-wsd-decay-style`` over the last ``--lr-wsd-decay-iters``), linear warmup from
``--lr-warmup-init`` over ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` of the decay length,
as Megatron-LM reads them (``validate_args`` turns a fraction into iterations).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    """The schedule's settings in ``OptimizerParamScheduler``'s terms; weight decay stays
    constant over the run."""

    init_lr: float
    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: str
    weight_decay: float
    train_iters: int
    wsd_decay_steps: int | None
    wsd_decay_style: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LRSchedule:
        """From validated run arguments (warmup and decay lengths in iterations)."""
        return cls(init_lr=args.lr_warmup_init if args.lr_warmup_iters else args.lr,
                   max_lr=args.lr, min_lr=args.min_lr, warmup_steps=args.lr_warmup_iters,
                   decay_steps=args.lr_decay_iters, decay_style=args.lr_decay_style,
                   weight_decay=args.weight_decay, train_iters=args.train_iters,
                   wsd_decay_steps=args.lr_wsd_decay_iters,
                   wsd_decay_style=args.lr_wsd_decay_style)

    def build(self, optimizer):
        """The scheduler of ``optimizer`` (Megatron's, or any with ``param_groups``)."""
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(
            optimizer, init_lr=self.init_lr, max_lr=self.max_lr, min_lr=self.min_lr,
            lr_warmup_steps=self.warmup_steps, lr_decay_steps=self.decay_steps,
            lr_decay_style=self.decay_style, start_wd=self.weight_decay,
            end_wd=self.weight_decay, wd_incr_steps=self.train_iters,
            wd_incr_style="constant", wsd_decay_steps=self.wsd_decay_steps,
            lr_wsd_decay_style=self.wsd_decay_style)
