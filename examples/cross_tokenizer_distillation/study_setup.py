"""The study's models and data (``study.py``): each experiment's teacher and student checkpoints
(a random-init student per seed for *signal*, the demo pair for *real*) and its training and
held-out sets, made once under the work directory."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from run import say

from megatron_xdistill.demo.workflow import (
    ModelPair,
    build_projection,
    convert_to_megatron,
    run_command,
)

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[1].parent / "shared" / "assets"


def _write_jsonl(path: Path, docs: list[dict]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps({"id": d["id"], "text": d["text"]}) + "\n" for d in docs))
    tmp.replace(path)
    return path


def signal_data(cfg, work: Path) -> dict:
    """train.jsonl (Shakespeare minus the held-out works + Wikipedia train) and the held-out
    sets (the held-out works; Wikipedia validation)."""
    out = work / "data"
    out.mkdir(parents=True, exist_ok=True)
    files = {"train": out / "train.jsonl", "shakespeare": out / "heldout_shakespeare.jsonl",
             "enwiki": out / "heldout_enwiki.jsonl"}
    if all(p.exists() for p in files.values()):
        return files
    corpora = SHARED / "corpora"
    works = [json.loads(x) for x in (corpora / "shakespeare.jsonl").read_text().splitlines()]
    held = set(cfg.signal.data.heldout_works)
    missing = held - {w["id"] for w in works}
    if missing:
        raise ValueError(f"signal.data.heldout_works: {sorted(missing)} not in shakespeare.jsonl")
    wiki = [json.loads(x) for x in (corpora / "enwiki_train.jsonl").read_text().splitlines()]
    _write_jsonl(files["train"], [w for w in works if w["id"] not in held] + wiki)
    _write_jsonl(files["shakespeare"], [w for w in works if w["id"] in held])
    shutil.copy(corpora / "enwiki_val.jsonl", files["enwiki"])
    return files


def random_student(cfg, work: Path, seed: int) -> tuple[Path, Path]:
    """A Llama-shaped student from random init (seeded) with the shared tokenizer:
    ``(HF folder, Megatron checkpoint)``; cached."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from megatron_xdistill.storage import follow_umask

    shape = cfg.signal.student
    name = f"student-{cfg.signal.student_tokenizer}-h{shape.hidden_size}-l{shape.num_layers}-s{seed}"
    hf = work / "models" / name
    if not (hf / "model.safetensors").exists():
        tok_dir = SHARED / "tokenizers" / cfg.signal.student_tokenizer
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        torch.manual_seed(seed)
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=shape.hidden_size,
            intermediate_size=shape.ffn_hidden_size, num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
            max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id)
        model = LlamaForCausalLM(config)
        tmp = hf.with_name(hf.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        follow_umask(tmp)  # safetensors writes its files 0600
        tmp.replace(hf)
        say(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    ckpt = work / "models" / f"{name}-mcore"  # beside its HF folder: made from it, nowhere else
    if not (ckpt / "xdistill_model.json").exists():
        run_command([sys.executable, "-m", "conversion.cli", "hf-to-mcore", "--hf-dir", hf,
                     "--out", ckpt, "--dtype", "fp32"], say)
    return hf, ckpt


def setup(cfg, work: Path) -> tuple[dict[int, ModelPair], dict]:
    """Models per seed and the data: ``({seed: ModelPair}, {"train": ..., held-out sets})``."""
    from megatron_xdistill.demo.assets import fetch_model
    from megatron_xdistill.demo.corpus import write_stdlib_corpus

    if cfg.experiment == "signal":
        exp = cfg.signal
        teacher_hf = fetch_model(exp.teacher, log=say)
        teacher_ckpt = convert_to_megatron(exp.teacher, teacher_hf, say)
        pairs = {}
        for seed in cfg.seeds:
            hf, ckpt = random_student(cfg, work, seed)
            projection = build_projection(cfg.signal.student_tokenizer, exp.teacher, hf,
                                          teacher_hf, say)
            pairs[seed] = ModelPair(exp.teacher, hf.name, teacher_hf, hf, teacher_ckpt, ckpt,
                                    projection)
        return pairs, signal_data(cfg, work)
    if cfg.experiment == "real":
        from megatron_xdistill.demo.workflow import prepare_models

        exp = cfg.real
        pair = prepare_models(exp.teacher, exp.student, log=say)
        train, valid = write_stdlib_corpus(work / "data", exp.data.valid_fraction,
                                           exp.data.max_chars)
        data = {"train": train, "stdlib": valid}
        if exp.data.get("fresh_code"):  # code written after both models were trained
            fresh = work / "data" / "fresh_code.jsonl"
            if not fresh.is_file() or fresh.read_bytes() != (HERE / exp.data.fresh_code
                                                             ).read_bytes():
                shutil.copyfile(HERE / exp.data.fresh_code, fresh)
            data["fresh_code"] = fresh
        return {seed: pair for seed in cfg.seeds}, data
    raise ValueError(f"experiment must be signal or real, got {cfg.experiment!r}")
