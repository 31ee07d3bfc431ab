"""The loss's CPU path for kernels that read only the logits and log-partitions (gold / H-KL,
CE alone; ``loss/cpu/rows.py``): no softmax buffer, the forward's log-partitions by one
exp-and-sum pass, the backward's gradient written from the logits.

Against the float64 reference (CE: torch's ``cross_entropy``; gold / H-KL:
``reference.kd_loss``) to fp32's tolerance, at T = 1 and T != 1 (CE's own partition), over a
padded vocabulary and several blocks; and the softmax path that a GPU takes (forced here on
CPU) gives the same numbers, so both stay tested on machines without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.loss import parallel_kd_loss
from megatron_xdistill.loss.cpu import rows as cpu_rows
from megatron_xdistill.loss.definitions.common import common_vocab_from_dense, predicting_chunk_id
from megatron_xdistill.loss.kernels.gold import GoldKernel
from megatron_xdistill.loss.student.kernel_choice import NoKernel
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.synthetic_kd import make_case


@pytest.fixture
def spread_calls(monkeypatch):
    """Counts the logits-only backward's passes (so a test knows which path ran)."""
    calls: list[int] = []
    spread = cpu_rows.exp_spread_

    def counted(out, *args, **kwargs):
        calls.append(out.shape[0])
        return spread(out, *args, **kwargs)

    monkeypatch.setattr(cpu_rows, "exp_spread_", counted)
    return calls


def _softmax_path(monkeypatch) -> None:
    """The GPU's path on CPU: every block's softmax in a buffer."""
    for kernel in (GoldKernel, NoKernel):
        monkeypatch.setattr(kernel, "needs_softmax", staticmethod(lambda like: True))


def _loss_and_grad(case, mode, temperature, padded: bool, with_ce: bool):
    common = None if mode == "ce" else common_vocab_from_dense(case.projection, mode)
    payload = None
    if common is not None:
        spec = payload_spec("gold", case.chunk_valid.shape[1], case.vt,
                            num_common=common[0].numel())
        payload = teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                                  spec, vocab_size=case.vt, temperature=temperature,
                                  common_teacher_ids=common[1])
    width = case.student_logits.shape[-1] if padded else case.vs
    logits = case.student_logits[..., :width].float().requires_grad_(True)
    terms = parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(width), student_vocab_size=case.vs,
        mode="pkl" if common is None else mode, temperature=temperature,
        common_student_ids=None if common is None else common[0],
        labels=case.labels if with_ce else None, block_bytes=4 * width * 7)  # several blocks
    loss = terms.ce_sum / terms.ce_count if with_ce else torch.zeros(())
    if payload is not None:
        loss = loss + terms.kd_sum / terms.kd_count
    loss.backward()
    return loss.item(), logits.grad.double()


CASES = [("gold", 1.0, True), ("gold", 1.5, True), ("hkl", 1.0, False), ("ce", 1.0, True),
         ("ce", 2.0, True)]


@pytest.mark.parametrize("mode,temperature,with_ce", CASES,
                         ids=[f"{m}-T{t}{'-ce' if c else ''}" for m, t, c in CASES])
@pytest.mark.parametrize("padded", [False, True], ids=["exact-width", "padded"])
@pytest.mark.parametrize("path", ["logits", "softmax"])
def test_cpu_logits_path_matches_reference(monkeypatch, spread_calls, mode, temperature,
                                           with_ce, padded, path):
    """fp32: loss rel 1e-5 and gradient 1e-5 of its largest entry against float64; zero
    gradient on padded columns; the logits path wrote the blocks from the logits."""
    if path == "softmax":
        _softmax_path(monkeypatch)
    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=4, realistic=True)
    loss, grad = _loss_and_grad(case, mode, temperature, padded, with_ce)
    ref, ref_grad = case.reference_loss(mode, temperature, with_ce)
    assert loss == pytest.approx(ref, rel=1e-5)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad[..., : case.vs], ref_grad, rtol=1e-5, atol=1e-5 * scale)
    assert torch.count_nonzero(grad[..., case.vs:]) == 0
    if path == "softmax":
        assert spread_calls == []
    else:  # several blocks written by exp_spread_: all of them with CE (without, the blocks
        # of no chunk row are zeros)
        assert len(spread_calls) > 1
        assert sum(spread_calls) == 120 if with_ce else 0 < sum(spread_calls) <= 120


def test_cpu_logits_path_on_bf16_logits():
    """bf16 logits (computed in an fp32 copy of each block): the float64 reference on the same
    rounded logits, to bf16's resolution of the gradient."""
    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, seed=5, realistic=True)
    common = common_vocab_from_dense(case.projection, "gold")
    spec = payload_spec("gold", case.chunk_valid.shape[1], case.vt, num_common=common[0].numel())
    payload = teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, common_teacher_ids=common[1])
    logits = case.student_logits[..., : case.vs].bfloat16().requires_grad_(True)
    terms = parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(case.vs), student_vocab_size=case.vs,
        mode="gold", common_student_ids=common[0], labels=case.labels)
    loss = terms.kd_sum / terms.kd_count + terms.ce_sum / terms.ce_count
    loss.backward()
    ref, ref_grad = case.reference_loss("gold", 1.0, True, rounded_to=torch.bfloat16)
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert logits.grad.dtype == torch.bfloat16
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=8e-3, atol=8e-3 * scale)
