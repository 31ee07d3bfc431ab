"""Routing plan, process groups and teacher-payload traffic of one step from 64 to 16,384 GPUs,
simulated on one CPU (megatron_xdistill.transport.simulate; the cost model in docs/scale.md).

For every world size, student, teacher set and placement the project's construction runs for
rank 0 and the first teacher sender with torch.distributed counted instead of executed; the
traffic and the compute follow for each payload form. Writes one JSON result file per world
size under benchmarks/results/scale/ and prints, per payload form, the largest world where
construction stays under 10 s and the transfer hides under compute.

    python benchmarks/bench_scale.py                   # every world (64 to 2,048: 4 min)
    python benchmarks/bench_scale.py --gpus 64 1024    # some world sizes
    python benchmarks/bench_scale.py --light --gpus 16384  # rank 0 only (2 min)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMS = ("full", "image", "topk", "chunk_topk", "gold", "gold_topk")
SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STUDENTS = (("llama-3.2-1b", 1), ("llama-3.1-8b", 4))


def teacher_sets(gpus: int, placement: str):
    """(name, teachers) of a world: Qwen3-8B (TP2), Qwen3-32B (TP8 PP2), both, and the MoE
    Qwen3-30B-A3B (TP2, its experts over EP4: TP x EP one node) and Qwen3-235B-A22B (TP8 PP4,
    its experts over EP8: 256 teacher GPUs at least); disaggregated on a quarter of the GPUs
    (two teachers: an eighth each)."""
    from megatron_xdistill.transport.simulate import TeacherSetup

    quarter = gpus // 4 if placement == "disaggregated" else None
    eighth = gpus // 8 if placement == "disaggregated" else None
    return [("qwen3-8b", (TeacherSetup("qwen3-8b", tp=2, ranks=quarter),)),
            ("qwen3-32b", (TeacherSetup("qwen3-32b", tp=8, pp=2, ranks=quarter),)),
            ("qwen3-8b+qwen3-32b", (TeacherSetup("qwen3-8b", tp=2, ranks=eighth),
                                    TeacherSetup("qwen3-32b", tp=8, pp=2, ranks=eighth))),
            ("qwen3-30b-a3b", (TeacherSetup("qwen3-30b-a3b", tp=2, ep=4, ranks=quarter),)),
            ("qwen3-235b-a22b", (TeacherSetup("qwen3-235b-a22b", tp=8, pp=4, ep=8,
                                              ranks=quarter),))]


def _scenario(gpus: int, student: str, tp: int, placement: str, name: str):
    """The scenario ``name`` of a world, and why its layouts do not fit that world (None if
    they do)."""
    from megatron_xdistill.transport.simulate import Scenario

    teachers = dict(teacher_sets(gpus, placement))[name]
    scenario = Scenario(gpus, student=student, student_tp=tp, teachers=teachers,
                        placement=placement)
    try:
        scenario.global_batch_size()  # the layouts fit this world
    except ValueError as exc:
        return scenario, str(exc)
    return scenario, None


def smallest_world(student: str, tp: int, placement: str, name: str, above: int) -> int:
    """The smallest power-of-two world above ``above`` GPUs whose layouts fit the scenario."""
    gpus = 2 * above
    while _scenario(gpus, student, tp, placement, name)[1] is not None:
        gpus *= 2
    return gpus


def run(gpus: int, light: bool = False) -> list[dict]:
    from megatron_xdistill.transport.simulate import simulate

    rows = []
    for student, tp in STUDENTS:
        for placement in ("colocated", "disaggregated"):
            for name, _ in teacher_sets(gpus, placement):
                scenario, why = _scenario(gpus, student, tp, placement, name)
                if why is not None:
                    rows.append({"gpus": gpus, "student": student, "teachers": name,
                                 "placement": placement, "skipped": why,
                                 "min_gpus": smallest_world(student, tp, placement, name,
                                                            gpus)})
                    continue
                start = time.perf_counter()
                ranks = [0] if light else None
                for report in simulate(scenario, forms=FORMS, ranks=ranks, memory=not light):
                    rows.append({"gpus": gpus, "student": student, "teachers": name,
                                 "placement": placement, **report})
                print(f"{gpus:>6} {student:<13} {name:<19} {placement:<13} "
                      f"{time.perf_counter() - start:6.1f} s", flush=True)
    return rows


#: the docs' names of the pivot tables' rows and columns
FORM_ORDER = ("full", "image", "gold", "gold_topk", "topk", "chunk_topk")
STUDENT_LABEL = {"llama-3.2-1b": "L3.2-1b", "llama-3.1-8b": "L3.1-8b"}
TEACHER_LABEL = {"qwen3-8b": "Q8b", "qwen3-32b": "Q32b", "qwen3-8b+qwen3-32b": "Q8b+Q32b",
                 "qwen3-30b-a3b": "Q30b-A3b (MoE)", "qwen3-235b-a22b": "Q235b-A22b (MoE)"}
PLACEMENT_LABEL = {"colocated": "coloc.", "disaggregated": "disag."}


def load(folder: Path | str) -> list[dict]:
    """Every ``scale_<gpus>.json`` of ``folder``, smallest world first."""
    paths = sorted(Path(folder).glob("scale_*.json"), key=lambda p: int(p.stem.split("_")[1]))
    if not paths:
        raise FileNotFoundError(f"no scale_<gpus>.json in {folder}: run benchmarks/bench_scale.py")
    return [{**json.loads(p.read_text()), "path": p} for p in paths]


def column(row: dict) -> str:
    """A pivot column's field name: placement and teachers, e.g. ``colocated/qwen3-8b``."""
    return f"{row['placement']}/{row['teachers']}"


def columns() -> list[list[str]]:
    """``[field, header]`` of every placement x teachers column, as the docs' tables show them."""
    return [[f"{p}/{t}", f"{PLACEMENT_LABEL[p]} {TEACHER_LABEL[t]}"]
            for p in PLACEMENT_LABEL for t in TEACHER_LABEL]


def not_simulated(row: dict) -> str:
    """A cell of a scenario whose layouts do not fit the world: n/a and from which world
    they do (a skipped row's ``min_gpus``)."""
    return f"n/a (layouts fit from {row['min_gpus']} GPUs)" if "min_gpus" in row else "n/a"


def largest_world(records: list[dict]) -> list[dict]:
    """One row per payload form and student: per placement x teachers, the largest world where
    construction stays under 10 s and the transfer hides under compute ('none': at no world;
    then the transfer against the step period at the smallest world; 'from': the smallest
    world the layouts fit, where smaller worlds have files)."""
    done = [r for record in records for r in record["rows"] if "scenario" in r]
    skipped = [r for record in records for r in record["rows"] if "skipped" in r]
    out = []
    for form in FORM_ORDER:
        for student, label in STUDENT_LABEL.items():
            cells = {"form": form, "student": label}
            for name in (c for c, _ in columns()):
                ok = [r for r in done if r["scenario"]["form"] == form
                      and r["student"] == student and column(r) == name]
                missing = sorted((r for r in skipped if r["student"] == student
                                  and column(r) == name), key=lambda r: r["gpus"])
                if not ok:
                    cells[name] = not_simulated(missing[-1]) if missing else "n/a"
                    continue
                since = f", from {min(r['gpus'] for r in ok)}" if missing else ""
                good = [r["gpus"] for r in ok if r["hides"] and r["constructs_under_10s"]]
                first = min(ok, key=lambda r: r["gpus"])
                if not good:
                    cells[name] = (f"none ({first['transfer_s']:.2g} s vs "
                                   f"{first['period_s']:.2g} s{since})")
                    continue
                below = sorted(r["gpus"] for r in ok if r["gpus"] < max(good)
                               and not (r["hides"] and r["constructs_under_10s"]))
                notes = ([f"fails at {', '.join(map(str, below))}"] if below else []) + (
                    [since[2:]] if since else [])
                cells[name] = str(max(good)) + (f" ({'; '.join(notes)})" if notes else "")
            out.append(cells)
    return out


def _per_world(records: list[dict], cell, student: str, form: str) -> list[dict]:
    """One row per world (file): ``cell(row)`` in each placement x teachers column of
    ``student``'s ``form`` rows, 'n/a' where the world does not fit the layouts (and from which
    world they do); ``ranks`` says which ranks the run constructed (``--light``: rank 0
    only)."""
    out = []
    for record in records:
        line = {"gpus": record["rows"][0]["gpus"],
                "ranks": "rank 0" if "--light" in record["command"] else
                "rank 0, first sender"}
        line.update({name: "n/a" for name, _ in columns()})
        for r in record["rows"]:
            if "scenario" in r and r["student"] == student and r["scenario"]["form"] == form:
                line[column(r)] = cell(r)
            elif "skipped" in r and r["student"] == student:
                line[column(r)] = not_simulated(r)
        out.append(line)
    return out


def construction(records: list[dict], student: str = "llama-3.2-1b",
                 form: str = "chunk_topk") -> list[dict]:
    """One row per world: each column's construction time on one rank (the worst of the ranks
    constructed) and its modelled part (store requests, collectives, connects: the rest is
    measured Python time), the groups it enters and the world's store requests."""
    def cell(r: dict) -> str:
        worst = max(r["construction"], key=lambda c: c["construction_s"])
        return (f"{worst['construction_s']:.2f} s ({worst['modelled_s']:.2f} s modelled; "
                f"{worst['groups_entered']} groups, {worst['world_store_ops']} store req.)")
    return _per_world(records, cell, student, form)


def busiest_link(records: list[dict], student: str = "llama-3.2-1b",
                 form: str = "chunk_topk") -> list[dict]:
    """One row per world: each column's busiest GPU NIC over the mean, the same with every
    teacher replica sending from one rank only, and the GPUs that send."""
    def cell(r: dict) -> str:
        t = r["traffic"]
        return (f"{t['busiest_over_mean']}x (one sender: {t['busiest_over_mean_one_sender']}x), "
                f"{t['gpus_sending']} send")
    return _per_world(records, cell, student, form)


def runs(records: list[dict]) -> list[dict]:
    """One row per result file: the world, its nodes, the ranks constructed and the command."""
    rows = []
    for record in records:
        first = record["rows"][0]
        nodes = first["gpus"] // first["scenario"]["gpus_per_node"] if "scenario" in first else None
        rows.append({"gpus": first["gpus"], "nodes": nodes,
                     "ranks": "rank 0" if "--light" in record["command"] else
                     "rank 0, first sender",
                     "scenarios": len({(r["student"], r["teachers"], r["placement"])
                                       for r in record["rows"] if "scenario" in r}),
                     "command": f"`{record['command'].strip()}`"})
    return rows


#: the docs' tables of the result files (tools/docs_tables.py, source "scale")
TABLES = {"runs": runs, "largest_world": largest_world, "construction": construction,
          "busiest_link": busiest_link}


def table(records: list[dict]) -> str:
    """The largest-world table of ``records`` (result files' contents) as Markdown."""
    head = [["form", "payload"], ["student", "student"], *columns()]
    lines = ["| " + " | ".join(h for _, h in head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.get(k, "n/a") for k, _ in head) + " |"
              for r in largest_world(records)]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, nargs="*", default=list(SIZES))
    parser.add_argument("--light", action="store_true",
                        help="construct rank 0 only, without the heap trace (large worlds on a "
                        "busy machine)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale"))
    args = parser.parse_args()
    from megatron_xdistill.mcore import compat

    compat.install()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.results import machine  # the record fields every result file has
    from megatron_xdistill.demo.provenance import commit

    meta = {"machine": machine(), "commit": commit(), "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:])}
    records = []
    for gpus in args.gpus:
        records.append({**meta, "rows": run(gpus, args.light)})
        (out / f"scale_{gpus}.json").write_text(json.dumps(records[-1], indent=1))
    print(table(records))


if __name__ == "__main__":
    main()
