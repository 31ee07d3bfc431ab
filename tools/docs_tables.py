"""The docs' number tables, generated from kept result files.

A table in a Markdown page sits between two marker comments; the opening one says, as JSON,
where its numbers come from and which columns it shows:

    <!-- results-table {"file": "benchmarks/results/bench_x/20261201T...json",
         "columns": [["form", "form"], ["ops_per_block", "ops / block", ".1f"]],
         "where": {"table": "..."}} -->
    | form | ops / block |            <- generated: never edited by hand
    ...
    <!-- /results-table -->

``file`` is a result file of ``benchmarks/results.py`` (its ``rows``), or one of the studies'
results, read through ``"source"``: ``"study"`` (examples/cross_tokenizer_distillation's
``results/*.json``: one row per distilled variant and held-out set against its CE-only
baseline, or against the variant named by ``"against"``, through the study's own report code;
``payload_bytes`` is the teacher payload per token the runs logged), ``"onpolicy"``
(examples/on_policy_distillation's ``results.json``: one row per scored model),
``"humaneval"``
(examples/cross_tokenizer_distillation's ``results/humaneval.json``: the HumanEval table
of ``humaneval_study.py``, one row per model and one per paired comparison) or ``"scale"``
(``file`` is a folder: every ``scale_<gpus>.json`` in it, pivoted by
``benchmarks/bench_scale.py``'s table ``"table"``, one of its ``TABLES``). ``where``
keeps the rows whose fields equal the given values (a list: any of them, in that order);
``columns`` are ``[field, header]`` or ``[field, header, format spec]``. Under each table a
line names the file, the machine and the date.

    python tools/docs_tables.py            # rewrite every page's tables from their files
    python tools/docs_tables.py --check    # exit 1 naming each table that differs
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PAGES = ["README.md", "docs/*.md", "examples/*/REPORT.md"]
MARKER = re.compile(r"(<!-- results-table (\{.*?\}) -->\n)(.*?)(<!-- /results-table -->)", re.S)


def _module(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _study_report():
    return _module("xdistill_study_report",
                   REPO / "examples" / "cross_tokenizer_distillation" / "study_report.py")


def _humaneval_study():
    return _module("xdistill_humaneval_study",
                   REPO / "examples" / "cross_tokenizer_distillation" / "humaneval_study.py")


def _bench_scale():
    return _module("xdistill_bench_scale", REPO / "benchmarks" / "bench_scale.py")


def scale_rows(folder: Path, table: str) -> tuple[list[dict[str, Any]], list[dict]]:
    """The rows of bench_scale's pivot ``table`` over every ``scale_<gpus>.json`` in
    ``folder``, and the files' records."""
    bench = _bench_scale()
    if table not in bench.TABLES:
        raise ValueError(f"unknown scale table {table!r}: one of {sorted(bench.TABLES)}")
    records = bench.load(folder)
    return bench.TABLES[table](records), records


def _pm(values: list[float], sign: bool = False) -> str:
    mean = statistics.fmean(values)
    text = format(mean, "+.4f" if sign else ".4f")
    return f"{text} +- {statistics.stdev(values):.4f}" if len(values) > 1 else text


#: the studies' held-out sets as the docs name them
HELDOUT = {"fresh_code": "code written in 2026", "stdlib": "stdlib modules not trained on",
           "enwiki": "Wikipedia", "shakespeare": "Shakespeare works"}


def payload_bytes(results: dict, variant: str) -> float | None:
    """A variant's teacher payload per student token as its runs logged it (the mean over seeds
    of each run's last ``payload_bytes_per_token``); None where no run logged it."""
    values = [logged[-1] for run in results["runs"].values() if run["variant"] == variant
              for logged in [[m["payload_bytes_per_token"] for m in run.get("metrics", [])
                              if m.get("payload_bytes_per_token")]] if logged]
    return statistics.fmean(values) if values else None


def study_rows(results: dict, against: str | None = None) -> list[dict[str, Any]]:
    """Each distilled variant against its CE-only baseline (or the variant ``against``) on each
    held-out set, by the study's own rule (``study_report.verdicts``: real beyond twice the
    larger seed spread), with the per-seed share of the CE student's gap to the teacher that it
    closed (of the baseline's gap, with ``against``) and the payload per token."""
    report = _study_report()
    variants = results["config"]["variants"]
    summary = report.summarize(results)
    rows = []
    for v in report.verdicts(results, against):
        table = summary[v["heldout"]]["variants"]
        kd, ce = table[v["variant"]], table[v["baseline"]]
        seeds = sorted(set(kd) & set(ce))
        teacher = summary[v["heldout"]]["teacher"]
        closed = [100 * (ce[s] - kd[s]) / (ce[s] - teacher) for s in seeds]
        lo, hi = round(min(closed)), round(max(closed))
        gap = f"{lo}%" if lo == hi else (f"{lo}-{hi}%" if lo >= 0 else f"{lo}% to {hi}%")
        rows.append({
            "variant": v["variant"], "label": variants[v["variant"]]["label"],
            "heldout": v["heldout"], "heldout_label": HELDOUT.get(v["heldout"], v["heldout"]),
            "seeds": len(seeds),
            "ce": _pm([ce[s] for s in seeds]), "distilled": _pm([kd[s] for s in seeds]),
            "diff": _pm([kd[s] - ce[s] for s in seeds], sign=True),
            "seeds_ahead": f"{v['seeds_better']}/{len(seeds)}",
            "verdict": ("real" if v["real"] else "within the spread") if len(seeds) > 1
            else "one seed",
            "two_spread": None if math.isnan(v["spread"]) else 2 * v["spread"],
            "paired_t": None if math.isnan(v["paired_t"]) else v["paired_t"],
            "gap_closed": gap,
            "diff_mean": v["diff"], "teacher": teacher,
            "baseline_label": variants[v["baseline"]]["label"],
            "payload_bytes": payload_bytes(results, v["variant"])})
    return rows


def onpolicy_rows(results: dict) -> list[dict[str, Any]]:
    """One row per scored model: greedy pass rate on the held-out prompts."""
    labels = {k: v["label"] for k, v in results["config"]["variants"].items()}
    return [{"name": name, "label": labels.get(name, name), "prompts": s["prompts"],
             "pass_rate": s["mean_reward"]} for name, s in results["scores"].items()]


def _rows(spec: dict) -> tuple[list[dict], dict]:
    source = spec.get("source", "bench")
    if source == "scale":
        rows, records = scale_rows(REPO / spec["file"], spec.get("table", ""))
        record = {"scale": records}
    else:
        record = json.loads((REPO / spec["file"]).read_text())
    if source == "bench":
        rows = record["rows"]
    elif source == "study":
        rows = study_rows(record, spec.get("against"))
    elif source == "onpolicy":
        rows = onpolicy_rows(record)
    elif source == "humaneval":  # {model: result}: each result keeps its machine and date
        rows = _humaneval_study().rows(record)
        models = list(record.values())
        record = {"machine": {**models[-1].get("machine", {}),
                              "date": max(m.get("date", "?")[:10] for m in models)}}
    elif source != "scale":
        raise ValueError(f"unknown source {source!r} (bench, study, onpolicy, humaneval or "
                         f"scale)")
    for key, want in spec.get("where", {}).items():
        if isinstance(want, list):
            rows = [r for w in want for r in rows if r.get(key) == w]
        else:
            rows = [r for r in rows if r.get(key) == want]
    if not rows:
        raise ValueError(f"{spec['file']}: no rows match {spec.get('where')}")
    return rows, record


def _cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if fmt and isinstance(value, int | float):
        return format(value, fmt)
    return str(value)


def _machine_words(machine: dict) -> str:
    """A result file's machine record (benchmarks.results.machine) in a few words: its GPUs,
    else its CPU and how many."""
    if machine.get("gpus"):
        return ", ".join(machine["gpus"])
    count = machine.get("cpu_count")
    return f"{machine.get('cpu', '?')}" + (f", {count} CPUs" if count else "")


def _source_line(spec: dict, record: dict, page: Path) -> str:
    link = os.path.relpath(REPO / spec["file"], page.parent)
    source = spec.get("source", "bench")
    if source == "scale":  # one file per world, each with its machine and date
        records = record["scale"]
        worlds = [r["rows"][0]["gpus"] for r in records]
        machines = "; ".join(dict.fromkeys(_machine_words(r["machine"]) for r in records))
        dates = ", ".join(dict.fromkeys(r["date"] for r in records))
        return (f"<sub>Source: [`{spec['file']}/scale_*.json`]({link}) ({len(records)} files, "
                f"{worlds[0]} to {worlds[-1]} GPUs); {machines}; {dates}.</sub>\n")
    machine = record.get("machine", {})
    if source == "bench":
        where = _machine_words(machine)
        date = record.get("date", "?")[:10]
    else:  # the studies keep their own machine record
        where = (f"{machine.get('cpu_count', '?')} CPUs, torch {machine.get('torch', '?')}"
                 if machine else "see the file")
        date = machine.get("date") or record.get("provenance", {}).get("date", "?")
    origin = " (imported)" if record.get("imported_from") else ""
    return f"<sub>Source: [`{spec['file']}`]({link}){origin}; {where}; {date}.</sub>\n"


def render(spec: dict, page: Path) -> str:
    """The generated Markdown between a table's markers."""
    rows, record = _rows(spec)
    columns = [(c[0], c[1], c[2] if len(c) > 2 else None) for c in spec["columns"]]
    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |",
             "|" + "|".join("---" if f is None else "---:" for _, _, f in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row.get(k), f) for k, _, f in columns) + " |")
    return "\n".join(lines) + "\n\n" + _source_line(spec, record, page)


def pages() -> list[Path]:
    return sorted({p for pattern in PAGES for p in REPO.glob(pattern)})


def process(page: Path, write: bool, text: str | None = None) -> list[str]:
    """Regenerate ``page``'s tables (from ``text`` in place of the page's own, if given); the
    names of those that differed."""
    text = page.read_text() if text is None else text
    stale = []

    def one(match: re.Match) -> str:
        spec = json.loads(match.group(2))
        body = render(spec, page)
        if body != match.group(3):
            name = page.relative_to(REPO) if page.is_relative_to(REPO) else page
            table = f" ({spec['table']})" if "table" in spec else ""
            stale.append(f"{name}: the table from {spec['file']}{table}")
        return match.group(1) + body + match.group(4)

    new = MARKER.sub(one, text)
    if write and new != text:
        page.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a table differs from its file")
    args = parser.parse_args(argv)
    stale = [name for page in pages() for name in process(page, write=not args.check)]
    for name in stale:
        print(("differs from its file: " if args.check else "rewrote ") + name)
    if args.check and stale:
        print("run: python tools/docs_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
