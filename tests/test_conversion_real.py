"""Real pretrained models through ``xdistill-convert``: SmolLM2-135M (Llama, tied),
Qwen2.5-Coder-0.5B (Qwen2, QKV bias, untied head) and Gemma-3-270M (sandwich norms, sliding and
global layers with their own RoPE; verified past its 512-token window, and with CP). Each
converts, matches the HF logits (fp32, rel 1e-4) unsharded and in a parallel layout, and
round-trips to HF bit for bit.

Needs the models from ``../shared/assets/fetch_models.sh smollm2-135m qwen2.5-coder-0.5b
gemma3-270m`` (skipped otherwise). Run: ``pytest -m "slow and assets" tests/test_conversion_real.py -s``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conversion.safetensors_io import SafetensorsFolder

pytestmark = [pytest.mark.slow, pytest.mark.assets]

MODELS_DIR = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets")) \
    / "models"
#: model -> ((TP, PP) the checkpoint is written at, (TP, PP, CP) it is verified at, tokens)
CASES = {
    "smollm2-135m": ((1, 1), (1, 2, 1), 128),  # 9 heads / 3 KV heads: TP must divide 3
    "qwen2.5-coder-0.5b": ((2, 1), (2, 2, 1), 128),
    "gemma3-270m": ((1, 1), (1, 2, 2), 768),  # 1 KV head: TP=1
}


def _cli(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "conversion.cli", *args], capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


def _verify(hf: Path, ckpt: Path, tp: int, pp: int, cp: int, seq: int, out: Path) -> dict:
    _cli("verify", "--hf-dir", str(hf), "--load", str(ckpt), "--tp", str(tp), "--pp", str(pp),
         "--cp", str(cp), "--batch", "2", "--seq-length", str(seq), "--max-rel-diff", "1e-4",
         "--json", str(out))
    metrics = json.loads(out.read_text())
    print(f"\n{hf.name} TP{tp} PP{pp} CP{cp}: max abs {metrics['max_abs_diff']:.3e}, max rel "
          f"{metrics['max_rel_diff']:.3e}, mean abs {metrics['mean_abs_diff']:.3e}, top-1 "
          f"{metrics['top1_agreement']:.4f}")
    return metrics


@pytest.mark.parametrize("name", list(CASES))
def test_real_model_converts_verifies_and_round_trips(name, tmp_path):
    hf = MODELS_DIR / name
    if not (hf / "model.safetensors").exists():
        pytest.skip(f"{hf} missing: run ../shared/assets/fetch_models.sh {name}")
    (tp, pp), parallel, seq = CASES[name]
    ckpt, back = tmp_path / "mcore", tmp_path / "hf"
    _cli("hf-to-mcore", "--hf-dir", str(hf), "--out", str(ckpt), "--tp", str(tp), "--pp", str(pp))
    for layout in ((1, 1, 1), parallel):
        metrics = _verify(hf, ckpt, *layout, seq, tmp_path / f"verify_{''.join(map(str, layout))}.json")
        assert metrics["max_rel_diff"] <= 1e-4
        assert metrics["top1_agreement"] >= 0.99

    _cli("mcore-to-hf", "--load", str(ckpt), "--out", str(back))
    with SafetensorsFolder(str(hf)) as a, SafetensorsFolder(str(back)) as b:
        assert sorted(a.names()) == sorted(b.names())
        for tensor in a.names():
            x, y = a.get(tensor), b.get(tensor)
            assert x.dtype == y.dtype and torch.equal(x, y), tensor
    for side in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (back / side).read_bytes() == (hf / side).read_bytes(), side

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(back))
    tokenizer = AutoTokenizer.from_pretrained(str(back))
    ids = tokenizer("def add(a, b):\n    return", return_tensors="pt")["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(str(hf))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
