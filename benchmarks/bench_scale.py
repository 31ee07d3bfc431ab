"""Routing plan, process groups and teacher-payload traffic of one step from 64 to 16,384 GPUs,
simulated on one CPU (megatron_xdistill.transport.simulate; the cost model in docs/scale.md).

For every world size, student, teacher set and placement the project's construction runs for
rank 0 and the first teacher sender with torch.distributed counted instead of executed; the
traffic and the compute follow for each payload form. Writes one JSON result file per world
size under benchmarks/results/scale/ and prints, per payload form, the largest world where
construction stays under 10 s and the transfer hides under compute.

    python benchmarks/bench_scale.py                   # the full sweep (about 20 min on 2 cores)
    python benchmarks/bench_scale.py --gpus 64 1024    # some world sizes
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FORMS = ("full", "image", "topk", "chunk_topk", "gold")
SIZES = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
STUDENTS = (("llama-3.2-1b", 1), ("llama-3.1-8b", 4))


def teacher_sets(gpus: int, placement: str):
    """(name, teachers) of a world: Qwen3-8B (TP2), Qwen3-32B (TP8 PP2), both; disaggregated
    on a quarter of the GPUs (two teachers: an eighth each)."""
    from megatron_xdistill.transport.simulate import TeacherSetup

    quarter = gpus // 4 if placement == "disaggregated" else None
    eighth = gpus // 8 if placement == "disaggregated" else None
    return [("qwen3-8b", (TeacherSetup("qwen3-8b", tp=2, ranks=quarter),)),
            ("qwen3-32b", (TeacherSetup("qwen3-32b", tp=8, pp=2, ranks=quarter),)),
            ("qwen3-8b+qwen3-32b", (TeacherSetup("qwen3-8b", tp=2, ranks=eighth),
                                    TeacherSetup("qwen3-32b", tp=8, pp=2, ranks=eighth)))]


def run(gpus: int, light: bool = False) -> list[dict]:
    from megatron_xdistill.transport.simulate import Scenario, simulate

    rows = []
    for student, tp in STUDENTS:
        for placement in ("colocated", "disaggregated"):
            for name, teachers in teacher_sets(gpus, placement):
                scenario = Scenario(gpus, student=student, student_tp=tp, teachers=teachers,
                                    placement=placement)
                try:
                    scenario.global_batch_size()  # the layouts fit this world
                except ValueError as exc:
                    rows.append({"gpus": gpus, "student": student, "teachers": name,
                                 "placement": placement, "skipped": str(exc)})
                    continue
                start = time.perf_counter()
                ranks = [0] if light else None
                for report in simulate(scenario, forms=FORMS, ranks=ranks, memory=not light):
                    rows.append({"gpus": gpus, "student": student, "teachers": name,
                                 "placement": placement, **report})
                print(f"{gpus:>6} {student:<13} {name:<19} {placement:<13} "
                      f"{time.perf_counter() - start:6.1f} s", flush=True)
    return rows


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def table(rows: list[dict]) -> str:
    """Per form, placement and teachers: the largest world where construction < 10 s and the
    transfer hides under compute (and the transfer's share there)."""
    lines = ["| payload | placement | teachers | student | largest world | transfer / period |",
             "|---|---|---|---|---|---|"]
    keys = sorted({(r["scenario"]["form"], r["placement"], r["teachers"], r["student"])
                   for r in rows if "scenario" in r})
    for form, placement, teachers, student in keys:
        ok = [r for r in rows if "scenario" in r and r["scenario"]["form"] == form
              and r["placement"] == placement and r["teachers"] == teachers
              and r["student"] == student]
        good = [r for r in ok if r["hides"] and r["constructs_under_10s"]]
        best = max(good, key=lambda r: r["gpus"]) if good else None
        share = (f"{best['transfer_s']:.3g} s / {best['period_s']:.3g} s" if best else
                 f"{min(ok, key=lambda r: r['gpus'])['transfer_s']:.3g} s at the smallest")
        lines.append(f"| {form} | {placement} | {teachers} | {student} | "
                     f"{best['gpus'] if best else 'none'} | {share} |")
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
    meta = {"machine": f"{platform.node()} ({platform.processor() or platform.machine()}, "
                       f"{platform.python_version()})",
            "commit": _commit(), "date": datetime.date.today().isoformat(),
            "command": "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:])}
    rows = []
    for gpus in args.gpus:
        found = run(gpus, args.light)
        rows += found
        (out / f"scale_{gpus}.json").write_text(json.dumps({**meta, "rows": found}, indent=1))
    print(table(rows))


if __name__ == "__main__":
    main()
