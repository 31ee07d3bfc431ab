"""The demo's commands point at this checkout's entry point (the demo helpers moved into
megatron_xdistill/demo/; a wrong root made `make demo` fail)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_xdistill.demo import workflow


def test_the_pretrain_entry_point_is_this_checkouts():
    checkout = Path(__file__).resolve().parents[1]
    assert workflow.ENTRY == checkout / "pretrain_xdistill.py"
    assert workflow.ENTRY.is_file()


def test_a_second_demo_run_says_which_run_it_replaces(tmp_path):
    """The demo starts each run afresh in its run folder: a second run names the first run's
    output it replaces (and the option that keeps it) before it starts; a first run says
    nothing; a folder that holds anything else is refused, never deleted."""
    from megatron_xdistill.demo.quickstart import replaced_run

    run = tmp_path / "runs" / "demo" / "run"
    assert replaced_run(run) is None  # first run: nothing to replace
    run.mkdir(parents=True)
    assert replaced_run(run) is None  # an empty folder holds no run
    (run / "ckpt" / "iter_0000020").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"iteration": 1}\n')
    assert replaced_run(run) == (f"replacing the previous demo run in {run} (its checkpoint and "
                                 "metrics); pass --run-dir DIR to keep it")
    (run / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"notes.txt.*not a demo run's.*--run-dir"):
        replaced_run(run)
    assert (run / "notes.txt").exists()


def test_the_demo_takes_a_run_folder(tmp_path):
    from megatron_xdistill.demo.quickstart import build_parser

    args = build_parser().parse_args(["--work-dir", str(tmp_path), "--run-dir", "runs/keep"])
    assert args.run_dir == "runs/keep"
    assert build_parser().parse_args(["--work-dir", str(tmp_path)]).run_dir is None
