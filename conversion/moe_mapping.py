"""HF <-> Megatron names and shapes of mixture-of-experts layers (Qwen3-MoE, Mixtral).

Megatron-Core's MoE layer (SequentialMLP experts) holds per layer ``mlp.router.weight``
[experts, hidden] and, per local expert i, ``mlp.experts.local_experts.{i}.linear_fc1.weight``
([gate; up], as a dense SwiGLU fc1) and ``...linear_fc2.weight``. An expert-parallel rank holds
experts ``ep_rank * E / EP + i``; roles name the *global* expert (``expert_fc1.7``) so that the
rest of :mod:`conversion.mapping` treats an expert as one more layer role: fc1 joins gate and up,
TP splits fc1 per [gate; up] half (dim 0) and fc2 along dim 1 (expert TP = TP), the router is
replicated.

HF names: Qwen3-MoE ``mlp.gate.weight`` and ``mlp.experts.{e}.{gate,up,down}_proj.weight``;
Mixtral ``block_sparse_moe.gate.weight`` and ``block_sparse_moe.experts.{e}.w1`` (gate) /
``w3`` (up) / ``w2`` (down) — the hub format, which ``save_pretrained`` writes too.
"""

from __future__ import annotations

import re

from megatron_xdistill.models.hf_config import ModelInfo
from megatron_xdistill.models.moe import is_moe_layer

_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
ROUTER_SUFFIX = "mlp.router.weight"
#: Megatron roles of one expert (``expert_fc1.<global expert>``) and their TP split.
EXPERT_TP_SPLIT: dict[str, int | str | None] = {"router": None, "expert_fc1": "glu",
                                                "expert_fc2": 1}


def base_role(role: str) -> str:
    """``expert_fc1.7`` -> ``expert_fc1``; other roles unchanged."""
    return role.split(".", 1)[0]


def expert_of(role: str) -> int | None:
    """The global expert a role belongs to (None for non-expert roles)."""
    return int(role.split(".", 1)[1]) if role.startswith("expert_") else None


def parse_moe_suffix(suffix: str) -> str | None:
    """Layer-parameter suffix -> role with the *local* expert index (``expert_fc2.0``), or None
    when the suffix is not an MoE parameter."""
    if suffix == ROUTER_SUFFIX:
        return "router"
    match = _EXPERT_RE.match(suffix)
    if match is None:
        return None
    return f"expert_fc{match.group(2)}.{match.group(1)}"


def globalize(role: str, local_expert_indices: list[int]) -> str:
    """Role with a local expert index -> the same role with the global one."""
    expert = expert_of(role)
    if expert is None:
        return role
    return f"{base_role(role)}.{local_expert_indices[expert]}"


def moe_layer_roles(info: ModelInfo, layer: int) -> list[str] | None:
    """The MLP roles of layer ``layer`` in HF file order (router, then each expert's fc1 and
    fc2), or None when the layer has a dense MLP."""
    if not is_moe_layer(info, layer):
        return None
    roles = ["router"]
    for expert in range(info.num_moe_experts):
        roles += [f"expert_fc1.{expert}", f"expert_fc2.{expert}"]
    return roles


def moe_hf_names(role: str, layer: int, info: ModelInfo) -> list[str]:
    """HF tensors of an MoE role of global layer ``layer``."""
    expert = expert_of(role)
    if info.family == "mixtral":
        p = f"model.layers.{layer}.block_sparse_moe."
        names = {"router": ["gate.weight"], "expert_fc1": ["w1.weight", "w3.weight"],
                 "expert_fc2": ["w2.weight"]}
    else:
        p = f"model.layers.{layer}.mlp."
        names = {"router": ["gate.weight"],
                 "expert_fc1": ["gate_proj.weight", "up_proj.weight"],
                 "expert_fc2": ["down_proj.weight"]}
    base = base_role(role)
    if expert is not None:
        p += f"experts.{expert}."
    return [p + n for n in names[base]]


def moe_hf_shapes(role: str, info: ModelInfo) -> list[tuple[int, ...]]:
    """Shapes of an MoE role's HF tensors."""
    h, f = info.hidden_size, info.moe_ffn_hidden_size
    return {"router": [(info.num_moe_experts, h)], "expert_fc1": [(f, h), (f, h)],
            "expert_fc2": [(h, f)]}[base_role(role)]
