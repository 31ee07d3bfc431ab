"""What each side of a run needs of its arguments, typed and built once from them.

``pretrain_xdistill.py`` parses Megatron-style flags into one argparse Namespace; the sides that
build models, optimizers and schedules take these configurations instead, in Megatron-Core's own
types where they exist (``DistributedDataParallelConfig``, ``OptimizerConfig``), so the flags are
read in one place and a side can be built without a Namespace (tests, several teachers, a
generating student).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig

from megatron_xdistill.training.arguments import model_options
from megatron_xdistill.training.lr_schedule import LRSchedule


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    """The models' parameter dtype: bf16 with ``--bf16``, fp16 with ``--fp16``, else fp32."""
    if getattr(args, "fp16", False):
        return torch.float16
    return torch.bfloat16 if args.bf16 else torch.float32


@dataclass(frozen=True)
class TeacherSideConfig:
    """One teacher's side of a run (``args``: that teacher's view, ``TeacherSpec.view``)."""

    load: str | None          # --teacher-load (None: the teacher is read from a cache)
    seed: int
    seq_length: int           # --teacher-seq-length
    global_batch_size: int
    micro_batch_size: int     # the student's; the teacher's divides it and its share
    model_options: dict = field(default_factory=dict)  # TransformerConfig fields

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TeacherSideConfig:
        return cls(load=args.teacher_load, seed=args.seed, seq_length=args.teacher_seq_length,
                   global_batch_size=args.global_batch_size,
                   micro_batch_size=args.micro_batch_size,
                   model_options=model_options(args, "teacher"))


@dataclass(frozen=True)
class StudentSideConfig:
    """The student's side of a run: model, DDP, optimizer, schedule, loss weights, checkpoint
    loading."""

    load: str                 # --load: the initial weights (and the HF files kept with a run)
    tokenizer_model: str
    seed: int
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    ddp: DistributedDataParallelConfig
    optimizer: OptimizerConfig  # its bf16 / params_dtype: the models' precision
    schedule: LRSchedule
    ce_weight: float
    kd_dynamic_scaling: bool
    load_optim: bool = True   # resume: take the checkpoint's optimizer and scheduler
    load_rng: bool = True     # resume: take the checkpoint's RNG states
    model_options: dict = field(default_factory=dict)  # TransformerConfig fields

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> StudentSideConfig:
        ddp = DistributedDataParallelConfig(
            use_distributed_optimizer=args.use_distributed_optimizer,
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather,
            bucket_size=args.ddp_bucket_size,
        )
        optimizer = OptimizerConfig(
            optimizer=args.optimizer, sgd_momentum=args.sgd_momentum, lr=args.lr,
            min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
            adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad,
            bf16=bool(args.bf16), params_dtype=params_dtype(args),
            fp16=bool(getattr(args, "fp16", False)), loss_scale=getattr(args, "loss_scale", None),
            initial_loss_scale=getattr(args, "initial_loss_scale", 2.0 ** 32),
            min_loss_scale=getattr(args, "min_loss_scale", 1.0),
            loss_scale_window=getattr(args, "loss_scale_window", 1000),
            hysteresis=getattr(args, "hysteresis", 2),
            use_distributed_optimizer=args.use_distributed_optimizer,
        )
        return cls(load=args.load, tokenizer_model=args.tokenizer_model, seed=args.seed,
                   seq_length=args.seq_length, global_batch_size=args.global_batch_size,
                   micro_batch_size=args.micro_batch_size, ddp=ddp,
                   optimizer=optimizer, schedule=getattr(args, "lr_schedule", None)
                   or LRSchedule.from_args(args),
                   ce_weight=args.ce_weight, kd_dynamic_scaling=bool(args.kd_dynamic_scaling),
                   load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
                   model_options=model_options(args, "student"))


__all__ = ["StudentSideConfig", "TeacherSideConfig", "params_dtype"]
