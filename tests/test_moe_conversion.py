"""Mixture-of-experts families (Qwen3-MoE, Mixtral): their HF configs in Megatron terms, and
conversion with expert parallelism on 4 CPU ranks.

A tiny random model of each family (4 experts, top-2; Qwen3-MoE without top-k renormalisation
and with a dense layer, Mixtral with it and a sliding window) written at EP=2 must give the HF
logits (fp32, rel 1e-5) at TP1 x EP2, TP2 x EP2, EP1 and EP4 (one expert per rank), and export
back to HF bit for bit. The TP / PP / CP layouts are covered with every other family in
test_conversion.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.verify import verify_conversion
from megatron_xdistill.models import model_info_from_hf, transformer_config
from megatron_xdistill.models.megatron_lm import megatron_lm_cannot_express
from megatron_xdistill.parallel.shape import ParallelLayout
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model, tiny_config

WORLD = 4
RTOL = 1e-5

# Published configs, abbreviated to the keys that matter; numbers as released.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "vocab_size": 151936,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.02, "vocab_size": 32000, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5, "sliding_window": None, "tie_word_embeddings": False,
    "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
}


def test_published_moe_configs():
    qwen = model_info_from_hf(QWEN3_30B_A3B)
    assert (qwen.num_moe_experts, qwen.moe_router_topk, qwen.moe_ffn_hidden_size) == (128, 8, 768)
    assert qwen.ffn_hidden_size == 6144 and qwen.moe_layers is None and qwen.qk_layernorm
    assert not qwen.moe_router_pre_softmax  # norm_topk_prob: softmax over the top-k logits
    config = transformer_config(qwen, ep=8)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_layer_freq) == (128, 8, 1)
    assert config.moe_aux_loss_coeff == 0.001 and config.moe_router_dtype == "fp32"
    assert config.moe_expert_capacity_factor is None  # dropless
    assert config.expert_model_parallel_size == 8 and config.moe_token_dispatcher_type == "alltoall"
    mixtral = model_info_from_hf(MIXTRAL_8X7B)
    assert (mixtral.num_moe_experts, mixtral.moe_ffn_hidden_size) == (8, 14336)
    assert mixtral.sliding_window is None and not mixtral.moe_router_pre_softmax
    assert mixtral.moe_aux_loss_coeff == 0.02 and not mixtral.qk_layernorm
    # Megatron-LM's args in our training checkpoints: none rather than a dense description.
    assert "mixture-of-experts" in megatron_lm_cannot_express(mixtral)


def test_qwen3_moe_dense_layers_and_unnormalised_top_k():
    info = model_info_from_hf({**QWEN3_30B_A3B, "num_hidden_layers": 6, "mlp_only_layers": [0],
                               "decoder_sparse_step": 2, "norm_topk_prob": False})
    # HF: MoE where layer not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0.
    assert info.moe_layers == [0, 1, 0, 1, 0, 1]
    assert info.moe_router_pre_softmax  # top-k of the softmax over all experts, as HF
    assert transformer_config(info).moe_layer_freq == [0, 1, 0, 1, 0, 1]
    tiny = model_info_from_hf(tiny_config("qwen3_moe"))
    assert tiny.moe_layers == [1, 0, 1, 1] and tiny.moe_ffn_hidden_size == 32


def test_expert_parallel_size_must_divide_the_experts():
    info = model_info_from_hf(MIXTRAL_8X7B)
    with pytest.raises(ValueError, match="8 experts are not divisible by EP=3"):
        transformer_config(info, ep=3)
    dense = model_info_from_hf({**MIXTRAL_8X7B, "architectures": ["MistralForCausalLM"],
                                "model_type": "mistral", "num_local_experts": None})
    with pytest.raises(ValueError, match="has no experts"):
        transformer_config(dense, ep=2)
    with pytest.raises(ValueError, match="expert-model-parallel size 4 does not divide"):
        ParallelLayout.for_world(4, tp=2, ep=4)
    layout = ParallelLayout.for_world(8, tp=2, ep=2)
    assert [layout.ep_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


def _assert_same_tensors(original: str, exported: str) -> None:
    from safetensors import safe_open

    with safe_open(os.path.join(original, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(exported, "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name


def _ep_ranks(tp: int, ep: int) -> tuple[int, int]:
    from conversion.launch import layout_groups

    groups = layout_groups(tp, ep=ep)
    return groups.ep_rank, groups.pg_collection.ep.rank()


@pytest.mark.parametrize("tp,ep", [(2, 2), (1, 4), (1, 2)])
def test_layout_ep_rank_is_the_expert_groups_rank(pool, tp, ep):
    for ours, megatrons in pool.run(_ep_ranks, tp, ep):
        assert ours == megatrons


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_parallel_conversion_matches_hf(pool, tmp_path, family):
    hf_dir = make_tiny_model(family, str(tmp_path / family), None, seed=4)
    ckpt = str(tmp_path / "ep2")
    pool.run(convert_hf_to_mcore, hf_dir, ckpt, 1, 1, ep=2)
    # (tp, ep) run layouts; the experts each rank holds differ in every one.
    for tp, ep in ((1, 2), (2, 2), (1, 1), (1, 4)):
        metrics = pool.run(verify_conversion, hf_dir, ckpt, tp, 1, 2, 32, 0, False, ep=ep)[0]
        assert metrics["ep"] == ep
        assert metrics["max_rel_diff"] <= RTOL, f"{family} at TP{tp} EP{ep}: {metrics}"
        assert metrics["top1_agreement"] == 1.0 and metrics["padded_logits_max_abs"] == 0.0
    exported = str(tmp_path / "back")
    pool.run(convert_mcore_to_hf, ckpt, exported)
    _assert_same_tensors(hf_dir, exported)
