"""What a Megatron GPTModel needs to know about a Hugging Face causal LM: :class:`ModelInfo`.

:func:`model_info_from_hf` reads an HF config (a ``PretrainedConfig``, its dict, or a folder with
``config.json``) of a supported family and checks everything the Megatron side cannot express
(biases on other projections, unknown RoPE scaling, per-layer sliding windows...), so a model that
converts is a model that computes the same function. The result is plain data: it travels with
checkpoints as JSON and needs no ``transformers`` to read back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from megatron_xdistill.models.longrope import LONGROPE_TYPES, longrope_parameters
from megatron_xdistill.models.moe import MOE_ARCHITECTURES, moe_info_fields

#: HF architecture -> family. Llama covers Llama 2/3.x and SmolLM; Mistral adds a sliding window.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
    **MOE_ARCHITECTURES,
}
#: HF activation (``hidden_act`` / Gemma's ``hidden_activation``) -> gated MLP activation.
SUPPORTED_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
#: HF ``layer_types`` entries we build (which layers use the sliding window).
_LAYER_TYPES = ("full_attention", "sliding_attention")
#: HF ``rope_type`` values whose Megatron equivalent we build.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", *LONGROPE_TYPES)


class UnsupportedModelError(ValueError):
    """The HF model uses an architecture or a feature the Megatron side does not reproduce."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: ``linear`` (positions / factor), Llama 3's ``llama3`` or Phi-3's
    ``longrope`` (:mod:`.longrope`: short / long factors per frequency, an attention factor)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    attention_factor: float | None = None

    def __post_init__(self) -> None:  # JSON gives lists; equality needs tuples
        for name in ("short_factor", "long_factor"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(float(x) for x in value))


@dataclass(frozen=True)
class ModelInfo:
    """Architecture of one HF causal LM in Megatron terms, independent of the parallel layout.

    ``vocab_size`` is the real vocabulary (rows of the HF embedding, what the loss normalises
    over); Megatron pads it per layout, see :meth:`padded_vocab_size`. ``hf_config`` is the full
    HF config dict, written back on export.
    """

    architecture: str
    family: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    tie_word_embeddings: bool
    add_qkv_bias: bool
    qk_layernorm: bool
    rope_scaling: RopeScaling | None = None
    #: Fraction of each head's channels that RoPE rotates (Phi-4-mini: 0.75; the first ones).
    rotary_percent: float = 1.0
    sliding_window: int | None = None
    #: Per layer, 1 = sliding window, 0 = full attention (Megatron's ``window_attn_skip_freq``
    #: list); None = every layer slides when ``sliding_window`` is set.
    window_layers: list[int] | None = None
    #: RoPE base of the sliding-window layers when it differs from the global one (Gemma 3).
    local_rotary_base: float | None = None
    activation: str = "silu"
    #: Gemma-style norms: fp32 RMSNorm scaled by 1 + weight, plus a norm after attention and
    #: after the MLP ("sandwich" norms).
    gemma_norms: bool = False
    #: Embedding output multiplier (Gemma: sqrt(hidden_size)); None = 1.
    embedding_multiplier: float | None = None
    #: Attention softmax scale when not 1 / sqrt(kv_channels) (Gemma: query_pre_attn_scalar).
    softmax_scale: float | None = None
    attention_dropout: float = 0.0
    #: Mixture of experts (:mod:`.moe`): experts per MoE layer (None = dense model), their FFN
    #: width, experts per token, per layer 1 = MoE / 0 = dense (None = all MoE), top-k softmax
    #: before the top-k (no renormalisation), load-balancing loss coefficient.
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_router_topk: int | None = None
    moe_layers: list[int] | None = None
    moe_router_pre_softmax: bool = False
    moe_aux_loss_coeff: float = 0.0
    init_method_std: float = 0.02
    hf_dtype: str = "float32"
    make_vocab_size_divisible_by: int = 128
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Megatron's padding: the next multiple of ``make_vocab_size_divisible_by * tp``.

        Rows past ``vocab_size`` are never real tokens (zero on import, dropped on export);
        checkpoints load at another TP because Megatron loads vocab tensors with
        ``allow_shape_mismatch``.
        """
        multiple = self.make_vocab_size_divisible_by * tp
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    @property
    def seq_length(self) -> int:
        """Longest sequence the HF model was configured for (``max_position_embeddings``)."""
        return self.max_position_embeddings

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def differences(self, other: ModelInfo, ignore: tuple[str, ...] = ()) -> list[str]:
        """``"field: mine != theirs"`` for every compared field that differs (``ignore``: fields
        that may differ, e.g. ``hf_dtype`` when the same weights are stored in another dtype)."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self)
                if f.compare and f.name not in ignore
                and getattr(self, f.name) != getattr(other, f.name)]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelInfo:
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelInfo: unknown fields {unknown} (written by a newer version?)")
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = RopeScaling(**data["rope_scaling"])
        return cls(**data)


def _load_hf_config(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if isinstance(hf_config, (str, os.PathLike)):
        path = os.path.join(os.fspath(hf_config), "config.json")
        if not os.path.isdir(hf_config):
            raise FileNotFoundError(f"no such directory: {os.fspath(hf_config)}")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{hf_config}: no config.json (not a Hugging Face model folder)")
        with open(path) as fh:
            return json.load(fh)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"expected an HF config, its dict or a folder, got {type(hf_config).__name__}")


def _rope_params(params: dict[str, Any], where: str, cfg: dict[str, Any] | None = None,
                 rotary_dim: int = 0) -> tuple[float, RopeScaling | None]:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" not in params:
        raise UnsupportedModelError(f"{where}: no rope_theta in {sorted(params)}")
    base = float(params["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"{where}: RoPE type {rope_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return base, None
    if rope_type == "linear":
        return base, RopeScaling("linear", float(params["factor"]))
    if rope_type in LONGROPE_TYPES:
        if cfg is None:
            raise UnsupportedModelError(f"{where}: LongRoPE is supported for the global RoPE only")
        try:
            return base, RopeScaling(**longrope_parameters(params, cfg, rotary_dim, where))
        except ValueError as err:
            raise UnsupportedModelError(str(err)) from None
    return base, RopeScaling(
        "llama3",
        float(params["factor"]),
        float(params.get("low_freq_factor", 1.0)),
        float(params.get("high_freq_factor", 4.0)),
        int(params.get("original_max_position_embeddings", 8192)),
    )


def _rotary_percent(cfg: dict[str, Any], family: str) -> float:
    """``partial_rotary_factor`` (top level, or in transformers 5's ``rope_parameters``)."""
    params = cfg.get("rope_parameters") or {}
    if set(params) & set(_LAYER_TYPES):
        params = {}
    percent = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if percent != 1.0 and family != "phi3":
        raise UnsupportedModelError(f"partial_rotary_factor={percent} is supported for the Phi-3 "
                                    f"family only")
    if not 0.0 < percent <= 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor={percent}: expected 0 < f <= 1")
    return percent


def _rope(cfg: dict[str, Any], rotary_dim: int = 0
          ) -> tuple[float, RopeScaling | None, float | None]:
    """(base, scaling, sliding layers' base or None) from transformers 5's ``rope_parameters``
    (one dict, or one per layer type) or 4.x's rope_theta / rope_scaling / rope_local_base_freq.
    ``rotary_dim``: the rotated channels per head (LongRoPE's factor lists have half as many)."""
    params = cfg.get("rope_parameters")
    local_base = cfg.get("rope_local_base_freq")
    if params is None:
        params = dict(cfg.get("rope_scaling") or {})
        params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    elif set(params) & set(_LAYER_TYPES):  # per layer type
        unknown = sorted(set(params) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"rope_parameters for layer types {unknown} are not "
                                        f"supported (known: {', '.join(_LAYER_TYPES)})")
        if "sliding_attention" in params:
            local_base, local_scaling = _rope_params(params["sliding_attention"],
                                                     "rope_parameters.sliding_attention")
            if local_scaling is not None:
                raise UnsupportedModelError(
                    "rope_parameters.sliding_attention: scaled RoPE on sliding-window layers is "
                    "not supported")
        params = params.get("full_attention", params.get("sliding_attention"))
    base, scaling = _rope_params(params, "rope_parameters", cfg, rotary_dim)
    if local_base is not None and float(local_base) == base and scaling is None:
        local_base = None  # one table serves every layer
    return base, scaling, None if local_base is None else float(local_base)


def _sliding_window(cfg: dict[str, Any], family: str) -> tuple[int | None, list[int] | None]:
    """(window, per-layer 1 = sliding / 0 = full, or None when all layers are alike)."""
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown} are not supported (known: "
                                        f"{', '.join(_LAYER_TYPES)})")
        if len(layer_types) != int(cfg["num_hidden_layers"]):
            raise UnsupportedModelError(f"layer_types has {len(layer_types)} entries for "
                                        f"{cfg['num_hidden_layers']} layers")
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None, None
        if not window:
            raise UnsupportedModelError("layer_types has sliding_attention layers but "
                                        "sliding_window is not set")
        if kinds == {"sliding_attention"}:
            return int(window), None
        return int(window), [int(t == "sliding_attention") for t in layer_types]
    if family in ("mistral", "mixtral", "phi3") or cfg.get("use_sliding_window"):  # Phi-3: whenever set
        return (int(window), None) if window else (None, None)
    return None, None


def _activation(cfg: dict[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise UnsupportedModelError(
            f"hidden_act={act!r}; supported: silu (SwiGLU), gelu_pytorch_tanh (GeGLU)")
    return SUPPORTED_ACTIVATIONS[act]


def _check_unsupported(cfg: dict[str, Any], family: str) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise UnsupportedModelError(f"{key}={cfg[key]} (logit soft-capping) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=True is not supported")
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    if family != "qwen2" and cfg.get("attention_bias"):
        raise UnsupportedModelError(
            "attention_bias=True (bias on q/k/v *and* o_proj) is not supported")
    if family == "phi3" and float(cfg.get("resid_pdrop") or 0.0):
        raise UnsupportedModelError(f"resid_pdrop={cfg['resid_pdrop']} (residual dropout) is not "
                                    "supported")
    if family not in MOE_ARCHITECTURES.values() and (
            cfg.get("num_experts") or cfg.get("num_local_experts")):
        raise UnsupportedModelError("mixture-of-experts models are not supported")


def model_info_from_hf(hf_config: Any, make_vocab_size_divisible_by: int = 128) -> ModelInfo:
    """ModelInfo of an HF config (``PretrainedConfig``, dict, or model folder).

    Raises :class:`UnsupportedModelError` naming the supported architectures, or the feature that
    has no Megatron equivalent here.
    """
    cfg = _load_hf_config(hf_config)
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        what = f"architecture {arch!r}" if arch else f"model_type {cfg.get('model_type')!r}"
        raise UnsupportedModelError(
            f"unsupported {what}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    _check_unsupported(cfg, family)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    kv_channels = int(cfg.get("head_dim") or hidden // heads)
    rotary_percent = _rotary_percent(cfg, family)
    base, scaling, local_base = _rope(cfg, int(kv_channels * rotary_percent))
    window, window_layers = _sliding_window(cfg, family)
    gemma = family == "gemma3"
    softmax_scale = None
    if gemma and float(cfg.get("query_pre_attn_scalar") or kv_channels) != kv_channels:
        softmax_scale = float(cfg["query_pre_attn_scalar"]) ** -0.5
    dtype = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return ModelInfo(
        architecture=arch,
        family=family,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        num_attention_heads=heads,
        num_query_groups=int(cfg.get("num_key_value_heads") or heads),
        kv_channels=kv_channels,
        vocab_size=int(cfg["vocab_size"]),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        norm_epsilon=float(cfg.get("rms_norm_eps", 1e-6)),
        rotary_base=base,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        add_qkv_bias=family == "qwen2",  # Qwen2 always has q/k/v bias (and none on o_proj)
        qk_layernorm=family in ("qwen3", "qwen3_moe", "gemma3"),
        rope_scaling=scaling,
        rotary_percent=rotary_percent,
        sliding_window=window,
        window_layers=window_layers,
        local_rotary_base=local_base if window else None,
        activation=_activation(cfg),
        gemma_norms=gemma,
        embedding_multiplier=math.sqrt(hidden) if gemma else None,
        softmax_scale=softmax_scale,
        attention_dropout=float(cfg.get("attention_dropout", 0.0) or 0.0),
        init_method_std=float(cfg.get("initializer_range", 0.02)),
        hf_dtype=str(dtype).replace("torch.", ""),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        hf_config=cfg,
        **moe_info_fields(cfg, family),
    )


def check_layout(info: ModelInfo, tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    """Raise ValueError naming the size that does not divide the model."""
    for what, total, size, flag in (
        ("attention heads", info.num_attention_heads, tp, "TP"),
        ("query groups (KV heads)", info.num_query_groups, tp, "TP"),
        ("layers", info.num_layers, pp, "PP"),
    ):
        if total % size:
            raise ValueError(f"{info.architecture}: {total} {what} are not divisible by "
                             f"{flag}={size}; choose a {flag} size that divides {total}")
    if cp < 1:
        raise ValueError(f"context-parallel size must be >= 1, got {cp}")
