"""Line coverage of megatron_xdistill/ by package folder, from coverage.py's JSON report.

``make coverage`` runs the CPU suite under pytest-cov (ranks and subprocesses included: see
``[tool.coverage.run]`` in pyproject.toml), writes ``coverage.json`` and prints this table: one row
per top-level folder of the package (its subfolders counted in it), the files directly in the
package as ``(package)``, and the total. Folders under ``--threshold`` are marked; ``--files``
lists their files with the fewest lines covered first, which is where the work is left.
``--write`` keeps the rows as a result file (``benchmarks/results/coverage/``: machine, commit,
date, command), from which docs/test_checks.md's table is generated (tools/docs_tables.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

PACKAGE = "megatron_xdistill"


@dataclass
class Lines:
    """Statements and covered statements of a folder (or file)."""

    statements: int = 0
    covered: int = 0
    files: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def percent(self) -> float:
        return 100.0 * self.covered / self.statements if self.statements else 100.0

    def add(self, path: str, statements: int, covered: int) -> None:
        self.statements += statements
        self.covered += covered
        self.files[path] = (statements, covered)


def folder_of(path: str) -> str | None:
    """The package folder a measured file belongs to (None: not in the package)."""
    parts = PurePosixPath(path.replace("\\", "/")).parts
    if PACKAGE not in parts:
        return None
    rest = parts[parts.index(PACKAGE) + 1:]
    return "(package)" if len(rest) == 1 else rest[0]


def by_folder(report: dict) -> dict[str, Lines]:
    """Lines per package folder of a coverage.py JSON report (``coverage json``)."""
    folders: dict[str, Lines] = {}
    for path, entry in report["files"].items():
        folder = folder_of(path)
        if folder is None:
            continue
        summary = entry["summary"]
        folders.setdefault(folder, Lines()).add(path, int(summary["num_statements"]),
                                                int(summary["covered_lines"]))
    return dict(sorted(folders.items()))


def table(folders: dict[str, Lines], threshold: float, files: bool = False) -> str:
    """The printed table (``files``: each folder under the threshold's files, least covered
    first)."""
    lines = [f"{'folder':<16} {'lines':>7} {'covered':>8} {'%':>7}"]
    total = Lines()
    for name, lines_of in folders.items():
        total.statements += lines_of.statements
        total.covered += lines_of.covered
        mark = f"  < {threshold:g}%" if lines_of.percent < threshold else ""
        lines.append(f"{name:<16} {lines_of.statements:>7} {lines_of.covered:>8} "
                     f"{lines_of.percent:>6.1f}%{mark}")
    lines.append(f"{'total':<16} {total.statements:>7} {total.covered:>8} {total.percent:>6.1f}%")
    if files:
        for name, lines_of in folders.items():
            if lines_of.percent >= threshold:
                continue
            lines.append(f"\n{name} (< {threshold:g}%): uncovered lines by file")
            for path, (n, c) in sorted(lines_of.files.items(), key=lambda kv: kv[1][1] - kv[1][0]):
                if c < n:
                    lines.append(f"  {n - c:>5} of {n:>5}  {path}")
    return "\n".join(lines)


def rows(folders: dict[str, Lines], threshold: float) -> list[dict]:
    """One result row per folder and the total (what the table prints)."""
    total = Lines(sum(f.statements for f in folders.values()),
                  sum(f.covered for f in folders.values()))
    return [{"folder": name, "lines": f.statements, "covered": f.covered,
             "percent": round(f.percent, 2), "below_threshold": f.percent < threshold}
            for name, f in [*folders.items(), ("total", total)]]


def write_result(folders: dict[str, Lines], threshold: float, argv: Sequence[str] | None) -> None:
    """Keep the rows as ``benchmarks/results/coverage/<time>-<host>.json``."""
    root = str(Path(__file__).resolve().parents[1])
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks.results import write_rows

    write_rows("coverage", rows(folders, threshold), params={"threshold": threshold},
               notes="line coverage of megatron_xdistill/ by top-level folder on the CPU suite "
                     "(make coverage: ranks and subprocesses included)",
               argv=None if argv is None else ["tools/coverage_by_folder.py", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", default="coverage.json",
                        help="coverage.py JSON report (default: coverage.json)")
    parser.add_argument("--threshold", type=float, default=85.0,
                        help="mark folders under this share of lines covered (default 85)")
    parser.add_argument("--files", action="store_true",
                        help="list the files of the folders under the threshold")
    parser.add_argument("--write", action="store_true",
                        help="keep the rows as a result file under benchmarks/results/coverage/")
    args = parser.parse_args(argv)
    with open(args.report, encoding="utf-8") as f:
        folders = by_folder(json.load(f))
    if not folders:
        print(f"{args.report}: no file of {PACKAGE}/ was measured", file=sys.stderr)
        return 1
    print(table(folders, args.threshold, args.files))
    if args.write:
        write_result(folders, args.threshold, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
