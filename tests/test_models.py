"""GPTModel builders from HF configs: ModelInfo parsing, TransformerConfig, padded vocabulary,
model-info files, and (on 2 CPU ranks) a build from an explicit pg_collection that equals the
parallel_state-based build."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_xdistill.models import (
    SUPPORTED_ARCHITECTURES,
    CheckpointError,
    ModelInfo,
    UnsupportedModelError,
    check_layout,
    load_model_info,
    model_info_from_hf,
    save_model_info,
    transformer_config,
)
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import TINY_FAMILIES, tiny_config

# Published configs (transformers 4.x style: rope_theta + rope_scaling), abbreviated to the keys
# that matter; numbers as released.
LLAMA_32_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
    "max_window_layers": 21, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("family", [f for f in TINY_FAMILIES if not f.startswith("phi")])
def test_model_info_of_each_family(family):  # the Phi-3 family's: tests/test_phi3.py
    info = model_info_from_hf(tiny_config(family))
    spec = TINY_FAMILIES[family]
    assert info.architecture == spec.architecture
    assert info.vocab_size == spec.vocab_size
    assert (info.num_layers, info.hidden_size, info.ffn_hidden_size) == (4, 64, 96)
    assert (info.num_attention_heads, info.num_query_groups) == (4, 2)
    assert info.tie_word_embeddings == spec.overrides["tie_word_embeddings"]
    assert info.add_qkv_bias == (family == "qwen2")
    assert info.qk_layernorm == (family in ("qwen3", "qwen3_moe", "gemma3"))
    assert info.kv_channels == (32 if family in ("qwen3", "qwen3_moe") else 16)
    assert info.sliding_window == (8 if family in ("mistral", "mixtral", "gemma3") else None)
    assert info.window_layers == ([1, 0, 1, 0] if family == "gemma3" else None)
    assert info.gemma_norms == (family == "gemma3")
    config = transformer_config(info, dtype="bf16")
    assert config.add_qkv_bias == info.add_qkv_bias and config.qk_layernorm == info.qk_layernorm
    assert config.kv_channels == info.kv_channels and config.gated_linear_unit
    assert config.normalization == "RMSNorm" and not config.add_bias_linear
    assert config.params_dtype == torch.bfloat16 and config.bf16
    assert config.window_size == ((7, 0) if family in ("mistral", "mixtral", "gemma3") else None)
    assert config.num_moe_experts == (4 if family in ("qwen3_moe", "mixtral") else None)
    if family == "gemma3":
        assert config.window_attn_skip_freq == [1, 0, 1, 0]
        assert config.softmax_scale == pytest.approx(24 ** -0.5)
        assert (info.rotary_base, info.local_rotary_base) == (1e6, 1e4)
        assert info.rope_scaling.rope_type == "linear" and info.embedding_multiplier == 8.0


def test_published_configs_in_transformers4_style():
    llama = model_info_from_hf(LLAMA_32_1B)
    assert llama.rotary_base == 500000.0 and llama.tie_word_embeddings
    assert llama.rope_scaling.rope_type == "llama3" and llama.rope_scaling.factor == 32.0
    assert llama.rope_scaling.original_max_position_embeddings == 8192
    assert (llama.num_query_groups, llama.kv_channels, llama.hf_dtype) == (8, 64, "bfloat16")
    qwen = model_info_from_hf(QWEN25_05B)
    assert qwen.add_qkv_bias and qwen.sliding_window is None  # use_sliding_window is False
    assert (qwen.kv_channels, qwen.norm_epsilon, qwen.rotary_base) == (64, 1e-6, 1e6)


@pytest.mark.parametrize("vocab,tp,padded", [
    (151936, 1, 151936), (151936, 2, 152064), (151936, 8, 152576), (49152, 8, 49152),
    (32000, 2, 32000), (32000, 4, 32256), (128256, 4, 128512), (50257, 1, 50304),
])
def test_padded_vocab_size_is_megatrons(vocab, tp, padded):
    info = model_info_from_hf({**QWEN25_05B, "vocab_size": vocab})
    assert info.vocab_size == vocab
    assert info.padded_vocab_size(tp) == padded


@pytest.mark.parametrize("config,needle", [
    ({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}, "GPT2LMHeadModel"),
    ({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2"}, "Gemma2ForCausalLM"),
    ({"model_type": "falcon"}, "falcon"),
])
def test_unsupported_architecture_names_the_supported_ones(config, needle):
    with pytest.raises(UnsupportedModelError) as err:
        model_info_from_hf(config)
    message = str(err.value)
    assert needle in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "llama3"),
    ({"attention_bias": True}, "o_proj"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
    ({"layer_types": ["full_attention"] * 8 + ["chunked_attention"] * 8}, "chunked_attention"),
    ({"final_logit_softcapping": 30.0}, "soft-capping"),
])
def test_unsupported_features_are_refused(change, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        model_info_from_hf({**LLAMA_32_1B, **change})


def test_layout_that_does_not_divide_the_model_is_refused():
    smollm2 = model_info_from_hf({**LLAMA_32_1B, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "num_hidden_layers": 30})
    with pytest.raises(ValueError, match="TP=2"):
        check_layout(smollm2, tp=2)
    with pytest.raises(ValueError, match="PP=4"):
        transformer_config(smollm2, pp=4)
    check_layout(smollm2, tp=3, pp=5)


def test_model_info_file_round_trip(tmp_path):
    info = model_info_from_hf(LLAMA_32_1B)
    save_model_info(info, str(tmp_path), extra={"source": {"tp": 1}})
    data = json.loads((tmp_path / "xdistill_model.json").read_text())
    assert data["source"] == {"tp": 1}
    back = load_model_info(str(tmp_path))
    assert back == info and back.hf_config == info.hf_config
    assert back.rope_scaling == info.rope_scaling
    # A training run keeps it at its root; the iteration directory finds it there.
    (tmp_path / "iter_0000010").mkdir()
    assert load_model_info(str(tmp_path / "iter_0000010")) == info
    with pytest.raises(ValueError, match="unknown fields"):
        ModelInfo.from_dict({**info.to_dict(), "surprise": 1})


def test_missing_model_info_says_how_to_make_one(tmp_path):
    with pytest.raises(CheckpointError, match="hf-to-mcore"):
        load_model_info(str(tmp_path))


# ----------------------------------------------------------------------------- 2 ranks
def _build_both_ways(tp: int, pp: int) -> dict:
    """Build the same model from parallel_state and from an explicit pg_collection; compare."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_xdistill.models import build_gpt_model, sharded_model_state_dict
    from megatron_xdistill.parallel.layout import ParallelLayout, build_model_parallel_groups
    from megatron_xdistill.testing.tiny_gpt import init_model_parallel

    info = model_info_from_hf(tiny_config("qwen2", vocab_size=1000, num_hidden_layers=2))
    config = transformer_config(info, tp, pp)
    init_model_parallel(tp, pp, seed=7)
    legacy = build_gpt_model(info, config)
    groups = build_model_parallel_groups(ParallelLayout.for_world(2, tp=tp, pp=pp))
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7, tp_rank=groups.coords["tp"], ep_rank=0, etp_rank=0,
                                    force_reset_rng=True)
    explicit = build_gpt_model(info, config, pg_collection=groups.pg_collection)
    assert (legacy.pre_process, legacy.post_process) == (explicit.pre_process,
                                                         explicit.post_process)
    assert legacy.vocab_size == explicit.vocab_size == info.padded_vocab_size(tp)
    a, b = dict(legacy.named_parameters()), dict(explicit.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    sa, sb = legacy.sharded_state_dict(), sharded_model_state_dict(explicit, groups.pg_collection)
    assert sa.keys() == sb.keys()
    for key in sa:
        if hasattr(sa[key], "global_offset"):
            assert (sa[key].key, sa[key].global_shape, sa[key].global_offset, sa[key].replica_id) \
                == (sb[key].key, sb[key].global_shape, sb[key].global_offset,
                    sb[key].replica_id), key
    out = {"params": len(a)}
    if pp == 1:
        tokens = torch.randint(0, info.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        pos = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            out["max_logit_diff"] = (legacy(tokens, pos, None)
                                     - explicit(tokens, pos, None)).abs().max().item()
    return out


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_pg_collection_build_equals_parallel_state_build(pool, tp, pp):
    results = pool.run(_build_both_ways, tp, pp)
    assert all(r["params"] > 0 for r in results)
    if pp == 1:
        assert all(r["max_logit_diff"] == 0.0 for r in results)


def _gemma_where_te_is_installed() -> dict:
    """Gemma 3 with use_te=None on a machine that has TE: torch-native layers, no TE import;
    use_te=True is refused by name."""
    from megatron_xdistill.models import build_gpt_model, builder
    from megatron_xdistill.models.gemma3 import PostNormRowParallelLinear, ZeroCenteredRMSNorm
    from megatron_xdistill.testing.tiny_gpt import init_model_parallel

    info = model_info_from_hf(tiny_config("gemma3", vocab_size=1000))
    init_model_parallel(1, 1, seed=7)
    installed, builder.have_transformer_engine = builder.have_transformer_engine, lambda: True
    try:
        model = build_gpt_model(info, transformer_config(info))
        try:
            build_gpt_model(info, transformer_config(info), use_te=True)
            refused = ""
        except ValueError as exc:
            refused = str(exc)
    finally:
        builder.have_transformer_engine = installed
    layer = model.decoder.layers[0]
    return {"norm": type(layer.input_layernorm) is ZeroCenteredRMSNorm,
            "final": type(model.decoder.final_layernorm) is ZeroCenteredRMSNorm,
            "post": type(layer.self_attention.linear_proj) is PostNormRowParallelLinear,
            "refused": refused}


def test_gemma3_builds_torch_native_layers_even_where_te_is_installed(pool):
    out = pool.run(_gemma_where_te_is_installed)[0]
    assert out["norm"] and out["final"] and out["post"]
    assert "torch-native modules only" in out["refused"]
