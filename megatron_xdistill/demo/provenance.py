"""Where a kept result came from: the commit and the command that made it.

Benchmarks (``benchmarks/results.py``) and the examples' studies write these beside their
numbers, so a published figure names the code and the command that made it.
"""

from __future__ import annotations

import datetime as _dt
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """``HEAD``'s hash, with ``+dirty`` when a tracked file differs from it (the numbers then
    come from code no commit holds); ``unknown`` outside a git checkout."""
    head = _git("rev-parse", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def command_line(argv: list[str] | None = None) -> str:
    """The command as run (``python path/in/repo.py ARGS``), shell-quoted."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0]) if argv and argv[0] else Path("?")
    try:
        script = script.resolve().relative_to(REPO)
    except (ValueError, OSError):
        pass
    return shlex.join(["python", str(script), *argv[1:]])


def record(argv: list[str] | None = None) -> dict[str, str]:
    """``{"commit", "command", "date"}`` of the running process."""
    return {"commit": commit(), "command": command_line(argv),
            "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}
