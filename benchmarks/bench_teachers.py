"""Step time with one and with two teachers, colocated, against the teachers' own forward times.

Qwen2.5-Coder-0.5B and Gemma-3-270M (each its own tokenizer, projection and layout) teach
SmolLM2-135M on the CPython standard library, as ``make demo`` runs it: one run per teacher alone
and one run with both (``--teachers-config``, weights 0.5 / 0.5, combination sum). Colocated, the
teachers run one after the other on every rank, so the two-teacher step's teacher phase should
cost the sum of the single teachers' forwards and nothing more; the table prints that sum and the
max (what a placement that runs the teachers side by side could reach).

  python benchmarks/bench_teachers.py [--train-iters 4] [--nproc 2] [--seq-length 128]

Each row is the mean of steps 2..N (the first is warm-up). Models, checkpoints and projections
are fetched / converted / built once and cached (``megatron_xdistill.demo.assets.cache_dir``).
Measured on 2 CPU cores (fp32, student DP 2, qwen TP 2, gemma DP 2; global batch 4 x 128 student
tokens; s per step, steps 2..4; 2026-11-26, commit a55a03e):

  | teachers     | teacher (each)                | route | student (loss) | optimizer | wall  | / sum | / max |
  | qwen         |  7.77                         | 0.02  | 6.11 (0.13)    | 0.92      | 14.90 | 1.00  | 1.00  |
  | gemma        |  5.67                         | 0.59  | 5.53 (0.21)    | 0.81      | 12.84 | 1.00  | 1.00  |
  | qwen + gemma | 12.86 (qwen 7.24, gemma 5.62) | 0.51  | 5.91 (0.32)    | 1.17      | 20.46 | 0.96  | 1.65  |

Colocated, the second teacher costs its own forward and nothing more (0.96 x the sum of the two
alone); the student's loss grows by the second teacher's KD term (0.13 -> 0.32 s). Running the
teachers side by side (``--teacher-placement disaggregated``, each teacher on its own 'ranks')
takes the max instead of the sum, given ranks to spare: on 2 cores the three processes would only
share them, so that row belongs to a GPU machine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

PHASES = ("teacher", "route", "student", "loss", "optimizer")
TEACHERS = {  # name: (model, its layout on the --nproc ranks)
    "qwen": ("qwen2.5-coder-0.5b", "tensor"),  # 14 heads, 2 KV heads: TP 2
    "gemma": ("gemma3-270m", "data"),  # 1 KV head: no TP, one replica per rank
}
STUDENT = "smollm2-135m"


def _teachers_yaml(path: Path, pairs: dict, names: list[str], nproc: int) -> Path:
    import yaml

    entries = []
    for name in names:
        pair, (_, split) = pairs[name], TEACHERS[name]
        entries.append({"name": name, "load": str(pair.teacher_ckpt),
                        "tokenizer_model": str(pair.teacher_hf),
                        "projection_path": str(pair.projection),
                        "tensor_model_parallel_size": nproc if split == "tensor" else 1,
                        "weight": 1.0 / len(names)})
    path.write_text(yaml.safe_dump({"teachers": entries, "combination": "sum"}))
    return path


def _measure(args, pairs: dict, names: list[str], train: Path, work: Path) -> dict:
    """One colocated run of these teachers; mean phase seconds (and per teacher), wall."""
    from megatron_xdistill.demo.workflow import cpu_env, pretrain_command, read_metrics, run_command

    tag = "+".join(names)
    config = _teachers_yaml(work / f"{tag}.yaml", pairs, names, args.nproc)
    metrics = work / f"metrics-{tag}.jsonl"
    cmd = pretrain_command(pairs[names[0]], args.nproc, {
        "teachers-config": config, "data-path": train, "seq-length": args.seq_length,
        "micro-batch-size": 1, "global-batch-size": 2 * args.nproc,
        "train-iters": args.train_iters, "lr": "3e-5", "kd-topk": 64, "log-interval": 1,
        "metrics-file": metrics, "num-workers": 1, "data-cache-path": work / f"cache-{tag}"})
    run_command(cmd, env=dict(cpu_env(1), CUDA_VISIBLE_DEVICES=""),
                stdout_path=work / f"log-{tag}.txt")
    steps = [r for r in read_metrics(metrics) if "kd" in r][1:]
    mean = {p: sum(r[f"time_{p}"] for r in steps) / len(steps) for p in PHASES}
    if len(names) > 1:
        for name in names:
            mean[name] = sum(r[f"time_teacher/{name}"] for r in steps) / len(steps)
    else:
        mean[names[0]] = mean["teacher"]
    mean["wall"] = sum(r["elapsed_ms_per_iteration"] for r in steps) / len(steps) / 1e3
    mean["fill"] = {name: steps[-1].get(f"teacher_fill/{name}", steps[-1]["teacher_fill"])
                    for name in names}
    return mean


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=128)
    args = parser.parse_args(argv)
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")

    from megatron_xdistill.demo.corpus import write_stdlib_corpus
    from megatron_xdistill.demo.workflow import prepare_models

    pairs = {name: prepare_models(model, STUDENT) for name, (model, _) in TEACHERS.items()}
    work = Path(tempfile.mkdtemp(prefix="xdistill-bench-teachers-"))
    try:
        train, _ = write_stdlib_corpus(work / "data")
        runs = [["qwen"], ["gemma"], ["qwen", "gemma"]]
        rows = [(names, _measure(args, pairs, names, train, work)) for names in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    alone = {names[0]: m[names[0]] for names, m in rows if len(names) == 1}
    print(f"\nteachers -> {STUDENT}, {args.nproc} CPU ranks colocated, fp32, global batch "
          f"{2 * args.nproc} x {args.seq_length} tokens, chunk top-64; mean of steps "
          f"2..{args.train_iters} (s)\n")
    print("| teachers | teacher (each) | route | student (loss) | optimizer | wall | teacher / "
          "sum of alone | teacher / max of alone |")
    print("|---|---|---|---|---|---|---|---|")
    for names, m in rows:
        each = ", ".join(f"{n} {m[n]:.2f}" for n in names)
        total = sum(alone[n] for n in names)
        most = max(alone[n] for n in names)
        print(f"| {' + '.join(names)} | {m['teacher']:.2f} ({each}) | {m['route']:.2f} | "
              f"{m['student']:.2f} ({m['loss']:.2f}) | {m['optimizer']:.2f} | {m['wall']:.2f} | "
              f"{m['teacher'] / total:.2f} | {m['teacher'] / most:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
