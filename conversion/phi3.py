"""The Phi-3 family's fused HF projections, for :mod:`conversion.mapping`.

``Phi3ForCausalLM`` stores each layer's q, k and v projections as one ``self_attn.qkv_proj``
(rows: all query heads, then the KV heads' keys, then their values) and the MLP's gate and up
projections as one ``mlp.gate_up_proj`` (rows: gate, then up). The mapping works on the separate
tensors (q, k, v; gate, up) that the other families store: :func:`unfuse` cuts a fused tensor
into them on import and :func:`fuse` joins them again on export (row slices and one ``cat``:
bit-exact). Megatron's layouts and TP splits are then those of every other family: ``linear_qkv``
grouped per query group, ``linear_fc1`` as [gate; up] with each TP rank holding
[gate_r; up_r].
"""

from __future__ import annotations

import torch

from megatron_xdistill.models.hf_config import ModelInfo

#: role -> the fused HF tensor's name inside ``model.layers.N.``
FUSED_NAMES = {"qkv": "self_attn.qkv_proj.weight", "fc1": "mlp.gate_up_proj.weight"}


def is_fused(role: str, info: ModelInfo) -> bool:
    """True when ``info`` stores ``role`` as one fused HF tensor."""
    return info.family == "phi3" and role in FUSED_NAMES


def hf_name(role: str, layer: int) -> str:
    """The fused HF tensor of ``role`` in ``layer`` (global index)."""
    return f"model.layers.{layer}.{FUSED_NAMES[role]}"


def _row_sizes(role: str, info: ModelInfo) -> list[int]:
    if role == "qkv":
        kv = info.num_query_groups * info.kv_channels
        return [info.num_attention_heads * info.kv_channels, kv, kv]
    return [info.ffn_hidden_size, info.ffn_hidden_size]


def fused_shape(role: str, info: ModelInfo) -> tuple[int, int]:
    """Shape of the fused HF tensor of ``role``."""
    return sum(_row_sizes(role, info)), info.hidden_size


def unfuse(role: str, fused: torch.Tensor, info: ModelInfo) -> list[torch.Tensor]:
    """A fused HF tensor -> its parts in HF order ([q, k, v] or [gate, up]), as views."""
    sizes = _row_sizes(role, info)
    if fused.shape[0] != sum(sizes):
        raise ValueError(f"fused {role} tensor has {fused.shape[0]} rows, expected {sum(sizes)} "
                         f"({' + '.join(map(str, sizes))})")
    return list(torch.split(fused, sizes, dim=0))


def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts of a fused HF tensor joined in their order."""
    return torch.cat(parts, dim=0)
