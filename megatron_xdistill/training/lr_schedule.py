"""The learning-rate schedule: Megatron-Core's ``OptimizerParamScheduler`` from Megatron-LM's flags.

``--lr-decay-style`` constant | linear | cosine | inverse-square-root | WSD (warmup, stable, then
``--lr-wsd-decay-style`` over the last ``--lr-wsd-decay-iters``), linear warmup from
``--lr-warmup-init`` over ``--lr-warmup-iters`` or ``--lr-warmup-fraction`` of the decay length,
as Megatron-LM reads them (``validate_args`` turns a fraction into iterations).
"""

from __future__ import annotations

import argparse


def build_lr_scheduler(optimizer, args: argparse.Namespace):
    """The scheduler of ``optimizer`` (Megatron's, or any with ``param_groups``) for ``args``;
    weight decay stays constant."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init if args.lr_warmup_iters else args.lr,
        max_lr=args.lr, min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=args.lr_decay_iters, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay, wd_incr_steps=args.train_iters,
        wd_incr_style="constant", wsd_decay_steps=args.lr_wsd_decay_iters,
        lr_wsd_decay_style=args.lr_wsd_decay_style)
