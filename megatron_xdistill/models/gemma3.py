"""Gemma 3 in Megatron-Core terms: the pieces a Llama-style GPTModel lacks.

Gemma 3 (HF ``Gemma3ForCausalLM``) differs from the Llama layer in five places, each mapped to a
drop-in module of the torch-native layer spec:

* RMSNorm scales by ``1 + weight`` and computes in fp32 (:class:`ZeroCenteredRMSNorm`, every
  norm: input, pre-MLP, Q/K, final);
* "sandwich" norms: the attention output and the MLP output are normalised again before the
  residual add (:class:`PostNormRowParallelLinear`, the output projections with their norm);
* sliding-window layers use RoPE with their own base (``rope_local_base_freq``, 10k), global
  layers the model's (1M, optionally linearly scaled) (:class:`LocalRopeSelfAttention`);
* the embedding output is multiplied by sqrt(hidden) in the weights' dtype
  (:func:`scale_embeddings`);
* GeLU(tanh) gating and a softmax scale of ``query_pre_attn_scalar ** -0.5`` (TransformerConfig).

Which layers slide is Megatron's ``window_attn_skip_freq`` (a per-layer list), honoured by
:class:`~megatron_xdistill.models.attention.TorchCoreAttention`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm computed in fp32 and scaled by ``1 + weight`` (weights start at 0), as Gemma's.

    Constructor of Megatron's norm modules (``config, hidden_size, eps``), so it fills any norm
    slot of a layer spec. Weights carry ``sequence_parallel`` like Megatron's norms, so their
    gradients are reduced over TP when sequence parallelism is on.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6,
                 **unused) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class PostNormRowParallelLinear(RowParallelLinear):
    """Row-parallel output projection followed by a norm of its (reduced) output.

    Gemma's ``post_attention_layernorm`` / ``post_feedforward_layernorm`` sit between the
    attention (MLP) output and the residual add; as part of ``linear_proj`` (``linear_fc2``) they
    need no change to Megatron's TransformerLayer. Its parameter: ``post_layernorm.weight``.
    """

    def __init__(self, input_size: int, output_size: int, *, config: TransformerConfig,
                 bias: bool, skip_bias_add: bool, **kwargs) -> None:
        if bias:
            raise ValueError("PostNormRowParallelLinear: a bias before the norm is not supported")
        super().__init__(input_size, output_size, config=config, bias=False,
                         skip_bias_add=skip_bias_add, **kwargs)
        self.post_layernorm = ZeroCenteredRMSNorm(config, output_size, config.layernorm_epsilon)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        output, _ = super().forward(input_)
        return self.post_layernorm(output), None


class LocalRopeSelfAttention(SelfAttention):
    """Self-attention whose sliding-window layers rotate with their own RoPE base.

    GPTModel computes one RoPE table (the global layers' base and scaling) and hands it to every
    layer; a sliding layer replaces it by its own table of the same positions (same length, same
    CP slice), without scaling. ``local_rotary_base`` comes from the spec's params.
    """

    def __init__(self, config: TransformerConfig, submodules, layer_number: int, *args,
                 local_rotary_base: float | None = None, **kwargs) -> None:
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.local_rotary = None
        local_base = local_rotary_base
        if local_base is not None and is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, layer_number):
            self.local_rotary = RotaryEmbedding(
                kv_channels=config.kv_channels, rotary_percent=1.0, rotary_base=local_base,
                use_cpu_initialization=config.use_cpu_initialization,
                cp_group=self.pg_collection.cp)

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        rotary = kwargs.get("rotary_pos_emb")
        if self.local_rotary is not None and rotary is not None:
            if kwargs.get("packed_seq_params") is not None:
                raise NotImplementedError("Gemma 3 local RoPE: packed sequences are not supported")
            group = self.local_rotary.cp_group  # None while decoding (generation.decoding_mode)
            cp = group.size() if group is not None else 1
            local = self.local_rotary(rotary.size(0) * cp)
            kwargs["rotary_pos_emb"] = local.to(rotary.device)
        return super().forward(hidden_states, attention_mask, *args, **kwargs)


def gemma3_layer_spec(layer_spec: ModuleSpec, local_rotary_base: float | None) -> ModuleSpec:
    """Turn the torch-native GPT layer spec into Gemma 3's (see the module docstring); its final
    norm is a :class:`ZeroCenteredRMSNorm` too."""
    spec = copy.deepcopy(layer_spec)
    layer = spec.submodules
    layer.input_layernorm = ZeroCenteredRMSNorm
    layer.pre_mlp_layernorm = ZeroCenteredRMSNorm
    attention = layer.self_attention
    attention.module = LocalRopeSelfAttention
    attention.params = {**attention.params, "local_rotary_base": local_rotary_base}
    attention.submodules.q_layernorm = ZeroCenteredRMSNorm
    attention.submodules.k_layernorm = ZeroCenteredRMSNorm
    attention.submodules.linear_proj = PostNormRowParallelLinear
    layer.mlp = _with_fc2(layer.mlp, PostNormRowParallelLinear)
    return spec


def _with_fc2(mlp_spec, linear_fc2):
    """The MLP spec with another ``linear_fc2`` (a ModuleSpec, or megatron-core 0.19's
    ``partial(MLP.as_mlp_submodule, submodules=...)``)."""
    if isinstance(mlp_spec, functools.partial):
        submodules = dataclasses.replace(mlp_spec.keywords["submodules"], linear_fc2=linear_fc2)
        return functools.partial(mlp_spec.func, *mlp_spec.args,
                                 **{**mlp_spec.keywords, "submodules": submodules})
    mlp_spec.submodules.linear_fc2 = linear_fc2
    return mlp_spec


def scale_embeddings(model: torch.nn.Module, multiplier: float) -> None:
    """Multiply the embedding output by ``multiplier`` in its own dtype (Gemma: sqrt(hidden)).

    A forward hook on ``model.embedding`` (first pipeline stage only); the tied output layer
    reads the unscaled weights, as in HF.
    """
    embedding = getattr(model, "embedding", None)
    if embedding is None:
        return

    def hook(module, inputs, output):
        return output * torch.tensor(multiplier, dtype=output.dtype, device=output.device)

    embedding.register_forward_hook(hook)
