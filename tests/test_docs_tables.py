"""The docs' number tables are what their result files give (tools/docs_tables.py), and a
benchmark's rows are kept with the machine, commit and command that made them
(benchmarks/results.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import results  # noqa: E402

_spec = importlib.util.spec_from_file_location("docs_tables", REPO / "tools" / "docs_tables.py")
docs_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_tables)


def test_every_docs_table_matches_its_result_file():
    stale = [name for page in docs_tables.pages()
             for name in docs_tables.process(page, write=False)]
    assert not stale, f"regenerate with python tools/docs_tables.py: {stale}"


def test_every_table_marker_names_a_kept_file():
    for page in docs_tables.pages():
        for match in docs_tables.MARKER.finditer(page.read_text()):
            spec = json.loads(match.group(2))
            path = REPO / spec["file"]
            kept = (any(path.glob("scale_*.json")) if spec.get("source") == "scale"
                    else path.is_file())
            assert kept, f"{page.name}: {spec['file']} missing"


def test_a_result_file_keeps_provenance_and_its_table_follows_it(tmp_path, monkeypatch):
    monkeypatch.setenv("XDISTILL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.delenv("XDISTILL_NO_RESULTS", raising=False)
    rows = [{"form": "chunk_topk", "ms": 12.345}, {"form": "gold", "ms": 100.0}]
    path = results.write_rows("bench_demo", rows, params={"tokens": 16},
                              argv=[str(REPO / "benchmarks" / "bench_demo.py"), "--tokens", "16"])
    record = json.loads(path.read_text())
    assert record["rows"] == rows and record["params"] == {"tokens": 16}
    assert record["command"] == "python benchmarks/bench_demo.py --tokens 16"
    head = results.commit()
    assert record["commit"] == head and len(head.removesuffix("+dirty")) == 40
    assert record["machine"]["cpu_count"] and "gpus" in record["machine"]

    spec = {"file": str(path), "where": {"form": ["gold", "chunk_topk"]},
            "columns": [["form", "form"], ["ms", "ms", ".1f"]]}
    page = tmp_path / "page.md"
    marker = f"<!-- results-table {json.dumps(spec)} -->\n"
    page.write_text(f"text\n{marker}old\n<!-- /results-table -->\nmore\n")
    assert docs_tables.process(page, write=False)  # stale: differs from the file
    assert docs_tables.process(page, write=True)
    body = page.read_text()
    assert "| gold | 100.0 |\n| chunk_topk | 12.3 |" in body  # where's order, the format
    assert docs_tables.process(page, write=False) == []
    page.write_text(body.replace("100.0", "99.0"))  # a number pasted by hand
    assert docs_tables.process(page, write=False)


def test_study_rows_follow_the_study_report():
    real = json.loads((REPO / "examples/cross_tokenizer_distillation/results/real.json")
                      .read_text())
    rows = {(r["variant"], r["heldout"]): r for r in docs_tables.study_rows(real)}
    evals = real["evals"]
    seeds = (1, 2, 3)
    kd = [evals[f"pkl_first_ep3-s{s}/fresh_code"]["bits_per_byte"] for s in seeds]
    ce = [evals[f"ce_ep3-s{s}/fresh_code"]["bits_per_byte"] for s in seeds]
    teacher = evals["teacher/fresh_code"]["bits_per_byte"]
    row = rows["pkl_first_ep3", "fresh_code"]
    mean = sum(k - c for k, c in zip(kd, ce)) / 3
    assert row["diff"].startswith(f"{mean:+.4f}") and row["seeds_ahead"] == "3/3"
    closed = [100 * (c - k) / (c - teacher) for k, c in zip(kd, ce)]
    assert row["gap_closed"] == f"{round(min(closed))}-{round(max(closed))}%"


def test_study_rows_against_a_variant_carry_its_payload_size():
    """``"against"`` pairs each variant with the named one (gold_ep4 with P-KL here), and each
    row carries the payload per token the variant's runs logged (their last value, mean over
    seeds)."""
    signal = json.loads((REPO / "examples/cross_tokenizer_distillation/results/signal.json")
                        .read_text())
    rows = {(r["variant"], r["heldout"]): r
            for r in docs_tables.study_rows(signal, against="pkl_ep4")}
    row = rows["gold_ep4", "enwiki"]
    assert row["baseline_label"] == signal["config"]["variants"]["pkl_ep4"]["label"]
    evals = signal["evals"]
    diff = [evals[f"gold_ep4-s{s}/enwiki"]["bits_per_byte"]
            - evals[f"pkl_ep4-s{s}/enwiki"]["bits_per_byte"] for s in (1, 2, 3)]
    assert row["diff"].startswith(f"{sum(diff) / 3:+.4f}")
    logged = [[m["payload_bytes_per_token"] for m in signal["runs"][f"gold_ep4-s{s}"]["metrics"]
               if m.get("payload_bytes_per_token")][-1] for s in (1, 2, 3)]
    assert row["payload_bytes"] == pytest.approx(sum(logged) / 3)
    assert 100_000 < row["payload_bytes"] < 200_000  # gold's ~120 KB a token
    assert ("pkl_ep4", "enwiki") not in rows


SCALE = REPO / "benchmarks" / "results" / "scale"


def _scale_tables() -> dict[str, tuple[dict, str]]:
    text = (REPO / "docs" / "scale.md").read_text()
    return {spec["table"]: (spec, match.group(3))
            for match in docs_tables.MARKER.finditer(text)
            if (spec := json.loads(match.group(2))).get("source") == "scale"}


def test_scale_tables_have_a_row_per_world_file_and_catch_a_hand_edit():
    bench = docs_tables._bench_scale()
    tables = _scale_tables()
    assert set(tables) == set(bench.TABLES)
    worlds = sorted(int(p.stem.split("_")[1]) for p in SCALE.glob("scale_*.json"))
    for name in ("runs", "construction", "busiest_link"):
        body = tables[name][1].splitlines()
        rows = [line for line in body[2:] if line.startswith("| ")]
        assert [int(line.split("|")[1]) for line in rows] == worlds, name
    page = REPO / "docs" / "scale.md"
    text = page.read_text()
    row = tables["construction"][1].splitlines()[2]  # the smallest world's row
    edited = text.replace(row, row.replace(" s (", "1 s (", 1))
    assert edited != text
    assert docs_tables.process(page, write=False, text=edited) == [
        "docs/scale.md: the table from benchmarks/results/scale (construction)"]


def test_scale_prose_holds_in_the_result_files():
    """docs/scale.md's statements across the worlds, checked against every kept file."""
    bench = docs_tables._bench_scale()
    by_case: dict = {}
    for record in bench.load(SCALE):
        for r in record["rows"]:
            if "scenario" not in r:
                continue
            case = (r["student"], r["teachers"], r["placement"], r["scenario"]["form"])
            by_case.setdefault(case, {})[r["gpus"]] = r
            # the modelled store/collective/connect part of construction stays under a second
            assert max(c["modelled_s"] for c in r["construction"]) < 1.0, case
            # and the whole construction (measured CPU time + modelled) under 10 s
            assert r["constructs_under_10s"], (case, r["gpus"])
    for case, worlds in by_case.items():
        # the transfer verdict does not change with the world (weak scaling)
        assert len({r["hides"] for r in worlds.values()}) == 1, case
        # the groups one rank enters at most double when the world doubles
        for gpus, r in worlds.items():
            if 2 * gpus in worlds:
                groups = [max(c["groups_entered"] for c in w["construction"])
                          for w in (r, worlds[2 * gpus])]
                assert groups[1] <= 2 * groups[0], (case, gpus)
    # one teacher: its TP x CP senders divide the busiest link by TP x CP
    for (_, teachers, _, _), worlds in by_case.items():
        for r in worlds.values():
            if "+" not in teachers:
                t = r["layouts"]["teachers"][0]
                ratio = (r["traffic"]["busiest_gpu_nic_bytes_one_sender"]
                         / r["traffic"]["busiest_gpu_nic_bytes"])  # (+ 4-byte trailers)
                assert abs(ratio / (t["tp"] * t["cp"]) - 1) < 1e-3, (teachers, r["gpus"], ratio)
    # compact gold, top-k and chunk top-k hide in every scenario and world
    for (_, _, _, form), worlds in by_case.items():
        if form in ("gold_topk", "topk", "chunk_topk"):
            assert all(r["hides"] for r in worlds.values()), form
    # an 'n/a' world is too small: the scenario is simulated from its min_gpus on, not below
    skipped = [r for record in bench.load(SCALE) for r in record["rows"] if "skipped" in r]
    assert {r["teachers"] for r in skipped} >= {"qwen3-235b-a22b"}
    for r in skipped:
        worlds = by_case[r["student"], r["teachers"], r["placement"], "full"]
        assert min(worlds) == r["min_gpus"] > r["gpus"], r
    # the busiest link is the same for every payload form
    for (student, teachers, placement, _), worlds in by_case.items():
        for gpus, r in worlds.items():
            other = by_case[student, teachers, placement, "full"][gpus]
            assert r["traffic"]["busiest_over_mean"] == other["traffic"]["busiest_over_mean"]


def test_humaneval_table_follows_its_result_file(tmp_path):
    """The ``humaneval`` source: the study's own rows (per model, then the paired verdict), the
    newest date of its models, and a number edited by hand is caught."""
    models = {"teacher": {"xdistill_humaneval/pass@1": 0.25,
                          "xdistill_humaneval_bpb/canonical_bits_per_byte": 0.5,
                          "date": "2026-12-07T06:00:00+00:00",
                          "machine": {"cpu_count": 2, "torch": "2.13.0"}},
              "before": {"xdistill_humaneval/pass@1": 0.0,
                         "xdistill_humaneval_bpb/canonical_bits_per_byte": 0.9,
                         "date": "2026-12-08T01:00:00+00:00",
                         "machine": {"cpu_count": 2, "torch": "2.13.0"}}}
    path = tmp_path / "humaneval.json"
    path.write_text(json.dumps(models))
    spec = {"file": str(path), "source": "humaneval",
            "columns": [["model", "model"], ["runs", "runs"], ["pass_at_1", "pass@1"],
                        ["canonical_bits_per_byte", "bits / byte"]]}
    page = tmp_path / "page.md"
    page.write_text(f"<!-- results-table {json.dumps(spec)} -->\nold\n<!-- /results-table -->\n")
    assert docs_tables.process(page, write=True)
    body = page.read_text()
    assert "| teacher (Qwen2.5-Coder-0.5B) | 1 | 0.2500 | 0.5000 |" in body
    assert "| student before training (SmolLM2-135M) | 1 | 0.0000 | 0.9000 |" in body
    assert "| CE only (3 passes) | 0 | not run | not run |" in body
    assert "fewer than 2 seeds" in body and "2 CPUs, torch 2.13.0; 2026-12-08." in body
    page.write_text(body.replace("0.9000", "0.8000"))
    assert docs_tables.process(page, write=False)
