"""Step time with one and two teachers, colocated and disaggregated, against their forward times.

Qwen2.5-Coder-0.5B and Gemma-3-270M (each its own tokenizer, projection and layout) teach
SmolLM2-135M on the CPython standard library, as ``make demo`` runs it: one run per teacher alone
and one run with both (``--teachers-config``, weights 0.5 / 0.5, combination sum). Colocated, the
teachers run one after the other on every rank, so the two-teacher step's teacher phase should
cost the sum of the single teachers' forwards and nothing more; the table prints that sum and the
max (what a placement that runs the teachers side by side could reach).

  python benchmarks/bench_teachers.py [--train-iters 4] [--nproc 2] [--seq-length 128]
      [--placement colocated|disaggregated|both] [--teacher-ranks 1] [--threads-per-rank 1]
      [--random-weights --tokenizers DIR]

``--placement disaggregated`` puts the student on the ``--nproc`` ranks and each teacher on
``--teacher-ranks`` ranks of its own (``ranks`` in the teachers file); every teacher computes
step k+1 while the student trains on step k, so a step should cost the slowest side, not the sum.
Column "ideal": the step with nothing lost, from the uncontended (colocated) phase times: the sum
colocated; disaggregated the slowest side, or all sides' work over the machine's cores when the
ranks' threads outnumber them. ``benchmarks/device/checks.sh bench_teachers`` runs the same on a
lent machine's 16 CPU cores with ``--random-weights`` (the published architectures, random
weights: the model files do not travel there), where the ideal is the slowest side.

Prints a table and keeps its rows as a result file under ``benchmarks/results/``
(``benchmarks/results.py``); the docs' tables are generated from those files
(``tools/docs_tables.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from results import write_rows

PHASES = ("teacher", "route", "student", "loss", "optimizer")
TEACHERS = {  # name: (model, its layout on the --nproc ranks)
    "qwen": ("qwen2.5-coder-0.5b", "tensor"),  # 14 heads, 2 KV heads: TP 2
    "gemma": ("gemma3-270m", "data"),  # 1 KV head: no TP, one replica per rank
}
STUDENT = "smollm2-135m"

# Gemma-3-270M's published architecture, for --random-weights (the demo pair's are bench_step_time's)
GEMMA3_270M = ("gemma3", {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 32768, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_parameters": {"full_attention": {"rope_theta": 1000000.0, "rope_type": "default"},
                        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"}},
    "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0})


def _teachers_yaml(path: Path, pairs: dict, names: list[str], nproc: int,
                   teacher_ranks: int | None = None) -> Path:
    """The run's ``--teachers-config``: colocated (``teacher_ranks`` None) each teacher spans
    the ``nproc`` ranks; disaggregated each has ``teacher_ranks`` ranks of its own."""
    import yaml

    entries = []
    for name in names:
        pair, (_, split) = pairs[name], TEACHERS[name]
        ranks = nproc if teacher_ranks is None else teacher_ranks
        entry = {"name": name, "load": str(pair.teacher_ckpt),
                 "tokenizer_model": str(pair.teacher_hf),
                 "projection_path": str(pair.projection),
                 "tensor_model_parallel_size": ranks if split == "tensor" else 1,
                 "weight": 1.0 / len(names)}
        if teacher_ranks is not None:
            entry["ranks"] = teacher_ranks
        entries.append(entry)
    path.write_text(yaml.safe_dump({"teachers": entries, "combination": "sum"}))
    return path


def _measure(args, pairs: dict, names: list[str], train: Path, work: Path,
             placement: str) -> dict:
    """One run of these teachers (``placement`` colocated or disaggregated); mean phase seconds
    (and per teacher), wall. Disaggregated, the student keeps the ``--nproc`` ranks and each
    teacher gets ``--teacher-ranks`` more; its teacher phase is the wait for the slowest."""
    from megatron_xdistill.demo.workflow import cpu_env, pretrain_command, read_metrics, run_command

    tag = f"{'+'.join(names)}-{placement}"
    apart = placement == "disaggregated"
    config = _teachers_yaml(work / f"{tag}.yaml", pairs, names, args.nproc,
                            args.teacher_ranks if apart else None)
    world = args.nproc + (args.teacher_ranks * len(names) if apart else 0)
    metrics = work / f"metrics-{tag}.jsonl"
    cmd = pretrain_command(pairs[names[0]], world, {
        "teachers-config": config, "data-path": train, "seq-length": args.seq_length,
        "micro-batch-size": 1, "global-batch-size": 2 * args.nproc,
        "train-iters": args.train_iters, "lr": "3e-5", "kd-loss": "pkl", "kd-topk": 64,
        "log-interval": 1,
        "metrics-file": metrics, "num-workers": 1, "data-cache-path": work / f"cache-{tag}",
        "teacher-placement": placement})
    run_command(cmd, env=dict(cpu_env(args.threads_per_rank), CUDA_VISIBLE_DEVICES=""),
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
    parser.add_argument("--nproc", type=int, default=2, help="the student's ranks (colocated: "
                        "also every teacher's)")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--placement", choices=("colocated", "disaggregated", "both"),
                        default="colocated", help="disaggregated: each teacher on ranks of its "
                        "own (needs cores to spare: --nproc + --teacher-ranks x teachers ranks)")
    parser.add_argument("--teacher-ranks", type=int, default=1,
                        help="disaggregated: ranks of each teacher")
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--random-weights", action="store_true",
                        help="the models' published architectures with random weights (no "
                        "fetch: machines without the model files)")
    parser.add_argument("--tokenizers", type=Path, default=Path(__file__).resolve().parents[2]
                        / "shared" / "assets" / "tokenizers",
                        help="with --random-weights: the shared tokenizers")
    args = parser.parse_args(argv)
    if args.train_iters < 2:
        parser.error("--train-iters must be >= 2 (the first step is left out)")
    placements = (["colocated", "disaggregated"] if args.placement == "both"
                  else [args.placement])

    from megatron_xdistill.demo.corpus import write_stdlib_corpus
    from megatron_xdistill.demo.workflow import prepare_models

    work = Path(tempfile.mkdtemp(prefix="xdistill-bench-teachers-"))
    if args.random_weights:
        from bench_step_time import DEMO_CONFIGS, write_random_demo_models

        write_random_demo_models(work / "assets", args.tokenizers,
                                 {**DEMO_CONFIGS, "gemma3-270m": GEMMA3_270M})
        os.environ["XDISTILL_ASSETS"] = str(work / "assets")
    pairs = {name: prepare_models(model, STUDENT) for name, (model, _) in TEACHERS.items()}
    try:
        train, _ = write_stdlib_corpus(work / "data")
        runs = [(names, placement) for placement in placements
                for names in (["qwen"], ["gemma"], ["qwen", "gemma"])]
        rows = [(names, placement, _measure(args, pairs, names, train, work, placement))
                for names, placement in runs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(table(rows, args))
    cores = len(os.sched_getaffinity(0))
    write_rows("bench_teachers", [
        {"teachers": " + ".join(names), "placement": placement, **m} for names, placement, m
        in rows], params={"nproc": args.nproc, "teacher_ranks": args.teacher_ranks,
                          "threads_per_rank": args.threads_per_rank, "cores": cores,
                          "seq_length": args.seq_length, "train_iters": args.train_iters,
                          "random_weights": args.random_weights})
    return 0


def ideal(names: list[str], placement: str, m: dict, work: dict, args, cores: int) -> float:
    """The step these phases would take with nothing lost: colocated, all of them one after the
    other; disaggregated, the slowest side, or all sides' work over the machine's cores when the
    ranks' threads outnumber them. ``work``: each teacher's forward and each teacher set's
    student + optimizer time, from the colocated runs (one process: uncontended) where run."""
    student = work.get(tuple(names), m["student"] + m["optimizer"])
    sides = [work.get(n, m[n]) for n in names]
    if placement == "colocated":
        return sum(sides) + student
    core_seconds = (student * args.nproc + sum(sides) * args.teacher_ranks) * args.threads_per_rank
    return max(*sides, student, core_seconds / cores)


def table(rows: list, args, cores: int | None = None) -> str:
    """The Markdown table: each run's phases against its placement's teachers run alone (sum:
    one after the other; max: side by side), its wall against the phases' sum, and against the
    step the placement and the machine's cores would allow with nothing lost (:func:`ideal`)."""
    cores = cores or len(os.sched_getaffinity(0))
    alone = {(names[0], placement): m[names[0]] for names, placement, m in rows
             if len(names) == 1}
    work = {}  # uncontended phase times (see ideal)
    for names, placement, m in rows:
        if placement == "colocated":
            work[tuple(names)] = m["student"] + m["optimizer"]
            if len(names) == 1:
                work[names[0]] = m[names[0]]
    weights = ", random weights" if args.random_weights else ""
    lines = [f"\nteachers -> {STUDENT}{weights}, student on {args.nproc} CPU ranks ({args.threads_per_rank} "
             f"thread(s) each; disaggregated: + {args.teacher_ranks} rank(s) per teacher), {cores} "
             f"CPU cores, fp32, global batch {2 * args.nproc} x {args.seq_length} tokens, chunk "
             f"top-64; mean of steps 2..{args.train_iters} (s)\n",
             "| teachers | placement | teacher (each) | route | student (loss) | optimizer | wall "
             "| teacher / sum of alone | teacher / max of alone | wall / (sum of alone + student "
             "+ optimizer) | ideal | wall / ideal |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for names, placement, m in rows:
        each = ", ".join(f"{n} {m[n]:.2f}" for n in names)
        total = sum(alone[n, placement] for n in names)
        most = max(alone[n, placement] for n in names)
        serial = total + m["student"] + m["optimizer"]
        best = ideal(names, placement, m, work, args, cores)
        lines.append(f"| {' + '.join(names)} | {placement} | {m['teacher']:.2f} ({each}) | "
                     f"{m['route']:.2f} | {m['student']:.2f} ({m['loss']:.2f}) | "
                     f"{m['optimizer']:.2f} | {m['wall']:.2f} | {m['teacher'] / total:.2f} | "
                     f"{m['teacher'] / most:.2f} | {m['wall'] / serial:.2f} | {best:.2f} | "
                     f"{m['wall'] / best:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
