"""The on-policy example's report: pass rates, the share of responses that end within the cap,
seconds per step and the generating share (steps after the first), from scores and metrics."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "examples" / "on_policy_distillation"
_spec = importlib.util.spec_from_file_location("on_policy_example", HERE / "run.py")
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)


def _score(rewards: list[float], finished: list[bool]) -> dict:
    return {"prompts": len(rewards), "mean_reward": sum(rewards) / len(rewards),
            "responses": [{"prompt": i, "response": "", "finished": f, "reward": r}
                          for i, (r, f) in enumerate(zip(rewards, finished))]}


def test_report_rows_follow_the_scores_and_the_steps(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(HERE / "config.yaml")
    cfg.pop("hydra")  # its run folder is Hydra's to resolve (${now:...})
    cfg.work_dir = str(tmp_path)
    scores = {"student before training": _score([0, 0, 0, 1], [False] * 4),
              "onpolicy": _score([1, 1, 0, 1], [True, True, False, True])}
    # the first step is warm-up and left out: 2 s per step, 0.5 s of it generating
    steps = [{"kd": 1.0, "elapsed_ms_per_iteration": 9000.0, "time_generate": 8.0}] + [
        {"kd": 1.0, "elapsed_ms_per_iteration": 2000.0, "time_generate": 0.5}] * 3
    steps = [dict(m, iteration=i + 1, on_policy=1.0, reward=i / 4, finished_fraction=0.5)
             for i, m in enumerate(steps)]
    path = example.report(cfg, scores, {"onpolicy": steps}, tmp_path / "out")
    rows = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    label = cfg.variants.onpolicy.label
    assert rows[1] == "| student before training | 0.250 | 0.00 | - | - |"
    assert rows[2] == f"| {label} | 0.750 | 0.75 | 2.0 | 25% |"
    # the training course, first and last steps (all 4 steps in one row: fewer than 10)
    assert rows[4:] == [f"| {label} | 1-4 | 4 | 0.38 | 0.50 | 1.000 |"]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["scores"]["onpolicy"] == {"prompts": 4, "mean_reward": pytest.approx(0.75)}
    assert results["config"]["steps"] == cfg.steps
