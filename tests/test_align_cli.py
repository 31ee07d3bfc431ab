"""The ``xdistill-align`` command line (show, dump, stats) and its errors."""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from shared_assets import ASSETS, needs_shared_assets

from megatron_xdistill.align.chunks import check_partition
from megatron_xdistill.align.cli import main

pytestmark = needs_shared_assets
STUDENT = str(ASSETS / "tokenizers" / "smollm2")
TEACHER = str(ASSETS / "tokenizers" / "mistral")
PAIR = ["--tokenizer-model", STUDENT, "--teacher-tokenizer-model", TEACHER]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "docs.jsonl"
    docs = [{"id": "a", "text": "Hello world, naïve café 🤖!"}, {"id": 7, "text": ""},
            {"text": "Second line\n\nwith 12345 digits."}]
    path.write_text("".join(json.dumps(d) + "\n" for d in docs), encoding="utf-8")
    return path


def test_console_script_is_declared() -> None:
    eps = [e for e in entry_points(group="console_scripts") if e.name == "xdistill-align"]
    assert eps and eps[0].value == "megatron_xdistill.align.cli:main"


def test_show_prints_chunks_side_by_side(capsys) -> None:
    assert main(["show", *PAIR, "--text", "Hello wörld 🤖"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [c.strip() for c in out[0].split(" | ")] == ["s span", "student pieces", "t span", "teacher pieces", "exact"]
    assert any("[Hello]" in line and "yes" in line for line in out)
    assert any("[\\xf0]" in line for line in out)  # mistral's byte-fallback pieces of the emoji
    assert out[-1].startswith("5 chunks, 5 exact")


def test_dump_writes_ids_and_chunks(data: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "out.jsonl"
    assert main(["dump", *PAIR, "--data-path", str(data), "--out", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in recs] == ["a", 7, 2]
    s_tok = AutoTokenizer.from_pretrained(STUDENT)
    t_tok = AutoTokenizer.from_pretrained(TEACHER)
    texts = [json.loads(line)["text"] for line in data.read_text(encoding="utf-8").splitlines()]
    for rec, text in zip(recs, texts):
        assert rec["student_ids"] == s_tok(text, add_special_tokens=False)["input_ids"]
        assert rec["teacher_ids"] == t_tok(text, add_special_tokens=False)["input_ids"]
        rows = [[a, b, p, q, int(e)] for a, b, p, q, e in rec["chunks"]]
        check_partition(rows, len(rec["student_ids"]), len(rec["teacher_ids"]))
        assert all(isinstance(c[4], bool) for c in rec["chunks"])
    assert recs[1]["chunks"] == [] and recs[1]["student_ids"] == []
    assert all(c[4] for c in recs[0]["chunks"])

    few = tmp_path / "few.jsonl"
    assert main(["dump", *PAIR, "--data-path", str(data), "--max-docs", "1", "--out", str(few)]) == 0
    assert len(few.read_text().splitlines()) == 1


def test_stats_prints_coverage_and_throughput(data: Path, capsys) -> None:
    assert main(["stats", *PAIR, "--data-path", str(data), "--method", "dp"]) == 0
    out = capsys.readouterr().out
    assert "characters in exact chunks 100.000%" in out
    assert "1:1" in out and "tokens/s" in out
    assert "documents          3" in out


def test_errors_are_clear(data: Path, tmp_path: Path, capsys) -> None:
    missing = str(tmp_path / "nope")
    assert main(["show", "--tokenizer-model", missing, "--teacher-tokenizer-model", TEACHER,
                 "--text", "x"]) == 2
    assert "nope' does not exist" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n{"text": "\\ud800"}\n{"body": 1}\n'
                    b'{"text": "fine"}\n')
    assert main(["stats", *PAIR, "--data-path", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:2: not valid UTF-8" in err and "--on-bad-line skip" in err

    assert main(["stats", *PAIR, "--data-path", str(bad), "--on-bad-line", "skip"]) == 0
    cap = capsys.readouterr()
    assert "documents          2" in cap.out
    assert ":3: text holds a lone surrogate" in cap.err and ":4: expected an object" in cap.err

    assert main(["stats", *PAIR, "--data-path", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["dump", *PAIR, "--data-path", str(data), "--out", str(tmp_path / "x" / "o")]) == 2
    assert "output directory" in capsys.readouterr().err
