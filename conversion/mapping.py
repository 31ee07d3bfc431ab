"""HF <-> Megatron weight mapping for dense Llama-style models (Llama, Mistral, Qwen2, Qwen3) and
Gemma 3 (its norms after attention and after the MLP live in the output projections, see
``megatron_xdistill.models.gemma3``; its pre-MLP norm is HF's ``pre_feedforward_layernorm``).

Every Megatron parameter has a *role*; a role knows its HF tensors, how to join them into the
unsharded Megatron tensor (TP=1) and back, and how TP splits it:

- ``linear_qkv``: rows grouped per query group: [q heads of group g, k_g, v_g] for g = 0..G-1,
  so a TP rank's contiguous row block holds whole groups;
- ``linear_fc1`` (SwiGLU): [gate; up] and each TP rank holds [gate_r; up_r];
- column-parallel (qkv, fc1, vocab rows) split dim 0, row-parallel (linear_proj, fc2) dim 1;
- vocab rows are padded with zeros to Megatron's padded size on import and cut on export;
- tied embeddings: one HF tensor (``model.embed_tokens.weight``) feeds both ends;
- Phi-3's fused ``qkv_proj`` / ``gate_up_proj`` are cut into q, k, v / gate, up first
  (:mod:`conversion.phi3`).

Megatron parameter names of both layer specs are understood (torch-native: separate
``input_layernorm``; TransformerEngine: ``linear_qkv.layer_norm_weight``). Mixture-of-experts
layers (router and experts) are roles of :mod:`conversion.moe_mapping`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from conversion import moe_mapping, phi3
from conversion.safetensors_io import SafetensorsFolder, TensorSpec
from megatron_xdistill.models.hf_config import ModelInfo

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
FINAL_NORM = "model.norm.weight"

#: Megatron layer-parameter suffix -> role (both layer specs).
_LAYER_ROLES = {
    "input_layernorm.weight": "input_norm",
    "self_attention.linear_qkv.layer_norm_weight": "input_norm",
    "self_attention.linear_qkv.weight": "qkv",
    "self_attention.linear_qkv.bias": "qkv_bias",
    "self_attention.q_layernorm.weight": "q_norm",
    "self_attention.k_layernorm.weight": "k_norm",
    "self_attention.linear_proj.weight": "proj",
    "self_attention.linear_proj.post_layernorm.weight": "attn_post_norm",
    "pre_mlp_layernorm.weight": "mlp_norm",
    "mlp.linear_fc1.layer_norm_weight": "mlp_norm",
    "mlp.linear_fc1.weight": "fc1",
    "mlp.linear_fc2.weight": "fc2",
    "mlp.linear_fc2.post_layernorm.weight": "mlp_post_norm",
}
_GLOBAL_ROLES = {
    "embedding.word_embeddings.weight": "embedding",
    "output_layer.weight": "output",
    "decoder.final_layernorm.weight": "final_norm",
}
#: role -> TP split: dim to split, "glu" for [gate; up], None for replicated.
_TP_SPLIT: dict[str, int | str | None] = {
    "embedding": 0, "output": 0, "final_norm": None, "input_norm": None, "qkv": 0,
    "qkv_bias": 0, "q_norm": None, "k_norm": None, "proj": 1, "attn_post_norm": None,
    "mlp_norm": None, "fc1": "glu", "fc2": 1, "mlp_post_norm": None,
}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: Layer roles in HF file order.
_LAYER_ORDER = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "proj", "attn_post_norm",
                "mlp_norm", "fc1", "fc2", "mlp_post_norm")


def layer_roles(info: ModelInfo, layer: int = 0) -> list[str]:
    """The roles transformer layer ``layer`` (global index) of ``info`` has."""
    moe_roles = moe_mapping.moe_layer_roles(info, layer)
    roles = []
    for role in _LAYER_ORDER:
        if role == "qkv_bias" and not info.add_qkv_bias:
            continue
        if role in ("q_norm", "k_norm") and not info.qk_layernorm:
            continue
        if role in ("attn_post_norm", "mlp_post_norm") and not info.gemma_norms:
            continue
        if role in ("fc1", "fc2") and moe_roles is not None:
            if role == "fc1":
                roles += moe_roles
            continue
        roles.append(role)
    return roles


def hf_names(role: str, layer: int | None, info: ModelInfo) -> list[str]:
    """The HF tensors a role is made of (global layer index)."""
    if phi3.is_fused(role, info):
        return [phi3.hf_name(role, layer)]
    if moe_mapping.base_role(role) in moe_mapping.EXPERT_TP_SPLIT:
        return moe_mapping.moe_hf_names(role, layer, info)
    p = f"model.layers.{layer}."
    return {
        "embedding": [EMBED],
        "output": [EMBED if info.tie_word_embeddings else LM_HEAD],
        "final_norm": [FINAL_NORM],
        "input_norm": [p + "input_layernorm.weight"],
        "qkv": [p + f"self_attn.{x}_proj.weight" for x in "qkv"],
        "qkv_bias": [p + f"self_attn.{x}_proj.bias" for x in "qkv"],
        "q_norm": [p + "self_attn.q_norm.weight"],
        "k_norm": [p + "self_attn.k_norm.weight"],
        "proj": [p + "self_attn.o_proj.weight"],
        "attn_post_norm": [p + "post_attention_layernorm.weight"],
        "mlp_norm": [p + ("pre_feedforward_layernorm.weight" if info.gemma_norms
                          else "post_attention_layernorm.weight")],
        "fc1": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "fc2": [p + "mlp.down_proj.weight"],
        "mlp_post_norm": [p + "post_feedforward_layernorm.weight"],
    }[role]


def expected_hf_shapes(info: ModelInfo) -> dict[str, tuple[int, ...]]:
    """Every HF tensor of ``info`` with its shape, in file order (lm_head only when untied)."""
    h, d, f = info.hidden_size, info.kv_channels, info.ffn_hidden_size
    q, kv = info.num_attention_heads * d, info.num_query_groups * d
    shapes = {
        "input_norm": [(h,)], "qkv": [(q, h), (kv, h), (kv, h)], "qkv_bias": [(q,), (kv,), (kv,)],
        "q_norm": [(d,)], "k_norm": [(d,)], "proj": [(h, q)], "attn_post_norm": [(h,)],
        "mlp_norm": [(h,)], "fc1": [(f, h), (f, h)], "fc2": [(h, f)], "mlp_post_norm": [(h,)],
    }
    for role in ("qkv", "fc1"):
        if phi3.is_fused(role, info):
            shapes[role] = [phi3.fused_shape(role, info)]
    out = {EMBED: (info.vocab_size, h)}
    for layer in range(info.num_layers):
        for role in layer_roles(info, layer):
            role_shapes = shapes.get(role) or moe_mapping.moe_hf_shapes(role, info)
            out.update(zip(hf_names(role, layer, info), role_shapes))
    out[FINAL_NORM] = (h,)
    if not info.tie_word_embeddings:
        out[LM_HEAD] = (info.vocab_size, h)
    return out


def check_hf_tensors(hf: SafetensorsFolder, info: ModelInfo) -> list[str]:
    """Raise ValueError naming any missing, unexpected or mis-shaped HF tensor; returns notes
    about tensors that are ignored (a tied model's stored lm_head, RoPE buffers)."""
    expected = expected_hf_shapes(info)
    missing = [n for n in expected if n not in hf]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"{hf.folder}: missing tensors {missing[:5]}{more} for "
                         f"{info.architecture} with {info.num_layers} layers")
    for name, shape in expected.items():
        got = hf.spec(name).shape
        if got != shape:
            raise ValueError(f"tensor {name} in {hf.file_of(name)} has shape {list(got)}, "
                             f"expected {list(shape)} from config.json")
    notes, unexpected = [], []
    for name in hf.names():
        if name in expected:
            continue
        if name.endswith("rotary_emb.inv_freq") or (name == LM_HEAD and info.tie_word_embeddings):
            notes.append(f"ignoring {name} (tied/derived)")
        else:
            unexpected.append(name)
    if unexpected:
        raise ValueError(f"{hf.folder}: tensors with no Megatron counterpart: {unexpected[:5]}")
    return notes


def parse_megatron_name(name: str) -> tuple[str, int | None]:
    """Megatron parameter name -> (role, local layer index or None)."""
    if name in _GLOBAL_ROLES:
        return _GLOBAL_ROLES[name], None
    match = _LAYER_RE.match(name)
    if match and match.group(2) in _LAYER_ROLES:
        return _LAYER_ROLES[match.group(2)], int(match.group(1))
    moe_role = moe_mapping.parse_moe_suffix(match.group(2)) if match else None
    if moe_role is not None:  # the expert index is the rank's local one
        return moe_role, int(match.group(1))
    raise KeyError(f"Megatron parameter {name} has no HF counterpart")


def _qkv_dims(info: ModelInfo) -> tuple[int, int, int]:
    groups = info.num_query_groups
    return groups, info.num_attention_heads // groups * info.kv_channels, info.kv_channels


def to_megatron(role: str, tensors: list[torch.Tensor], info: ModelInfo, tp: int) -> torch.Tensor:
    """Join a role's HF tensors into its unsharded Megatron tensor (vocab padded for ``tp``)."""
    if phi3.is_fused(role, info):
        tensors = phi3.unfuse(role, tensors[0], info)
    if role == "qkv" or role == "qkv_bias":
        groups, q_rows, d = _qkv_dims(info)
        q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in tensors)
        return torch.cat([q, k, v], dim=1).reshape(groups * (q_rows + 2 * d), *q.shape[2:])
    if moe_mapping.base_role(role) in ("fc1", "expert_fc1"):
        return torch.cat(tensors, dim=0)
    if role in ("embedding", "output"):
        (weight,) = tensors
        pad = info.padded_vocab_size(tp) - weight.shape[0]
        return torch.cat([weight, weight.new_zeros(pad, weight.shape[1])]) if pad else weight
    (tensor,) = tensors
    return tensor


def to_hf(role: str, full: torch.Tensor, info: ModelInfo) -> list[torch.Tensor]:
    """Split an unsharded Megatron tensor into its role's HF tensors (views where possible)."""
    parts = _split(role, full, info)
    return [phi3.fuse(parts)] if phi3.is_fused(role, info) else parts


def _split(role: str, full: torch.Tensor, info: ModelInfo) -> list[torch.Tensor]:
    if role == "qkv" or role == "qkv_bias":
        groups, q_rows, d = _qkv_dims(info)
        grouped = full.reshape(groups, q_rows + 2 * d, *full.shape[1:])
        q, k, v = torch.split(grouped, [q_rows, d, d], dim=1)
        return [t.reshape(-1, *full.shape[1:]) for t in (q, k, v)]
    if moe_mapping.base_role(role) in ("fc1", "expert_fc1"):
        return list(torch.chunk(full, 2, dim=0))
    if role in ("embedding", "output"):
        return [full[: info.vocab_size]]
    return [full]


def tp_shard(role: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    """This TP rank's part of an unsharded Megatron tensor."""
    base = moe_mapping.base_role(role)
    split = _TP_SPLIT[base] if base in _TP_SPLIT else moe_mapping.EXPERT_TP_SPLIT[base]
    if split is None or tp == 1:
        return full
    if split == "glu":
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]])
    return full.chunk(tp, dim=split)[tp_rank]


@dataclass(frozen=True)
class HFTensorPlan:
    """One Megatron parameter's HF tensors, for export: where they come from."""

    role: str
    layer: int | None
    param_name: str


def export_plan(info: ModelInfo, param_names: list[str]) -> list[HFTensorPlan]:
    """Export order (HF file order) over an unsharded model's parameters (TP=PP=1)."""
    by_role: dict[tuple[str, int | None], str] = {}
    for name in param_names:
        role, layer = parse_megatron_name(name)
        by_role[(role, layer)] = name
    plan = [HFTensorPlan("embedding", None, by_role[("embedding", None)])]
    for layer in range(info.num_layers):
        for role in layer_roles(info, layer):
            plan.append(HFTensorPlan(role, layer, by_role[(role, layer)]))
    plan.append(HFTensorPlan("final_norm", None, by_role[("final_norm", None)]))
    if not info.tie_word_embeddings:
        plan.append(HFTensorPlan("output", None, by_role[("output", None)]))
    return plan


def hf_specs(info: ModelInfo, dtype: torch.dtype) -> list[TensorSpec]:
    """Header entries of the exported HF tensors, in file order."""
    return [TensorSpec(n, s, dtype) for n, s in expected_hf_shapes(info).items()]


def iter_hf_tensors(
    info: ModelInfo, params: dict[str, torch.Tensor], dtype: torch.dtype,
    progress: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) in file order from an unsharded model's parameters."""
    last_expert = (info.num_moe_experts or 0) - 1
    for item in export_plan(info, list(params)):
        names = hf_names(item.role, item.layer, info)
        if item.role == "output":
            names = [LM_HEAD]
        pieces = to_hf(item.role, params[item.param_name].detach(), info)
        for name, tensor in zip(names, pieces):
            yield name, tensor.to(dtype)
        if progress is not None and item.role in ("fc2", f"expert_fc2.{last_expert}"):
            progress(f"layer {item.layer + 1}/{info.num_layers}")
