"""HumanEval scores of the code study's models (issue 68, point 4): pass@1 (greedy, <= 512 new
tokens) and the canonical solutions' bits per byte, for the teacher (Qwen2.5-Coder-0.5B), the
student before training (SmolLM2-135M) and the study's three-seed runs (CE only and distilled)
where their final checkpoints exist.

    python examples/cross_tokenizer_distillation/humaneval_study.py \\
        [--work-dir runs/study/real] [--models before teacher ce_ep3-seed1 ...] [--threads 2]

Resumable: a model whose result is in ``results/humaneval.json`` (same checkpoint and
iteration) is skipped, and lm-eval's request cache (``WORK_DIR/humaneval_cache/``) keeps every
answered request, so a killed evaluation continues where it stopped. ``results/humaneval.md``
(a table: mean +- std over seeds per variant) is rewritten after each model. The trained runs
come from ``study.py experiment=real variants_to_run=[ce_ep3,pkl_first_ep3]`` (three seeds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

ASSETS = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets"))
RESULTS = HERE / "results" / "humaneval.json"
TABLE = HERE / "results" / "humaneval.md"
TASKS = ["xdistill_humaneval_bpb", "xdistill_humaneval"]
VARIANTS = {"ce_ep3": "CE only (3 passes)", "pkl_first_ep3": "P-KL first token + CE (3 passes)"}
SEEDS = (1, 2, 3)


def models(work_dir: Path) -> dict[str, Path]:
    """Name -> checkpoint: the two pretrained models, then every run of the study."""
    out = {"before": ASSETS / "megatron" / "smollm2-135m",
           "teacher": ASSETS / "megatron" / "qwen2.5-coder-0.5b"}
    for variant in VARIANTS:
        for seed in SEEDS:
            out[f"{variant}-seed{seed}"] = work_dir / "runs" / f"{variant}-seed{seed}" / "ckpt"
    return out


def iteration(ckpt: Path) -> str | None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return tracker.read_text().strip() if tracker.is_file() else None


def evaluate(name: str, ckpt: Path, cache_dir: Path, batch_size: int) -> dict:
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.evaluation.lm_eval_tasks import evaluate_tasks

    started = time.time()
    # the tokenizer: the checkpoint's hf_files/ (converted models and training runs keep one)
    lm = XDistillLM(load=str(ckpt), batch_size=batch_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    scores = evaluate_tasks(lm, TASKS, use_cache=str(cache_dir / name))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return {"load": str(ckpt), "iteration": iteration(ckpt), **scores,
            "seconds": round(time.time() - started, 1)}


def table(results: dict) -> str:
    def cell(values: list[float], digits: int) -> str:
        if not values:
            return "not run"
        if len(values) == 1:
            return f"{values[0]:.{digits}f}"
        return f"{statistics.mean(values):.{digits}f} +- {statistics.stdev(values):.{digits}f}"

    rows = [("teacher (Qwen2.5-Coder-0.5B)", ["teacher"]),
            ("student before training (SmolLM2-135M)", ["before"])]
    rows += [(label, [f"{v}-seed{s}" for s in SEEDS]) for v, label in VARIANTS.items()]
    lines = ["| model | runs | HumanEval pass@1 | canonical bits per byte |", "|---|---|---|---|"]
    for label, names in rows:
        done = [results[n] for n in names if n in results]
        lines.append(f"| {label} | {len(done)} | "
                     f"{cell([r['xdistill_humaneval/pass@1'] for r in done], 4)} | "
                     f"{cell([r['xdistill_humaneval_bpb/canonical_bits_per_byte'] for r in done], 4)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="runs/study/real", type=Path)
    p.add_argument("--models", nargs="+", default=None, help="names (default: all present)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    for name, ckpt in models(args.work_dir).items():
        if args.models and name not in args.models:
            continue
        it = iteration(ckpt)
        if it is None:
            print(f"[humaneval] {name}: no checkpoint at {ckpt} (train it with study.py)",
                  flush=True)
            continue
        if name in results and results[name]["load"] == str(ckpt) and \
                results[name]["iteration"] == it:
            print(f"[humaneval] {name}: done", flush=True)
            continue
        print(f"[humaneval] {name}: evaluating {ckpt} (iteration {it})", flush=True)
        results[name] = evaluate(name, ckpt, args.work_dir / "humaneval_cache", args.batch_size)
        print(f"[humaneval] {name}: {results[name]}", flush=True)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        TABLE.write_text(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
