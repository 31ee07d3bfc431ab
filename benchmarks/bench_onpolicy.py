"""On-policy step time: how fast the student generates, and what share of a step generation takes.

SmolLM2-135M (student, DP over the ranks) samples responses to short prompts with its Megatron
model in its training layout (KV-cached, ``megatron_xdistill.generation``); Qwen2.5-Coder-0.5B
(TP 2) scores them; the step trains on them (``pretrain_xdistill.py --on-policy``, reverse KL).
Rows vary the response length; the generation batch is each replica's share of the global batch.

  python benchmarks/bench_onpolicy.py [--train-iters 4] [--nproc 2] [--new-tokens 16 64]
  python benchmarks/bench_onpolicy.py --device cuda --nproc 1 --bf16 --random-weights \
      --global-batch-size 16 --new-tokens 64 256        # one GPU, no model download

Each row is the mean of steps 2..N (the first is warm-up). ``tokens/s`` is one replica's newly
generated tokens per second of generation (every rank of a replica decodes together).
Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path

from results import write_rows

PROMPTS = [f"What is {a} + {b}?" for a, b in [(12, 34), (56, 7), (81, 19), (23, 45), (67, 89),
                                              (10, 90), (44, 55), (31, 62)]]


def _measure(args, models, prompts: Path, new_tokens: int, work: Path) -> dict:
    from megatron_xdistill.demo.workflow import cpu_env, pretrain_command, read_metrics, run_command

    metrics = work / f"metrics-{new_tokens}.jsonl"
    cmd = pretrain_command(models, args.nproc, {
        # prompts: about 40 student / 50 teacher tokens with the chat templates' system turns
        "on-policy": True, "data-path": prompts, "seq-length": 64 + new_tokens,
        "teacher-seq-length": 96 + new_tokens, "max-new-tokens": new_tokens,
        "teacher-tensor-model-parallel-size": 2 if args.nproc % 2 == 0 else 1,
        "micro-batch-size": 1, "global-batch-size": args.global_batch_size, "bf16": args.bf16,
        "train-iters": args.train_iters, "lr": "1e-5", "kd-loss": "pkl", "kd-topk": 64,
        "gkd-beta": 1.0,
        "ce-weight": 0.0, "sampling-temperature": 1.0, "log-interval": 1,
        "metrics-file": metrics})
    env = cpu_env(1)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    run_command(cmd, env=env, stdout_path=work / f"log-{new_tokens}.txt")
    steps = [r for r in read_metrics(metrics) if "kd" in r][1:]

    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in steps)

    wall = mean("elapsed_ms_per_iteration") / 1e3
    return {"new_tokens": new_tokens, "response": mean("response_tokens"),
            "generate": mean("time_generate"), "tokens_per_s": mean("generate_tokens_per_s"),
            "teacher": mean("time_teacher"), "student": mean("time_student"), "wall": wall,
            "share": mean("time_generate") / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-iters", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one rank per GPU (--nproc at most the GPUs), NCCL")
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (Megatron's --bf16)")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="prompts per step (default 2 x --nproc)")
    parser.add_argument("--random-weights", action="store_true",
                        help="the models' published architectures with random weights (no "
                             "download; responses run to --new-tokens, so tokens/s still holds)")
    parser.add_argument("--tokenizers", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "assets"
                        / "tokenizers", help="with --random-weights: the shared tokenizers")
    args = parser.parse_args()
    args.global_batch_size = args.global_batch_size or 2 * args.nproc
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")

    from megatron_xdistill.demo.workflow import prepare_models

    work = Path(tempfile.mkdtemp(prefix="bench-onpolicy-"))
    if args.random_weights:
        from bench_step_time import write_random_demo_models

        write_random_demo_models(work / "assets", args.tokenizers)
        os.environ["XDISTILL_ASSETS"] = str(work / "assets")
    models = prepare_models("qwen2.5-coder-0.5b", "smollm2-135m", log=print)
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    try:
        rows = [_measure(args, models, prompts, n, work) for n in args.new_tokens]
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print("\n| max new tokens | mean response | generate s | tokens/s (replica) | teacher s "
          "| student s | wall s | generating share |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['new_tokens']} | {r['response']:.1f} | {r['generate']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r['teacher']:.2f} | {r['student']:.2f} | "
              f"{r['wall']:.2f} | {100 * r['share']:.0f}% |")
    write_rows("bench_onpolicy", rows,
               params={"device": args.device, "nproc": args.nproc, "bf16": args.bf16,
                       "global_batch_size": args.global_batch_size,
                       "random_weights": args.random_weights, "train_iters": args.train_iters})


if __name__ == "__main__":
    main()
