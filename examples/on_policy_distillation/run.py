"""On-policy vs off-policy distillation at equal steps, scored by held-out pass rate.

    python examples/on_policy_distillation/run.py [hydra overrides]

SmolLM2-135M (student) learns two-digit additions from Qwen2.5-Coder-0.5B (teacher, another
tokenizer). Train and held-out prompts are disjoint operand pairs ("What is 47 + 38?", answer
"85"). Each variant trains ``steps`` steps with ``pretrain_xdistill.py --on-policy`` (the same
prompts, seed and learning rate): off-policy (lambda 0: the reference answers, KD + CE), on-policy
(lambda 1: the student's own sampled responses, reverse KL, no CE) and GKD's mix. The student
before training, each trained student and the teacher are scored on the held-out prompts with
``megatron_xdistill.evaluation.prompt_scores`` (greedy, reward ``last_number``); REPORT.md has
the pass rates, the time per step and the share of it spent generating.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))

from megatron_xdistill.demo import provenance  # noqa: E402
from megatron_xdistill.demo.workflow import (  # noqa: E402
    cpu_env,
    prepare_models,
    pretrain_command,
    read_metrics,
    run_command,
)


def say(message: str) -> None:
    print(f"[on-policy example] {message}", flush=True)


def write_prompts(cfg, work: Path) -> dict[str, Path]:
    """Disjoint train / held-out addition prompts (deterministic in ``cfg.seed``)."""
    out = work / "data"
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    if all(p.exists() for p in paths.values()):
        return paths
    rng = random.Random(cfg.seed)
    pairs = [(a, b) for a in range(cfg.data.low, cfg.data.high + 1)
             for b in range(cfg.data.low, cfg.data.high + 1)]
    rng.shuffle(pairs)
    need = cfg.data.train_prompts + cfg.data.heldout_prompts
    if len(pairs) < need:
        raise ValueError(f"data: {len(pairs)} operand pairs for {need} prompts")
    split = {"heldout": pairs[: cfg.data.heldout_prompts],
             "train": pairs[cfg.data.heldout_prompts: need]}
    for name, chosen in split.items():
        tmp = paths[name].with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"prompt": f"What is {a} + {b}?",
                                           "answer": f"{a} + {b} = {a + b}"}) + "\n"
                               for a, b in chosen))
        tmp.replace(paths[name])
    return paths


def _finished(ckpt: Path) -> int:
    tracker = ckpt / "latest_checkpointed_iteration.txt"
    text = tracker.read_text().strip() if tracker.is_file() else ""
    return int(text) if text.isdigit() else 0


def train(cfg, name: str, models, data: dict, work: Path) -> Path:
    """One variant's run (resumed from its checkpoints; skipped once finished)."""
    variant = cfg.variants[name]
    run_dir = work / "runs" / name
    if _finished(run_dir / "ckpt") >= cfg.steps:
        return run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    tp = 2 if cfg.nproc % 2 == 0 else 1  # Qwen2.5-Coder-0.5B: 2 KV heads
    options = {
        "on-policy": True, "data-path": data["train"], "seq-length": cfg.seq_length,
        "teacher-seq-length": cfg.teacher_seq_length, "max-new-tokens": cfg.max_new_tokens,
        "teacher-tensor-model-parallel-size": tp, "micro-batch-size": cfg.micro_batch_size,
        "global-batch-size": cfg.global_batch_size, "train-iters": cfg.steps, "lr": cfg.lr,
        "min-lr": cfg.min_lr, "lr-warmup-iters": cfg.lr_warmup_iters,
        "lr-decay-style": "cosine", "kd-loss": "pkl", "kd-topk": cfg.kd_topk, "seed": cfg.seed,
        "gkd-lambda": variant.gkd_lambda, "gkd-beta": variant.gkd_beta,
        "ce-weight": variant.ce_weight, "reward-fn": cfg.reward_fn, "log-interval": 1,
        "metrics-file": run_dir / "metrics.jsonl",
        "generations-file": run_dir / "generations.jsonl", "save": run_dir / "ckpt",
        "save-interval": cfg.save_interval, "keep-last-checkpoints": 1}
    say(f"training {name} ({variant.label}) from step {_finished(run_dir / 'ckpt')}")
    run_command(pretrain_command(models, cfg.nproc, options), say,
                env=cpu_env(cfg.threads_per_rank), stdout_path=run_dir / "train.log")
    return run_dir


def score(cfg, label: str, model: list[str], data: dict, work: Path) -> dict:
    """Held-out pass rate of a model (cached by label and the model's files' state)."""
    out = work / "scores" / f"{label}.json"
    if out.is_file():
        return json.loads(out.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    run_command([sys.executable, "-m", "megatron_xdistill.evaluation.prompt_scores", *model,
                 "--data-path", str(data["heldout"]), "--reward-fn", cfg.reward_fn,
                 "--max-new-tokens", str(cfg.max_new_tokens), "--json", str(out),
                 "--threads", str(cfg.nproc * cfg.threads_per_rank)], say)
    return json.loads(out.read_text())


def report(cfg, scores: dict, runs: dict, out: Path) -> Path:
    """REPORT.md (pass rates, time per step, generating share) and results.json in ``out``."""
    lines = ["# On-policy vs off-policy distillation (held-out pass rate)", "",
             f"Student {cfg.student}, teacher {cfg.teacher}; {cfg.steps} steps x "
             f"{cfg.global_batch_size} prompts, up to {cfg.max_new_tokens} new tokens; "
             f"{cfg.data.heldout_prompts} held-out additions, greedy, reward {cfg.reward_fn}; "
             f"{time.strftime('%Y-%m-%d')}.", "",
             "| model | pass rate | responses ended (EOS within the cap) | s / step "
             "| generating (share of the step) |",
             "|---|---|---|---|---|"]
    for label, result in scores.items():
        metrics = [m for m in runs.get(label, []) if "kd" in m][1:]
        step = gen = "-"
        if metrics:
            wall = statistics.fmean(m["elapsed_ms_per_iteration"] for m in metrics) / 1e3
            share = statistics.fmean(m.get("time_generate", 0.0) for m in metrics) / wall
            step, gen = f"{wall:.1f}", f"{100 * share:.0f}%"
        name = cfg.variants[label].label if label in cfg.variants else label
        ended = statistics.fmean(float(r["finished"]) for r in result["responses"])
        lines.append(f"| {name} | {result['mean_reward']:.3f} | {ended:.2f} | {step} | {gen} |")
    lines += _trajectory(cfg, runs)
    out.mkdir(parents=True, exist_ok=True)
    results = {"scores": {k: {key: v[key] for key in ("prompts", "mean_reward")}
                          for k, v in scores.items()}, "config": _plain(cfg),
               "provenance": provenance.record(), "curves": curves(runs)}
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    path = out / "REPORT.md"
    path.write_text("\n".join(lines) + "\n")
    say(f"wrote {path}")
    return path


#: The per-step metrics each variant's curve keeps (those a step logged).
CURVE_KEYS = ("iteration", "kd", "ce", "on_policy", "reward", "finished_fraction",
              "response_tokens", "lr", "grad_norm", "elapsed_ms_per_iteration", "time_generate")


def curves(runs: dict) -> dict[str, list[dict]]:
    """Each variant's training steps, one dict a step (:data:`CURVE_KEYS` it logged): the
    on-policy reward, the share of responses that ended and the KD loss over training, kept
    beside the scores so the report's trajectory can be redrawn from results.json."""
    return {label: [{k: m[k] for k in CURVE_KEYS if k in m} for m in metrics if "kd" in m]
            for label, metrics in runs.items()}


def _trajectory(cfg, runs: dict, span: int = 10) -> list[str]:
    """The training rollouts' course: the first and the last ``span`` steps of each variant
    (KD; on its on-policy steps the sampled responses' reward and the share that ended)."""
    lines = ["", f"Training steps (first and last {span}; reward and ended: the on-policy steps' "
             "sampled responses, temperature 1, on training prompts):", "",
             "| variant | steps | on-policy steps | sampled reward | responses ended | KD |",
             "|---|---|---|---|---|---|"]
    for label, metrics in runs.items():
        steps = [m for m in metrics if "kd" in m]
        for first in sorted({0, max(len(steps) - span, 0)}):
            part = steps[first : first + span]
            sampled = [m for m in part if m.get("on_policy")]
            reward = ended = "-"
            if sampled and all("reward" in m for m in sampled):
                reward = f"{statistics.fmean(m['reward'] for m in sampled):.2f}"
            if sampled:
                ended = f"{statistics.fmean(m['finished_fraction'] for m in sampled):.2f}"
            name = cfg.variants[label].label if label in cfg.variants else label
            lines.append(f"| {name} | {part[0]['iteration']}-{part[-1]['iteration']} | "
                         f"{len(sampled)} | {reward} | {ended} | "
                         f"{statistics.fmean(m['kd'] for m in part):.3f} |")
    return lines


def _plain(cfg) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(cfg, resolve=True)


def run(cfg) -> dict:
    work = Path(cfg.work_dir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    models = prepare_models(cfg.teacher, cfg.student, log=say)
    data = write_prompts(cfg, work)
    scores = {"student before training": score(
        cfg, "before", ["--load", str(models.student_ckpt), "--tokenizer-model",
                        str(models.student_hf)], data, work),
              f"teacher ({cfg.teacher})": score(cfg, "teacher", ["--hf-dir",
                                                                 str(models.teacher_hf)],
                                                 data, work)}
    runs = {}
    for name in cfg.variants_to_run:
        run_dir = train(cfg, name, models, data, work)
        runs[name] = read_metrics(run_dir / "metrics.jsonl")
        scores[name] = score(cfg, f"{name}-step{cfg.steps}",
                             ["--load", str(run_dir / "ckpt"), "--tokenizer-model",
                              str(models.student_hf)], data, work)
    report(cfg, scores, runs, Path(cfg.report_dir).resolve())
    return scores


def main() -> None:
    import hydra

    @hydra.main(config_path=str(HERE), config_name="config", version_base=None)
    def _main(cfg) -> None:
        run(cfg)

    _main()


if __name__ == "__main__":
    main()
