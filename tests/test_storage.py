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


@pytest.fixture
def umask():
    """Set the process umask for one test (restored after)."""
    old = os.umask(0o022)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize("mask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_follow_the_umask(tmp_path, umask, mask, mode):
    """Files are created as open() creates them (0666 less the umask), also those a library
    writes with a mode of its own (safetensors: 0600): a projection file, every atomic helper's
    file, and the files of an atomic directory (an HF export, a checkpoint)."""
    import torch
    from safetensors.torch import save_file

    from megatron_xdistill.projection.fileio import write_projection_file

    umask(mask)
    write_projection_file(tmp_path / "proj.safetensors",
                          {"indices": torch.zeros(4, 2, dtype=torch.int32),
                           "weights": torch.ones(4, 2)}, {"student_vocab_size": "4"})
    write_text_atomic(tmp_path / "tracker.txt", "release")
    write_json_atomic(tmp_path / "info.json", {"v": 1})
    with atomic_file(tmp_path / "shard.arrow") as tmp, open(tmp, "wb") as handle:
        handle.write(b"payload")
    with atomic_file(tmp_path / "lib.safetensors") as tmp:
        save_file({"a": torch.zeros(2)}, str(tmp))
    with atomic_directory(tmp_path / "hf") as staging:
        save_file({"a": torch.zeros(2)}, str(staging / "model.safetensors"))
        (staging / "sub").mkdir()
        save_file({"a": torch.zeros(2)}, str(staging / "sub" / "part.safetensors"))
        (staging / "config.json").write_text("{}")
    files = ["proj.safetensors", "tracker.txt", "info.json", "shard.arrow", "lib.safetensors",
             "hf/model.safetensors", "hf/sub/part.safetensors", "hf/config.json"]
    got = {name: oct((tmp_path / name).stat().st_mode & 0o777) for name in files}
    assert got == {name: oct(mode) for name in files}
    assert (tmp_path / "hf" / "sub").stat().st_mode & 0o777 == 0o777 & ~mask
