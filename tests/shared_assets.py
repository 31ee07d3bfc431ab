"""Where the tests find ``../shared/assets`` (real tokenizers and texts) and how they skip.

Tests that need real tokenizers or texts are marked ``needs_shared_assets``; without the folder
they are skipped with one reason naming it, and the session's header and summary say how many
(conftest), so a clone without ``../shared`` never passes silently on fewer tests.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ASSETS = Path(os.environ.get("XDISTILL_SHARED_ASSETS",
                             Path(__file__).resolve().parents[2] / "shared" / "assets"))
TOKENIZERS = ASSETS / "tokenizers"
SKIP_REASON = (f"shared assets not found at {ASSETS} (real tokenizers and texts; "
               "set XDISTILL_SHARED_ASSETS=DIR)")


def have_shared_assets() -> bool:
    return TOKENIZERS.is_dir() and (ASSETS / "corpora").is_dir()


needs_shared_assets = pytest.mark.skipif(not have_shared_assets(), reason=SKIP_REASON)
