"""The demo's commands point at this checkout's entry point (the demo helpers moved into
megatron_xdistill/demo/; a wrong root made `make demo` fail)."""

from __future__ import annotations

from pathlib import Path

from megatron_xdistill.demo import workflow


def test_the_pretrain_entry_point_is_this_checkouts():
    checkout = Path(__file__).resolve().parents[1]
    assert workflow.ENTRY == checkout / "pretrain_xdistill.py"
    assert workflow.ENTRY.is_file()
