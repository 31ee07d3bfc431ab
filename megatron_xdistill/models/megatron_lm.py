"""Megatron-LM / Megatron-Bridge checkpoints as model sources, and what their tools read from ours.

A Megatron-LM training root holds ``latest_checkpointed_iteration.txt`` naming ``release`` (a
released model: ``<root>/release/``) or an iteration N > 0 (``<root>/iter_000000N/``), and that
folder is a torch_dist (dist_checkpointing) checkpoint whose common state carries the run's
``args`` (an argparse Namespace), ``checkpoint_version`` and ``iteration``. Its model tensors
have GPTModel's own sharded keys, the ones our checkpoints have (Megatron-Core's local layer spec
maps its norms onto TransformerEngine's key names), so only the architecture is missing: it is
read from ``args`` (:func:`model_info_from_megatron_args`), through the same checks as an HF
config, so a checkpoint we accept is one we build exactly.

Our training checkpoints write ``args`` (:func:`megatron_lm_args`: Megatron-LM's names for the
student's architecture and layout) and ``checkpoint_version`` into their common state, so
Megatron-LM's ``--use-checkpoint-args`` and its tools read them.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from megatron_xdistill.models.hf_config import (
    ModelInfo,
    UnsupportedModelError,
    model_info_from_hf,
)

TRACKER_FILE = "latest_checkpointed_iteration.txt"
RELEASE = "release"
#: Megatron-LM's current checkpoint format version (its ``checkpoint_version`` key).
CHECKPOINT_VERSION = 3.0


class TrackerError(ValueError):
    """A tracker file that names neither ``release`` nor an iteration."""


def read_tracker(root: str) -> str | int | None:
    """What ``root``'s tracker names: ``"release"``, an iteration number, or None without a
    tracker. As Megatron-LM reads it (``read_metadata``); 0 is allowed (our runs start there)."""
    path = os.path.join(root, TRACKER_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        text = fh.read().strip()
    if text == RELEASE:
        return RELEASE
    if not text.isdigit():
        raise TrackerError(f"{path}: expected an iteration number or 'release', found {text!r}")
    return int(text)


def tracked_folder(root: str, tracked: str | int) -> str:
    """The checkpoint folder a tracker value names: ``release/`` or ``iter_000000N/``."""
    name = RELEASE if tracked == RELEASE else f"iter_{int(tracked):07d}"
    return os.path.join(root, name)


def _arg(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default)


def _refuse(where: str, what: str) -> None:
    raise UnsupportedModelError(
        f"{where}: the Megatron-LM run's args say {what}; models here are GPT decoders with "
        f"RMSNorm, SwiGLU, RoPE and no linear biases (QKV bias or QK norm allowed)")


def model_info_from_megatron_args(args: Any, where: str) -> ModelInfo:
    """ModelInfo of a Megatron-LM run's ``args`` (its checkpoint's common state). ``where``
    names the checkpoint in errors. Vocabulary: the run's padded vocabulary (what its embedding
    has and its loss normalised over)."""
    if args is None:
        raise UnsupportedModelError(f"{where}: its common state has no 'args'; it was not "
                                    f"written by Megatron-LM's training loop")
    if _arg(args, "normalization", "LayerNorm") != "RMSNorm":
        _refuse(where, f"--normalization {_arg(args, 'normalization', 'LayerNorm')}")
    if not _arg(args, "swiglu", False):
        _refuse(where, "no --swiglu")
    if _arg(args, "add_bias_linear", True):
        _refuse(where, "linear biases (no --disable-bias-linear)")
    rope = _arg(args, "position_embedding_type") == "rope" or _arg(
        args, "use_rotary_position_embeddings", False)
    if not rope:
        _refuse(where, f"--position-embedding-type {_arg(args, 'position_embedding_type')}")
    for flag, bad in (("rotary_percent", lambda v: v not in (None, 1.0)),
                      ("rotary_interleaved", bool), ("apply_layernorm_1p", bool),
                      ("num_experts", bool), ("multi_latent_attention", bool),
                      ("window_size", bool), ("squared_relu", bool)):
        value = _arg(args, flag)
        if value is not None and bad(value):
            _refuse(where, f"{flag} = {value!r}")
    qkv_bias, qk_norm = bool(_arg(args, "add_qkv_bias", False)), bool(_arg(args, "qk_layernorm",
                                                                             False))
    if qkv_bias and qk_norm:
        _refuse(where, "both a QKV bias and a QK norm")
    architecture, family = (("Qwen2ForCausalLM", "qwen2") if qkv_bias else
                            ("Qwen3ForCausalLM", "qwen3") if qk_norm else
                            ("LlamaForCausalLM", "llama"))
    heads, hidden = int(args.num_attention_heads), int(args.hidden_size)
    groups = int(args.num_query_groups) if _arg(args, "group_query_attention") else heads
    cfg: dict[str, Any] = {
        "architectures": [architecture], "model_type": family,
        "hidden_size": hidden, "intermediate_size": int(args.ffn_hidden_size),
        "num_hidden_layers": int(args.num_layers), "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": int(_arg(args, "kv_channels") or hidden // heads),
        "vocab_size": int(args.padded_vocab_size),
        "max_position_embeddings": int(_arg(args, "max_position_embeddings")
                                       or _arg(args, "seq_length")),
        "rms_norm_eps": float(_arg(args, "norm_epsilon", 1e-5)),
        "rope_theta": float(_arg(args, "rotary_base", 10000)),
        "tie_word_embeddings": not _arg(args, "untie_embeddings_and_output_weights", False),
        "hidden_act": "silu", "attention_bias": qkv_bias,
        "attention_dropout": float(_arg(args, "attention_dropout", 0.0) or 0.0),
        "initializer_range": float(_arg(args, "init_method_std", 0.02)),
        "torch_dtype": ("bfloat16" if _arg(args, "bf16") else
                        "float16" if _arg(args, "fp16") else "float32"),
    }
    if _arg(args, "use_rope_scaling", False):  # Megatron-LM's Llama 3.1 frequency scaling
        cfg["rope_scaling"] = {"rope_type": "llama3",
                               "factor": float(_arg(args, "rope_scaling_factor", 8.0)),
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}
    try:
        return model_info_from_hf(cfg, int(_arg(args, "make_vocab_size_divisible_by", 128)))
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"{where}: {err}") from None


def megatron_lm_cannot_express(info: ModelInfo) -> str | None:
    """Why Megatron-LM's GPT flags cannot describe ``info`` (None: they can)."""
    scaling = info.rope_scaling
    reasons = [
        (info.gemma_norms, "Gemma's norms"), (info.sliding_window is not None, "sliding windows"),
        (info.embedding_multiplier is not None, "a scaled embedding"),
        (info.softmax_scale is not None, "a custom attention scale"),
        (info.activation != "silu", f"the {info.activation} activation"),
        (bool(info.num_moe_experts), "mixture-of-experts layers (not written as MoE flags yet)"),
        (scaling is not None and (scaling.rope_type != "llama3" or (
            scaling.low_freq_factor, scaling.high_freq_factor,
            scaling.original_max_position_embeddings) != (1.0, 4.0, 8192)),
         "this RoPE scaling (Megatron-LM's is Llama 3.1's: 1 / 4 / 8192)"),
    ]
    found = [what for bad, what in reasons if bad]
    return ", ".join(found) if found else None


def megatron_lm_args(info: ModelInfo, *, tp: int, pp: int, cp: int, seq_length: int,
                     bf16: bool, iteration: int, consumed_samples: int, fp16: bool = False
                     ) -> argparse.Namespace | None:
    """Megatron-LM's ``args`` for a checkpoint of ``info``: the architecture flags its
    ``--use-checkpoint-args`` and conversion tools read, under its names. None for a model
    those flags cannot describe (:func:`megatron_lm_cannot_express`): no args beat wrong ones."""
    if megatron_lm_cannot_express(info) is not None:
        return None
    return argparse.Namespace(
        num_layers=info.num_layers, hidden_size=info.hidden_size,
        ffn_hidden_size=info.ffn_hidden_size, num_attention_heads=info.num_attention_heads,
        group_query_attention=info.num_query_groups != info.num_attention_heads,
        num_query_groups=info.num_query_groups, kv_channels=info.kv_channels,
        max_position_embeddings=info.max_position_embeddings, seq_length=seq_length,
        position_embedding_type="rope", use_rotary_position_embeddings=True,
        rotary_base=info.rotary_base, rotary_percent=info.rotary_percent, rotary_interleaved=False,
        use_rope_scaling=info.rope_scaling is not None and info.rope_scaling.rope_type == "llama3",
        rope_scaling_factor=info.rope_scaling.factor if info.rope_scaling else 8.0,
        normalization="RMSNorm", norm_epsilon=info.norm_epsilon, swiglu=True,
        add_bias_linear=False, add_qkv_bias=info.add_qkv_bias, qk_layernorm=info.qk_layernorm,
        untie_embeddings_and_output_weights=not info.tie_word_embeddings,
        apply_layernorm_1p=False, attention_dropout=info.attention_dropout, hidden_dropout=0.0,
        init_method_std=info.init_method_std,
        padded_vocab_size=info.padded_vocab_size(tp),
        make_vocab_size_divisible_by=info.make_vocab_size_divisible_by,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=cp, bf16=bf16, fp16=fp16, params_dtype=None,
        iteration=iteration, consumed_train_samples=consumed_samples,
        ckpt_format="torch_dist",
    )


__all__ = ["CHECKPOINT_VERSION", "RELEASE", "TRACKER_FILE", "TrackerError",
           "megatron_lm_args", "megatron_lm_cannot_express",
           "model_info_from_megatron_args", "read_tracker", "tracked_folder"]
