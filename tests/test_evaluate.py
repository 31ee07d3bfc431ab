"""``python -m megatron_xdistill.evaluation``: bits per byte of an HF folder and of its Megatron
conversion agree, and equal an independent dense computation with ``transformers``."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from scratch import scratch_dir

from conversion.hf_to_mcore import convert_hf_to_mcore
from conversion.launch import run_distributed
from megatron_xdistill.evaluation import bits_per_byte as ev
from megatron_xdistill.evaluation.bits_per_byte import document_windows, start_token
from megatron_xdistill.testing.tiny_models import make_tiny_model

TOKENIZERS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "assets", "tokenizers")
TEXTS = [
    "def add(a, b):\n    return a + b\n\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x, self.y = x, y\n\n    def norm(self):\n        return (self.x ** 2 + "
    "self.y ** 2) ** 0.5\n" * 3,
    "The quick brown fox jumps over the lazy dog. Ünïcödé text: naïve café, 日本語, emoji 🙂.",
    "x = 1\n",
]


@pytest.fixture(scope="module")
def tiny(request, tmp_path_factory):
    if not os.path.isdir(os.path.join(TOKENIZERS, "smollm2")):
        pytest.skip("needs the shared tokenizers (../shared/assets/tokenizers)")
    root = scratch_dir(request, tmp_path_factory, "evaluate")
    hf = make_tiny_model("smollm2", str(root / "hf"), TOKENIZERS, seed=7)
    run_distributed(convert_hf_to_mcore, 1, hf, str(root / "ckpt"))
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return root


def _evaluate(tiny, which: str, seq_length: int, mbs: int = 2) -> dict:
    target = {"hf_dir" if which == "hf" else "load": str(tiny / which)}
    return ev.evaluate([str(tiny / "docs.jsonl")], seq_length=seq_length, micro_batch_size=mbs,
                       **target).to_dict()


def _dense_bpb(hf_dir: str, seq_length: int) -> tuple[float, int]:
    """Independent reference: one unpadded forward per window, log-softmax, gather."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    first = tok.eos_token_id  # this tokenizer does not add its BOS by itself
    nats, count, num_bytes = 0.0, 0, 0
    for text in TEXTS:
        ids = [first, *tok.encode(text, add_special_tokens=False)]
        num_bytes += len(text.encode("utf-8"))
        for k in range(0, len(ids) - 1, seq_length):
            window = torch.tensor(ids[k : k + seq_length + 1])
            with torch.no_grad():
                logp = torch.log_softmax(model(window[None, :-1]).logits[0].double(), -1)
            nats -= logp.gather(1, window[1:, None]).sum().item()
            count += len(window) - 1
    return nats / math.log(2) / num_bytes, count


@pytest.mark.parametrize("seq_length", [512, 24])
def test_hf_and_megatron_agree_with_dense_reference(tiny, seq_length):
    hf = _evaluate(tiny, "hf", seq_length)
    mcore = _evaluate(tiny, "ckpt", seq_length, mbs=3)
    reference, count = _dense_bpb(str(tiny / "hf"), seq_length)
    assert hf["bytes"] == mcore["bytes"] == sum(len(t.encode()) for t in TEXTS)
    assert hf["tokens"] == mcore["tokens"] == count
    assert hf["bits_per_byte"] == pytest.approx(reference, rel=1e-4)
    assert mcore["bits_per_byte"] == pytest.approx(hf["bits_per_byte"], rel=1e-4)
    assert hf["ce_per_token"] == pytest.approx(hf["nats"] / hf["tokens"])


def _save_as_training_run(ckpt: str, root: str) -> None:
    """The converted model saved the way pretrain_xdistill.py saves (model under "model",
    common state beside it), as iteration 3 of a run rooted at ``root``."""
    from conversion.launch import layout_groups
    from megatron_xdistill.models import (
        build_gpt_model,
        load_megatron_checkpoint,
        load_model_info,
        save_model_info,
        transformer_config,
    )
    from megatron_xdistill.training.checkpointing import save_checkpoint

    info = load_model_info(ckpt)
    groups = layout_groups()
    config = transformer_config(info, perform_initialization=False)
    model = build_gpt_model(info, config, pg_collection=groups.pg_collection, use_te=False)
    load_megatron_checkpoint(model, ckpt, groups.pg_collection)
    save_checkpoint(root, 3, model, None, None, groups.pg_collection.dp_cp,
                    {"consumed_samples": 6})
    save_model_info(info, root)


def test_training_run_checkpoint(tiny):
    """--load of a training run (latest iteration; common state next to the model's tensors)."""
    root = str(tiny / "run")
    run_distributed(_save_as_training_run, 1, str(tiny / "ckpt"), root)
    assert (tiny / "run" / "latest_checkpointed_iteration.txt").read_text() == "3"
    tok = os.path.join(TOKENIZERS, "smollm2")
    run = ev.evaluate([str(tiny / "docs.jsonl")], load=root, tokenizer=tok, seq_length=64)
    converted = ev.evaluate([str(tiny / "docs.jsonl")], load=str(tiny / "ckpt"), seq_length=64)
    assert run.bits_per_byte == pytest.approx(converted.bits_per_byte, rel=1e-6)
    with pytest.raises(ValueError, match="--tokenizer-model"):
        ev.evaluate([str(tiny / "docs.jsonl")], load=root)


def test_windows_predict_every_token_once():
    ids = list(range(10, 27))
    for seq_length in (1, 4, 16, 17, 100):
        windows = document_windows(ids, 0, seq_length)
        targets = [t for w in windows for t in w[1:]]
        assert targets == ids
        assert all(1 < len(w) <= seq_length + 1 for w in windows)
        assert windows[0][0] == 0
    assert document_windows([], 0, 8) == []


def test_start_token_rule():
    class Tok:
        name_or_path = "t"

        def __init__(self, bos, eos, adds_bos):
            self.bos_token_id, self.eos_token_id, self.adds = bos, eos, adds_bos

        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": ([self.bos_token_id] if self.adds else []) + [5]}

    assert start_token(Tok(1, 2, True)) == 1
    assert start_token(Tok(1, 2, False)) == 2
    assert start_token(Tok(None, 2, False)) == 2
    assert start_token(Tok(1, None, False)) == 1


def test_cli(tiny, tmp_path, capsys):
    out = tmp_path / "result.json"
    assert ev.main(["--load", str(tiny / "ckpt"), "--data-path", str(tiny / "docs.jsonl"),
                    "--max-docs", "2", "--max-chars", "40", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["documents"] == 2 and result["bytes"] == sum(
        len(t[:40].encode()) for t in TEXTS[:2])
    assert "bits/byte" in capsys.readouterr().out
    assert ev.main(["--hf-dir", str(tiny / "hf"), "--data-path", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def length_reward(record, response: str) -> float:
    """A reward that tells responses apart: their length in characters."""
    return float(len(response))


def test_prompt_scores_of_megatron_and_hf_agree(tiny, tmp_path):
    """Greedy responses to held-out prompts: the Megatron checkpoint (KV-cached generation,
    batched prompts of different lengths) and ``transformers``' ``generate`` give the same
    responses, hence the same mean reward; the CLI writes them."""
    from megatron_xdistill.evaluation import prompt_scores as ps

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in (
        "What is 2 + 2?", "Write a haiku about the sea, please, in three lines.", "Hi")))
    kw = dict(reward="test_evaluate:length_reward", max_new_tokens=6, batch_size=3)
    mcore = ps.evaluate_prompts(str(prompts), load=str(tiny / "ckpt"), **kw)
    hf = ps.evaluate_prompts(str(prompts), hf_dir=str(tiny / "hf"), **kw)
    assert [r["response"] for r in mcore["responses"]] == [r["response"] for r in hf["responses"]]
    assert mcore["mean_reward"] == hf["mean_reward"] > 0
    out = tmp_path / "scores.json"
    assert ps.main(["--load", str(tiny / "ckpt"), "--data-path", str(prompts), "--reward-fn",
                    "last_number", "--max-new-tokens", "4", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["prompts"] == 3
