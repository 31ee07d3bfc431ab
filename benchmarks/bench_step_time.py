"""Step time of the demo configuration, split by phase: teacher / route / student (loss) / optim.

Runs ``pretrain_xdistill.py`` the way ``make demo`` does (Qwen2.5-Coder-0.5B teaches
SmolLM2-135M on the CPython standard library; two CPU ranks, student DP=2, teacher TP=2, global
batch 4 x 128 tokens) for a few steps per teacher payload form and prints the mean per step,
leaving out the first step (warm-up: DataLoader workers, allocator). ``loss`` is the
cross-tokenizer loss's forward + recomputing backward, part of ``student``.

  python benchmarks/bench_step_time.py [--train-iters 5] [--kd-topk 64 0] [--seq-length 128]
      [--placements colocated disaggregated] [--teacher-ranks 1]
  python benchmarks/bench_step_time.py --device cuda --random-weights --nproc 1 --bf16 \
      --seq-length 2048 --micro-batch-size 2 --global-batch-size 8 --kd-topk 64   # one GPU

``--kd-topk 0`` is the exact form, whose teacher ships its columns in W's image (not the full
vocabulary). Disaggregated = ``--teacher-ranks`` teacher ranks + the rest student ranks: the
teacher's forward of step k+1 overlaps the student's step k, so a step costs the slower side.
Models, checkpoints and the projection are fetched / converted / built once and cached
(``megatron_xdistill.demo.assets.cache_dir``).
Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from results import write_rows

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
                        help="payload forms to time (0 = the exact form: the teacher's columns in W's "
                             "image, not its full vocabulary)")
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
        name = f"chunk top-{topk} + tail" if topk else "exact (W's image)"
        cells = " | ".join(f"{mean[p]:.2f}" for p in PHASES)
        parts = mean["teacher"] + mean["student"] + mean["optimizer"]
        print(f"| {placement} | {name} | {cells} | {wall:.2f} | {wall / parts:.2f} | "
              f"{tok_s:.0f} | {bpt:,.0f} | {fill:.1%} |")
    write_rows("bench_step_time", [
        {"placement": placement, "payload": f"chunk top-{topk} + tail" if topk
         else "exact (W's image)", **{p: mean[p] for p in PHASES}, "wall": wall,
         "wall_over_phases": wall / (mean["teacher"] + mean["student"] + mean["optimizer"]),
         "tokens_per_s": tok_s, "bytes_per_token": bpt, "teacher_fill": fill}
        for placement, topk, (mean, wall, tok_s, bpt, fill) in rows],
        params={"device": args.device, "nproc": args.nproc, "bf16": args.bf16,
                "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
                "global_batch_size": args.global_batch_size, "train_iters": args.train_iters,
                "teacher_ranks": args.teacher_ranks, "random_weights": args.random_weights})
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
