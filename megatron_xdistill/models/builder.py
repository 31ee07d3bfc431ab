"""TransformerConfig and GPTModel from a :class:`ModelInfo`, for any parallel layout.

The training runtime builds the student and the teacher in different layouts in the same
processes, so :func:`build_gpt_model` takes the layout's ``pg_collection`` (Megatron's global
parallel_state is used only when none is given).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig

from megatron_xdistill.mcore import compat as mcore_compat
from megatron_xdistill.models import gemma3, moe, phi3
from megatron_xdistill.models.hf_config import (  # noqa: F401 - check_layout: this API too
    ModelInfo,
    check_layout,
    model_info_from_hf,
)
from megatron_xdistill.models.specs import (
    TorchRMSNorm,
    gpt_layer_spec,
    have_transformer_engine,
    torch_block_spec,
)

_ACTIVATIONS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": functools.partial(torch.nn.functional.gelu, approximate="tanh"),
}
_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bf16"``/``"bfloat16"``/``torch.bfloat16`` (and fp32/fp16 likewise) -> torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32")
    return _DTYPES[key]


def transformer_config(
    info: ModelInfo,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dtype: str | torch.dtype = torch.float32,
    ep: int = 1,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron TransformerConfig of ``info`` at a layout: RMSNorm, SwiGLU (GeGLU for Gemma 3),
    GQA, no linear bias (QKV bias for Qwen2), QK RMSNorm (Qwen3, Gemma 3), sliding window on all
    layers (Mistral) or some (Gemma 3), softmax scale (Gemma 3). No dropout unless the HF
    config has attention dropout; MoE layers (Qwen3-MoE, Mixtral) with their experts split over
    ``ep`` expert-parallel ranks (:mod:`.moe`). Kernel fusions are left to the runtime.
    ``overrides`` are
    passed to TransformerConfig last (e.g. ``sequence_parallel=True``,
    ``gradient_accumulation_fusion=True``).
    """
    check_layout(info, tp, pp, cp)
    dtype = torch_dtype(dtype)
    on_gpu = mcore_compat.cuda_available()
    kwargs: dict[str, Any] = dict(
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        ffn_hidden_size=info.ffn_hidden_size,
        num_attention_heads=info.num_attention_heads,
        num_query_groups=info.num_query_groups,
        kv_channels=info.kv_channels,
        layernorm_epsilon=info.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=_ACTIVATIONS[info.activation],
        add_bias_linear=False,
        add_qkv_bias=info.add_qkv_bias,
        qk_layernorm=info.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=info.attention_dropout,
        init_method_std=info.init_method_std,
        window_size=(info.sliding_window - 1, 0) if info.sliding_window else None,
        window_attn_skip_freq=list(info.window_layers) if info.window_layers else None,
        softmax_scale=info.softmax_scale,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=not on_gpu,
        # Pure-PyTorch (jit) fusions on GPUs; those that need Apex/TE kernels stay off here.
        bias_activation_fusion=on_gpu,
        bias_dropout_fusion=on_gpu,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
    )
    kwargs.update(moe.moe_config_kwargs(info, ep))
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def config_from_hf(
    hf_config: Any,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    dtype: str | torch.dtype = torch.float32,
    make_vocab_size_divisible_by: int = 128,
    **overrides: Any,
) -> tuple[TransformerConfig, ModelInfo]:
    """(TransformerConfig, ModelInfo) of an HF config, dict or model folder at a layout."""
    info = model_info_from_hf(hf_config, make_vocab_size_divisible_by)
    return transformer_config(info, tp, pp, cp, dtype, **overrides), info


def _stage_flags(pg_collection: ProcessGroupCollection | None) -> tuple[bool, bool]:
    if pg_collection is None:
        return parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    pp = pg_collection.pp
    return pp.rank() == 0, pp.rank() == pp.size() - 1


def _llama3_inv_freq(info: ModelInfo, rotary) -> torch.Tensor:
    """Llama 3 RoPE frequencies with the HF config's own low/high/original parameters (Megatron's
    constructor fixes them to Llama 3.1's 1 / 4 / 8192)."""
    dim = info.kv_channels
    base = 1.0 / (info.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    s = info.rope_scaling
    inv = rotary._apply_scaling(base, factor=s.factor, low_freq_factor=s.low_freq_factor,
                                high_freq_factor=s.high_freq_factor,
                                original_max_position_embeddings=s.original_max_position_embeddings)
    return inv.to(rotary.inv_freq.device)


def build_gpt_model(
    info: ModelInfo,
    config: TransformerConfig,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    pg_collection: ProcessGroupCollection | None = None,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    parallel_output: bool = True,
) -> GPTModel:
    """GPTModel of ``info`` for this rank's pipeline stage.

    Vocabulary rows: ``info.padded_vocab_size(config.tensor_model_parallel_size)``. ``use_te``:
    None picks the TransformerEngine spec when TE is installed, else the torch-native spec
    (Gemma 3: always the torch-native one).
    ``pre_process``/``post_process`` default to this rank's stage in ``pg_collection`` (or the
    global parallel_state). Call ``model_parallel_cuda_manual_seed`` first, as for any GPTModel.
    """
    mcore_compat.require_installed("building a Megatron GPTModel")
    first, last = _stage_flags(pg_collection)
    pre_process = first if pre_process is None else pre_process
    post_process = last if post_process is None else post_process
    scaling = info.rope_scaling
    if info.gemma_norms:  # torch-native layers only, also where TE is installed
        if use_te:
            raise ValueError(f"{info.architecture}: its layers are built from torch-native "
                             f"modules only (use_te=False)")
        use_te = False
        layer_spec = gemma3.gemma3_layer_spec(
            gpt_layer_spec("RMSNorm", qk_layernorm=info.qk_layernorm, use_te=False),
            info.local_rotary_base)
        final_norm = gemma3.ZeroCenteredRMSNorm
    else:
        if use_te is None:
            use_te = have_transformer_engine()
        if info.local_rotary_base is not None:
            raise ValueError(f"{info.architecture}: a local RoPE base needs Gemma's layer spec")
        layer_spec = gpt_layer_spec("RMSNorm", qk_layernorm=info.qk_layernorm, use_te=use_te)
        final_norm = TorchRMSNorm
    if info.num_moe_experts:  # MoE (and dense) layers by their index
        if use_te:
            from megatron.core.extensions.transformer_engine import TENorm

            final_norm = TENorm
        layer_spec = moe.moe_block_spec(info, layer_spec, moe.moe_layer_spec(info, use_te), config,
                                        _pp_rank(pg_collection), vp_stage, final_norm)
    elif not use_te:  # TE's spec brings its own final norm
        layer_spec = torch_block_spec(layer_spec, config, _pp_rank(pg_collection), vp_stage,
                                      final_norm)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=info.padded_vocab_size(config.tensor_model_parallel_size),
        max_sequence_length=info.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=info.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=info.rotary_percent,
        rotary_base=info.rotary_base,
        rope_scaling=scaling is not None and scaling.rope_type == "llama3",
        rope_scaling_factor=scaling.factor if scaling is not None else 8.0,
        seq_len_interpolation_factor=(
            scaling.factor if scaling is not None and scaling.rope_type == "linear" else None),
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )
    if scaling is not None and scaling.rope_type == "llama3":
        model.rotary_pos_emb.inv_freq = _llama3_inv_freq(info, model.rotary_pos_emb)
    if scaling is not None and scaling.rope_type == "longrope":
        phi3.install_longrope(model, info)
    if info.embedding_multiplier is not None:
        gemma3.scale_embeddings(model, info.embedding_multiplier)
    if mcore_compat.cuda_available() and not config.use_cpu_initialization:
        # Megatron's linears are made on the GPU, torch-native norms on the host; as in
        # Megatron's own get_model, the whole module then moves to the rank's GPU.
        model.cuda(torch.cuda.current_device())
    return model


def build_model_for_layout(
    info: ModelInfo,
    groups: Any,
    dtype: torch.dtype,
    seed: int = 1234,
    use_te: bool | None = None,
    **config_overrides: Any,
) -> tuple[GPTModel, TransformerConfig]:
    """(GPTModel of this rank's stage, its TransformerConfig) in ``groups``' layout
    (:class:`~megatron_xdistill.parallel.layout.ModelParallelGroups`): Megatron's RNG seeded for
    this TP rank, the config for the layout, the model built. The one sequence that training,
    evaluation, conversion and the benchmarks share; ``config_overrides`` go to
    :func:`transformer_config` (e.g. ``perform_initialization=False`` before a load)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    layout = groups.layout
    model_parallel_cuda_manual_seed(seed, tp_rank=groups.coords["tp"],
                                    ep_rank=groups.ep_rank,
                                    etp_rank=groups.coords["tp"], force_reset_rng=True)
    config = transformer_config(info, layout.tp, layout.pp, layout.cp, dtype,
                                ep=getattr(layout, "ep", 1), **config_overrides)
    model = build_gpt_model(info, config, pre_process=groups.is_first_stage,
                            post_process=groups.is_last_stage,
                            pg_collection=groups.pg_collection, use_te=use_te)
    return model, config


def _pp_rank(pg_collection: ProcessGroupCollection | None) -> int:
    if pg_collection is None:
        return parallel_state.get_pipeline_model_parallel_rank()
    return pg_collection.pp.rank()
