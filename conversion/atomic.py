"""Output directories that appear only when complete: write into ``<dir>.tmp``, then rename."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager


def check_output_dir(path: str, overwrite: bool) -> None:
    """Refuse to replace an existing output unless asked (checked before any long work)."""
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} exists; pass --overwrite to replace it")


@contextmanager
def atomic_output_dir(path: str, overwrite: bool = False) -> Iterator[str]:
    """Yield a temporary directory that becomes ``path`` when the block succeeds.

    On an exception the temporary directory is removed; a killed process leaves only
    ``<path>.tmp``, never ``path``. An existing ``path`` is replaced only with ``overwrite``.
    """
    path = os.path.abspath(path)
    check_output_dir(path, overwrite)
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = path + ".old"
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
