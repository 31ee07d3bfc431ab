"""Megatron-LM checkpoints as model sources (issue 23.1), against Megatron-Core's own model.

The reference is a GPTModel built from Megatron-Core's local layer spec and a TransformerConfig
written here (not through this package's builder), saved the way Megatron-LM's training loop
saves a release: ``{"model": sharded state, "args": Namespace, "checkpoint_version": 3.0,
"iteration": 0}`` in ``<root>/release`` with a ``release`` tracker. Loading the root must give
a model with the reference's logits.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from megatron_xdistill.models.hf_config import UnsupportedModelError
from megatron_xdistill.models.megatron_lm import (
    megatron_lm_args,
    model_info_from_megatron_args,
    read_tracker,
)
from megatron_xdistill.testing.multirank import RankPool


@pytest.fixture(scope="module")
def pool():
    with RankPool(1) as ranks:  # one spawned rank for the module's tests
        yield ranks


ARGS = dict(  # a Llama-style Megatron-LM run's flags, under Megatron-LM's attribute names
    num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4,
    group_query_attention=True, num_query_groups=2, kv_channels=16, max_position_embeddings=64,
    seq_length=32, position_embedding_type="rope", rotary_base=10000, rotary_percent=1.0,
    normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, add_bias_linear=False,
    add_qkv_bias=False, qk_layernorm=False, untie_embeddings_and_output_weights=True,
    padded_vocab_size=384, make_vocab_size_divisible_by=128, bf16=False, fp16=False,
    attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02,
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
)


def _megatron_core_gpt(a: argparse.Namespace):
    """Megatron-Core's GPTModel for a Megatron-LM run's args, from its own local layer spec (with
    torch's RMSNorm: same parameters and keys), not through this package's builder."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_xdistill.models.specs import TorchRMSNorm

    config = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, ffn_hidden_size=a.ffn_hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups if a.group_query_attention else None,
        kv_channels=a.kv_channels, normalization="RMSNorm", layernorm_epsilon=a.norm_epsilon,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=a.add_qkv_bias, qk_layernorm=a.qk_layernorm, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False)
    spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=a.qk_layernorm)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    if a.qk_layernorm:
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = TorchRMSNorm
    return GPTModel(config, spec, vocab_size=a.padded_vocab_size,
                    max_sequence_length=a.max_position_embeddings,
                    position_embedding_type="rope", rotary_base=a.rotary_base,
                    share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights)


def _logit_gap(reference, ours, vocab: int, gen: torch.Generator) -> dict:
    tokens = torch.randint(0, vocab, (2, 24), generator=gen)
    pos = torch.arange(24).expand(2, 24)
    causal = torch.triu(torch.ones(1, 1, 24, 24, dtype=torch.bool), 1)
    reference.eval()
    ours.eval()
    with torch.no_grad():
        want = reference(tokens, pos, causal)
        got = ours(tokens, pos, None)
    return {"diff": (want - got).abs().max().item(), "scale": want.abs().max().item()}


def _reference_release(root: str, qkv_bias: bool) -> dict:
    """Rank 0 of 1: a Megatron-Core GPTModel (its own local spec) saved as a Megatron-LM
    release under ``root``; then the same root loaded through this package. Returns the
    largest logit difference and what the loader read."""
    from megatron.core import dist_checkpointing

    from megatron_xdistill.models import (
        build_gpt_model,
        load_megatron_checkpoint,
        load_model_info,
        transformer_config,
    )
    from megatron_xdistill.testing.tiny_gpt import init_model_parallel

    init_model_parallel(1, 1, seed=5)
    a = argparse.Namespace(**{**ARGS, "add_qkv_bias": qkv_bias})
    reference = _megatron_core_gpt(a)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in reference.parameters():  # every weight random: norms and biases too
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    state = {"model": reference.sharded_state_dict(), "args": a, "checkpoint_version": 3.0,
             "iteration": 0}
    os.makedirs(os.path.join(root, "release"))
    dist_checkpointing.save(state, os.path.join(root, "release"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("release")

    info = load_model_info(root)
    ours = build_gpt_model(info, transformer_config(info))
    load_megatron_checkpoint(ours, root)
    return {**_logit_gap(reference, ours, a.padded_vocab_size, gen),
            "architecture": info.architecture, "vocab": info.vocab_size,
            "tied": info.tie_word_embeddings, "groups": info.num_query_groups}


def _ours_into_megatron_core(out: str, family: str) -> dict:
    """Rank 0 of 1: a model saved by this package (as ``xdistill-convert hf-to-mcore`` saves: a
    Megatron-LM release root), read back the way Megatron-LM would: Megatron-Core's GPTModel built from the ``args`` in the
    checkpoint's common state, its tensors requested under ``model`` as Megatron-LM does."""
    from megatron.core import dist_checkpointing

    from megatron_xdistill.models import (
        build_gpt_model,
        model_info_from_hf,
        save_megatron_checkpoint,
        transformer_config,
    )
    from megatron_xdistill.testing.tiny_gpt import init_model_parallel
    from megatron_xdistill.testing.tiny_models import tiny_config

    init_model_parallel(1, 1, seed=5)
    info = model_info_from_hf(tiny_config(family, vocab_size=1000))
    ours = build_gpt_model(info, transformer_config(info))
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    save_megatron_checkpoint(ours, out, info)
    # Megatron-LM's --load: the tracker names a release, the tensors are in <out>/release.
    with open(os.path.join(out, "latest_checkpointed_iteration.txt")) as fh:
        assert fh.read().strip() == "release"
    tensors = os.path.join(out, "release")
    common = dist_checkpointing.load_common_state_dict(tensors)
    args = common["args"]
    reference = _megatron_core_gpt(args)
    loaded = dist_checkpointing.load({"model": reference.sharded_state_dict()}, tensors)
    reference.load_state_dict(loaded["model"])
    return {**_logit_gap(reference, ours, info.vocab_size, gen),
            "version": common["checkpoint_version"], "iteration": common["iteration"]}


@pytest.mark.parametrize("family", ["smollm2", "qwen2", "qwen3"])
def test_our_checkpoints_load_into_megatron_core_from_their_args(pool, tmp_path, family):
    (out,) = pool.run(_ours_into_megatron_core, str(tmp_path / "ckpt"), family)
    assert (out["version"], out["iteration"]) == (3.0, 0)
    assert out["diff"] <= 1e-5 * out["scale"], out


@pytest.mark.parametrize("qkv_bias,architecture", [(False, "LlamaForCausalLM"),
                                                   (True, "Qwen2ForCausalLM")])
def test_megatron_lm_release_loads_with_megatron_cores_logits(pool, tmp_path, qkv_bias,
                                                             architecture):
    (out,) = pool.run(_reference_release, str(tmp_path / "mlm"), qkv_bias)
    assert out["architecture"] == architecture
    assert (out["vocab"], out["tied"], out["groups"]) == (384, False, 2)
    assert out["diff"] <= 1e-5 * out["scale"], out


def test_tracker_values_as_megatron_lm_reads_them(tmp_path):
    assert read_tracker(str(tmp_path)) is None
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release\n")
    assert read_tracker(str(tmp_path)) == "release"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1200")
    assert read_tracker(str(tmp_path)) == 1200
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("latest")
    with pytest.raises(ValueError, match="iteration number or 'release', found 'latest'"):
        read_tracker(str(tmp_path))


@pytest.mark.parametrize("change,needle", [
    ({"normalization": "LayerNorm"}, "--normalization LayerNorm"),
    ({"swiglu": False}, "no --swiglu"),
    ({"add_bias_linear": True}, "linear biases"),
    ({"position_embedding_type": "learned_absolute"}, "learned_absolute"),
    ({"num_experts": 8}, "num_experts"),
    ({"qk_layernorm": True, "add_qkv_bias": True}, "both a QKV bias and a QK norm"),
])
def test_architectures_we_cannot_build_are_refused_by_name(change, needle):
    args = argparse.Namespace(**{**ARGS, **change})
    with pytest.raises(UnsupportedModelError, match=needle) as err:
        model_info_from_megatron_args(args, "/ckpt/iter_0000100")
    assert "/ckpt/iter_0000100" in str(err.value)


def test_args_we_write_read_back_as_the_same_model():
    """The ``args`` our training checkpoints carry describe the student they hold."""
    from megatron_xdistill.models import model_info_from_hf
    from megatron_xdistill.testing.tiny_models import tiny_config

    for family in ("smollm2", "qwen2", "qwen3"):
        info = model_info_from_hf(tiny_config(family, vocab_size=1000))
        args = megatron_lm_args(info, tp=2, pp=1, cp=1, seq_length=32, bf16=False,
                                iteration=10, consumed_samples=80)
        back = model_info_from_megatron_args(args, "ckpt")
        for field in ("architecture", "family", "num_layers", "hidden_size", "ffn_hidden_size",
                      "num_attention_heads", "num_query_groups", "kv_channels",
                      "max_position_embeddings", "norm_epsilon", "rotary_base",
                      "tie_word_embeddings", "add_qkv_bias", "qk_layernorm", "rope_scaling"):
            assert getattr(back, field) == getattr(info, field), (family, field)
        assert back.vocab_size == info.padded_vocab_size(2)


def _resume_sources(root: str) -> dict:
    """Rank 0 of 1: which --load / --save roots a run resumes, with and without --finetune."""
    from megatron.core import dist_checkpointing

    from megatron_xdistill.training.preflight import resume_source

    def checkpoint(name: str, tracker: str, folder: str, state: dict) -> str:
        path = os.path.join(root, name)
        os.makedirs(os.path.join(path, folder))
        dist_checkpointing.save(state, os.path.join(path, folder))
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as fh:
            fh.write(tracker)
        return path

    args = argparse.Namespace(**ARGS)
    mlm = checkpoint("mlm", "100", "iter_0000100",
                     {"args": args, "checkpoint_version": 3.0, "iteration": 100})
    release = checkpoint("release", "release", "release",
                         {"args": args, "checkpoint_version": 3.0, "iteration": 0})
    ours = checkpoint("ours", "2", "iter_0000002",
                      {"common": {"consumed_samples": 8}, "iteration": 2})

    def source(**given) -> str | None:
        flags = {"save": None, "load": None, "finetune": False, "teacher_cache_only": False,
                 **given}
        try:
            found = resume_source(argparse.Namespace(**flags))
        except ValueError as exc:
            return f"refused: {exc}"
        return None if found is None else found[1]

    names = {mlm: "mlm", release: "release", ours: "ours", None: None}
    out = {"ours": source(load=ours), "ours --finetune": source(load=ours, finetune=True),
           "release": source(load=release), "mlm --finetune": source(load=mlm, finetune=True),
           "save wins": source(load=mlm, save=ours, finetune=True), "mlm": source(load=mlm)}
    return {key: names.get(value, value) for key, value in out.items()}


def test_which_checkpoint_a_run_resumes(pool, tmp_path):
    """As in Megatron-LM: a release and --finetune give weights only (iteration 0); our own
    run under --load or --save resumes; another Megatron-LM run's iteration is refused without
    --finetune, saying so."""
    (out,) = pool.run(_resume_sources, str(tmp_path))
    assert out["ours"] == "ours" and out["save wins"] == "ours"
    assert out["ours --finetune"] is None and out["release"] is None
    assert out["mlm --finetune"] is None
    assert out["mlm"].startswith("refused: --load ") and "pass --finetune" in out["mlm"]


def _unreadable_args(root: str) -> str:
    """Rank 0 of 1: a release whose args hold an object of a module this machine lacks (as a
    Megatron-LM version we do not have would write); loading it must name the checkpoint."""
    import sys
    import types

    from megatron.core import dist_checkpointing

    from megatron_xdistill.models import CheckpointError, load_model_info

    gone = types.ModuleType("module_of_another_megatron")

    class Setting:
        pass

    Setting.__module__, Setting.__qualname__ = gone.__name__, "Setting"
    gone.Setting = Setting
    sys.modules[gone.__name__] = gone
    try:
        path = os.path.join(root, "release")
        os.makedirs(path)
        args = argparse.Namespace(**ARGS, attention_backend=Setting())
        dist_checkpointing.save({"args": args, "checkpoint_version": 3.0}, path)
    finally:
        del sys.modules[gone.__name__]
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as fh:
        fh.write("release")
    try:
        load_model_info(root)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_args_that_cannot_be_read_name_the_checkpoint(pool, tmp_path):
    (message,) = pool.run(_unreadable_args, str(tmp_path / "foreign"))
    assert "foreign/release" in message and "cannot be read here" in message, message
    assert "module_of_another_megatron" in message


def _rng_state_as_megatron_lm_loads_it(root: str) -> dict:
    """Rank 0 of 1: a training checkpoint saved by this trainer, its ``rng_state`` requested the
    way Megatron-LM's loader requests it (one ShardedObject per (PP, TP) coordinate)."""
    import random

    import numpy as np
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_xdistill.models import build_gpt_model, model_info_from_hf, transformer_config
    from megatron_xdistill.testing.tiny_gpt import init_model_parallel
    from megatron_xdistill.testing.tiny_models import tiny_config
    from megatron_xdistill.training.checkpointing import save_checkpoint

    init_model_parallel(1, 1, seed=5)
    info = model_info_from_hf(tiny_config("smollm2", vocab_size=1000))
    model = build_gpt_model(info, transformer_config(info))
    torch.manual_seed(123)
    random.seed(7)
    np.random.seed(9)
    expected = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1])
    path = save_checkpoint(root, 3, model, None, None,
                           parallel_state.get_data_parallel_group(with_context_parallel=True),
                           {"consumed_samples": 24})
    template = {"rng_state": ShardedObject("rng_state", None, (1, 1), (0, 0), replica_id=0)}
    loaded = dist_checkpointing.load(template, path)["rng_state"]
    state = loaded[0]
    return {"keys": sorted(state), "list": isinstance(loaded, list) and len(loaded) == 1,
            "torch": torch.equal(state["torch_rng_state"], expected[0]),
            "python": state["random_rng_state"] == expected[1],
            "numpy": bool(np.array_equal(state["np_rng_state"][1], expected[2]))}


def test_training_checkpoints_hold_the_rng_where_megatron_lm_reads_it(pool, tmp_path):
    """Megatron-LM's --load restores ``rng_state`` from a torch_dist checkpoint: ours holds it
    under that key and layout, with Megatron-LM's names (no CUDA state on a CPU run)."""
    got = pool.run(_rng_state_as_megatron_lm_loads_it, str(tmp_path / "run"))[0]
    assert got == {"keys": ["np_rng_state", "random_rng_state", "rng_tracker_states",
                            "torch_rng_state"], "list": True, "torch": True, "python": True,
                   "numpy": True}


def test_pruning_keeps_the_newest_and_never_the_tracked_or_a_partial_one(tmp_path):
    """--keep-last-checkpoints: the newest N iteration folders stay; the tracked one (even
    if older, e.g. a rerun that saved less far) and a save in progress are never removed."""
    from megatron_xdistill.training.checkpointing import prune_checkpoints

    for name in ("iter_0000010", "iter_0000020", "iter_0000030", "iter_0000040.tmp",
                 "release"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("1")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("10")
    removed = prune_checkpoints(str(tmp_path), 1)
    assert sorted(removed) == [str(tmp_path / "iter_0000020")]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "iter_0000010", "iter_0000030", "iter_0000040.tmp", "release"]
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    assert prune_checkpoints(str(tmp_path), 1) == [str(tmp_path / "iter_0000010")]
    assert prune_checkpoints(str(tmp_path), 1) == []
    with pytest.raises(ValueError, match="keep_last"):
        prune_checkpoints(str(tmp_path), 0)
