"""Tiny random HF models of every supported family, for tests, benchmarks and smoke runs.

Each is built with ``transformers`` from its family's config at a small size but with the real
vocabulary size of the family's tokenizer, and *every* parameter is randomised (norm weights
and biases too, which HF initialises to constants), so a mapping mistake cannot hide.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from typing import Any

import torch

#: Tokenizer files copied into the model folder when a tokenizer directory is given.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class TinyFamily:
    """One family's tiny config: the transformers config class name, its vocab, overrides."""

    config_class: str
    architecture: str
    vocab_size: int
    tokenizer: str
    overrides: dict[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32


_COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)

TINY_FAMILIES: dict[str, TinyFamily] = {
    # SmolLM2-like Llama: tied embeddings.
    "smollm2": TinyFamily("LlamaConfig", "LlamaForCausalLM", 49152, "smollm2",
                          dict(tie_word_embeddings=True, rope_theta=100000.0)),
    # Llama 3.x: untied head, llama3 RoPE scaling with a short original context so all three
    # frequency regimes (kept, smoothed, divided) occur at head_dim 16.
    "llama3": TinyFamily("LlamaConfig", "LlamaForCausalLM", 128256, "llama3", dict(
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64})),
    # Mistral: sliding window shorter than the test sequences.
    "mistral": TinyFamily("MistralConfig", "MistralForCausalLM", 32000, "mistral",
                          dict(tie_word_embeddings=False, sliding_window=8, head_dim=16)),
    # Qwen2.5: QKV bias, untied head (like the fetched Qwen2.5-Coder-0.5B).
    "qwen2": TinyFamily("Qwen2Config", "Qwen2ForCausalLM", 151936, "qwen2",
                        dict(tie_word_embeddings=False, rope_theta=1000000.0)),
    # Qwen3: QK RMSNorm, head_dim != hidden / heads, tied, stored in bf16.
    "qwen3": TinyFamily("Qwen3Config", "Qwen3ForCausalLM", 151936, "qwen2",
                        dict(tie_word_embeddings=True, head_dim=32), dtype=torch.bfloat16),
    # Gemma 3: sliding and full layers alternate (each PP=2 stage has both), the full layers'
    # RoPE linearly scaled (as in Gemma 3 4B+), a softmax scale other than 1/sqrt(head_dim).
    "gemma3": TinyFamily("Gemma3TextConfig", "Gemma3ForCausalLM", 262144, "gemma3", dict(
        tie_word_embeddings=True, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    # Phi-4-mini's ratios scaled down (hidden 3072 / 24 heads / 8 KV heads / ffn 8192 -> 96 / 6 /
    # 2 / 256), its vocabulary, tied, 3/4 of each head rotated, LongRoPE with its 32x context
    # (original 4096 -> 32, max 131072 -> 1024: attention factor sqrt(2)), long factors from its
    # curve, short factors != 1 so that picking the wrong set shows; the window is past the
    # context (262144 there) as in Phi-4-mini.
    "phi4mini": TinyFamily("Phi3Config", "Phi3ForCausalLM", 200064, "gpt2", dict(
        hidden_size=96, intermediate_size=256, num_attention_heads=6, num_key_value_heads=2,
        tie_word_embeddings=True, max_position_embeddings=1024,
        original_max_position_embeddings=32, sliding_window=2048, partial_rotary_factor=0.75,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.75,
                         "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3],
                         "long_factor": [1.0, 1.25, 2.19, 5.35, 32.03, 47.77]})),
    # Phi-3-mini-4k / -medium-4k: untied, full rotary, plain RoPE, a sliding window (2047 there)
    # shorter than the test sequences; the Llama-2 SentencePiece vocabulary plus 64 added.
    "phi3": TinyFamily("Phi3Config", "Phi3ForCausalLM", 32064, "mistral", dict(
        tie_word_embeddings=False, sliding_window=7, rope_theta=10000.0)),
    # Qwen3-MoE: 4 experts, top-2 without renormalisation, layer 1 dense (each PP=2 stage has an
    # MoE and a dense layer), expert FFN narrower than the dense one.
    "qwen3_moe": TinyFamily("Qwen3MoeConfig", "Qwen3MoeForCausalLM", 151936, "qwen2", dict(
        tie_word_embeddings=False, head_dim=32, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=False, mlp_only_layers=[1],
        router_aux_loss_coef=0.01)),
    # Mixtral: 4 experts, top-2 renormalised, sliding window.
    "mixtral": TinyFamily("MixtralConfig", "MixtralForCausalLM", 32000, "mistral", dict(
        tie_word_embeddings=False, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=8, router_aux_loss_coef=0.02)),
}


def _randomise(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            base = 1.0 if name.endswith("norm.weight") else 0.0
            param.copy_(base + noise * (1.0 if param.dim() > 1 or base else 0.5))


def tiny_config(family: str, **overrides: Any):
    """The transformers config of a tiny ``family`` model (``overrides`` win)."""
    import transformers

    spec = TINY_FAMILIES[family]
    config_class = getattr(transformers, spec.config_class)
    kwargs = {**_COMMON, "vocab_size": spec.vocab_size, **spec.overrides, **overrides}
    rope = kwargs.pop("rope_theta", None)
    if rope is not None:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": rope}
    config = config_class(**kwargs)
    config.architectures = [spec.architecture]
    return config


def make_tiny_model(family: str, out_dir: str, tokenizers_dir: str | None = None,
                    seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random HF model of ``family`` (see ``TINY_FAMILIES``) to ``out_dir``.

    ``tokenizers_dir/<tokenizer>`` (the shared assets' tokenizers) is copied in when given.
    ``overrides``: config fields that differ from the family's (e.g. another ``vocab_size``).
    """
    import transformers

    spec = TINY_FAMILIES[family]
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    _randomise(model, seed)
    model.to(spec.dtype).save_pretrained(out_dir)
    if tokenizers_dir is not None:
        source = os.path.join(tokenizers_dir, spec.tokenizer)
        for name in _TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copy2(os.path.join(source, name), out_dir)
    return out_dir
