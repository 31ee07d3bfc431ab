"""GPT layer specs: TransformerEngine's when it is installed, torch-native everywhere else.

The torch-native spec is Megatron-Core's local spec with the core attention replaced by
:class:`~megatron_xdistill.models.attention.TorchCoreAttention`, which supports context
parallelism without TE, and its RMSNorms by :class:`TorchRMSNorm`, which supports sequence
parallelism (Megatron's ``WrappedTorchNorm`` refuses it). :func:`torch_block_spec` makes the
block spec (this stage's layers and the final norm) that GPTModel takes.
"""

from __future__ import annotations

import importlib.util

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class TorchRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with Megatron's norm constructor (``config, hidden_size, eps``).

    Its weight carries ``sequence_parallel``, so with sequence parallelism (each TP rank
    normalises its part of the sequence) Megatron reduces the weight's gradient over TP. It is
    in the model's parameter dtype, as every other weight and as Megatron-LM's Float16Module
    makes it: Megatron's bf16 / fp16 optimizer checkpoints its fp32 main copies of the 16-bit
    parameters only (a weight left in fp32 made every --bf16 save fail).
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                 **unused) -> None:
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


def torch_block_spec(layer_spec: ModuleSpec, config: TransformerConfig, pp_rank: int,
                     vp_stage: int | None = None,
                     final_norm: type = TorchRMSNorm) -> TransformerBlockSubmodules:
    """Block spec of a torch-native layer spec: this pipeline stage's layers + ``final_norm``."""
    layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=final_norm)


def have_transformer_engine() -> bool:
    """True when TransformerEngine can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(
    normalization: str = "RMSNorm", qk_layernorm: bool = False, use_te: bool | None = None,
    num_experts: int | None = None,
) -> ModuleSpec:
    """Transformer layer spec of a GPT model: dense, or with ``num_experts`` Megatron-Core's MoE
    MLP (router + SequentialMLP experts, no grouped GEMM; see :mod:`.moe`).

    ``use_te=None`` picks TE when installed. ``normalization`` is "RMSNorm" or "LayerNorm".
    """
    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_layernorm)

    import warnings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_xdistill.models.attention import TorchCoreAttention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False,
                                        normalization=normalization, qk_layernorm=qk_layernorm)
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = TorchCoreAttention
    if normalization == "RMSNorm":
        layer.input_layernorm = layer.pre_mlp_layernorm = TorchRMSNorm
        if qk_layernorm:
            layer.self_attention.submodules.q_layernorm = TorchRMSNorm
            layer.self_attention.submodules.k_layernorm = TorchRMSNorm
    return spec
