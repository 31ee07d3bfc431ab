"""Shared test configuration: ``gpu``-marked tests are skipped on machines without CUDA; the
end-to-end setup (tiny converted models, projection, text) and its single-rank reference losses
are built once per session for every module that trains (test_e2e, test_disaggregated)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def e2e_setup(tmp_path_factory):
    """``(root, student tokenizer, teacher tokenizer)`` of test_e2e.make_setup."""
    from test_e2e import make_setup

    return make_setup(tmp_path_factory.mktemp("e2e"))


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
