"""The teacher runs only the positions its micro-batch's text needs (parallel.teacher_batches).

The rule against hand counts; the teacher's forward against it (what the schedule is given);
the run's fill metric and losses are covered end to end in test_e2e.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_xdistill.parallel.shape import ParallelLayout
from megatron_xdistill.parallel.teacher_batches import TeacherBatching, positions_needed


def test_a_width_is_the_longest_need_rounded_up_and_capped():
    batching = TeacherBatching(8, 2, 2, seq_length=48, multiple=4)
    # 10 real tokens: 9 predictions -> 12 (multiple of 4)
    assert batching.width([10, 3]) == 12
    assert batching.width([13, 2]) == 12 and batching.width([14]) == 16
    assert batching.width([1]) == 4 and batching.width([0]) == 4  # at least one position
    assert batching.width([49, 20]) == 48 and batching.width([200]) == 48  # the cap
    assert positions_needed(10) == 9 and positions_needed(0) == 1


def test_micro_batches_and_widths_per_replica():
    lengths = [5, 9, 3, 4, 30, 2, 7, 7]
    batching = TeacherBatching(8, 2, 2, seq_length=32)
    assert batching.microbatches(0) == [[0, 1], [2, 3]]
    assert batching.microbatches(1) == [[4, 5], [6, 7]]
    assert batching.widths(0, lengths) == [8, 3]
    assert batching.widths(1, lengths) == [29, 6]
    # every sample at its micro-batch's width: 2 x (8 + 3 + 29 + 6)
    assert batching.positions_run(lengths) == 92
    # what the forwards need to run: each sample's next-token predictions (fill = 66 / 92)
    assert batching.positions_predicting(lengths) == 4 + 8 + 2 + 3 + 29 + 1 + 6 + 6
    assert batching.positions_predicting([0, 1]) == 0  # an empty sample predicts nothing
    # a pipeline sends one shape per schedule call: the block's longest sets it
    piped = TeacherBatching(8, 2, 2, seq_length=32, pipelined=True)
    assert piped.widths(0, lengths) == [8, 8] and piped.widths(1, lengths) == [29, 29]
    assert piped.positions_run(lengths) == 4 * 8 + 4 * 29
    # the widths of a replica read only its own samples (a dict of them will do)
    assert batching.widths(1, {4: 30, 5: 2, 6: 7, 7: 7}) == [29, 6]


def test_layout_multiples():
    assert ParallelLayout(tp=2, cp=1).sequence_multiple(False) == 1
    assert ParallelLayout(tp=2, cp=1).sequence_multiple(True) == 2
    assert ParallelLayout(tp=2, cp=2).sequence_multiple(False) == 4
    assert ParallelLayout(tp=2, cp=2).sequence_multiple(True) == 8


def test_bad_batchings_are_refused():
    with pytest.raises(ValueError, match="does not divide the replica block"):
        TeacherBatching(8, 2, 3, seq_length=32)
    with pytest.raises(ValueError, match="not a multiple of 4"):
        TeacherBatching(8, 2, 2, seq_length=30, multiple=4)


def _sample(n_teacher: int, width: int) -> dict:
    from megatron_xdistill.data.dataset import _identity_chunks

    tokens = np.zeros(width + 1, np.int64)
    tokens[:n_teacher] = np.arange(1, n_teacher + 1)
    return {"tokens": tokens, "student_length": n_teacher,
            "loss_mask": np.ones(width, np.float32), "num_bytes": n_teacher,
            "teachers": [{"teacher_tokens": tokens.copy(), "teacher_length": n_teacher,
                          "chunks": _identity_chunks(n_teacher)}]}


@pytest.mark.parametrize("pp", [1, 2])
def test_the_forward_is_given_each_micro_batch_cut_to_its_width(monkeypatch, pp):
    """The schedule runs each micro-batch with tokens of its width + 1 (and chunk ids to
    match), and the payloads come back by sample, whatever the width."""
    from megatron_xdistill.training import teacher_side
    from megatron_xdistill.training.side_config import TeacherSideConfig

    lengths = [5, 9, 3, 4, 30, 2, 7, 7]
    samples = {i: _sample(n, 32) for i, n in enumerate(lengths)}
    groups = SimpleNamespace(layout=ParallelLayout(pp=pp, dp=2), coords={"dp": 1})
    config = TeacherSideConfig(load=None, seed=1, seq_length=32, global_batch_size=8,
                               micro_batch_size=2)
    side = teacher_side.TeacherSide(config, None, groups, runs=False, device="cpu",
                                    dtype=torch.float32)
    side.model = object()
    seen = []

    def schedule(model, cfg, grp, microbatches, *, tokens, loss_func, seq_length, **_):
        for mb in microbatches:
            inputs = tokens(mb)[:, :-1]
            seen.append((inputs.shape[1], mb["teacher_chunk_id"].shape[1], seq_length))
            loss_func(mb, torch.zeros(inputs.shape[0], inputs.shape[1], 4))

    class Payloads:  # each sample's row: its first token id and the logits' width
        @staticmethod
        def teacher_payload(logits, batch):
            return torch.stack([batch["teacher_tokens"][:, 1].float(),
                                torch.full((logits.shape[0],), float(logits.shape[1]))], 1)

    monkeypatch.setattr(teacher_side, "run_schedule", schedule)
    payloads = side.forward(samples, Payloads())
    want = [29, 6] if pp == 1 else [29, 29]
    assert seen == [(w, w + 1, max(want)) for w in want]
    assert sorted(payloads) == [4, 5, 6, 7]
    for i, w in zip([4, 5, 6, 7], [want[0], want[0], want[1], want[1]], strict=True):
        assert payloads[i].tolist() == [2.0, float(w)]
