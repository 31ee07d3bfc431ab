"""``make coverage``: tools/coverage_by_folder.py sums coverage.py's JSON report by top-level
package folder (subfolders counted in theirs), and the suite is measured in its ranks and
subprocesses too (pyproject's ``[tool.coverage.run]``)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("coverage_by_folder",
                                                  ROOT / "tools" / "coverage_by_folder.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _entry(statements: int, covered: int) -> dict:
    return {"summary": {"num_statements": statements, "covered_lines": covered}}


def test_lines_are_summed_by_top_level_folder(tmp_path, capsys):
    tool = _tool()
    report = {"files": {
        "megatron_xdistill/__init__.py": _entry(3, 3),
        "megatron_xdistill/loss/__init__.py": _entry(10, 5),
        "megatron_xdistill/loss/blocks/rows.py": _entry(30, 30),
        "/abs/path/megatron_xdistill/align/api.py": _entry(20, 10),
        "conversion/cli.py": _entry(50, 0),  # not the package's
    }}
    folders = tool.by_folder(report)
    assert {k: (v.statements, v.covered) for k, v in folders.items()} == {
        "(package)": (3, 3), "align": (20, 10), "loss": (40, 35)}
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report))
    assert tool.main([str(path), "--files"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^align\s+20\s+10\s+50\.0%  < 85%$", out, re.M), out
    assert re.search(r"^loss\s+40\s+35\s+87\.5%$", out, re.M), out
    assert re.search(r"^total\s+63\s+48\s+76\.2%$", out, re.M), out
    assert re.search(r"^\s+10 of\s+20  /abs/path/megatron_xdistill/align/api\.py$", out, re.M)
    assert "loss/__init__.py" not in out  # only the folders under the threshold list files


def test_write_keeps_the_rows_as_a_result_file(tmp_path, monkeypatch, capsys):
    """``--write`` (what ``make coverage`` passes) keeps the printed table as a result file, one
    row per folder plus the total, with where and how it was made: docs/test_checks.md's table is
    generated from it."""
    tool = _tool()
    report = {"files": {"megatron_xdistill/align/api.py": _entry(20, 10),
                        "megatron_xdistill/loss/rows.py": _entry(40, 38)}}
    path = tmp_path / "coverage.json"
    path.write_text(json.dumps(report))
    monkeypatch.setenv("XDISTILL_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.delenv("XDISTILL_NO_RESULTS", raising=False)
    assert tool.main([str(path), "--write"]) == 0
    capsys.readouterr()
    [kept] = (tmp_path / "results" / "coverage").glob("*.json")
    record = json.loads(kept.read_text())
    assert record["bench"] == "coverage" and record["params"] == {"threshold": 85.0}
    assert record["machine"] and record["date"] and "--write" in record["command"]
    assert record["rows"] == [
        {"folder": "align", "lines": 20, "covered": 10, "percent": 50.0, "below_threshold": True},
        {"folder": "loss", "lines": 40, "covered": 38, "percent": 95.0, "below_threshold": False},
        {"folder": "total", "lines": 60, "covered": 48, "percent": 80.0, "below_threshold": True}]


def test_the_suite_is_measured_in_its_ranks_and_subprocesses():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    run = config["tool"]["coverage"]["run"]
    assert run["source"] == ["megatron_xdistill"] and run["parallel"] is True
    assert "subprocess" in run["patch"]  # RankPool ranks, torchrun, pretrain_xdistill.py
    assert any(r.startswith("pytest-cov") for r in config["project"]["optional-dependencies"][
        "test"])
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^coverage: install\n(\t.*\n)*\t.*pytest -q --cov .*\n(\t.*\n)*"
                     r"\t.*tools/coverage_by_folder\.py coverage\.json .*--write", makefile, re.M)
