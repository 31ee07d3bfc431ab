"""Does cross-tokenizer distillation teach? CE-only fine-tuning vs P-KL / gold / H-KL at equal steps.

    python examples/cross_tokenizer_distillation/run.py [hydra overrides]

The full user path on real models (config.yaml): fetch and convert the HF teacher and student to
Megatron checkpoints, build the projection between their vocabularies, write the CPython
standard library as train / held-out text (split by module), train one student per variant with
``torchrun pretrain_xdistill.py`` (same data, seed, steps and learning rate; only the loss weights
differ), score student-before, every student-after and the teacher on the held-out text with
``python -m megatron_xdistill.evaluation`` (bits per byte: one scale for both tokenizers), export
one trained student back to Hugging Face and check it, and write REPORT.md with PNG plots.

Every stage keeps its outputs under ``work_dir`` and is skipped when they exist for the same
settings (``force=true`` redoes training and evaluation).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG_DIR = Path(__file__).resolve().parent
for _path in (REPO, CONFIG_DIR):  # run as a script from anywhere in the checkout
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from run_report import BEFORE, TEACHER, summary_table, write_report  # noqa: E402

from megatron_xdistill.demo.workflow import (  # noqa: E402
    ModelPair,
    cpu_env,
    prepare_models,
    pretrain_command,
    read_metrics,
    run_command,
)


def say(message: str) -> None:
    print(f"[example] {message}", flush=True)


def stage(number: int, total: int, title: str) -> None:
    say(f"== stage {number}/{total}: {title}")


def load_config(overrides: list[str] | None = None):
    """config.yaml with Hydra overrides (``["steps=4", "variants_to_run=[ce,pkl]"]``)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="config", overrides=list(overrides or []))


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- training
def train_options(cfg, name: str, data: dict, run_dir: Path, work: Path) -> dict:
    """``pretrain_xdistill.py`` arguments of one variant; everything but the loss weights is
    shared by all variants. Gold / H-KL ship the full payload (this run's REPORT rows) unless
    the variant sets ``gold_topk`` / ``gold_uncommon_topk`` (the compact payload)."""
    t, kd, variant = cfg.train, cfg.kd, cfg.variants[name]
    s, te = cfg.layout.student, cfg.layout.teacher
    payload = ({"kd-gold-topk": int(variant.get("gold_topk", 0)),
                "kd-gold-uncommon-topk": int(variant.get("gold_uncommon_topk", 0))}
               if variant.kd_loss in ("gold", "hkl")
               else {"kd-topk": kd.topk, "kd-topk-mode": kd.topk_mode})  # each loss its own flags
    return {**payload,
        "tensor-model-parallel-size": s.tp, "pipeline-model-parallel-size": s.pp,
        "context-parallel-size": s.cp,
        "teacher-tensor-model-parallel-size": te.tp,
        "teacher-pipeline-model-parallel-size": te.pp,
        "teacher-context-parallel-size": te.cp,
        "data-path": str(data["train"]), "valid-data-path": str(data["valid"]),
        "seq-length": t.seq_length, "teacher-seq-length": t.teacher_seq_length,
        "micro-batch-size": t.micro_batch_size, "global-batch-size": t.global_batch_size,
        "train-iters": cfg.steps, "seed": cfg.seed,
        "lr": t.lr, "min-lr": t.min_lr, "lr-warmup-iters": t.lr_warmup_iters,
        "lr-decay-style": t.lr_decay_style, "weight-decay": t.weight_decay,
        "clip-grad": t.clip_grad, "bf16": bool(t.bf16),
        "kd-loss": variant.kd_loss, "kd-weight": variant.kd_weight,
        "ce-weight": variant.ce_weight,
        "kd-temperature": kd.temperature,
        "eval-interval": t.eval_interval, "eval-iters": t.eval_iters,
        "log-interval": 1, "num-workers": t.num_workers,
        "metrics-file": str(run_dir / "metrics.jsonl"),
        # shared by the variants: the packing plan (same samples, same order) is built once
        "data-cache-path": str(work / "data_cache"),
        "save": str(run_dir / "ckpt"),
    }


def _finished_iteration(ckpt: Path) -> int | None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def train_variant(cfg, name: str, models: ModelPair, data: dict, work: Path) -> dict:
    """Train one variant (skipped when a finished run with the same settings exists)."""
    run_dir = work / "runs" / name
    options = train_options(cfg, name, data, run_dir, work)
    settings = {"options": options, "teacher": str(models.teacher_ckpt),
                "student": str(models.student_ckpt), "nproc": cfg.nproc}
    stamp = run_dir / "settings.json"
    done = (_finished_iteration(run_dir / "ckpt") == cfg.steps and stamp.is_file()
            and {k: v for k, v in json.loads(stamp.read_text()).items() if k != "seconds"}
            == json.loads(json.dumps(settings)))
    if done and not cfg.force:
        say(f"{name}: finished run with these settings found in {run_dir}; skipped")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        start = time.time()
        run_command(pretrain_command(models, cfg.nproc, options), say,
                    env=cpu_env(cfg.threads_per_rank), stdout_path=run_dir / "train.log")
        stamp.write_text(json.dumps({**settings, "seconds": round(time.time() - start, 1)},
                                    indent=2))
    record = json.loads(stamp.read_text())
    return {"name": name, "ckpt": run_dir / "ckpt", "metrics": read_metrics(run_dir /
            "metrics.jsonl"), "seconds": record.get("seconds")}


# --------------------------------------------------------------------------- evaluation
def _eval_args(cfg, data: dict) -> list[str]:
    e = cfg.eval
    args = ["--data-path", str(data["valid"]), "--seq-length", str(e.seq_length),
            "--micro-batch-size", str(e.micro_batch_size)]
    if e.max_docs is not None:
        args += ["--max-docs", str(e.max_docs)]
    if e.max_chars is not None:
        args += ["--max-chars", str(e.max_chars)]
    return args


def evaluate_model(cfg, label: str, model_args: list[str], data: dict, work: Path,
                   model_stamp: str) -> dict:
    """``python -m megatron_xdistill.evaluation`` on the held-out split (cached by settings).
    ``model_args``: ``["--load", CKPT, "--tokenizer-model", DIR]`` or ``["--hf-dir", DIR]``."""
    args = [*model_args, *_eval_args(cfg, data)]
    key = _digest([args, model_stamp])
    out = work / "eval" / f"{label}.json"
    if out.is_file() and not cfg.force:
        cached = json.loads(out.read_text())
        if cached.get("key") == key:
            say(f"{label}: {cached['bits_per_byte']:.4f} bits/byte (cached)")
            return cached
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    run_command([sys.executable, "-m", "megatron_xdistill.evaluation", *args, "--json", str(tmp)],
                say)
    result = {**json.loads(tmp.read_text()), "label": label, "key": key}
    out.write_text(json.dumps(result, indent=2))
    tmp.unlink()
    say(f"{label}: {result['bits_per_byte']:.4f} bits/byte, {result['ce_per_token']:.4f} "
        f"nats/token over {result['tokens']} tokens ({result['seconds']:.0f} s)")
    return result


def _run_stamp(ckpt: Path) -> str:
    return f"{ckpt}:{(ckpt / 'latest_checkpointed_iteration.txt').stat().st_mtime}"


# --------------------------------------------------------------------------- export
def export_student(cfg, run: dict, models: ModelPair, data: dict, work: Path,
                   megatron_eval: dict) -> dict:
    """Trained student -> HF folder (``xdistill-convert mcore-to-hf``), loaded with
    ``transformers`` and scored on the held-out text like the Megatron checkpoint."""
    name = run["name"]
    out = work / "hf" / f"{models.student}-{name}"
    stamp = out / "xdistill_export.json"
    source = _run_stamp(run["ckpt"])
    if cfg.force or not (stamp.is_file() and json.loads(stamp.read_text()).get("source") == source):
        run_command([sys.executable, "-m", "conversion.cli", "mcore-to-hf", "--load", run["ckpt"],
                     "--out", out, "--hf-template", models.student_hf, "--dtype",
                     cfg.export.dtype, "--overwrite"], say)
        stamp.write_text(json.dumps({"source": source}))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    prompt = "def fibonacci(n):\n"
    generated = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=24,
                               do_sample=False)
    result: dict = {"variant": name, "hf_dir": str(out), "dtype": cfg.export.dtype,
                    "parameters": sum(p.numel() for p in model.parameters()),
                    "sample": tok.decode(generated[0], skip_special_tokens=True)}
    del model
    say(f"transformers loads {out} ({result['parameters'] / 1e6:.1f}M parameters); greedy "
        f"completion of {prompt!r}: {result['sample'][len(prompt):]!r}")
    if cfg.export.evaluate:
        hf_eval = evaluate_model(cfg, f"{name}-hf-export", ["--hf-dir", str(out)], data, work,
                                 source + ":" + cfg.export.dtype)
        result["bits_per_byte"] = hf_eval["bits_per_byte"]
        result["megatron_bits_per_byte"] = megatron_eval["bits_per_byte"]
        say(f"held-out bits/byte: exported HF {hf_eval['bits_per_byte']:.6f}, Megatron "
            f"checkpoint {megatron_eval['bits_per_byte']:.6f}")
    return result


# --------------------------------------------------------------------------- whole comparison
def run_comparison(cfg, print_table: bool = True) -> dict:
    """All stages; returns what the report shows (also written to ``work_dir/results.json``)."""
    from megatron_xdistill.demo.corpus import write_stdlib_corpus

    t0 = time.time()
    work = Path(cfg.work_dir).resolve()
    if cfg.get("report_only"):
        results = json.loads((work / "results.json").read_text())
        say(f"wrote {write_report(results, Path(cfg.report_dir).resolve())} from "
            f"{work / 'results.json'}")
        print(summary_table(results), flush=True)
        return results
    work.mkdir(parents=True, exist_ok=True)
    unknown = [v for v in cfg.variants_to_run if v not in cfg.variants]
    if unknown:
        raise ValueError(f"variants_to_run: unknown {unknown}; defined: {list(cfg.variants)}")
    if cfg.train.lr_warmup_iters >= cfg.steps:
        raise ValueError(f"train.lr_warmup_iters ({cfg.train.lr_warmup_iters}) must be smaller "
                         f"than steps ({cfg.steps})")
    total = 6
    timings: dict[str, float] = {}

    stage(1, total, f"models: {cfg.teacher} (teacher), {cfg.student} (student)")
    t = time.time()
    models = prepare_models(cfg.teacher, cfg.student, log=say)
    timings["models"] = time.time() - t

    stage(2, total, "data: CPython standard library, split by module")
    train, valid = write_stdlib_corpus(work / "data", cfg.data.valid_fraction, cfg.data.max_chars)
    data = {"train": train, "valid": valid}
    say(f"train {train} ({_count(train)} modules), held-out {valid} ({_count(valid)} modules)")

    stage(3, total, f"training {len(cfg.variants_to_run)} variant(s) x {cfg.steps} steps")
    t = time.time()
    runs = {}
    for name in cfg.variants_to_run:
        say(f"-- variant {name}: {cfg.variants[name].label}")
        runs[name] = train_variant(cfg, name, models, data, work)
    timings["training"] = time.time() - t

    stage(4, total, "held-out bits per byte (python -m megatron_xdistill.evaluation)")
    t = time.time()
    student_tok = ["--tokenizer-model", str(models.student_hf)]
    evals = {BEFORE: evaluate_model(cfg, BEFORE, ["--load", str(models.student_ckpt),
                                                  *student_tok], data, work,
                                    str(models.student_ckpt))}
    for name, run in runs.items():
        evals[name] = evaluate_model(cfg, name, ["--load", str(run["ckpt"]), *student_tok],
                                     data, work, _run_stamp(run["ckpt"]))
    if cfg.eval.teacher:
        evals[TEACHER] = evaluate_model(
            cfg, TEACHER, ["--load", str(models.teacher_ckpt), "--tokenizer-model",
                           str(models.teacher_hf)], data, work, str(models.teacher_ckpt))
    timings["evaluation"] = time.time() - t

    stage(5, total, "export a trained student to Hugging Face")
    t = time.time()
    export = None
    if cfg.export.variant and cfg.export.variant in runs:
        export = export_student(cfg, runs[cfg.export.variant], models, data, work,
                                evals[cfg.export.variant])
    else:
        say("skipped (export.variant is not among the variants run)")
    timings["export"] = time.time() - t

    stage(6, total, "report")
    results = {
        "config": _plain(cfg),
        "models": {k: str(v) for k, v in vars(models).items()},
        "evals": evals,
        "runs": {name: {"metrics": run["metrics"], "seconds": run["seconds"]}
                 for name, run in runs.items()},
        "export": export,
        "timings": {k: round(v, 1) for k, v in timings.items()},
        "machine": machine(),
    }
    results["timings"]["total"] = round(time.time() - t0, 1)
    (work / "results.json").write_text(json.dumps(results, indent=2, default=str))
    report = write_report(results, Path(cfg.report_dir).resolve())
    say(f"wrote {report}")
    if print_table:
        print(summary_table(results), flush=True)
    return results


def _count(path: Path) -> int:
    with open(path) as fh:
        return sum(1 for line in fh if line.strip())


def machine() -> dict:
    import torch

    return {"cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.cuda.is_available(), "date": time.strftime("%Y-%m-%d")}


def main() -> None:
    import hydra

    @hydra.main(config_path=str(CONFIG_DIR), config_name="config", version_base=None)
    def _main(cfg) -> None:
        run_comparison(cfg)

    _main()


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        say(f"failed: {' '.join(exc.cmd)} (exit {exc.returncode})")
        sys.exit(1)
