"""Mixture-of-experts families (Qwen3-MoE, Mixtral) on Megatron-Core's own MoE layer.

HF config -> :class:`~megatron_xdistill.models.hf_config.ModelInfo` fields
(:func:`moe_info_fields`), ModelInfo -> TransformerConfig arguments (:func:`moe_config_kwargs`)
and the per-layer specs of a pipeline stage (:func:`moe_block_spec`: MoE layers and, for
Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``, dense ones).

What makes the Megatron layer compute HF's function:

- routing: HF takes the top-k of softmax(router logits) and, with ``norm_topk_prob`` (always for
  Mixtral), renormalises the k probabilities, which equals Megatron's softmax over the top-k
  logits (``moe_router_pre_softmax=False``); without it the raw top-k softmax probabilities
  (``moe_router_pre_softmax=True``);
- the router runs in fp32 (``moe_router_dtype="fp32"``; HF computes its softmax in fp32);
- no token is ever dropped (no capacity factor: dropless), no shared experts;
- the load-balancing loss is Switch's ``aux_loss`` with HF's ``router_aux_loss_coef`` (it only
  acts in training; a teacher never pays it);
- the token dispatcher is ``alltoall`` (works with gloo on CPU and NCCL on GPUs);
- Mixtral's ``router_jitter_noise`` is not applied: HF multiplies the whole MoE input by noise
  in training only, Megatron's ``moe_input_jitter_eps`` the router's input also in evaluation
  (a teacher's forward would change from run to run).
"""

from __future__ import annotations

from typing import Any

#: HF architecture -> MoE family.
MOE_ARCHITECTURES: dict[str, str] = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}


def moe_layer_pattern(cfg: dict[str, Any], family: str, num_layers: int) -> list[int] | None:
    """Per layer, 1 = MoE, 0 = dense MLP (Megatron's ``moe_layer_freq`` list); None when every
    layer is MoE. Qwen3-MoE: a layer is MoE unless it is in ``mlp_only_layers`` or
    ``(layer + 1) % decoder_sparse_step != 0``, as HF's decoder layer decides."""
    if family != "qwen3_moe":
        return None
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(int(x) for x in (cfg.get("mlp_only_layers") or []))
    pattern = [int(layer not in dense and (layer + 1) % step == 0) for layer in range(num_layers)]
    return None if all(pattern) else pattern


def moe_info_fields(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """ModelInfo's MoE fields of an HF config ({} for a dense family)."""
    if family not in MOE_ARCHITECTURES.values():
        return {}
    from megatron_xdistill.models.hf_config import UnsupportedModelError

    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError(f"{family}: config has no num_experts / num_local_experts")
    topk = int(cfg["num_experts_per_tok"])
    if not 0 < topk <= int(experts):
        raise UnsupportedModelError(f"num_experts_per_tok={topk} must be in 1..{experts}")
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError("shared experts are not supported for this architecture")
    num_layers = int(cfg["num_hidden_layers"])
    pattern = moe_layer_pattern(cfg, family, num_layers)
    if pattern is not None and not any(pattern):
        raise UnsupportedModelError("no layer is a mixture-of-experts layer (mlp_only_layers / "
                                    "decoder_sparse_step); convert it as the dense family")
    if family == "qwen3_moe":
        expert_ffn = int(cfg["moe_intermediate_size"])
        normalize = bool(cfg.get("norm_topk_prob", False))
    else:  # Mixtral: experts are intermediate_size wide, top-k always renormalised
        expert_ffn = int(cfg["intermediate_size"])
        normalize = True
    return dict(
        num_moe_experts=int(experts),
        moe_ffn_hidden_size=expert_ffn,
        moe_router_topk=topk,
        moe_layers=pattern,
        moe_router_pre_softmax=not normalize,
        moe_aux_loss_coeff=float(cfg.get("router_aux_loss_coef", 0.0) or 0.0),
    )


def moe_config_kwargs(info: Any, ep: int = 1) -> dict[str, Any]:
    """TransformerConfig arguments of an MoE ModelInfo at expert-parallel size ``ep``
    ({} for a dense model). Raises ValueError when ``ep`` does not divide the experts."""
    if not info.num_moe_experts:
        if ep != 1:
            raise ValueError(f"{info.architecture} has no experts: expert-model-parallel size "
                             f"must be 1, got {ep}")
        return {}
    if ep < 1 or info.num_moe_experts % ep:
        raise ValueError(f"{info.architecture}: {info.num_moe_experts} experts are not divisible "
                         f"by EP={ep}; choose an expert-model-parallel size that divides "
                         f"{info.num_moe_experts}")
    return dict(
        num_moe_experts=info.num_moe_experts,
        moe_ffn_hidden_size=info.moe_ffn_hidden_size,
        moe_router_topk=info.moe_router_topk,
        moe_layer_freq=list(info.moe_layers) if info.moe_layers else 1,
        moe_router_pre_softmax=info.moe_router_pre_softmax,
        moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=info.moe_aux_loss_coeff,
        moe_input_jitter_eps=None,
        moe_router_dtype="fp32",
        moe_token_dispatcher_type="alltoall",
        moe_expert_capacity_factor=None,
        moe_grouped_gemm=False,
        moe_permute_fusion=False,
        moe_router_fusion=False,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=None,  # = TP
    )


def is_moe_layer(info: Any, layer: int) -> bool:
    """Whether global layer ``layer`` (0-based) of ``info`` has experts."""
    if not info.num_moe_experts:
        return False
    return info.moe_layers is None or bool(info.moe_layers[layer])


def moe_layer_spec(info: Any, use_te: bool):
    """Megatron-Core's GPT layer spec with an MoE MLP (SequentialMLP experts; TE's when
    ``use_te``), with the torch-native attention and norms of the dense spec."""
    from megatron_xdistill.models.specs import gpt_layer_spec

    return gpt_layer_spec("RMSNorm", qk_layernorm=info.qk_layernorm, use_te=use_te,
                          num_experts=info.num_moe_experts)


def moe_block_spec(info: Any, dense_spec, moe_spec, config, pp_rank: int,
                   vp_stage: int | None, final_norm: type):
    """Block spec of this pipeline stage: each layer the MoE or the dense spec by its global
    index (``final_norm``: None where the layer spec brings its own, TE)."""
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    specs = [moe_spec if is_moe_layer(info, offset + i) else dense_spec for i in range(count)]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm)
