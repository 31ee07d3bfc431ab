"""Megatron-LM's command-line habits: no abbreviated flags, the closest names for a misspelt
one, and the Megatron-LM flags a user brings along, with Megatron-LM's meaning.

Accepted with Megatron-LM's meaning: ``--fp16`` (loss-scaled mixed precision, Megatron-Core's
dynamic grad scaler, with ``--loss-scale`` / ``--initial-loss-scale`` / ``--min-loss-scale`` /
``--loss-scale-window`` / ``--hysteresis``), ``--train-samples`` (a schedule in samples,
:mod:`.lr_schedule`), ``--log-throughput``, ``--distributed-backend``, ``--ckpt-format
torch_dist``, ``--tokenizer-type HuggingFaceTokenizer`` and ``--use-checkpoint-args`` (the model's
shape always comes from its checkpoint here). Architecture flags (``--num-layers``,
``--hidden-size``, ...) are accepted when they agree with the student's checkpoint and refused
naming both values when they do not (:func:`architecture_mismatches`). Other values of these flags
are refused saying what to use instead.
"""

from __future__ import annotations

import argparse
import difflib
import re

#: Megatron-LM's architecture flags: dest -> (the ModelInfo value it must equal, how to show it)
ARCHITECTURE_FLAGS = {
    "num_layers": "num_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "max_position_embeddings": "max_position_embeddings",
    "rotary_base": "rotary_base",
    "norm_epsilon": "norm_epsilon",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
}


class MegatronArgumentParser(argparse.ArgumentParser):
    """argparse as Megatron-LM sets it up: a flag is taken only when spelt in full
    (``--teacher-tensor 2`` is not ``--teacher-tensor-model-parallel-size 2``), and an unknown
    one is answered with the closest names."""

    def __init__(self, **kwargs) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str):
        match = re.match(r"unrecognized arguments: (.*)", message)
        if match:
            hints = []
            for token in match.group(1).split():
                if token.startswith("--"):
                    name = token.split("=", 1)[0]
                    close = closest_flags(name, self._option_names())
                    hints.append(f"{name}: did you mean {' or '.join(close)}?" if close else
                                 f"{name}: no such flag ({self.prog} --help lists them)")
            if hints:
                message += "\n" + "\n".join(hints)
        self.exit_with(message)

    def exit_with(self, message: str):
        """Exit 2 with ``message``, as argparse does, but once per job: rank 0 prints it with
        a one-line usage (``--help`` has the whole list), the other ranks exit silently (see
        ``user_errors.wait_for_rank0``)."""
        import os
        import sys

        if int(os.environ.get("RANK", "0")) == 0:
            sys.stderr.write(f"usage: {self.prog} [arguments] ({self.prog} --help lists them)\n"
                             f"{self.prog}: error: {message}\n")
            sys.exit(2)
        from megatron_xdistill.training.user_errors import wait_for_rank0

        wait_for_rank0()
        sys.exit(2)

    def _option_names(self) -> list[str]:
        return [name for action in self._actions for name in action.option_strings
                if name.startswith("--")]


def closest_flags(name: str, options: list[str], limit: int = 3) -> list[str]:
    """The flags ``name`` most likely meant: those it begins (an abbreviation), then the
    closest spellings."""
    starts = sorted(o for o in options if o.startswith(name) and o != name)
    if starts:
        return starts[:limit]
    return difflib.get_close_matches(name, options, n=limit, cutoff=0.6)


def _only(flag: str, allowed: str, instead: str):
    """An argparse type that accepts ``allowed`` alone and refuses other values with what to
    use instead."""

    def check(value: str) -> str:
        if value != allowed:
            raise argparse.ArgumentTypeError(f"{value!r} is not supported: {instead}")
        return value

    check.__name__ = flag.lstrip("-").replace("-", "_")
    return check


def add_megatron_lm_arguments(parser: argparse.ArgumentParser) -> None:
    """The Megatron-LM flags a user brings along (see the module docstring)."""
    g = parser.add_argument_group("Megatron-LM compatibility (its flags, with its meaning)")
    g.add_argument("--tokenizer-type", default="HuggingFaceTokenizer",
                   type=_only("--tokenizer-type", "HuggingFaceTokenizer",
                              "the tokenizers here are Hugging Face tokenizer directories "
                              "(--tokenizer-model DIR): use HuggingFaceTokenizer"),
                   help="HuggingFaceTokenizer (the only kind: --tokenizer-model is an HF "
                   "tokenizer directory)")
    g.add_argument("--ckpt-format", default="torch_dist",
                   type=_only("--ckpt-format", "torch_dist",
                              "training checkpoints are dist_checkpointing's torch_dist format, "
                              "which Megatron-LM loads at any layout: use torch_dist"),
                   help="torch_dist (the only format written and read)")
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="torch.distributed backend (default: nccl with CUDA, gloo without)")
    g.add_argument("--log-throughput", action="store_true",
                   help="log the student's model TFLOP/s per GPU beside tokens/s (as "
                   "Megatron-LM: 6 x parameters + attention, per token trained)")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="accepted for Megatron-LM's scripts: the model's shape always comes "
                   "from its checkpoint here (xdistill_model.json or the Megatron-LM args)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights and activations with Megatron-Core's loss scaling "
                   "(dynamic unless --loss-scale); --bf16 needs none")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="--fp16: a static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32,
                   help="--fp16, dynamic: the first loss scale")
    g.add_argument("--min-loss-scale", type=float, default=1.0,
                   help="--fp16, dynamic: the smallest loss scale")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="--fp16, dynamic: steps without overflow before the scale grows")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="--fp16, dynamic: overflows tolerated before the scale shrinks")
    a = parser.add_argument_group(
        "architecture (Megatron-LM's flags: checked against the student's checkpoint, which "
        "decides the model)")
    for dest in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                 "num_query_groups", "kv_channels", "max_position_embeddings",
                 "make_vocab_size_divisible_by"):
        a.add_argument("--" + dest.replace("_", "-"), type=int, default=None,
                       help="must equal the checkpoint's")
    for dest in ("rotary_base", "norm_epsilon"):
        a.add_argument("--" + dest.replace("_", "-"), type=float, default=None,
                       help="must equal the checkpoint's")
    a.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="the checkpoint must have an output layer of its own")
    a.add_argument("--group-query-attention", action="store_true",
                   help="the checkpoint must have fewer query groups than heads")
    a.add_argument("--swiglu", action="store_true", help="the checkpoint's MLP must be SwiGLU")
    a.add_argument("--normalization", choices=("RMSNorm", "LayerNorm"), default=None,
                   help="must be the checkpoint's (RMSNorm for every family here)")
    a.add_argument("--position-embedding-type", choices=("rope", "learned_absolute", "none"),
                   default=None, help="must be the checkpoint's (rope for every family here)")
    a.add_argument("--disable-bias-linear", action="store_true",
                   help="accepted: the linear layers here have no bias (Qwen2's QKV bias "
                   "aside: --add-qkv-bias)")
    a.add_argument("--add-qkv-bias", action="store_true",
                   help="the checkpoint must have a QKV bias (Qwen2)")


def check_megatron_lm_arguments(args: argparse.Namespace, check) -> None:
    """The compatibility flags that do not go together (``check(condition, message)``)."""
    check(not (args.fp16 and args.bf16), "--fp16 and --bf16: give one of them")
    fp16_only = [flag for flag, given in (
        ("--loss-scale", args.loss_scale is not None),
        ("--initial-loss-scale", args.initial_loss_scale != 2.0 ** 32),
        ("--min-loss-scale", args.min_loss_scale != 1.0),
        ("--loss-scale-window", args.loss_scale_window != 1000),
        ("--hysteresis", args.hysteresis != 2)) if given]
    check(args.fp16 or not fp16_only,
          f"{', '.join(fp16_only)}: loss scaling is for --fp16 (bf16 and fp32 need none)")


def architecture_mismatches(args: argparse.Namespace, info) -> list[str]:
    """The architecture flags given that disagree with the checkpoint's ``info``
    (``ModelInfo``), each as ``--flag N, but the checkpoint has M``."""
    out = []
    for dest, field in ARCHITECTURE_FLAGS.items():
        given = getattr(args, dest, None)
        have = getattr(info, field)
        if given is not None and given != have:
            out.append(f"--{dest.replace('_', '-')} {given:g}, but the checkpoint has {have:g}"
                       if isinstance(given, float) else
                       f"--{dest.replace('_', '-')} {given}, but the checkpoint has {have}")
    for dest, holds, says in (
            ("untie_embeddings_and_output_weights", not info.tie_word_embeddings,
             "ties its output layer to the embedding"),
            ("group_query_attention", info.num_query_groups < info.num_attention_heads,
             f"has as many query groups as heads ({info.num_attention_heads})"),
            ("swiglu", info.activation == "silu", "has a GeGLU MLP"),
            ("add_qkv_bias", info.add_qkv_bias, "has no QKV bias")):
        if getattr(args, dest, False) and not holds:
            out.append(f"--{dest.replace('_', '-')}, but the checkpoint {says}")
    if getattr(args, "normalization", None) not in (None, "RMSNorm"):
        out.append(f"--normalization {args.normalization}, but the checkpoint has RMSNorm")
    if getattr(args, "position_embedding_type", None) not in (None, "rope"):
        out.append(f"--position-embedding-type {args.position_embedding_type}, but the "
                   f"checkpoint has rope")
    return out


__all__ = ["ARCHITECTURE_FLAGS", "MegatronArgumentParser", "add_megatron_lm_arguments",
           "architecture_mismatches", "check_megatron_lm_arguments", "closest_flags"]
