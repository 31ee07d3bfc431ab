"""Atomic writes: a reader sees the old file (or none) or the whole new one, never a part.

Everything is written under a temporary name beside its destination (same folder, so the final
``os.replace`` is a rename on one file system), flushed to disk, then renamed. A write that fails
or is interrupted removes its temporary; one killed outright leaves only a hidden ``*.tmp`` that
the next write of the same destination does not mistake for data.

What is committed gets the mode ``open()`` and ``mkdir`` give under the process umask, whoever
wrote it: some writers create their files 0600 whatever the umask (safetensors' ``save_file``),
which would hide a projection or a model from the other users of a shared machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def process_umask() -> int:
    """The process umask: read from /proc where Linux shows it (setting it to read it would race
    with other threads creating files), else set and restored."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike) -> None:
    """Give ``path`` (a file, or a folder and everything under it; links are left alone) the
    permissions ``open()`` / ``mkdir`` give under the process umask: 0666 (0777 for folders and
    files with an execute bit) less the umask. Setgid and sticky bits are kept; an entry that
    cannot be changed (another user's) keeps its mode."""
    mask = process_umask()

    def fix(entry: str, folder: bool) -> None:
        st = os.lstat(entry)
        if stat.S_ISLNK(st.st_mode):
            return
        want = (0o777 if folder or st.st_mode & 0o111 else 0o666) & ~mask
        if st.st_mode & 0o777 != want:
            with contextlib.suppress(PermissionError):
                os.chmod(entry, stat.S_IMODE(st.st_mode) & ~0o777 | want)

    path = os.fspath(path)
    if not os.path.isdir(path) or os.path.islink(path):
        fix(path, False)
        return
    fix(path, True)
    for folder, dirs, files in os.walk(path):
        for name in dirs:
            fix(os.path.join(folder, name), True)
        for name in files:
            fix(os.path.join(folder, name), False)


def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write (by any library) in the block; when the
    block completes it is synced and renamed onto ``path`` with the mode the umask gives (see
    :func:`follow_umask`); on an error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    try:
        yield tmp
        follow_umask(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """``path`` holds ``text`` (UTF-8), written atomically."""
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, data: Any, **dump_options: Any) -> None:
    """``path`` holds ``data`` as JSON (``json.dump`` options, e.g. ``indent``), atomically,
    with a final newline."""
    with atomic_file(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, **dump_options)
        handle.write("\n")


def refuse_existing(path: str | os.PathLike, replace: bool) -> None:
    """Refuse to replace an existing ``path`` unless asked (check it before long work)."""
    if os.path.exists(path) and not replace:
        raise FileExistsError(f"{path} exists; pass --overwrite to replace it")


def swap_in_directory(staging: str | os.PathLike, path: str | os.PathLike) -> None:
    """Rename a complete ``staging`` folder onto ``path``; an existing ``path`` is moved aside
    first and deleted after the rename, so a crash leaves one of the two whole. What it holds
    gets the modes the umask gives (:func:`follow_umask`)."""
    follow_umask(staging)
    path = Path(path)
    old = path.parent / f".{path.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(staging, path)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty staging folder beside ``path`` to fill in the block; when it completes the
    folder becomes ``path``, on an error it is removed. An existing ``path`` is kept unless
    ``replace`` (then it is moved aside first and deleted after the rename).

    One writer per destination: the staging folder ``.<name>.tmp`` left by a killed writer (it
    can be large: model weights) is removed by the next write. A folder written by several ranks
    is committed by the checkpoint code, after they agree."""
    path = Path(path).absolute()
    refuse_existing(path, replace)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.parent / f".{path.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        swap_in_directory(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
