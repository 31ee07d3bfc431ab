"""Time and peak memory of ``xdistill-convert`` on a real model (default Qwen2.5-Coder-1.5B).

Each step runs the CLI in a child process pinned to ``--cores`` CPUs; memory is sampled every
50 ms over the child's whole process tree (spawned ranks and dist_checkpointing's helpers): the
peak of the summed PSS, and the peak RSS of the largest process. The HF folder's and the
checkpoint's weight sizes are printed for scale. Steps: hf-to-mcore at TP1 and at TP2 (two
ranks), verify (fp32, 1x64 tokens), mcore-to-hf. Prints a table.

  python benchmarks/bench_conversion.py [--model qwen2.5-coder-1.5b] [--cores 2]
      [--steps import import-tp2 verify export] [--dtype bf16]

Needs the model from ``../shared/assets/fetch_models.sh``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from results import write_rows

MODELS = Path(os.environ.get("XDISTILL_ASSETS", Path.home() / ".cache" / "xdistill-assets")) \
    / "models"


def _tree_memory(proc: psutil.Process) -> tuple[int, int]:
    """(sum of PSS, largest RSS) over a process tree. PSS splits pages shared between processes
    (forked helpers, spawned ranks) so the sum is the memory really used; RSS would count them
    once per process."""
    pss, rss = 0, 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except psutil.Error:
            continue
        pss += info.pss
        rss = max(rss, info.rss)
    return pss, rss


def run_step(cmd: list[str], cores: int) -> tuple[float, float, float]:
    """Run one CLI command; returns (wall s, peak PSS of its process tree GiB, peak RSS of its
    largest process GiB)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(cores))
    cpus = sorted(os.sched_getaffinity(0))[:cores]
    start = time.perf_counter()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, preexec_fn=lambda: os.sched_setaffinity(0, cpus))
    proc, peak_pss, peak_rss = psutil.Process(child.pid), 0, 0
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True)
    reader.start()
    while child.poll() is None:
        pss, rss = _tree_memory(proc)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.05)
    reader.join()
    wall = time.perf_counter() - start
    if child.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(lines[-40:])}")
    return wall, peak_pss / 2**30, peak_rss / 2**30


def _size_gib(folder: Path, suffixes: tuple[str, ...]) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.name.endswith(suffixes)) / 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--steps", nargs="+", default=["import", "import-tp2", "verify", "export"])
    args = parser.parse_args(argv)
    hf = MODELS / args.model
    if not (hf / "config.json").exists():
        print(f"{hf} missing: run ../shared/assets/fetch_models.sh {args.model}")
        return 1
    cli = [sys.executable, "-m", "conversion.cli"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, ckpt2, back = Path(tmp) / "mcore", Path(tmp) / "mcore_tp2", Path(tmp) / "hf"
        steps = {
            "import": ("hf-to-mcore TP1", [*cli, "hf-to-mcore", "--hf-dir", str(hf), "--out",
                                           str(ckpt), "--dtype", args.dtype]),
            "import-tp2": ("hf-to-mcore TP2 (2 ranks)",
                           [*cli, "hf-to-mcore", "--hf-dir", str(hf), "--out", str(ckpt2),
                            "--dtype", args.dtype, "--tp", "2"]),
            "verify": ("verify TP1 (fp32, 1x64)",
                       [*cli, "verify", "--hf-dir", str(hf), "--load", str(ckpt), "--batch", "1",
                        "--seq-length", "64"]),
            "export": ("mcore-to-hf", [*cli, "mcore-to-hf", "--load", str(ckpt), "--out",
                                       str(back)]),
        }
        for step in args.steps:
            label, cmd = steps[step]
            wall, pss, rss = run_step(cmd, args.cores)
            rows.append((label, wall, pss, rss))
            print(f"  {label}: {wall:.1f} s, peak memory {pss:.2f} GiB (PSS, all processes), "
                  f"largest process RSS {rss:.2f} GiB", flush=True)
        hf_size = _size_gib(hf, (".safetensors",))
        ckpt_size = _size_gib(ckpt, (".distcp",)) if ckpt.exists() else float("nan")
    print(f"\n{args.model}: HF weights {hf_size:.2f} GiB, Megatron checkpoint ({args.dtype}) "
          f"{ckpt_size:.2f} GiB; {args.cores} cores\n")
    print(f"| {'step':<28} | {'time (s)':>8} | {'peak PSS, all procs (GiB)':>25} | "
          f"{'peak RSS, largest proc (GiB)':>28} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 27}|{'-' * 30}|")
    for label, wall, pss, rss in rows:
        print(f"| {label:<28} | {wall:8.1f} | {pss:25.2f} | {rss:28.2f} |")
    write_rows("bench_conversion", [
        {"step": label, "seconds": wall, "peak_pss_gib": pss, "peak_rss_gib": rss}
        for label, wall, pss, rss in rows],
        params={"model": args.model, "dtype": args.dtype, "cores": args.cores,
                "hf_weights_gib": hf_size, "checkpoint_gib": ckpt_size})
    return 0


if __name__ == "__main__":
    sys.exit(main())
