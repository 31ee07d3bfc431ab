"""Scratch directories for module- and session-scoped fixtures that go away with the fixture.

pytest removes a passed test's ``tmp_path`` at once (``tmp_path_retention_policy = "failed"``
in pyproject.toml) but keeps ``tmp_path_factory`` directories until the session ends; the
suite's converted models, checkpoints and caches would pile up to gigabytes on the CI disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def scratch_dir(request: pytest.FixtureRequest, factory: pytest.TempPathFactory,
                name: str) -> Path:
    """A new directory removed when the requesting fixture is torn down, unless a test failed
    while it lived (then it stays for a look, as pytest keeps a failed test's ``tmp_path``)."""
    path = factory.mktemp(name)
    failed_before = request.session.testsfailed

    def remove() -> None:
        if request.session.testsfailed == failed_before:
            shutil.rmtree(path, ignore_errors=True)

    request.addfinalizer(remove)
    return path
