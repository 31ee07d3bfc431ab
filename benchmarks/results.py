"""Benchmark results as data: each run's printed rows, with where and how they were made.

Every ``benchmarks/bench_*.py`` passes the rows it prints to :func:`write_rows`, which keeps
them as one JSON file, ``benchmarks/results/<bench>/<UTC time>-<host>[-<table>].json``:
the machine (host, CPU model and count, GPU model, Python / torch versions), the commit
(``git rev-parse HEAD``, ``+dirty`` when tracked files differ from it), the date, the command
line and the rows (one dict a row, numbers as measured, not rounded). The docs' number
tables are generated from these files (``tools/docs_tables.py``), so a published figure
always names the run that made it. ``XDISTILL_RESULTS_DIR`` puts the files elsewhere (a
device session writes them under its ``$OUT``); ``XDISTILL_NO_RESULTS=1`` writes none.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from megatron_xdistill.demo.provenance import command_line, commit

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def results_dir() -> Path:
    """Where result files go: ``$XDISTILL_RESULTS_DIR`` or ``benchmarks/results``."""
    return Path(os.environ.get("XDISTILL_RESULTS_DIR") or RESULTS)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_models() -> list[str]:
    """The visible GPUs' names: torch's where it is imported with CUDA, else nvidia-smi's."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001 - a broken CUDA setup is reported as no GPU
        return []
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {"host": socket.gethostname(), "cpu": _cpu_model(),
                            "cpu_count": os.cpu_count(), "gpus": _gpu_models(),
                            "platform": platform.platform(), "python": platform.python_version()}
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
    return info


def write_rows(bench: str, rows: list[dict[str, Any]], *, table: str | None = None,
               params: dict[str, Any] | None = None, notes: str | None = None,
               argv: list[str] | None = None) -> Path | None:
    """Keep ``rows`` (what ``bench`` printed) as a result file; return its path.

    ``table`` names one of several tables a benchmark prints (it becomes part of the file
    name and a field); ``params`` are the run's settings that are not in every row (sizes,
    threads); ``notes`` one line on how to read the rows. None when ``XDISTILL_NO_RESULTS``
    is set (tests that run a benchmark's main leave no files)."""
    if os.environ.get("XDISTILL_NO_RESULTS"):
        return None
    if not rows:
        raise ValueError(f"{bench}: no rows to write (a benchmark that measured nothing "
                         f"should say why instead)")
    now = _dt.datetime.now(_dt.UTC)
    host = socket.gethostname().split(".")[0] or "host"
    name = now.strftime("%Y%m%dT%H%M%SZ") + f"-{host}" + (f"-{table}" if table else "")
    record = {"bench": bench, "table": table, "date": now.isoformat(timespec="seconds"),
              "commit": commit(), "command": command_line(argv), "machine": machine(),
              "params": params or {}, "notes": notes, "rows": rows}
    folder = results_dir() / bench
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    n = 1
    while path.exists():  # two tables of one run in the same second, or a rerun
        n += 1
        path = folder / f"{name}-{n}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1, default=_plain) + "\n")
    tmp.replace(path)
    print(f"[results] {len(rows)} rows -> {path}", flush=True)
    return path


def _plain(value: Any) -> Any:
    """JSON for the numbers benchmarks hold: NumPy / torch scalars, paths."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot keep {type(value).__name__} in a result file: {value!r}")


def load(path: str | Path) -> dict[str, Any]:
    """A result file's record."""
    return json.loads(Path(path).read_text())


def latest(bench: str, table: str | None = None, root: Path | None = None) -> Path | None:
    """The newest result file of ``bench`` (and ``table``), or None."""
    folder = (root or RESULTS) / bench
    files = sorted(p for p in folder.glob("*.json") if load(p).get("table") == table)
    return files[-1] if files else None
