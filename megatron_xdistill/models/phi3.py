"""The Phi-3 family (HF ``Phi3ForCausalLM``: Phi-3, Phi-3.5-mini, Phi-4-mini) in Megatron-Core.

Its layer is Llama's; what differs is handled where it lives:

* fused ``qkv_proj`` / ``gate_up_proj``: a weight layout, split in the conversion
  (:mod:`conversion.phi3`);
* partial rotary embedding (Phi-4-mini rotates 96 of 128 channels): GPTModel's
  ``rotary_percent``, which, as HF, rotates the first channels and passes the rest through;
* ``sliding_window``, applied by HF whenever set: Megatron's ``window_size`` (see the builder);
* LongRoPE (:mod:`.longrope`): :class:`LongRopeRotaryEmbedding` takes GPTModel's rotary module's
  place and picks the short or the long factors from the forward's whole sequence length, the
  one Megatron computes the table for (under CP: the local length times CP, the whole
  sequence; with packed sequences the longest one) -- HF's ``max(position_ids) + 1`` for the
  positions 0..s-1 both run; the attention factor multiplies cos and sin of the rotated
  channels through Megatron's own RoPE ``mscale`` (:func:`install_longrope`).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from megatron_xdistill.models.hf_config import ModelInfo
from megatron_xdistill.models.longrope import longrope_inv_freq, uses_long_factors

#: The attribute Megatron-Core's Attention multiplies RoPE's cos and sin by (YaRN's mscale).
_MSCALE_ATTR = "_yarn_concentration_factor"


class LongRopeRotaryEmbedding(RotaryEmbedding):
    """Megatron's RotaryEmbedding with LongRoPE frequencies: the short factors' table for
    sequences up to ``original_max_position_embeddings``, the long factors' past it."""

    def __init__(self, info: ModelInfo, use_cpu_initialization: bool = True,
                 cp_group: torch.distributed.ProcessGroup | None = None) -> None:
        scaling = info.rope_scaling
        if scaling is None or scaling.rope_type != "longrope":
            raise ValueError(f"{info.architecture}: LongRopeRotaryEmbedding needs LongRoPE scaling")
        super().__init__(kv_channels=info.kv_channels, rotary_percent=info.rotary_percent,
                         rotary_base=info.rotary_base,
                         use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        dim = self.inv_freq.numel() * 2
        self.original_max_position_embeddings = scaling.original_max_position_embeddings
        self.short_inv_freq = longrope_inv_freq(info.rotary_base, dim, scaling.short_factor)
        self.long_inv_freq = longrope_inv_freq(info.rotary_base, dim, scaling.long_factor)
        self.inv_freq = self.short_inv_freq.to(self.inv_freq.device)
        #: when set, the factors are chosen for sequences of this length (or the forward's, if
        #: longer): see :func:`decide_longrope_at`
        self.decision_length: int | None = None

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
        """RoPE angles [max_seq_len, 1, 1, rotary dim] (this CP rank's part) of the factors
        ``max_seq_len`` selects."""
        length = max(max_seq_len, self.decision_length or 0)
        long = uses_long_factors(length, self.original_max_position_embeddings)
        chosen = self.long_inv_freq if long else self.short_inv_freq
        self.inv_freq = chosen.to(self.inv_freq.device)
        emb = self.get_emb(max_seq_len, offset)
        if cp_group is None:
            cp_group = self.cp_group
        if cp_group is not None and cp_group.size() > 1 and not packed_seq:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, cp_group)
        return emb

    def get_rotary_seq_len(self, inference_context, *args, **kwargs) -> int:
        """Megatron's table length; refuses decoding past the original length, where HF switches
        to the long factors mid-generation (its cached keys keep the short ones) and a table
        computed once for the whole budget cannot agree with it."""
        length = super().get_rotary_seq_len(inference_context, *args, **kwargs)
        if inference_context is not None and uses_long_factors(
                length, self.original_max_position_embeddings):
            raise NotImplementedError(
                f"LongRoPE decoding to {length} tokens passes original_max_position_embeddings="
                f"{self.original_max_position_embeddings}; generate at most that many tokens "
                f"(prompt + new) with this model")
        return length


def install_longrope(model: torch.nn.Module, info: ModelInfo) -> None:
    """Give a freshly built GPTModel of ``info`` LongRoPE: its rotary module replaced by a
    :class:`LongRopeRotaryEmbedding` and every attention layer's RoPE ``mscale`` set to the
    attention factor (the rotated channels of q and k scaled, the passed-through ones not)."""
    scaling = info.rope_scaling
    config = model.config
    old = model.rotary_pos_emb
    model.rotary_pos_emb = LongRopeRotaryEmbedding(
        info, use_cpu_initialization=old.inv_freq.device.type == "cpu", cp_group=old.cp_group)
    factor = float(scaling.attention_factor or 1.0)
    if factor == 1.0:
        return
    if getattr(config, "fused_single_qkv_rope", False):
        raise ValueError(f"{info.architecture}: LongRoPE's attention factor {factor:.6f} needs "
                         "fused_single_qkv_rope=False (the fused kernel has no mscale)")
    for layer in model.decoder.layers:
        attention = layer.self_attention
        if not hasattr(attention, _MSCALE_ATTR):
            raise RuntimeError(f"this Megatron-Core's attention has no {_MSCALE_ATTR}; LongRoPE's "
                               "attention factor cannot be applied")
        setattr(attention, _MSCALE_ATTR, factor)


def decide_longrope_at(model: torch.nn.Module, length: int) -> None:
    """Choose a LongRoPE model's factors as for batches of ``length`` positions, whatever width
    a forward runs (no-op for other models). The teacher runs each micro-batch only as wide as
    its longest text needs, rounded to its layout (CP, sequence parallelism) and, with PP, the
    same for the replica's whole block: without this, whether a sample past the original length
    saw the short or the long factors would depend on the layout and on its neighbours; with
    it, every sample sees what HF computes on the batch padded to ``--teacher-seq-length``."""
    for module in model.modules():
        if isinstance(module, LongRopeRotaryEmbedding):
            module.decision_length = int(length)
