"""A tiny Megatron GPTModel and model-parallel (re)initialisation for multi-rank tests.

Tests run many layouts inside one set of ranks, so :func:`init_model_parallel` tears down the
previous layout before building the next one.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer import TransformerConfig

from megatron_xdistill.mcore import compat as mcore_compat
from megatron_xdistill.models.specs import gpt_layer_spec, torch_block_spec

TINY_VOCAB = 256


def init_model_parallel(tp: int = 1, pp: int = 1, cp: int = 1, seed: int = 1234) -> None:
    """(Re)initialise Megatron's global model-parallel state and RNG for this layout."""
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def tiny_config(tp: int = 1, pp: int = 1, cp: int = 1, **overrides) -> TransformerConfig:
    """A small Llama-like TransformerConfig (RMSNorm, SwiGLU, GQA, no bias, no dropout), fp32."""
    kwargs = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        use_cpu_initialization=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        bias_activation_fusion=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_tiny_gpt(config: TransformerConfig, vocab_size: int = TINY_VOCAB,
                   seq_length: int = 64, tied: bool = True) -> GPTModel:
    """GPTModel with the torch-native layer spec for the current pipeline stage."""
    mcore_compat.require_installed("building a Megatron GPTModel")
    return GPTModel(
        config=config,
        transformer_layer_spec=torch_block_spec(
            gpt_layer_spec(normalization=config.normalization, use_te=False), config,
            ps.get_pipeline_model_parallel_rank()),
        vocab_size=vocab_size,
        max_sequence_length=seq_length,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=tied,
        position_embedding_type="rope",
    )
