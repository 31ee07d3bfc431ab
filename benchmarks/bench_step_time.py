"""Step time of the demo configuration, split by phase: teacher / route / student (loss) / optim.

Runs ``pretrain_xdistill.py`` the way ``make demo`` does (Qwen2.5-Coder-0.5B teaches
SmolLM2-135M on the CPython standard library; two CPU ranks, student DP=2, teacher TP=2, global
batch 4 x 128 tokens) for a few steps per teacher payload form and prints the mean per step,
leaving out the first step (warm-up: DataLoader workers, allocator). ``loss`` is the
cross-tokenizer loss's forward + recomputing backward, part of ``student``.

  python benchmarks/bench_step_time.py [--train-iters 5] [--kd-topk 64 0] [--seq-length 128]
      [--placements colocated disaggregated] [--teacher-ranks 1]

Models, checkpoints and the projection are fetched/converted/built once and cached
(``megatron_xdistill.demo.assets.cache_dir``). Measured on 2 CPU cores (s per step, steps 2..5):

  placement      payload               teacher  route  student (loss)  optim   wall  tokens/s  B/token
  colocated      chunk top-64 + tail     6.64   0.01     4.52  (0.24)   0.66  11.86        43       524
  colocated      full vocabulary         8.34   0.10     6.96  (1.90)   0.88  16.38        31   612,496
  disaggregated  chunk top-64 + tail    11.50   2.75     7.81  (0.33)   0.57  11.13        46       524
  disaggregated  full vocabulary        11.76   0.00    10.94  (3.18)   0.60  11.56        44   612,496

The loss column at 2026-11-28 (same command, colocated; A/B of fa015af and the commit that set
a floor of 8 positions a block, ``loss/blocks/block_size.py``, runs alternated twice): full vocabulary
0.91-0.92 -> 0.53-0.60 s a step, chunk top-64 0.13-0.16 -> 0.10-0.13 s (a rank's micro-batch is
128 tokens: the 1/128 share made blocks of one position). Since 7e44447 (before
``loss/cpu/exact.py``) the full-vocabulary loss went from 0.82-1.04 s a step.

Disaggregated = 1 teacher rank + 1 student rank (one node: payloads through shared-memory
slots): the teacher's forward of step k+1 overlaps the student's step k, so a step costs the
slower side, not the sum. With full-vocabulary payloads the student is the slower side (the
teacher keeps ahead, route 0.00 s: 1.42x colocated tokens/s); with compact ones the single
teacher rank is (the student waits 2.75 s for it: 1.07x). Give the teacher more ranks
(--teacher-ranks) until the two sides balance.

On one H100 (bf16, torch-native layers: TransformerEngine is not installed there; the demo pair's
published architectures with random weights, ``--device cuda --random-weights --nproc 1 --bf16
--seq-length 2048 --micro-batch-size 2 --global-batch-size 8 --kd-topk 64``, steps 2..5):

  placement   payload               teacher  route  student (loss)  optim   wall  tokens/s  B/token
  colocated   chunk top-64 + tail      0.81   0.00     1.55  (0.55)   0.01   2.38     6,901      520

The step costs the sum of its phases (2.38 s vs 0.81 + 1.55 + 0.01 = 2.37: ratio 1.00); the
cross-tokenizer loss is 23% of it (see bench_loss.py's GPU table).

The same command on one H200 (2026-11-26, an intermediate state of commit 76a1e6a: the loss's W
entries expanded once per call,
``loss/blocks/block_entries.py``; steps 2..5 from the run's log, the process was stopped before its
table): teacher 0.90 s, student 1.26 s (loss 0.27), optimizer 0.01 s, wall 2.18 s, 7,570
tokens/s; ratio wall / (teacher + student + optimizer) = 1.00, the loss 12% of the step. On CUDA the phase clocks
synchronise the device at each boundary, so the split is of GPU time too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

PHASES = ("teacher", "route", "student", "loss", "optimizer")

# The demo pair's published architectures (SmolLM2-135M, Qwen2.5-Coder-0.5B) for --random-weights.
DEMO_CONFIGS = {
    "smollm2-135m": ("smollm2", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 1, "eos_token_id": 2}),
    "qwen2.5-coder-0.5b": ("qwen2", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
        "num_key_value_heads": 2, "vocab_size": 151936, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 32768,
        "max_window_layers": 21, "bos_token_id": 151643, "eos_token_id": 151645}),
}


def write_random_demo_models(cache: Path, tokenizers: Path, configs: dict | None = None
                             ) -> None:
    """HF folders of the demo models (``configs``, default the demo pair: name -> (tokenizer
    folder, config.json)) under ``cache/models`` (where ``fetch_model`` looks): the published
    architecture, random bf16 weights, the shared tokenizer of the family."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    for name, (tokenizer, config) in (configs or DEMO_CONFIGS).items():
        if not (tokenizers / tokenizer).is_dir():
            raise SystemExit(f"--random-weights: tokenizer folder {tokenizers / tokenizer} not "
                             f"found (pass --tokenizers DIR holding {tokenizer}/)")
        out = cache / "models" / name
        shutil.copytree(tokenizers / tokenizer, out)
        (out / "config.json").write_text(json.dumps(config))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out),
                                                 dtype=torch.bfloat16)
        model.save_pretrained(out)


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
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one rank per GPU (--nproc at most the GPUs), NCCL")
    parser.add_argument("--bf16", action="store_true", help="train in bf16 (Megatron's --bf16)")
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="default 2 x --nproc")
    parser.add_argument("--random-weights", action="store_true",
                        help="the demo models' published architectures with random weights and "
                             "the shared tokenizers (--tokenizers), for machines that cannot "
                             "fetch the models: step time does not depend on the weights' values")
    parser.add_argument("--tokenizers", type=Path,
                        default=Path(__file__).resolve().parents[2] / "shared" / "assets"
                        / "tokenizers", help="with --random-weights: the shared tokenizers")
    args = parser.parse_args(argv)
    args.global_batch_size = args.global_batch_size or 2 * args.nproc
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")

    from megatron_xdistill.demo.corpus import write_stdlib_corpus
    from megatron_xdistill.demo.quickstart import STUDENT, TEACHER
    from megatron_xdistill.demo.workflow import (
        prepare_models,
    )

    work = Path(tempfile.mkdtemp(prefix="xdistill-bench-step-"))
    if args.random_weights:
        write_random_demo_models(work / "assets", args.tokenizers)
        os.environ["XDISTILL_ASSETS"] = str(work / "assets")
    models = prepare_models(TEACHER, STUDENT)
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
    where = "GPU" if args.device == "cuda" else "CPU"
    weights = ", random weights" if args.random_weights else ""
    print(f"\n{TEACHER} -> {STUDENT}{weights}, {args.nproc} {where} ranks, "
          f"{'bf16' if args.bf16 else 'fp32'}, global batch {args.global_batch_size} x "
          f"{args.seq_length} tokens; mean of steps 2..{args.train_iters} (s). colocated: every "
          f"rank runs both (student DP={args.nproc}, teacher TP={args.nproc}); disaggregated: "
          f"{t_ranks} teacher rank(s) (TP={t_ranks}), {args.nproc - t_ranks} student rank(s) "
          f"(DP), teacher of step k+1 overlapping the student of step k. 'wall' is the measured "
          f"step time (the phases of the two sides overlap when disaggregated); 'teacher fill' the "
          f"share of the positions the teacher ran that predict its text (each teacher "
          f"micro-batch runs as many as its longest text needs).\n")
    head = ("| placement | payload | " + " | ".join(PHASES)
            + " | wall | wall / (teacher + student + optimizer) | tokens/s | B/token "
              "| teacher fill |")
    print(head)
    print("|" + "---|" * (len(PHASES) + 7))
    for placement, topk, (mean, wall, tok_s, bpt, fill) in rows:
        name = f"chunk top-{topk} + tail" if topk else "full vocabulary"
        cells = " | ".join(f"{mean[p]:.2f}" for p in PHASES)
        parts = mean["teacher"] + mean["student"] + mean["optimizer"]
        print(f"| {placement} | {name} | {cells} | {wall:.2f} | {wall / parts:.2f} | "
              f"{tok_s:.0f} | {bpt:,.0f} | {fill:.1%} |")
    return 0


def _measure(args, models, train: Path, work: Path, placement: str, topk: int):
    """One run; (mean phase seconds, wall seconds per step, tokens/s, payload B/token)."""
    from megatron_xdistill.demo.workflow import cpu_env, pretrain_command, read_metrics, run_command

    layout = {"teacher-tensor-model-parallel-size": args.nproc}
    if placement == "disaggregated":
        layout = {"teacher-placement": "disaggregated", "teacher-ranks": args.teacher_ranks,
                  "teacher-tensor-model-parallel-size": args.teacher_ranks}
    metrics = work / f"metrics-{placement}-{topk}.jsonl"
    cmd = pretrain_command(models, args.nproc, {
        **layout, "data-path": train, "seq-length": args.seq_length,
        # the teacher's length as users get it: derived from the data (issue 18: padding)
        "micro-batch-size": args.micro_batch_size, "global-batch-size": args.global_batch_size,
        "bf16": args.bf16,
        "train-iters": args.train_iters, "lr": "3e-5", "kd-loss": "pkl",
        "kd-topk": topk, "kd-weight": "1.0", "ce-weight": "0.1", "log-interval": 1,
        "metrics-file": metrics, "num-workers": 1, "data-cache-path": work / "data_cache"})
    env = cpu_env(1)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    run_command(cmd, env=env, stdout_path=work / f"log-{placement}-{topk}.txt")
    steps = [r for r in read_metrics(metrics) if "kd" in r][1:]
    mean = {p: sum(r[f"time_{p}"] for r in steps) / len(steps) for p in PHASES}
    tok_s = sum(r["tokens_per_s"] for r in steps) / len(steps)
    wall = sum(r["tokens"] / r["tokens_per_s"] for r in steps) / len(steps)
    fill = sum(r["teacher_fill"] for r in steps) / len(steps)
    return mean, wall, tok_s, steps[-1]["payload_bytes_per_token"], fill


if __name__ == "__main__":
    raise SystemExit(main())
