"""Step time of the demo configuration, split by phase: teacher / route / student (loss) / optim.

Runs ``pretrain_xdistill.py`` the way ``make demo`` does (Qwen2.5-Coder-0.5B teaches
SmolLM2-135M on the CPython standard library; two CPU ranks, student DP=2, teacher TP=2, global
batch 4 x 128 tokens) for a few steps per teacher payload form and prints the mean per step,
leaving out the first step (warm-up: DataLoader workers, allocator). ``loss`` is the
cross-tokenizer loss's forward + recomputing backward, part of ``student``.

  python benchmarks/bench_step_time.py [--train-iters 5] [--kd-topk 64 0] [--seq-length 128]
      [--placements colocated disaggregated] [--teacher-ranks 1]

Models, checkpoints and the projection are fetched/converted/built once and cached
(``megatron_xdistill.assets.cache_dir``). Measured on 2 CPU cores (s per step, steps 2..5):

  placement      payload               teacher  route  student (loss)  optim  wall  tokens/s  B/token
  colocated      chunk top-64 + tail     6.79   0.01     5.16  (0.40)   0.76  12.77      40       524
  disaggregated  chunk top-64 + tail    10.83   0.00     8.66  (0.31)   0.52   9.19      56       524
  colocated      full vocabulary         8.36   0.21     6.68  (1.35)   0.78  16.04      32   612,496

Disaggregated = 1 teacher rank + 1 student rank: the teacher's forward of step k+1 overlaps the
student's step k, 1.39x the colocated tokens/s here (over 4 steps the teacher's one-batch head
start also hides some of its time; the steady state is bounded by the slower side, ~10.8 s).
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
    parser.add_argument("--placements", nargs="+", default=["colocated"],
                        choices=["colocated", "disaggregated"])
    parser.add_argument("--teacher-ranks", type=int, default=1,
                        help="disaggregated: ranks that serve the teacher (its TP size here)")
    args = parser.parse_args(argv)
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")

    from megatron_xdistill.demo import STUDENT, TEACHER
    from megatron_xdistill.examples_data import write_stdlib_corpus
    from megatron_xdistill.workflow import (
        prepare_models,
    )

    models = prepare_models(TEACHER, STUDENT)
    work = Path(tempfile.mkdtemp(prefix="xdistill-bench-step-"))
    rows = []
    try:
        train, _ = write_stdlib_corpus(work / "data")
        for placement in args.placements:
            for topk in args.kd_topk:
                rows.append((placement, topk, _measure(args, models, train, work, placement,
                                                       topk)))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    t_ranks = args.teacher_ranks
    print(f"\n{TEACHER} -> {STUDENT}, {args.nproc} CPU ranks, global batch {2 * args.nproc} x "
          f"{args.seq_length} tokens; mean of steps 2..{args.train_iters} (s). colocated: every "
          f"rank runs both (student DP={args.nproc}, teacher TP={args.nproc}); disaggregated: "
          f"{t_ranks} teacher rank(s) (TP={t_ranks}), {args.nproc - t_ranks} student rank(s) "
          f"(DP), teacher of step k+1 overlapping the student of step k. 'wall' is the measured "
          f"step time (the phases of the two sides overlap when disaggregated).\n")
    head = "| placement | payload | " + " | ".join(PHASES) + " | wall | tokens/s | B/token |"
    print(head)
    print("|" + "---|" * (len(PHASES) + 5))
    for placement, topk, (mean, wall, tok_s, bpt) in rows:
        name = f"chunk top-{topk} + tail" if topk else "full vocabulary"
        cells = " | ".join(f"{mean[p]:.2f}" for p in PHASES)
        print(f"| {placement} | {name} | {cells} | {wall:.2f} | {tok_s:.0f} | {bpt:,.0f} |")
    return 0


def _measure(args, models, train: Path, work: Path, placement: str, topk: int):
    """One run; (mean phase seconds, wall seconds per step, tokens/s, payload B/token)."""
    from megatron_xdistill.workflow import cpu_env, pretrain_command, read_metrics, run_command

    layout = {"teacher-tensor-model-parallel-size": args.nproc}
    if placement == "disaggregated":
        layout = {"teacher-placement": "disaggregated", "teacher-ranks": args.teacher_ranks,
                  "teacher-tensor-model-parallel-size": args.teacher_ranks}
    metrics = work / f"metrics-{placement}-{topk}.jsonl"
    cmd = pretrain_command(models, args.nproc, {
        **layout, "data-path": train, "seq-length": args.seq_length,
        "teacher-seq-length": args.seq_length + args.seq_length // 4,
        "micro-batch-size": 1, "global-batch-size": 2 * args.nproc,
        "train-iters": args.train_iters, "lr": "3e-5", "kd-loss": "pkl",
        "kd-topk": topk, "kd-weight": "1.0", "ce-weight": "0.1", "log-interval": 1,
        "metrics-file": metrics, "num-workers": 1, "data-cache-path": work / "data_cache"})
    run_command(cmd, env=cpu_env(1), stdout_path=work / f"log-{placement}-{topk}.txt")
    steps = [r for r in read_metrics(metrics) if "kd" in r][1:]
    mean = {p: sum(r[f"time_{p}"] for r in steps) / len(steps) for p in PHASES}
    tok_s = sum(r["tokens_per_s"] for r in steps) / len(steps)
    wall = sum(r["tokens"] / r["tokens_per_s"] for r in steps) / len(steps)
    return mean, wall, tok_s, steps[-1]["payload_bytes_per_token"]


if __name__ == "__main__":
    raise SystemExit(main())
