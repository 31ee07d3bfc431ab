"""LongRoPE (``rope_type`` ``longrope``, formerly ``su``) as Hugging Face's Phi-3 family uses it.

Two sets of per-frequency divisors: ``short_factor`` for sequences no longer than
``original_max_position_embeddings`` and ``long_factor`` past it, chosen per forward by the
batch's longest position (HF: ``max(position_ids) + 1 > original``). Both scale the default RoPE
frequencies of the rotary dimensions, ``inv_freq[i] = 1 / (factor[i] * base ** (2 i / dim))``.
The cos and sin tables (and so the rotated part of q and k, never the pass-through part) are
multiplied by one attention factor, ``sqrt(1 + ln(s) / ln(original))`` with
``s = max_position_embeddings / original`` unless the config gives ``factor`` or
``attention_factor``; it applies to short and long sequences alike.

Plain Python and torch, no Megatron-Core: :mod:`.hf_config` reads the parameters with it and
:mod:`.phi3` builds the Megatron rotary module from them.
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: The names HF reads as LongRoPE (``su`` and Phi-3's old ``yarn`` spelling become ``longrope``).
LONGROPE_TYPES = ("longrope", "su")


def longrope_parameters(params: dict[str, Any], cfg: dict[str, Any], rotary_dim: int,
                        where: str) -> dict[str, Any]:
    """The LongRoPE fields of ``RopeScaling`` from a rope dict and the whole HF config, by HF's
    rules: the top-level ``original_max_position_embeddings`` wins over the rope dict's (Phi-3
    configs keep it there; Phi3Config defaults it to 4096), ``factor`` defaults to
    ``max_position_embeddings / original`` and the attention factor is derived from it."""
    missing = [k for k in ("short_factor", "long_factor") if not params.get(k)]
    if missing:
        raise ValueError(f"{where}: LongRoPE needs {' and '.join(missing)}")
    short = tuple(float(x) for x in params["short_factor"])
    long = tuple(float(x) for x in params["long_factor"])
    for name, factors in (("short_factor", short), ("long_factor", long)):
        if len(factors) != rotary_dim // 2:
            raise ValueError(f"{where}: {name} has {len(factors)} entries, the rotary dimension "
                             f"{rotary_dim} needs {rotary_dim // 2}")
    original = cfg.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", 4096)
    original = int(original)
    factor = params.get("factor")
    if factor is None:
        factor = int(cfg.get("max_position_embeddings", 4096)) / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return dict(rope_type="longrope", factor=float(factor), short_factor=short, long_factor=long,
                original_max_position_embeddings=original, attention_factor=float(attention))


def longrope_inv_freq(base: float, rotary_dim: int, factors: tuple[float, ...]) -> torch.Tensor:
    """fp32 inverse frequencies of the ``rotary_dim`` rotated channels, divided by ``factors``
    (HF's ``_compute_longrope_parameters``)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** exponents)


def uses_long_factors(sequence_length: int, original_max_position_embeddings: int) -> bool:
    """HF's switch: the long factors once the longest position (``sequence_length - 1``) reaches
    the original length, i.e. ``sequence_length > original_max_position_embeddings``."""
    return sequence_length > original_max_position_embeddings
