"""Torch-native core attention with context parallelism, for layer specs without TransformerEngine.

Megatron-Core's local ``DotProductAttention`` refuses CP > 1 (CP lives in TE there). This module
takes its place in the layer spec: causal softmax attention with GQA and TP-local heads, and with
CP it all-gathers K/V over the CP group and masks by the global positions of Megatron's
load-balanced 2*CP layout. ``config.window_size`` (sliding-window attention, Megatron's
(left, right) convention: keys at positions q - left .. q) is honoured per layer as in Megatron's
``is_layer_window_attention``. Correctness first: memory is O(s_local x s_global) per head.
"""

from __future__ import annotations

import math

import torch
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention
from megatron.core.utils import divide

from megatron_xdistill.parallel.context_parallel import all_gather_sequence, local_positions


class TorchCoreAttention(MegatronModule):
    """Causal scaled-dot-product attention over [s, b, heads, dim] tensors, CP-capable.

    Same constructor as Megatron's ``DotProductAttention`` so it drops into a ``ModuleSpec``.
    Scores and softmax are computed in fp32.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"TorchCoreAttention supports causal masks only, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling:
            raise ValueError("TorchCoreAttention does not implement apply_query_key_layer_scaling")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.tp_group = pg_collection.tp
        self.cp_group = getattr(pg_collection, "cp", None)
        tp_size = self.tp_group.size()
        self.heads_per_partition = divide(config.num_attention_heads, tp_size)
        self.groups_per_partition = divide(config.num_query_groups, tp_size)
        self.head_dim = config.kv_channels
        if softmax_scale is None:
            softmax_scale = config.softmax_scale or 1.0 / math.sqrt(self.head_dim)
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window_left = -1
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                     layer_number):
            left, right = config.window_size
            if right not in (0, -1):
                raise ValueError(f"TorchCoreAttention is causal; window_size right={right}")
            self.window_left = left

    def _cp_size_rank(self) -> tuple[int, int]:
        if self.cp_group is None:
            return 1, 0
        return self.cp_group.size(), self.cp_group.rank()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query [sq, b, np, hn], key/value [sk, b, ng, hn] -> context [sq, b, np * hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("TorchCoreAttention supports neither packed sequences nor bias")
        cp_size, cp_rank = self._cp_size_rank()
        s_local = query.size(0)
        if cp_size > 1:
            key = all_gather_sequence(key, self.cp_group)
            value = all_gather_sequence(value, self.cp_group)
            seq = s_local * cp_size
            q_pos = local_positions(seq, cp_rank, cp_size)
            k_pos = torch.cat([local_positions(seq, r, cp_size) for r in range(cp_size)])
        else:  # the queries are the last s_local keys' positions (a KV-cached decoding step)
            k_pos = torch.arange(key.size(0))
            q_pos = k_pos[key.size(0) - s_local:]
        # Key position after query position -> masked (True = masked, Megatron's convention).
        mask = k_pos[None, :] > q_pos[:, None]
        if self.window_left >= 0:
            mask = mask | (k_pos[None, :] < q_pos[:, None] - self.window_left)
        mask = mask.to(query.device)
        if attention_mask is not None and cp_size == 1:
            mask = mask | attention_mask.to(torch.bool)

        rep = self.heads_per_partition // self.groups_per_partition
        if rep > 1:
            key = key.repeat_interleave(rep, dim=2)
            value = value.repeat_interleave(rep, dim=2)
        # [s, b, h, d] -> [b, h, s, d]
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * self.softmax_scale
        scores = scores.masked_fill(mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        if self.training and self.dropout_p > 0:
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                probs = torch.nn.functional.dropout(probs, p=self.dropout_p)
        context = torch.matmul(probs, v)  # [b, h, sq, d]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(s_local, context.size(1), self.heads_per_partition * self.head_dim)
