"""The Phi-3 family (``Phi3ForCausalLM``) against ``transformers``, on 2 CPU ranks.

A Phi-4-mini-shaped model (its ratios scaled down: fused qkv / gate_up, GQA, 3/4 of each head
rotated, LongRoPE with a 32x context and attention factor sqrt(2), tied) and a Phi-3-mini-4k-shaped
one (untied, full RoPE, a 7-token sliding window) are converted and must give HF's fp32 logits
(rel 1e-5) at TP 1 and 2, at a sequence length below LongRoPE's original length (short factors)
and above it (long factors), also under CP 2 where no rank holds the whole sequence; the round
trip back to HF is bit-exact. Unit checks: the LongRoPE tables and attention factor against HF's
own rotary module, the fused-tensor split, and what is refused.
"""

from __future__ import annotations

import os

import pytest
import torch
from scratch import scratch_dir
from test_conversion import _assert_same_tensors
from test_conversion_cli import _cli

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.verify import verify_conversion
from megatron_xdistill.models.hf_config import UnsupportedModelError, model_info_from_hf
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import make_tiny_model, tiny_config

TOKENIZERS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets", "tokenizers")
RTOL = 1e-5
ORIGINAL = 32  # the tiny Phi-4-mini's original_max_position_embeddings


def _tokenizers() -> str | None:
    return TOKENIZERS if os.path.isdir(TOKENIZERS) else None


@pytest.fixture(scope="module")
def pool():
    with RankPool(2) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def root(request, tmp_path_factory):
    return scratch_dir(request, tmp_path_factory, "phi3")


def _check(metrics: dict, what: str) -> None:
    assert metrics["max_rel_diff"] <= RTOL, f"{what}: {metrics}"
    assert metrics["top1_agreement"] == 1.0, f"{what}: {metrics}"
    assert metrics["padded_logits_max_abs"] == 0.0, f"{what}: padded vocab rows are not zero"


@pytest.mark.parametrize("family", ["phi4mini", "phi3"])
def test_phi3_logits_match_hf_and_round_trip(pool, root, family):
    hf_dir = make_tiny_model(family, str(root / family), _tokenizers(), seed=5)
    info = model_info_from_hf(hf_dir)
    assert info.family == "phi3"
    ckpts = {}
    for tp in (1, 2):
        ckpts[tp] = str(root / f"{family}_tp{tp}")
        pool.run(convert_hf_to_mcore, hf_dir, ckpts[tp], tp, 1, None, True)
        # below LongRoPE's original length (short factors) and above it (long factors); for
        # Phi-3-mini both lengths pass its 7-token window
        for seq in (ORIGINAL - 8, 2 * ORIGINAL):
            metrics = pool.run(verify_conversion, hf_dir, ckpts[tp], tp, 1, 2, seq, 0, True)[0]
            _check(metrics, f"{family} TP{tp} at {seq} tokens")
    # CP 2: each rank holds half the sequence, the whole length picks the factors
    for seq in (ORIGINAL - 8, 2 * ORIGINAL):
        metrics = pool.run(verify_conversion, hf_dir, ckpts[2], 1, 1, 2, seq, 0, True, 2)[0]
        _check(metrics, f"{family} CP2 at {seq} tokens")
    if family == "phi3":  # the command line's verify, past the window
        run = _cli("verify", "--hf-dir", hf_dir, "--load", ckpts[1], "--seq-length", "40",
                   "--max-rel-diff", str(RTOL))
        assert run.returncode == 0 and "PASS" in run.stdout, run.stdout + run.stderr
    exported = str(root / f"{family}_back")
    pool.run(convert_mcore_to_hf, ckpts[2], exported, None, None, 5.0, True)
    _assert_same_tensors(hf_dir, exported)
    assert model_info_from_hf(exported).differences(info) == []


def test_longrope_tables_match_hf_rotary():
    """Our short and long inverse frequencies and attention factor are HF's, at both sides of
    the switch (a published-style config: top-level original length, ``rope_scaling``, ``su``)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from megatron_xdistill.models.longrope import longrope_inv_freq

    config = tiny_config("phi4mini")
    hf = Phi3RotaryEmbedding(config)
    info = model_info_from_hf(config)
    scaling = info.rope_scaling
    x = torch.zeros(1)
    for seq, factors in ((ORIGINAL, scaling.short_factor), (ORIGINAL + 1, scaling.long_factor)):
        hf(x, torch.arange(seq)[None])
        ours = longrope_inv_freq(info.rotary_base, 12, factors)
        assert torch.equal(hf.inv_freq, ours), seq
    assert scaling.attention_factor == pytest.approx(hf.attention_scaling, rel=1e-12)

    published = config.to_dict()
    rope = published.pop("rope_parameters")
    published["rope_scaling"] = {"type": "su", "short_factor": rope["short_factor"],
                                 "long_factor": rope["long_factor"]}
    published["rope_theta"] = rope["rope_theta"]
    assert model_info_from_hf(published).rope_scaling == scaling


def test_megatron_rotary_switches_on_the_whole_length():
    """The Megatron module gives HF's angles for every position, short below the original length
    and long past it (the length a CP rank passes is the whole sequence's)."""
    from megatron_xdistill.models.longrope import longrope_inv_freq
    from megatron_xdistill.models.phi3 import LongRopeRotaryEmbedding

    info = model_info_from_hf(tiny_config("phi4mini"))
    rotary = LongRopeRotaryEmbedding(info, use_cpu_initialization=True)
    for seq, factors in ((ORIGINAL, info.rope_scaling.short_factor),
                         (ORIGINAL + 1, info.rope_scaling.long_factor)):
        emb = rotary(seq)
        freqs = torch.outer(torch.arange(seq).float(),
                            longrope_inv_freq(info.rotary_base, 12, factors))
        assert emb.shape == (seq, 1, 1, 12)
        assert torch.equal(emb[:, 0, 0], torch.cat([freqs, freqs], dim=-1)), seq


def test_fused_split_is_the_megatron_layout():
    """qkv_proj's rows land in Megatron's per-group order and gate_up_proj's in [gate; up]."""
    from conversion.mapping import hf_names, to_hf, to_megatron

    info = model_info_from_hf(tiny_config("phi4mini"))
    h, d = info.hidden_size, info.kv_channels
    rows = torch.arange((6 + 2 + 2) * d, dtype=torch.float32)[:, None].expand(-1, h)
    assert hf_names("qkv", 3, info) == ["model.layers.3.self_attn.qkv_proj.weight"]
    full = to_megatron("qkv", [rows], info, 1)
    # group g: its 3 query heads, then key g, then value g
    expected = []
    for g in range(2):
        expected += list(range(3 * g * d, 3 * (g + 1) * d))
        expected += list(range(6 * d + g * d, 6 * d + (g + 1) * d))
        expected += list(range(8 * d + g * d, 8 * d + (g + 1) * d))
    assert full[:, 0].tolist() == [float(r) for r in expected]
    assert torch.equal(to_hf("qkv", full, info)[0], rows)
    gate_up = torch.randn(2 * info.ffn_hidden_size, h)
    assert torch.equal(to_hf("fc1", to_megatron("fc1", [gate_up], info, 1), info)[0], gate_up)


def test_model_info_and_config_of_the_phi3_shapes():
    from megatron_xdistill.models.builder import transformer_config

    mini = model_info_from_hf(tiny_config("phi4mini"))
    assert (mini.hidden_size, mini.ffn_hidden_size, mini.kv_channels) == (96, 256, 16)
    assert (mini.num_attention_heads, mini.num_query_groups) == (6, 2)
    assert mini.rotary_percent == 0.75 and mini.tie_word_embeddings
    assert mini.sliding_window == 2048 and mini.rope_scaling.rope_type == "longrope"
    phi3 = model_info_from_hf(tiny_config("phi3"))
    assert phi3.rotary_percent == 1.0 and not phi3.tie_word_embeddings
    assert phi3.rope_scaling is None and transformer_config(phi3).window_size == (6, 0)


def test_refused_phi3_configs_name_the_problem():
    config = tiny_config("phi4mini").to_dict()
    bad = dict(config, rope_parameters=dict(config["rope_parameters"], long_factor=[1.0] * 5))
    with pytest.raises(UnsupportedModelError, match="long_factor has 5 entries.*needs 6"):
        model_info_from_hf(bad)
    with pytest.raises(UnsupportedModelError, match="resid_pdrop"):
        model_info_from_hf(dict(config, resid_pdrop=0.1))
    llama = tiny_config("smollm2").to_dict()
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor=0.5 .*Phi-3"):
        model_info_from_hf(dict(llama, partial_rotary_factor=0.5))
