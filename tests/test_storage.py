"""Atomic writes: the destination holds the old content or the whole new one, never a part."""

from __future__ import annotations

import json
import multiprocessing as mp
import os

import pytest

from megatron_xdistill.storage import (
    atomic_directory,
    atomic_file,
    write_json_atomic,
    write_text_atomic,
)


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_file_replaced_whole_and_failed_write_keeps_the_old(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_json_atomic(path, {"v": 1}, indent=1)
    assert json.loads(path.read_text()) == {"v": 1}
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        tmp.write_text('{"v": 2, "trunc')
        raise RuntimeError("writer failed")
    assert json.loads(path.read_text()) == {"v": 1}
    assert _leftovers(path.parent) == []
    write_text_atomic(path, "two")
    assert path.read_text() == "two" and _leftovers(path.parent) == []


def _killed_mid_write(path: str) -> None:
    with atomic_file(path) as tmp, open(tmp, "w") as handle:
        handle.write("half of the new")
        handle.flush()
        os._exit(9)  # killed: no cleanup runs


def test_writer_killed_mid_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "plan.npz"
    path.write_text("old")
    child = mp.get_context("fork").Process(target=_killed_mid_write, args=(str(path),))
    child.start()
    child.join(60)
    assert child.exitcode == 9
    assert path.read_text() == "old"
    # Only a hidden temporary stays behind, never under the destination's name.
    assert all(name.endswith(".tmp") for name in _leftovers(tmp_path))


def test_directory_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "model"
    with atomic_directory(out) as staging:
        (staging / "config.json").write_text("{}")
        assert not out.exists()
    assert (out / "config.json").read_text() == "{}"
    with pytest.raises(FileExistsError):
        with atomic_directory(out):
            pass
    with pytest.raises(ValueError), atomic_directory(out, replace=True) as staging:
        (staging / "config.json").write_text("new")
        raise ValueError("conversion failed")
    assert (out / "config.json").read_text() == "{}" and _leftovers(tmp_path) == []
    with atomic_directory(out, replace=True) as staging:
        (staging / "weights").write_text("w")
    assert sorted(p.name for p in out.iterdir()) == ["weights"] and _leftovers(tmp_path) == []
