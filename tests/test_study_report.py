"""The study's statistics: mean +- std per variant, paired differences to CE-only, and the rule
that calls a difference real only beyond twice the seed spread."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"
                       / "cross_tokenizer_distillation"))
import study  # noqa: E402
import study_report  # noqa: E402


def _results(bpb: dict[str, list[float]], teacher: float = 1.0) -> dict:
    seeds = [1, 2, 3]
    evals = {"teacher/wiki": {"bits_per_byte": teacher}}
    for variant, values in bpb.items():
        for seed, value in zip(seeds, values):
            evals[f"{variant}-s{seed}/wiki"] = {"bits_per_byte": value}
    runs = {f"{v}-s{s}": {"variant": v, "seed": s, "metrics": []}
            for v, values in bpb.items() for s in seeds[: len(values)]}
    config = {"variants_to_run": list(bpb), "seeds": seeds,
              "variants": {v: {"label": v, **({"kd_weight": 0.0} if v == "ce" else {})}
                           for v in bpb}}
    return {"config": config, "evals": evals, "runs": runs}


def test_a_consistent_gain_beyond_the_spread_is_real():
    rows = study_report.verdicts(_results({"ce": [2.00, 2.02, 2.01], "pkl": [1.90, 1.92, 1.91],
                                           "gold": [1.99, 2.03, 2.00]}))
    pkl, gold = rows
    assert pkl["variant"] == "pkl" and pkl["seeds"] == 3
    assert pkl["diff"] == pytest.approx(-0.10) and pkl["diff_std"] == pytest.approx(0.0, abs=1e-12)
    assert pkl["spread"] == pytest.approx(0.01) and pkl["real"]
    assert pkl["seeds_better"] == 3
    assert study_report._verdict(pkl) == "better than CE-only"
    # closes 0.10 of the 1.01 bits/byte between CE-only and the teacher
    assert pkl["gap_closed"] == pytest.approx(0.10 / 1.01)
    assert gold["diff"] == pytest.approx(-0.0033333, abs=1e-6) and not gold["real"]
    # paired: differences -0.01, +0.01, -0.01 -> better on 2 of 3, t = mean / (std / sqrt(3))
    assert gold["seeds_better"] == 2 and gold["paired_t"] == pytest.approx(-0.5, abs=1e-3)
    assert study_report._verdict(gold) == "within seed noise"


def test_a_variant_is_paired_with_the_ce_only_run_of_the_same_plan():
    """A variant trained for several epochs over a small set is compared with CE-only over the
    same set (its overfitting is what the teacher counters), never with one pass of new text;
    CE-only variants get no verdict of their own."""
    results = _results({"ce": [2.00, 2.02, 2.01], "ce_ep3": [2.30, 2.31, 2.29],
                        "pkl": [1.95, 1.96, 1.97], "pkl_ep3": [2.10, 2.12, 2.11]})
    variants = results["config"]["variants"]
    variants["ce_ep3"].update(kd_weight=0.0, samples_per_epoch=200)
    variants["pkl_ep3"]["samples_per_epoch"] = 200
    assert study_report.baseline_of(variants, "pkl_ep3") == "ce_ep3"
    assert study_report.baseline_of(variants, "pkl") == "ce"
    rows = {r["variant"]: r for r in study_report.verdicts(results)}
    assert sorted(rows) == ["pkl", "pkl_ep3"]
    assert rows["pkl_ep3"]["baseline"] == "ce_ep3"
    assert rows["pkl_ep3"]["diff"] == pytest.approx(-0.19)
    assert rows["pkl_ep3"]["gap_closed"] == pytest.approx(0.19 / 1.30)
    assert rows["pkl"]["diff"] == pytest.approx(-0.05)


def test_against_a_named_variant_pairs_every_other_distilled_variant_with_it():
    """A compact payload against the full one: each variant is paired by seed with the named
    variant instead of CE-only, by the same rule; CE-only and the named variant get no row, and
    a name the study does not have is refused by name."""
    results = _results({"ce": [2.00, 2.02, 2.01], "gold": [1.80, 1.82, 1.81],
                        "gold_c64": [1.81, 1.82, 1.83], "pkl": [1.90, 1.91, 1.93]})
    rows = {r["variant"]: r for r in study_report.verdicts(results, against="gold")}
    assert sorted(rows) == ["gold_c64", "pkl"]
    assert rows["gold_c64"]["baseline"] == "gold"
    assert rows["gold_c64"]["diff"] == pytest.approx(0.01) and not rows["gold_c64"]["real"]
    assert rows["pkl"]["diff"] == pytest.approx(0.1033333, abs=1e-6) and rows["pkl"]["real"]
    assert study_report._verdict(rows["pkl"]).startswith("worse")
    with pytest.raises(ValueError, match="'hkl': not a variant"):
        study_report.verdicts(results, against="hkl")


def test_worse_is_called_worse_and_one_seed_is_never_real():
    rows = study_report.verdicts(_results({"ce": [2.0, 2.01, 2.02], "kd": [2.5, 2.51, 2.52]}))
    assert rows[0]["real"] and study_report._verdict(rows[0]) == "worse than CE-only"
    (row,) = study_report.verdicts(_results({"ce": [2.0], "kd": [1.0]}))
    assert not row["real"] and math.isnan(row["spread"])


def test_paired_difference_is_the_rule_on_any_metric():
    """The rule on plain per-seed lists (the HumanEval study uses it on pass@1 too): a steady
    difference is real only beyond twice either side's own spread over seeds; no difference
    and one that flips sign between seeds are not; pairing is by index."""
    same_gap = study_report.paired_difference([0.3, 0.4, 0.5], [0.2, 0.3, 0.4])
    assert same_gap["diff"] == pytest.approx(0.1) and same_gap["diff_std"] == pytest.approx(0.0)
    # the spread is each side's std over seeds (0.1), so 0.1 < 2 x 0.1 is not real
    assert same_gap["spread"] == pytest.approx(0.1) and not same_gap["real"]
    assert study_report.paired_difference([0.5, 0.5], [0.0, 0.0])["real"]
    assert not study_report.paired_difference([0.0, 0.0, 0.0], [0.0, 0.0, 0.0])["real"]
    flips = study_report.paired_difference([1.0, 0.0], [0.0, 1.0])
    assert flips["diff"] == 0.0 and not flips["real"]
    with pytest.raises(ValueError, match="one per seed"):
        study_report.paired_difference([1.0, 2.0], [1.0])


def test_run_settings_name_a_run_by_what_decides_its_result():
    """A published run is skipped on another machine only when nothing that decides its result
    changed (variant, experiment block, payload, evaluation, seed); paths are not part of it."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(study.HERE) / "study.yaml")
    same = study.run_settings(cfg, "pkl", 1)
    assert study.run_settings(OmegaConf.merge(cfg, {"work_dir": "/elsewhere"}), "pkl", 1) == same
    assert study.run_settings(cfg, "pkl", 2) != same
    assert study.run_settings(cfg, "gold", 1) != same
    assert study.run_settings(OmegaConf.merge(cfg, {"signal": {"lr": 5e-4}}), "pkl", 1) != same
    assert study.run_settings(OmegaConf.merge(cfg, {"kd": {"topk": 8}}), "pkl", 1) != same


def test_the_report_is_rebuilt_from_a_results_file_alone(tmp_path):
    """``study_report.py RESULTS OUT`` writes the tables from the numbers in the file: the mean
    +- std row of each variant and its verdict against CE-only."""
    import json
    import subprocess

    results = _results({"ce": [2.00, 2.02, 2.01], "pkl": [1.90, 1.92, 1.91]})
    results["config"].update(experiment="real", kd={"topk": 64, "temperature": 1.0},
                             real={"student": "s", "teacher": "t", "steps": 3,
                                   "global_batch_size": 2, "seq_length": 8})
    results["machine"] = {"cpu_count": 2, "torch": "x", "date": "d"}
    for seed in (1, 2, 3):
        results["runs"][f"ce-s{seed}"]["metrics"] = [{"iteration": 1, "eval_bpb": 2.0}]
    source = tmp_path / "real.json"
    source.write_text(json.dumps(results))
    subprocess.run([sys.executable, str(Path(study_report.__file__)), str(source),
                    str(tmp_path / "out")], check=True, capture_output=True)
    report = (tmp_path / "out" / "REPORT-real.md").read_text()
    assert "| pkl | 3 | 1.9100 +- 0.0100 |" in report
    assert "| ce | 3 | 2.0100 +- 0.0100 |" in report
    assert ("| wiki | pkl | ce | 3 | -0.1000 +- 0.0000 | 0.0200 | better than CE-only | 3/3 |"
            in report)
    assert (tmp_path / "out" / "study-real-curves.png").is_file()


def test_a_run_is_not_started_over_for_how_often_it_saves():
    """The stamp of a finished run (written before --keep-last-checkpoints existed) still
    matches when only saving options differ; a deciding option does not."""
    old = {"options": {"lr": 5e-5, "save-interval": 50}, "student": "s"}
    new = {"options": {"lr": 5e-5, "save-interval": 100, "keep-last-checkpoints": 1},
           "student": "s"}
    assert study._deciding(old) == study._deciding(new)
    assert study._deciding(old) != study._deciding({**new, "options": {"lr": 1e-4}})


def test_a_second_held_out_set_leaves_the_in_loop_set_and_the_runs_as_they_were():
    """The real pair's in-training curve stays on the stdlib held-out set when the fresh-code
    set is added (it is part of every run's stamp: another set starts every run over)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(Path(study.HERE) / "study.yaml"), {"experiment": "real"})
    one = {"train": Path("t.jsonl"), "stdlib": Path("s.jsonl")}
    two = {**one, "fresh_code": Path("f.jsonl")}
    variant = dict(cfg.variants["pkl"])
    assert study._options(cfg, two, variant, 1) == study._options(cfg, one, variant, 1)
    assert study._options(cfg, two, variant, 1)["valid-data-path"] == "s.jsonl"


def test_a_small_set_variant_trains_in_passes_over_its_own_cache():
    """``samples_per_epoch``: the run packs that many samples and passes over them for the same
    steps; its teacher cache is its own (another plan), the other variants' options are as they
    were (no --samples-per-epoch: their stamps stay)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(Path(study.HERE) / "study.yaml"), {"experiment": "real"})
    data = {"train": Path("t.jsonl"), "stdlib": Path("s.jsonl")}
    small, full = dict(cfg.variants["pkl_ep3"]), dict(cfg.variants["pkl"])
    options = study._options(cfg, data, small, 1)
    assert options["samples-per-epoch"] == 200
    assert options["train-iters"] == cfg.real.steps
    assert options["train-iters"] * options["global-batch-size"] == 3 * 200
    assert "samples-per-epoch" not in study._options(cfg, data, full, 1)
    assert study._form(cfg, small, 1) == study._form(cfg, full, 1) + "-plan200"
    assert study._form(cfg, dict(cfg.variants["ce_ep3"]), 1).endswith("-plan200")
    assert study._form(cfg, dict(cfg.variants["gold_ep3"]), 1) == "gold-T1.0-seed1-plan200"


def test_a_smaller_payload_topk_reads_the_shared_cache():
    """pkl_k8 reads the shared top-64 cache (narrowed on read: no teacher pass of its own) and
    still trains at top-8; top-512 and all of V_t need caches of their own."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(Path(study.HERE) / "study.yaml"), {"experiment": "real"})
    data = {"train": Path("t.jsonl"), "stdlib": Path("s.jsonl")}
    k8, pkl = dict(cfg.variants["pkl_k8"]), dict(cfg.variants["pkl"])
    assert study._form(cfg, study._cache_variant(cfg, k8), 1) == study._form(cfg, pkl, 1)
    assert study._options(cfg, data, k8, 1)["kd-topk"] == 8
    for big in ("pkl_k512", "pkl_full", "pkl_t2"):
        variant = dict(cfg.variants[big])
        assert study._cache_variant(cfg, variant) == variant


def test_a_quick_look_never_replaces_the_published_results():
    """Only the settings of study.yaml publish: a shorter run, an overridden variant or another
    evaluation keeps its numbers in its work directory (the published file holds the study)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(Path(study.HERE) / "study.yaml")
    assert study.publishes(OmegaConf.merge(cfg, {"work_dir": "/elsewhere", "seeds": [2]}))
    assert study.publishes(OmegaConf.merge(cfg, {"experiment": "real"}))
    assert not study.publishes(OmegaConf.merge(cfg, {"signal": {"steps": 6}}))
    assert not study.publishes(OmegaConf.merge(cfg, {"eval": {"max_chars": 2000}}))
    assert not study.publishes(OmegaConf.merge(
        cfg, {"variants_to_run": ["pkl_ep4"], "variants": {"pkl_ep4": {"samples_per_epoch": 16}}}))
    assert study.publishes(OmegaConf.merge(cfg, {"variants_to_run": ["ce"],
                                                 "variants": {"pkl_ep4": {"kd_weight": 2.0}}}))
    assert not study.publishes(OmegaConf.merge(
        cfg, {"variants_to_run": ["mine"], "variants": {"mine": {"kd_loss": "pkl"}}}))


def test_compact_gold_variants_share_one_cache_and_the_gold_rows_stay():
    """The compact gold / H-KL variants read the cache at compact_gold_cache's sizes (narrowed
    on read) and train at their own; the published gold / H-KL rows keep their settings (full
    payload: 0 / 0 on the command line, their digest unchanged)."""
    import json

    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(OmegaConf.load(Path(study.HERE) / "study.yaml"),
                          {"experiment": "signal"})
    data = {"train": Path("t.jsonl"), "enwiki": Path("w.jsonl")}
    small = dict(cfg.variants["hkl_c64_ep4"])
    options = study._options(cfg, data, small, 1)
    assert (options["kd-gold-topk"], options["kd-gold-uncommon-topk"]) == (64, 256)
    reads = study._cache_variant(cfg, small)
    assert (reads["gold_topk"], reads["gold_uncommon_topk"]) == (256, 1024)
    assert study._form(cfg, reads, 1) == "hkl-g256u1024-T1.0-plan1000"
    assert study._cache_variant(cfg, dict(cfg.variants["gold_c256_ep4"])) == dict(
        cfg.variants["gold_c256_ep4"])
    gold = dict(cfg.variants["gold_ep4"])
    options = study._options(cfg, data, gold, 1)
    assert (options["kd-gold-topk"], options["kd-gold-uncommon-topk"]) == (0, 0)
    assert "kd-topk" not in options and "kd-topk-mode" not in options  # P-KL's: refused here
    assert study._form(cfg, gold, 1) == "gold-T1.0-plan1000"
    assert "kd-gold-topk" not in study._options(cfg, data, dict(cfg.variants["pkl_ep4"]), 1)
    published = json.loads((Path(study.HERE) / "results" / "signal.json").read_text())["runs"]
    for name in ("gold_ep4", "hkl_ep4", "pkl_ep4"):
        assert study.run_settings(cfg, name, 1) == published[f"{name}-s1"]["settings"], name
