"""The package's stage folders import only toward earlier stages (DESIGN.md's layout): no cycles,
and a new stage states where it sits."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_xdistill"
#: Stages in order; each may import the ones before it.
ORDER = ["mcore", "storage", "align", "projection", "loss", "parallel", "transport", "models", "data",
         "generation", "teacher_cache", "teachers", "onpolicy", "evaluation", "training",
         "launch", "demo", "testing"]


def _imports(path: Path) -> set[str]:
    """The megatron_xdistill stages a module imports."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                 [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        for name in names:
            parts = name.split(".")
            if parts[0] == "megatron_xdistill" and len(parts) > 1:
                out.add(parts[1])
    return out


def test_every_stage_imports_only_earlier_stages():
    stages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert stages == set(ORDER), f"place new stages in ORDER: {sorted(stages ^ set(ORDER))}"
    wrong = []
    for stage in ORDER:
        allowed = set(ORDER[: ORDER.index(stage) + 1])
        for path in sorted((PACKAGE / stage).rglob("*.py")):
            for target in _imports(path) & set(ORDER):
                if target not in allowed:
                    wrong.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert not wrong, "imports against the stage order:\n" + "\n".join(wrong)


def test_no_loose_modules_at_the_package_root():
    """Every module belongs to a stage: the package root holds only ``__init__.py``."""
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"move these into a stage folder (and ORDER): {loose}"
