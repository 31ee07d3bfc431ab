"""Megatron GPTModel builders from Hugging Face configs; layer specs (torch-native, TE when
installed); model checkpoints that carry their own architecture.

Supported: Llama (Llama 2/3.x, SmolLM2), Mistral (sliding window), Qwen2/Qwen2.5 (QKV bias, tied
or untied head), Qwen3 (QK RMSNorm), Gemma 3 text models (:mod:`.gemma3`: sandwich norms, local
and global layers with their own RoPE, GeGLU, scaled embeddings; torch-native layers only), the
Phi-3 family (:mod:`.phi3`: fused projections, partial rotary, LongRoPE, Phi-4-mini). See
``SUPPORTED_ARCHITECTURES``.

API for the training runtime::

    info = load_model_info(ckpt_dir)                       # ModelInfo from xdistill_model.json
    config = transformer_config(info, tp, pp, cp, dtype)   # TransformerConfig for one layout
    #   or: config, info = config_from_hf(hf_config_or_dir, tp, pp, cp, dtype)
    model = build_gpt_model(info, config, pre_process, post_process,
                            pg_collection=pgs, vp_stage=None)   # GPTModel for this stage
    #   or, seeded, at a ModelParallelGroups' layout and stage:
    #   model, config = build_model_for_layout(info, groups, dtype, seed)
    load_megatron_checkpoint(model, ckpt_dir, pg_collection=pgs)  # any TP/PP
    save_megatron_checkpoint(model, out_dir, info, pg_collection=pgs)  # atomic
    keep_hf_files(run_root, load_dir)  # tokenizer/config next to a run: export needs no template

``ModelInfo`` fields: architecture, family, num_layers, hidden_size, ffn_hidden_size,
num_attention_heads, num_query_groups, kv_channels, vocab_size (real; the loss normalises over
it), max_position_embeddings (``seq_length``), norm_epsilon, rotary_base, rope_scaling
(``RopeScaling`` or None), tie_word_embeddings, add_qkv_bias, qk_layernorm, sliding_window,
window_layers, local_rotary_base, activation, gemma_norms, embedding_multiplier, softmax_scale,
attention_dropout, init_method_std, hf_dtype, make_vocab_size_divisible_by, hf_config; and
``padded_vocab_size(tp)``: Megatron's padded vocabulary (multiple of
``make_vocab_size_divisible_by * tp``) that the model's embedding and logits have; logit columns
``>= vocab_size`` are padding and never real tokens.
"""

import importlib

#: Exported name -> the submodule that defines it. Imported on first use: the model description
#: (``load_model_info``, ``ModelInfo``) needs no Megatron-Core, so a run can check its inputs
#: before the seconds that importing Megatron-Core takes.
_EXPORTS = {
    "CheckpointError": "description",
    "HF_FILES_DIR": "model_checkpoint",
    "MODEL_INFO_FILE": "description",
    "ModelInfo": "hf_config",
    "RopeScaling": "hf_config",
    "SUPPORTED_ARCHITECTURES": "hf_config",
    "UnsupportedModelError": "hf_config",
    "build_gpt_model": "builder",
    "build_model_for_layout": "builder",
    "check_layout": "hf_config",
    "check_tokenizer_fits": "description",
    "config_from_hf": "builder",
    "copy_hf_files": "model_checkpoint",
    "decide_longrope_at": "phi3",
    "hf_files_dir": "model_checkpoint",
    "keep_hf_files": "model_checkpoint",
    "load_megatron_checkpoint": "model_checkpoint",
    "load_model_info": "description",
    "model_info_from_hf": "hf_config",
    "read_model_json": "description",
    "resolve_checkpoint_dir": "description",
    "save_megatron_checkpoint": "model_checkpoint",
    "save_model_info": "description",
    "sharded_model_state_dict": "model_checkpoint",
    "torch_dtype": "builder",
    "transformer_config": "builder",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "HF_FILES_DIR",
    "MODEL_INFO_FILE",
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "ModelInfo",
    "RopeScaling",
    "UnsupportedModelError",
    "build_gpt_model",
    "build_model_for_layout",
    "check_layout",
    "config_from_hf",
    "copy_hf_files",
    "decide_longrope_at",
    "hf_files_dir",
    "keep_hf_files",
    "load_megatron_checkpoint",
    "check_tokenizer_fits",
    "load_model_info",
    "model_info_from_hf",
    "read_model_json",
    "resolve_checkpoint_dir",
    "save_megatron_checkpoint",
    "save_model_info",
    "sharded_model_state_dict",
    "torch_dtype",
    "transformer_config",
]
