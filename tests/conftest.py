"""Shared test configuration.

Device: a session that selects ``gpu``-marked tests (``-m gpu``, ``make test-gpu``) runs on the
GPU; any other session (``make test``) is the CPU suite and hides CUDA from itself and every rank
it starts (``CUDA_VISIBLE_DEVICES=""``), so it computes exactly what it computes on a machine
without a GPU (gloo ranks, CPU numerics and tolerances), wherever it runs. Its gpu-marked tests
are skipped with a reason that names ``make test-gpu``; the loss's Triton kernels run there under
Triton's interpreter (``TRITON_INTERPRET=1``).

The end-to-end setup (tiny converted models, projection, text) and its single-rank reference
losses are built once per session for every module that trains (test_e2e, test_disaggregated).
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from scratch import scratch_dir
from shared_assets import ASSETS, SKIP_REASON, have_shared_assets

_GPU_SESSION = False


def selects_gpu_tests(markexpr: str) -> bool:
    """True when a ``-m`` expression asks for gpu-marked tests (``gpu``, ``gpu and not slow``),
    not when it only excludes them (``not gpu``) or does not name them (``not slow``)."""
    return re.search(r"(?<!not )\bgpu\b", markexpr or "") is not None


def pytest_configure(config) -> None:
    global _GPU_SESSION
    _GPU_SESSION = selects_gpu_tests(config.option.markexpr)
    if not _GPU_SESSION:
        # Before anything initialises CUDA here; the ranks and subprocesses inherit it.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        # The loss's Triton kernels run on CPU tensors through Triton's interpreter (set before
        # anything imports Triton; the ranks inherit it): the fused-kernel tests run here too.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    # Megatron-Core adapted to this machine, as pretrain_xdistill.py does at start-up (after
    # CUDA_VISIBLE_DEVICES: on a CPU session its CPU adaptations apply).
    from megatron_xdistill.mcore import compat as mcore_compat

    mcore_compat.install()


def pytest_report_header(config) -> list[str]:
    if _GPU_SESSION:
        lines = [f"xdistill: GPU session (CUDA available: {torch.cuda.is_available()})"]
    else:
        lines = ["xdistill: CPU session, CUDA hidden (CUDA_VISIBLE_DEVICES=''); the gpu-marked "
                 "tests run with `make test-gpu` (pytest -m gpu)"]
    if have_shared_assets():
        lines.append(f"xdistill: shared assets at {ASSETS}")
    else:
        lines.append(f"xdistill: {SKIP_REASON}: every test that needs them is SKIPPED "
                     "(count in the summary)")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Say how many tests the missing shared assets skipped: never a silent pass on fewer."""
    skipped = terminalreporter.stats.get("skipped", [])
    count = sum(1 for report in skipped if "shared assets not found" in str(report.longrepr))
    if count:
        terminalreporter.write_line(f"xdistill: {count} tests SKIPPED: {SKIP_REASON}",
                                    yellow=True, bold=True)


def pytest_collection_modifyitems(config, items) -> None:
    if _GPU_SESSION and torch.cuda.is_available():
        return
    reason = ("needs a CUDA GPU" if _GPU_SESSION else
              "gpu test in the CPU session: run `make test-gpu` (pytest -m gpu) on a GPU machine")
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_setup(request, tmp_path_factory):
    """``(root, student tokenizer, teacher tokenizer)`` of test_e2e.make_setup."""
    from test_e2e import make_setup

    if not have_shared_assets():
        pytest.skip(SKIP_REASON)
    return make_setup(scratch_dir(request, tmp_path_factory, "e2e"))


@pytest.fixture(scope="session")
def e2e_reference(e2e_setup):
    """The single-rank colocated run's first (kd, ce) losses."""
    from test_e2e import reference_losses

    return reference_losses(*e2e_setup)


@pytest.fixture(scope="module")
def e2e_pool():
    """test_e2e.WORLD ranks, started once per module that runs trainings."""
    from test_e2e import WORLD

    from megatron_xdistill.testing.multirank import RankPool

    with RankPool(WORLD) as ranks:
        yield ranks


@pytest.fixture
def base(tmp_path):
    """A complete, valid ``pretrain_xdistill.py`` command line over empty stand-in folders: what
    argument tests change one flag of (nothing is loaded by parsing and validating it)."""
    for name in ("student", "teacher", "s_tok", "t_tok"):
        (tmp_path / name).mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    return [
        "--load", str(tmp_path / "student"), "--teacher-load", str(tmp_path / "teacher"),
        "--tokenizer-model", str(tmp_path / "s_tok"),
        "--teacher-tokenizer-model", str(tmp_path / "t_tok"),
        "--data-path", str(data), "--seq-length", "64", "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-4",
    ]
