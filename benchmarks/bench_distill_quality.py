"""Does distillation teach? Held-out bits per byte after CE-only fine-tuning vs cross-tokenizer
distillation (P-KL, gold, H-KL) at equal steps, on real models (Qwen2.5-Coder-0.5B teaches
SmolLM2-135M on the CPython standard library). Prints a table.

A small rerun of ``examples/cross_tokenizer_distillation`` (its functions, its config.yaml with
the overrides below): by default 8 steps per variant at 128 student tokens x 2 per step, scored on
6 held-out modules, which takes 10-15 minutes on 2 CPU cores (models, conversions and the
projection are cached after the first run). Extra arguments are Hydra overrides of the example's
config, e.g. ``steps=25 train.seq_length=256 eval.max_docs=12``; the full comparison and its
report are ``python examples/cross_tokenizer_distillation/run.py``.

  python benchmarks/bench_distill_quality.py [--work-dir DIR] [hydra overrides ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from results import write_rows

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cross_tokenizer_distillation"

SMALL = [
    "steps=8",
    "train.seq_length=128",
    "train.teacher_seq_length=160",
    "train.eval_interval=4",
    "train.eval_iters=2",
    "eval.max_docs=6",
    "eval.max_chars=2000",
    "export.variant=null",
]


def load_example_module(name: str):
    """One of the example's modules (``run``, ``run_report``), loaded from its file."""
    spec = importlib.util.spec_from_file_location(f"xdistill_example_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_example():
    return load_example_module("run")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default="runs/bench_distill_quality")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the example's config")
    args = parser.parse_args(argv)
    example = load_example()
    cfg = example.load_config([*SMALL, f"work_dir={args.work_dir}", *args.overrides])
    results = example.run_comparison(cfg, print_table=False)
    print()
    print(f"held-out bits per byte after {cfg.steps} steps per variant "
          f"({cfg.train.global_batch_size} x {cfg.train.seq_length} student tokens per step, "
          f"lr {cfg.train.lr:g}, seed {cfg.seed}; report: {Path(cfg.report_dir) / 'REPORT.md'})")
    report = load_example_module("run_report")
    print(report.summary_table(results))
    for line in report.verdict(results):
        print(line)
    write_rows("bench_distill_quality", [
        {"model": r["label"], "bits_per_byte": r["bpb"], "ce_per_token": r["ce"],
         "tokens": r["tokens"], "vs_before": r["delta"]} for r in report.rows(results)],
        params={"steps": cfg.steps, "global_batch_size": cfg.train.global_batch_size,
                "seq_length": cfg.train.seq_length, "lr": cfg.train.lr, "seed": cfg.seed})
    return 0


if __name__ == "__main__":
    sys.exit(main())
