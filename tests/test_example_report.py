"""The 25-step comparison's report (``examples/cross_tokenizer_distillation/run_report.py``):
its table and verdicts are the numbers of the results file, and REPORT.md is written whole."""

from __future__ import annotations

import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cross_tokenizer_distillation"
sys.path.insert(0, str(EXAMPLE))
import run_report  # noqa: E402


def _results() -> dict:
    from omegaconf import OmegaConf

    raw = OmegaConf.load(EXAMPLE / "config.yaml")
    raw.pop("hydra", None)  # ${now:...}: a Hydra resolver, not the report's business
    cfg = OmegaConf.to_container(raw, resolve=True)
    cfg.update(variants_to_run=["ce", "pkl"], steps=4)
    bpb = {"student-before": 1.00, "ce": 0.90, "pkl": 0.85, "teacher": 0.60}
    evals = {k: {"bits_per_byte": v, "ce_per_token": 2 * v, "tokens": 100, "bytes": 400,
                 "documents": 2} for k, v in bpb.items()}
    curve = {"ce": 0.95, "pkl": 0.93}  # the training loop's held-out: same direction
    runs = {k: {"seconds": 60.0, "metrics": [
        {"iteration": 2, "ce": 2.0, "kd": None if k == "ce" else 1.0},
        {"iteration": 4, "eval_bpb": v, "eval_ce": 2.0}]} for k, v in curve.items()}
    return {"config": cfg, "evals": evals, "runs": runs, "export": None,
            "timings": {"models": 1.0, "training": 2.0, "evaluation": 3.0, "export": 0.0,
                        "total": 6.0},
            "machine": {"cpu_count": 2, "platform": "p", "python": "3.11", "torch": "t",
                        "date": "d"}}


def test_table_and_verdicts_are_the_results_numbers(tmp_path):
    results = _results()
    table = run_report.summary_table(results).splitlines()
    assert [line.split()[-4] for line in table[1:]] == ["1.0000", "0.9000", "0.8500", "0.6000"]
    ce_line, pkl_line = run_report.verdict(results)
    assert ce_line.startswith("CE-only fine-tuning moved held-out bits per byte from 1.0000 to "
                              "0.9000 (-0.1000, -10.00%)")
    assert "beat CE-only on the evaluation set: 0.8500 vs 0.9000 bits/byte (-0.0500, 50% more " \
           "improvement than CE-only's); on the training loop's held-out samples 0.9300 vs " \
           "0.9500 (same direction)." in pkl_line
    report = run_report.write_report(results, tmp_path).read_text()
    assert "| after 4 steps: " in report and "0.8500" in report
    assert (tmp_path / "bpb_bars.png").is_file()
