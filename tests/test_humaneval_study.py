"""The code study's HumanEval driver: it trains the runs it scores with the settings of the
published bits-per-byte rows, checks a retrained run against the published one, and calls a
difference real with the study's rule (beyond twice the larger seed spread)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1] / "examples" / "cross_tokenizer_distillation"
sys.path.insert(0, str(HERE))
import humaneval_study  # noqa: E402
import study  # noqa: E402

PASS, BPB = humaneval_study.METRICS.values()


@pytest.mark.parametrize("variant", list(humaneval_study.VARIANTS))
def test_runs_are_made_with_the_published_settings(tmp_path, variant):
    """The digest of what decides a run (variant, experiment, payload, seed) equals the one
    recorded with the published run, so a retrained run is the same run."""
    cfg = humaneval_study.study_config(tmp_path)
    published = json.loads(humaneval_study.PUBLISHED.read_text())["runs"]
    for seed in humaneval_study.SEEDS:
        assert study.run_settings(cfg, variant, seed) == published[f"{variant}-s{seed}"]["settings"]
    assert cfg.work_dir == str(tmp_path) and cfg.experiment == "real"


def test_reproduction_compares_with_the_published_run(tmp_path, monkeypatch):
    published = {"runs": {"ce_ep3-s2": {"metrics": [
        {"iteration": 0, "eval_bpb": 0.93}, {"iteration": 10, "ce": 1.5},
        {"iteration": 20, "ce": 1.25}, {"iteration": 20, "eval_bpb": 0.61}]}}}
    path = tmp_path / "real.json"
    path.write_text(json.dumps(published))
    monkeypatch.setattr(humaneval_study, "PUBLISHED", path)
    ours = [{"iteration": 0, "eval_bpb": 0.93}, {"iteration": 10, "ce": 1.5},
            {"iteration": 20, "ce": 1.375}, {"iteration": 20, "eval_bpb": 0.625}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ours))
    got = humaneval_study.reproduction(tmp_path, "ce_ep3", 2)
    assert got == {"steps_compared": 2, "max_train_ce_difference": 0.125, "in_loop_bpb": 0.625,
                   "published_in_loop_bpb": 0.61, "at_step": 20}
    assert humaneval_study.reproduction(tmp_path, "ce_ep3", 3) == {}  # nothing published


def _results(ce: list[float], kd: list[float], metric: str) -> dict:
    out = {}
    for seed, (a, b) in enumerate(zip(ce, kd), start=1):
        out[f"ce_ep3-seed{seed}"] = {metric: a}
        out[f"pkl_first_ep3-seed{seed}"] = {metric: b}
    return out


def test_the_rule_for_real_is_the_studys():
    steady = _results([0.80, 0.82, 0.81], [0.70, 0.73, 0.71], BPB)
    row = humaneval_study.paired(steady, BPB, "pkl_first_ep3", "ce_ep3")
    assert row["seeds"] == 3 and row["diff"] == pytest.approx(-0.0967, abs=1e-4)
    assert row["spread"] == pytest.approx(0.0152753, rel=1e-5) and row["real"]
    noisy = _results([0.80, 0.90, 0.70], [0.75, 0.86, 0.66], BPB)
    assert not humaneval_study.paired(noisy, BPB, "pkl_first_ep3", "ce_ep3")["real"]
    assert humaneval_study.paired(_results([0.8], [0.7], BPB), BPB, "pkl_first_ep3",
                                  "ce_ep3") is None  # one seed decides nothing


def test_table_shows_every_model_and_the_verdict():
    results = {**_results([0.0, 0.0, 0.0], [0.0, 0.0, 0.0], PASS),
               "teacher": {PASS: 0.25, BPB: 0.5}, "before": {PASS: 0.0, BPB: 0.9}}
    for i, (ce, kd) in enumerate(zip([0.80, 0.82, 0.81], [0.70, 0.73, 0.71]), start=1):
        results[f"ce_ep3-seed{i}"][BPB] = ce
        results[f"pkl_first_ep3-seed{i}"][BPB] = kd
    text = humaneval_study.table(results)
    assert "| teacher (Qwen2.5-Coder-0.5B) | 1 | 0.2500 | 0.5000 |" in text
    assert "| CE only (3 passes) | 3 | 0.0000 +- 0.0000 | 0.8100 +- 0.0100 |" in text
    verdict = text.splitlines()[-1]
    assert "+0.0000 +- 0.0000 (3 seeds); 2 x spread 0.0000: no difference" in verdict
    assert "-0.0967 +- 0.0058 (3 seeds); 2 x spread 0.0306: **real**" in verdict


def test_a_run_trained_again_gets_a_new_request_cache(tmp_path):
    """lm-eval's cache is keyed by request only: a checkpoint written again (same name, same
    iteration) must not be answered from the earlier checkpoint's cache."""
    import os

    tracker = tmp_path / "latest_checkpointed_iteration.txt"
    tracker.write_text("300")
    os.utime(tracker, (1_000_000, 1_000_000))
    first = humaneval_study.cache_name("ce_ep3-seed1", tmp_path)
    assert first == "ce_ep3-seed1-300-1000000"
    os.utime(tracker, (1_000_100, 1_000_100))
    assert humaneval_study.cache_name("ce_ep3-seed1", tmp_path) != first


def test_save_keeps_what_another_invocation_wrote(tmp_path, monkeypatch):
    monkeypatch.setattr(humaneval_study, "RESULTS", tmp_path / "r" / "humaneval.json")
    monkeypatch.setattr(humaneval_study, "TABLE", tmp_path / "r" / "humaneval.md")
    humaneval_study.save("before", {PASS: 0.0, BPB: 0.4})
    results = humaneval_study.save("teacher", {PASS: 0.4, BPB: 0.3})
    assert json.loads(humaneval_study.RESULTS.read_text()) == results
    assert sorted(results) == ["before", "teacher"] and results["teacher"]["commit"]
    table = humaneval_study.TABLE.read_text()
    assert "| teacher (Qwen2.5-Coder-0.5B) | 1 | 0.4000 | 0.3000 |" in table
    assert "| student before training (SmolLM2-135M) | 1 | 0.0000 | 0.4000 |" in table
