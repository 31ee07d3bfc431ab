"""Where the loss's bookkeeping lives, and which device a test session uses.

The loss indexes the logits with its chunk rows and projection shard; CUDA refuses indices on
another device, so both move to the logits' device whole (``.to``). On CPU the moves are checked
with the ``meta`` device (every tensor moves, nothing stays behind); tests/test_gpu.py runs the
loss on CUDA against the float64 reference.
"""

from __future__ import annotations

import pytest
import torch
from conftest import selects_gpu_tests

from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows, build_chunk_rows
from megatron_xdistill.loss.blocks.shard import ProjectionShard


def _tensors(obj) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(obj).items() if isinstance(v, torch.Tensor)}


def test_chunk_rows_move_every_tensor():
    ids = torch.tensor([[0, 0, 1, 2, -1, 3], [0, 1, 1, -1, 2, 2]])
    rows = build_chunk_rows(ids, 4, None, None, 4)
    moved = rows.to(torch.device("meta"))
    assert isinstance(moved, ChunkRows)
    tensors = _tensors(moved)
    assert set(tensors) == set(_tensors(rows)) and len(tensors) >= 8
    assert {t.device.type for t in tensors.values()} == {"meta"}
    assert moved.blocks == rows.blocks and moved.num_chunks == rows.num_chunks
    assert all(t.device.type == "cpu" for t in _tensors(rows).values())  # a copy, not in place


@pytest.mark.gpu
def test_projection_shard_and_rows_on_cuda():
    idx = torch.tensor([[0, 2], [1, -1], [2, 3]])
    shard = ProjectionShard(idx, torch.rand(3, 2) + 0.1, 0, 5).to(torch.device("cuda", 0))
    assert {t.device.type for t in _tensors(shard).values()} == {"cuda"}
    rows = build_chunk_rows(torch.tensor([[0, 1, 1, 2]]), 3, None, None, 2).to("cuda")
    assert {t.device.type for t in _tensors(rows).values()} == {"cuda"}


@pytest.mark.parametrize("expr,gpu", [("gpu", True), ("gpu and not slow", True),
                                      ("not slow", False), ("not gpu", False), ("", False),
                                      ("slow or gpu", True), ("not slow and not gpu", False)])
def test_which_sessions_keep_cuda(expr, gpu):
    assert selects_gpu_tests(expr) is gpu
