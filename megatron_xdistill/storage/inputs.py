"""Input paths refused as missing before their contents are read: a reader that looks inside a
folder that is not there would call it something else ("not a checkpoint", "no config.json")."""

from __future__ import annotations

import os


def require_directory(path: str | os.PathLike, flag: str | None = None) -> None:
    """Refuse ``path`` (the value of option ``flag``) unless it is an existing directory:
    ``FileNotFoundError`` "no such directory: PATH", or ``NotADirectoryError`` for a file."""
    if os.path.isdir(path):
        return
    where = f"{flag}: " if flag else ""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{where}no such directory: {os.fspath(path)}")
    raise NotADirectoryError(f"{where}{os.fspath(path)} is a file, not a directory")


def require_file(path: str | os.PathLike, flag: str | None = None) -> None:
    """Refuse ``path`` (the value of option ``flag``) unless it exists: ``FileNotFoundError``
    "no such file: PATH"."""
    if not os.path.exists(path):
        where = f"{flag}: " if flag else ""
        raise FileNotFoundError(f"{where}no such file: {os.fspath(path)}")
