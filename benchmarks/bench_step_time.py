"""Step time of the demo configuration, split by phase: teacher / route / student (loss) / optim.

Runs ``pretrain_xdistill.py`` the way ``make demo`` does (Qwen2.5-Coder-0.5B teaches
SmolLM2-135M on the CPython standard library; two CPU ranks, student DP=2, teacher TP=2, global
batch 4 x 128 tokens) for a few steps per teacher payload form and prints the mean per step,
leaving out the first step (warm-up: DataLoader workers, allocator). ``loss`` is the
cross-tokenizer loss's forward + recomputing backward, part of ``student``.

  python benchmarks/bench_step_time.py [--train-iters 5] [--kd-topk 64 0] [--seq-length 128]

Models, checkpoints and the projection are fetched/converted/built once and cached
(``megatron_xdistill.assets.cache_dir``). Measured on 2 CPU cores (s per step, steps 2..5):

  payload               teacher  route  student (loss)  optimizer  step   tokens/s  B/token
  chunk top-64 + tail     6.83   0.01     5.01  (0.21)      0.73   12.58       40       524
  full vocabulary         8.36   0.21     6.68  (1.35)      0.78   16.04       32   612,496
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

PHASES = ("teacher", "route", "student", "loss", "optimizer")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=5)
    parser.add_argument("--kd-topk", type=int, nargs="+", default=[64, 0],
                        help="payload forms to time (0 = full teacher vocabulary)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")

    from megatron_xdistill.demo import STUDENT, TEACHER
    from megatron_xdistill.examples_data import write_stdlib_corpus
    from megatron_xdistill.workflow import (
        cpu_env,
        prepare_models,
        pretrain_command,
        read_metrics,
        run_command,
    )

    models = prepare_models(TEACHER, STUDENT)
    work = Path(tempfile.mkdtemp(prefix="xdistill-bench-step-"))
    rows = []
    try:
        train, _ = write_stdlib_corpus(work / "data")
        for topk in args.kd_topk:
            metrics = work / f"metrics-{topk}.jsonl"
            cmd = pretrain_command(models, args.nproc, {
                "teacher-tensor-model-parallel-size": args.nproc, "data-path": train,
                "seq-length": args.seq_length,
                "teacher-seq-length": args.seq_length + args.seq_length // 4,
                "micro-batch-size": 1, "global-batch-size": 2 * args.nproc,
                "train-iters": args.train_iters, "lr": "3e-5", "kd-loss": "pkl",
                "kd-topk": topk, "kd-weight": "1.0", "ce-weight": "0.1", "log-interval": 1,
                "metrics-file": metrics, "num-workers": 1,
                "data-cache-path": work / "data_cache"})
            run_command(cmd, env=cpu_env(1), stdout_path=work / f"log-{topk}.txt")
            steps = [r for r in read_metrics(metrics) if "kd" in r][1:]
            mean = {p: sum(r[f"time_{p}"] for r in steps) / len(steps) for p in PHASES}
            total = sum(mean[p] for p in PHASES if p != "loss")
            tok_s = sum(r["tokens_per_s"] for r in steps) / len(steps)
            rows.append((f"chunk top-{topk} + tail" if topk else "full vocabulary", mean, total,
                         tok_s, steps[-1]["payload_bytes_per_token"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{TEACHER} -> {STUDENT}, {args.nproc} CPU ranks (student DP={args.nproc}, teacher "
          f"TP={args.nproc}), global batch {2 * args.nproc} x {args.seq_length} tokens; mean of "
          f"steps 2..{args.train_iters} (s)\n")
    head = "| payload | " + " | ".join(PHASES) + " | step | tokens/s | payload B/token |"
    print(head)
    print("|" + "---|" * (len(PHASES) + 4))
    for name, mean, total, tok_s, bpt in rows:
        cells = " | ".join(f"{mean[p]:.2f}" for p in PHASES)
        print(f"| {name} | {cells} | {total:.2f} | {tok_s:.0f} | {bpt:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
