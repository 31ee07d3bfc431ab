"""GPT layer specs: TransformerEngine's when it is installed, torch-native everywhere else.

The torch-native spec is Megatron-Core's local spec with the core attention replaced by
:class:`~megatron_xdistill.models.attention.TorchCoreAttention`, which supports context
parallelism without TE.
"""

from __future__ import annotations

import importlib.util

from megatron.core.transformer.spec_utils import ModuleSpec


def have_transformer_engine() -> bool:
    """True when TransformerEngine can be imported."""
    return importlib.util.find_spec("transformer_engine") is not None


def gpt_layer_spec(
    normalization: str = "RMSNorm", qk_layernorm: bool = False, use_te: bool | None = None
) -> ModuleSpec:
    """Transformer layer spec for a dense GPT model (no MoE).

    ``use_te=None`` picks TE when installed. ``normalization`` is "RMSNorm" or "LayerNorm".
    """
    if use_te is None:
        use_te = have_transformer_engine()
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm)

    import warnings

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_xdistill.models.attention import TorchCoreAttention

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = get_gpt_layer_local_spec(normalization=normalization, qk_layernorm=qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = TorchCoreAttention
    return spec
