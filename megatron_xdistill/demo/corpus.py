"""Real text corpora that need no download: the CPython standard library, split by module.

Used by the demo and the "does it teach?" example: Python source is text both code models know,
and splitting by module keeps held-out files unseen during training.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from megatron_xdistill.demo.assets import stdlib_python_files
from megatron_xdistill.storage import atomic_file


def _held_out(path: Path, valid_fraction: float) -> bool:
    """Stable per-module split: a hash of the module path, not of the machine's file order."""
    digest = hashlib.sha256(str(path.as_posix()).encode()).digest()
    return int.from_bytes(digest[:4], "little") / 2**32 < valid_fraction


def write_stdlib_corpus(out_dir: str | os.PathLike, valid_fraction: float = 0.1,
                        max_chars: int = 20000, min_chars: int = 500) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``valid.jsonl`` of stdlib modules (each cut to ``max_chars``).

    Returns both paths. Idempotent: existing files are kept.
    """
    out = Path(out_dir)
    train, valid = out / "train.jsonl", out / "valid.jsonl"
    if train.exists() and valid.exists():
        return train, valid
    out.mkdir(parents=True, exist_ok=True)
    files = stdlib_python_files()
    root = Path(os.path.commonpath([str(f) for f in files]))
    with (atomic_file(train) as tmp_train, atomic_file(valid) as tmp_valid,
          open(tmp_train, "w") as t_out, open(tmp_valid, "w") as v_out):
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if len(text) < min_chars:
                continue
            rel = path.relative_to(root)
            record = json.dumps({"id": rel.as_posix(), "text": text[:max_chars]})
            (v_out if _held_out(rel, valid_fraction) else t_out).write(record + "\n")
    return train, valid
