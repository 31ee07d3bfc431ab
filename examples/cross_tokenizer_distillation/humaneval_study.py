"""HumanEval scores of the code study's models (issue 68, point 4): pass@1 (greedy, <= 512 new
tokens) and the canonical solutions' bits per byte, for the teacher (Qwen2.5-Coder-0.5B), the
student before training (SmolLM2-135M) and the study's three-seed runs (CE only and distilled).

    python examples/cross_tokenizer_distillation/humaneval_study.py \\
        [--work-dir runs/study/real] [--models before teacher ce_ep3-seed1 ...] [--threads 2]

A run whose checkpoint is not in ``WORK_DIR/runs/`` is trained first, made as the study makes
it (``study.py``'s ``train_run`` with ``study.yaml``'s ``real`` settings: the same data order,
steps and teacher payloads as the bits-per-byte rows of REPORT.md); that its training repeats
the published run is checked against ``results/real.json`` (the in-loop held-out bits per byte
at the last step, and the training CE at every logged step) and recorded with its scores.

Resumable: a model whose result is in ``results/humaneval.json`` (same checkpoint and
iteration) is skipped, a run continues from its last checkpoint, and lm-eval's request cache
(``WORK_DIR/humaneval_cache/``) keeps every answered request, so a killed evaluation continues
where it stopped. ``results/humaneval.md`` (a table: mean +- std over seeds per variant) is
rewritten after each model.
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

sys.path.insert(0, str(HERE))
from run import machine  # noqa: E402
from study_report import paired_difference  # noqa: E402

from megatron_xdistill.demo import provenance  # noqa: E402
from megatron_xdistill.storage.atomic import write_json_atomic, write_text_atomic  # noqa: E402

ASSETS = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets"))
RESULTS = HERE / "results" / "humaneval.json"
TABLE = HERE / "results" / "humaneval.md"
TASKS = ["xdistill_humaneval_bpb", "xdistill_humaneval"]
VARIANTS = {"ce_ep3": "CE only (3 passes)", "pkl_first_ep3": "P-KL first token + CE (3 passes)"}
SEEDS = (1, 2, 3)
PUBLISHED = HERE / "results" / "real.json"


def models(work_dir: Path) -> dict[str, Path]:
    """Name -> checkpoint: the two pretrained models, then every run of the study, seed-major
    (both variants of a seed first: paired results early)."""
    out = {"before": ASSETS / "megatron" / "smollm2-135m",
           "teacher": ASSETS / "megatron" / "qwen2.5-coder-0.5b"}
    for seed in SEEDS:
        for variant in VARIANTS:
            out[f"{variant}-seed{seed}"] = work_dir / "runs" / f"{variant}-seed{seed}" / "ckpt"
    return out


def iteration(ckpt: Path) -> str | None:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return tracker.read_text().strip() if tracker.is_file() else None


def study_config(work_dir: Path):
    """``study.yaml`` as ``study.py experiment=real work_dir=WORK_DIR`` composes it."""
    from omegaconf import OmegaConf

    return OmegaConf.merge(OmegaConf.load(HERE / "study.yaml"),
                           {"experiment": "real", "work_dir": str(work_dir)})


def train(work_dir: Path, variant: str, seed: int) -> Path:
    """Train (or resume) one study run as ``study.py`` does; its checkpoint directory."""
    import study
    from study_setup import setup

    cfg = study_config(work_dir.resolve())
    pairs, data = setup(cfg, Path(cfg.work_dir))
    return study.train_run(cfg, Path(cfg.work_dir), pairs[seed], data, variant, seed) / "ckpt"


def reproduction(run_dir: Path, variant: str, seed: int) -> dict:
    """How this run's training compares with the published run of the same settings
    (``results/real.json``): the largest difference of the training CE over the logged steps
    and the in-loop held-out bits per byte at the last step, both runs'."""
    from megatron_xdistill.demo.workflow import read_metrics

    published = json.loads(PUBLISHED.read_text())["runs"].get(f"{variant}-s{seed}")
    if published is None:
        return {}
    ours = read_metrics(run_dir / "metrics.jsonl")

    def by_step(records: list[dict], key: str) -> dict[int, float]:
        return {r["iteration"]: r[key] for r in records if r.get(key) is not None}

    ce, ce_pub = by_step(ours, "ce"), by_step(published["metrics"], "ce")
    bpb, bpb_pub = by_step(ours, "eval_bpb"), by_step(published["metrics"], "eval_bpb")
    common = sorted(set(ce) & set(ce_pub))
    last = max(set(bpb) & set(bpb_pub), default=None)
    return {"steps_compared": len(common),
            "max_train_ce_difference": max((abs(ce[i] - ce_pub[i]) for i in common),
                                           default=None),
            "in_loop_bpb": bpb.get(last), "published_in_loop_bpb": bpb_pub.get(last),
            "at_step": last}


def cache_name(name: str, ckpt: Path) -> str:
    """lm-eval's request cache of one checkpoint: named by the model, its iteration and when
    that iteration was written, so a run trained again is never answered from the old one's."""
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    return f"{name}-{iteration(ckpt)}-{int(tracker.stat().st_mtime)}"


def evaluate(name: str, ckpt: Path, cache_dir: Path, batch_size: int) -> dict:
    from megatron_xdistill.evaluation.lm_eval_backend import XDistillLM
    from megatron_xdistill.evaluation.lm_eval_tasks import evaluate_tasks

    started = time.time()
    # the tokenizer: the checkpoint's hf_files/ (converted models and training runs keep one)
    lm = XDistillLM(load=str(ckpt), batch_size=batch_size)
    cache_dir.mkdir(parents=True, exist_ok=True)
    scores = evaluate_tasks(lm, TASKS, use_cache=str(cache_dir / cache_name(name, ckpt)))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return {"load": str(ckpt), "iteration": iteration(ckpt), **scores,
            "seconds": round(time.time() - started, 1)}


METRICS = {"pass@1": "xdistill_humaneval/pass@1",
           "canonical bits per byte": "xdistill_humaneval_bpb/canonical_bits_per_byte"}


def paired(results: dict, metric: str, variant: str, baseline: str) -> dict | None:
    """``variant`` - ``baseline`` on ``metric``, paired by seed, with the study's rule
    (``study_report.paired_difference``: real beyond twice the larger seed spread); None with
    fewer than two seeds of both."""
    seeds = [s for s in SEEDS if f"{variant}-seed{s}" in results
             and f"{baseline}-seed{s}" in results]
    if len(seeds) < 2:
        return None
    return paired_difference([results[f"{variant}-seed{s}"][metric] for s in seeds],
                             [results[f"{baseline}-seed{s}"][metric] for s in seeds])


def _cell(values: list[float]) -> str:
    if not values:
        return "not run"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} +- {statistics.stdev(values):.4f}"


def _verdict(d: dict) -> str:
    """The rule's word on a paired difference; "no difference" where both variants score the
    same on every seed (no spread to be within: pass@1 of 0/164 for both, say)."""
    if d["diff"] == 0 and d["diff_std"] == 0:
        return "no difference"
    return "**real**" if d["real"] else "within seed noise"


def rows(results: dict) -> list[dict[str, str | int]]:
    """The table's rows (cells as text): mean +- std over seeds per model, then each distilled
    variant against CE only with the study's verdict; keys ``model``, ``runs`` and the keys of
    :data:`METRICS` with spaces as underscores."""
    fields = {name: name.replace(" ", "_").replace("@", "_at_") for name in METRICS}
    groups = [("teacher (Qwen2.5-Coder-0.5B)", ["teacher"]),
              ("student before training (SmolLM2-135M)", ["before"])]
    groups += [(label, [f"{v}-seed{s}" for s in SEEDS]) for v, label in VARIANTS.items()]
    out: list[dict[str, str | int]] = []
    for label, names in groups:
        done = [results[n] for n in names if n in results]
        out.append({"model": label, "runs": len(done),
                    **{fields[m]: _cell([r[key] for r in done]) for m, key in METRICS.items()}})
    baseline = next(iter(VARIANTS))
    for variant in list(VARIANTS)[1:]:
        row: dict[str, str | int] = {"model": f"{VARIANTS[variant]} - CE only, paired by seed",
                                     "runs": ""}
        for m, key in METRICS.items():
            d = paired(results, key, variant, baseline)
            row[fields[m]] = ("fewer than 2 seeds" if d is None else
                              f"{d['diff']:+.4f} +- {d['diff_std']:.4f} ({d['seeds']} seeds); "
                              f"2 x spread {2 * d['spread']:.4f}: {_verdict(d)}")
        out.append(row)
    return out


def table(results: dict) -> str:
    """:func:`rows` as Markdown."""
    keys = list(rows({})[0])
    headers = ["model", "runs"] + [f"HumanEval {m}" for m in METRICS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows(results)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-dir", default="runs/study/real", type=Path)
    p.add_argument("--models", nargs="+", default=None, help="names (default: all present)")
    p.add_argument("--batch-size", type=int, default=32,
                   help="sequences per forward (greedy decoding on 2 cores: 32 completes 1.8x the "
                        "problems per minute of 8, benchmarks/bench_generation.py)")
    p.add_argument("--no-train", action="store_true",
                   help="score only the runs already trained")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    trained = {f"{v}-seed{s}": (v, s) for v in VARIANTS for s in SEEDS}
    steps = study_config(args.work_dir).real.steps
    for name, ckpt in models(args.work_dir).items():
        if args.models and name not in args.models:
            continue
        if name in trained and (iteration(ckpt) or "0") != str(steps):
            if args.no_train:
                print(f"[humaneval] {name}: not trained (--no-train)", flush=True)
                continue
            print(f"[humaneval] {name}: training it as study.py does", flush=True)
            ckpt = train(args.work_dir, *trained[name])
        it = iteration(ckpt)
        if it is None:
            raise SystemExit(f"[humaneval] {name}: no checkpoint at {ckpt}")
        if name in results and results[name]["load"] == str(ckpt) and \
                results[name]["iteration"] == it:
            print(f"[humaneval] {name}: done", flush=True)
            continue
        print(f"[humaneval] {name}: evaluating {ckpt} (iteration {it})", flush=True)
        result = evaluate(name, ckpt, args.work_dir / "humaneval_cache", args.batch_size)
        if name in trained:
            result["reproduces"] = reproduction(ckpt.parent, *trained[name])
        print(f"[humaneval] {name}: {result}", flush=True)
        results = save(name, result)
    return 0


def save(name: str, result: dict) -> dict:
    """Add one model's result to ``results/humaneval.json`` (read again first, so results
    another invocation wrote meanwhile stay) and rewrite the table; all results."""
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    results[name] = {**result, **provenance.record(), "machine": machine()}
    write_json_atomic(RESULTS, results, indent=1)
    write_text_atomic(TABLE, table(results))
    return results


if __name__ == "__main__":
    sys.exit(main())
