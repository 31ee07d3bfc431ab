"""Build time and peak memory of the projection builder (``xdistill-projection build``).

Each configuration runs in a fresh child process pinned to ``--cores`` CPUs (Rust tokenizer
threads limited to match), so peak RSS is that of one build: load both tokenizers, build W, save
it. Prints a table. Default pair: qwen2 x gemma3 (151,936 x 262,144), both directions.

  python benchmarks/bench_projection.py [--cores 2] [--pairs qwen2:gemma3 gemma3:qwen2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from results import write_rows

ASSETS = Path(
    os.environ.get(
        "XDISTILL_SHARED_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets"
    )
)

_CHILD = r"""
import json, os, resource, sys, time
cores = int(sys.argv[4])
if hasattr(os, "sched_setaffinity"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:cores])
t0 = time.perf_counter()
from transformers import AutoTokenizer
from megatron_xdistill.projection import BuildOptions, build_projection, save_projection
student = AutoTokenizer.from_pretrained(sys.argv[1])
teacher = AutoTokenizer.from_pretrained(sys.argv[2])
t1 = time.perf_counter()
opts = json.loads(sys.argv[5])
m = build_projection(student, teacher, BuildOptions(**opts))
t2 = time.perf_counter()
save_projection(m, sys.argv[3])
t3 = time.perf_counter()
print(json.dumps({
    "load_s": t1 - t0, "build_s": t2 - t1, "total_s": t3 - t0,
    "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    "coverage": m.coverage(), "file_mib": os.path.getsize(sys.argv[3]) / 2**20,
}))
"""

CONFIGS = {
    "default": {},
    "reverse+special": {"reverse_pass": True, "special_tokens": True},
}


def run(student: str, teacher: str, options: dict, cores: int) -> dict:
    """One build in a child process; returns its timings, peak RSS and coverage."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(cores), TOKENIZERS_PARALLELISM="true")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "w.safetensors"
        args = [
            sys.executable, "-c", _CHILD,
            str(ASSETS / "tokenizers" / student), str(ASSETS / "tokenizers" / teacher),
            str(out), str(cores), json.dumps(options),
        ]  # fmt: skip
        proc = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"build {student} -> {teacher} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run the configurations and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--pairs", nargs="*", default=["qwen2:gemma3", "gemma3:qwen2"])
    args = p.parse_args()
    if not (ASSETS / "tokenizers").is_dir():
        sys.exit(f"shared tokenizers not found under {ASSETS} (set XDISTILL_SHARED_ASSETS)")
    header = (
        f"{'student -> teacher':<22} {'config':<16} {'load s':>7} {'build s':>8} "
        f"{'total s':>8} {'peak RSS GiB':>13} {'exact':>7} {'multi':>7} {'bytes':>6} "
        f"{'reverse':>7} {'special':>7} {'empty':>6}"
    )
    print(f"projection build, {args.cores} cores")
    print(header)
    print("-" * len(header))
    rows = []
    for pair in args.pairs:
        student, teacher = pair.split(":")
        for name, options in CONFIGS.items():
            r = run(student, teacher, options, args.cores)
            c = r["coverage"]
            print(
                f"{student + ' -> ' + teacher:<22} {name:<16} {r['load_s']:>7.1f} "
                f"{r['build_s']:>8.1f} {r['total_s']:>8.1f} {r['peak_rss_gib']:>13.2f} "
                f"{c['exact'] + c['exact_alias']:>7} {c['multi_token']:>7} {c['bytes']:>6} "
                f"{c['reverse']:>7} {c['special']:>7} {c['empty']:>6}",
                flush=True,
            )
            rows.append({"pair": f"{student} -> {teacher}", "config": name,
                         "load_s": r["load_s"], "build_s": r["build_s"],
                         "total_s": r["total_s"], "peak_rss_gib": r["peak_rss_gib"],
                         "exact": c["exact"] + c["exact_alias"], "multi_token": c["multi_token"],
                         "bytes": c["bytes"], "reverse": c["reverse"], "special": c["special"],
                         "empty": c["empty"]})
    write_rows("bench_projection", rows, params={"cores": args.cores})


if __name__ == "__main__":
    main()
