"""HF <-> Megatron conversion of tiny random models of every supported family, on 4 CPU ranks.

Each family's HF model (real tokenizer vocabulary size, all parameters random) is converted at
TP in {1, 2} x PP in {1, 2}; every checkpoint must reproduce the HF logits (fp32, rel 1e-4) at the
layout it was written in and, resharded, at another; the TP2 x PP2 checkpoint exported back to
HF must equal the original tensor for tensor, bit for bit, and load with ``transformers``.
"""

from __future__ import annotations

import filecmp
import os
import shutil

import pytest
import torch
from scratch import scratch_dir

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.mcore_to_hf import convert_mcore_to_hf
from conversion.verify import verify_conversion
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.tiny_models import TINY_FAMILIES, make_tiny_model, tiny_config

WORLD = 4
TOKENIZERS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets", "tokenizers")
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
RTOL = 1e-4


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def tiny_root(request, tmp_path_factory):
    return scratch_dir(request, tmp_path_factory, "tiny_hf")


def _tokenizers() -> str | None:
    return TOKENIZERS if os.path.isdir(TOKENIZERS) else None


def _assert_matches_hf(metrics: dict, what: str) -> None:
    assert metrics["max_rel_diff"] <= RTOL, f"{what}: {metrics}"
    assert metrics["top1_agreement"] == 1.0, f"{what}: {metrics}"
    assert metrics["padded_logits_max_abs"] == 0.0, f"{what}: padded vocab rows are not zero"


def _assert_same_tensors(original: str, exported: str) -> None:
    from safetensors import safe_open

    with safe_open(os.path.join(original, "model.safetensors"), "pt") as a, \
            safe_open(os.path.join(exported, "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())
        for name in a.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8) if x.dtype == torch.bfloat16 else x,
                               y.view(torch.uint8) if y.dtype == torch.bfloat16 else y), name


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_convert_verify_and_round_trip(pool, tmp_path, family):
    hf_dir = make_tiny_model(family, str(tmp_path / family), _tokenizers(), seed=3)
    ckpts = {}
    for tp, pp in LAYOUTS:
        ckpts[tp, pp] = str(tmp_path / f"{family}_mcore_tp{tp}pp{pp}")
        pool.run(convert_hf_to_mcore, hf_dir, ckpts[tp, pp], tp, pp)
        metrics = pool.run(verify_conversion, hf_dir, ckpts[tp, pp], tp, pp, 2, 32, 0, False)[0]
        _assert_matches_hf(metrics, f"{family} written and run at TP{tp} PP{pp}")
    # Resharding on load: written at TP2 x PP2, run unsharded, and the other way round.
    for written, run in (((2, 2), (1, 1)), ((1, 1), (2, 2))):
        metrics = pool.run(verify_conversion, hf_dir, ckpts[written], *run, 2, 32, 0, False)[0]
        _assert_matches_hf(metrics, f"{family} written at {written}, run at {run}")
    # Context parallel (TP2 x CP2): load-balanced sequence halves, windows and RoPE across them.
    metrics = pool.run(verify_conversion, hf_dir, ckpts[1, 1], 2, 1, 2, 32, 0, False, 2)[0]
    _assert_matches_hf(metrics, f"{family} run at TP2 CP2")

    exported = str(tmp_path / f"{family}_hf_back")
    pool.run(convert_mcore_to_hf, ckpts[2, 2], exported)
    _assert_same_tensors(hf_dir, exported)

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.architectures == [TINY_FAMILIES[family].architecture]
    assert model.dtype == TINY_FAMILIES[family].dtype
    if _tokenizers() is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            assert filecmp.cmp(os.path.join(hf_dir, name), os.path.join(exported, name), False)
        if family == "smollm2":  # loading a 150k-entry tokenizer takes seconds: one is enough
            from transformers import AutoTokenizer

            assert len(AutoTokenizer.from_pretrained(exported)) == 49152


def _failing_commit(tmp_dir: str) -> None:
    raise OSError(f"disk full while finishing {tmp_dir}")


def _save_with_failure(ckpt: str, out: str) -> str:
    """Load a checkpoint at TP2 and save it with a failing final step; return the error text."""
    from conversion.launch import layout_groups
    from megatron_xdistill.models import (
        build_gpt_model,
        load_megatron_checkpoint,
        load_model_info,
        save_megatron_checkpoint,
        transformer_config,
    )

    info = load_model_info(ckpt)
    groups = layout_groups(tp=2)
    config = transformer_config(info, 2, 1, 1, perform_initialization=False)
    model = build_gpt_model(info, config, pg_collection=groups.pg_collection, use_te=False)
    load_megatron_checkpoint(model, ckpt, groups.pg_collection)
    try:
        save_megatron_checkpoint(model, out, info, groups.pg_collection,
                                 before_commit=_failing_commit)
    except Exception as exc:  # noqa: BLE001 - the text is what the test checks
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _export_error(ckpt: str, out: str, template: str) -> str:
    try:
        convert_mcore_to_hf(ckpt, out, hf_template=template)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.fixture(scope="module")
def smollm2_ckpt(pool, tiny_root) -> tuple[str, str]:
    hf_dir = make_tiny_model("smollm2", str(tiny_root / "smollm2_small"), _tokenizers(), seed=4)
    ckpt = str(tiny_root / "smollm2_small_mcore")
    pool.run(convert_hf_to_mcore, hf_dir, ckpt, 2, 1)
    return hf_dir, ckpt


def test_export_from_a_training_run(pool, tiny_root, smollm2_ckpt):
    """Megatron-LM run layout: <root>/latest_checkpointed_iteration.txt, <root>/iter_N/, the
    model info and HF files at the root."""
    from megatron_xdistill.models import copy_hf_files, load_model_info, save_model_info

    hf_dir, ckpt = smollm2_ckpt
    root = tiny_root / "run"
    shutil.copytree(os.path.join(ckpt, "release"), root / "iter_0000005")
    (root / "latest_checkpointed_iteration.txt").write_text("5\n")
    save_model_info(load_model_info(ckpt), str(root))
    copy_hf_files(ckpt, str(root))
    exported = str(tiny_root / "run_hf")
    pool.run(convert_mcore_to_hf, str(root), exported)
    _assert_same_tensors(hf_dir, exported)
    assert os.path.isfile(os.path.join(exported, "tokenizer.json")) == (_tokenizers() is not None)


def test_failed_writes_leave_nothing(pool, tiny_root, smollm2_ckpt):
    _, ckpt = smollm2_ckpt
    out = str(tiny_root / "never_complete")
    errors = pool.run(_save_with_failure, ckpt, out)
    assert "disk full" in errors[0]
    assert all(e == errors[0] or "another rank" in e for e in errors), errors
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")

    # An export whose template describes another model fails on every rank before any work.
    template = tiny_root / "qwen2_template"
    template.mkdir()
    tiny_config("qwen2").to_json_file(str(template / "config.json"), use_diff=False)
    errors = pool.run(_export_error, ckpt, out, str(template))
    assert all("describes another model" in e for e in errors), errors
    assert not os.path.exists(out) and not os.path.exists(out + ".tmp")


def _verify_error(hf_dir: str, ckpt: str) -> str:
    try:
        verify_conversion(hf_dir, ckpt, 1, 1, 1, 16, 0, False)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_verify_accepts_another_stored_dtype_and_names_real_differences(pool, tiny_root):
    """An fp32 export of bf16 weights is the same model (verify runs both in fp32); a real
    architecture difference is refused naming the field and both values."""
    import json

    hf_dir = make_tiny_model("qwen3", str(tiny_root / "qwen3_bf16"), None, seed=6)
    ckpt = str(tiny_root / "qwen3_bf16_mcore")
    pool.run(convert_hf_to_mcore, hf_dir, ckpt, 1, 1)
    exported = str(tiny_root / "qwen3_fp32_hf")
    pool.run(convert_mcore_to_hf, ckpt, exported, None, "fp32")
    metrics = pool.run(verify_conversion, exported, ckpt, 2, 1, 2, 32, 0, False)[0]
    _assert_matches_hf(metrics, "fp32 export of bf16 weights")

    other = tiny_root / "qwen3_other_eps"
    shutil.copytree(exported, other)
    config = json.loads((other / "config.json").read_text())
    config["rms_norm_eps"] = 1e-3
    (other / "config.json").write_text(json.dumps(config))
    errors = pool.run(_verify_error, str(other), ckpt)
    assert all("describe different models: norm_epsilon:" in e and "0.001" in e
               for e in errors), errors
