"""benchmarks/device/checks.sh, read on the CPU: its gpu_tests part runs every gpu-marked test
under tests/, collected by marker, so a gpu test in a new file is not left out of the device
session (it once named two files and missed tests/test_device_placement.py)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device" / "checks.sh"


def part_commands(*parts: str) -> dict[str, list[str]]:
    """Each part's command as checks.sh runs it, from its dry run (``CHECKS_DRY_RUN=1``:
    installs and runs nothing, prints ``== PART`` and ``+ ARG...`` lines)."""
    out = subprocess.run(["bash", str(SCRIPT), *parts], env={**os.environ, "CHECKS_DRY_RUN": "1"},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    commands: dict[str, list[str]] = {}
    name = None
    for line in out.splitlines():
        if line.startswith("== "):
            name = line.split()[1]
        elif line.startswith("+ "):
            commands[name] = shlex.split(line[2:])
    return commands


def files_with_gpu_tests() -> set[str]:
    """The test files that mark a test ``gpu``, read from their source (not by pytest)."""
    return {p.name for p in (ROOT / "tests").glob("test_*.py")
            if re.search(r"\bmark\.gpu\b", p.read_text(encoding="utf-8"))}


def test_the_gpu_part_runs_every_gpu_marked_test():
    command = part_commands("gpu_tests")["gpu_tests"]
    assert command[:3] == ["python3", "-m", "pytest"], command
    args = command[3:]
    assert args[args.index("-m") + 1] == "gpu", command
    # What the part would run, collected here (on a CPU machine the same tests are collected,
    # none is run).
    collected = subprocess.run([sys.executable, *command[1:], "--collect-only"], cwd=ROOT,
                               capture_output=True, text=True, timeout=300)
    assert collected.returncode == 0, collected.stdout[-2000:] + collected.stderr[-2000:]
    ids = [line for line in collected.stdout.splitlines() if "::" in line]
    files = {Path(node.split("::")[0]).name for node in ids}
    want = files_with_gpu_tests()
    assert {"test_gpu.py", "test_loss_fused.py", "test_device_placement.py"} <= want
    assert files == want, f"gpu tests left out: {sorted(want - files)}"
