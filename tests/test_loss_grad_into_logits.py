"""``parallel_kd_loss(..., grad_into_logits=True)``: the backward writes the logits' gradient
over the logits (as Megatron's vocab-parallel CE does), so no [B, T, V] gradient is allocated.

Against the float64 reference (``reference.kd_loss``, torch's ``cross_entropy``) for the forms
that have one (exact P-KL, gold, H-KL, CE), over several blocks, a padded vocabulary, T != 1
(CE's second softmax reads the logits after the block's gradient: a workspace then) and both
CPU paths (logits only; the softmax buffer a GPU takes, forced here); the top-k forms against
the default call's gradient. The gradient is the logits' own storage, and a second autograd
user of the logits fails loudly instead of reading a gradient as logits.
"""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.loss import parallel_kd_loss
from megatron_xdistill.loss.definitions.common import common_vocab_from_dense, predicting_chunk_id
from megatron_xdistill.loss.kernels.gold import GoldKernel
from megatron_xdistill.loss.student.kernel_choice import NoKernel
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.synthetic_kd import make_case


def _case():
    return make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=6, realistic=True)


def _payload(case, mode: str, form: str, temperature: float):
    """(payload, common student ids) of a configuration; (None, None) for CE alone."""
    if mode == "ce":
        return None, None
    common = (None, None) if mode == "pkl" else common_vocab_from_dense(case.projection, mode)
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, topk=16,
                        num_common=None if common[0] is None else common[0].numel())
    payload = teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, temperature=temperature,
                              common_teacher_ids=common[1])
    return payload, common[0]


def _grad(case, mode: str, form: str, temperature: float, with_ce: bool, into: bool,
          dtype=torch.float32, padded: bool = True):
    """(loss, gradient, whether the gradient is the logits' own storage)."""
    payload, common = _payload(case, mode, form, temperature)
    width = case.student_logits.shape[-1] if padded else case.vs
    # a copy: the call writes its gradient over these logits
    logits = case.student_logits[..., :width].to(dtype).clone().requires_grad_(True)
    terms = parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(width), student_vocab_size=case.vs,
        mode="pkl" if mode == "ce" else mode, temperature=temperature,
        common_student_ids=common, labels=case.labels if with_ce else None,
        block_bytes=4 * width * 7, grad_into_logits=into)  # several blocks
    loss = terms.ce_sum / terms.ce_count if with_ce else torch.zeros(())
    if payload is not None:
        loss = loss + terms.kd_sum / terms.kd_count
    loss.backward()
    grad = logits.grad
    return loss.item(), grad, grad.data_ptr() == logits.data_ptr()


def _force_softmax_buffer(monkeypatch) -> None:
    """The GPU's blocks on CPU: a softmax buffer for gold and CE (P-KL has it anyway)."""
    for kernel in (GoldKernel, NoKernel):
        monkeypatch.setattr(kernel, "needs_softmax", staticmethod(lambda like: True))


def _assert_reference(case, loss: float, grad: torch.Tensor, ref: float,
                      ref_grad: torch.Tensor) -> None:
    """fp32: loss rel 1e-5 and gradient 1e-5 of its largest entry against float64, zeros on
    the padded columns."""
    assert loss == pytest.approx(ref, rel=1e-5)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad[..., : case.vs].double(), ref_grad, rtol=1e-5,
                               atol=1e-5 * scale)
    assert torch.count_nonzero(grad[..., case.vs:]) == 0


EXACT = [("pkl", "full", 1.0, True), ("pkl", "full", 2.0, False), ("gold", "gold", 1.0, True),
         ("gold", "gold", 1.5, True), ("hkl", "gold", 1.0, False), ("ce", None, 1.0, True),
         ("ce", None, 2.0, True)]


@pytest.mark.parametrize("mode,form,temperature,with_ce", EXACT,
                         ids=[f"{m}-{f}-T{t}{'-ce' if c else ''}" for m, f, t, c in EXACT])
@pytest.mark.parametrize("path", ["logits", "softmax"])
def test_gradient_over_the_logits_matches_reference(monkeypatch, mode, form, temperature,
                                                    with_ce, path):
    """fp32: loss rel 1e-5 and gradient 1e-5 of its largest entry against float64, zeros on
    the padded columns, written into the logits' storage."""
    if path == "softmax":
        _force_softmax_buffer(monkeypatch)
    case = _case()
    loss, grad, shared = _grad(case, mode, form, temperature, with_ce, into=True)
    ref, ref_grad = case.reference_loss(mode, temperature, with_ce)
    assert shared
    _assert_reference(case, loss, grad, ref, ref_grad)


@pytest.mark.parametrize("form", ["topk", "chunk_topk"])
@pytest.mark.parametrize("with_ce", [False, True], ids=["kd", "kd-ce"])
def test_topk_forms_over_the_logits_equal_the_default_call(form, with_ce):
    """The top-k forms (no dense reference) give the default call's loss and gradient."""
    case = _case()
    loss, grad, shared = _grad(case, "pkl", form, 1.0, with_ce, into=True)
    loss0, grad0, shared0 = _grad(case, "pkl", form, 1.0, with_ce, into=False)
    assert shared and not shared0
    assert loss == loss0
    torch.testing.assert_close(grad, grad0, rtol=1e-6, atol=1e-7)


def test_bf16_logits_take_their_gradient_in_place():
    """bf16 logits (an fp32 workspace per block, then rounded into the logits): the float64
    reference on the same rounded logits, to bf16's resolution."""
    case = _case()
    loss, grad, shared = _grad(case, "gold", "gold", 1.0, True, into=True,
                               dtype=torch.bfloat16, padded=False)
    ref, ref_grad = case.reference_loss("gold", 1.0, True, rounded_to=torch.bfloat16)
    assert shared and grad.dtype == torch.bfloat16
    assert loss == pytest.approx(ref, rel=1e-5)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad.double(), ref_grad, rtol=8e-3, atol=8e-3 * scale)


@pytest.mark.parametrize("other", ["second-loss", "saving-op"])
def test_another_user_of_the_logits_raises(other):
    """Logits another autograd node saved (a second loss call, or an op like a square) are
    not read back as gradients: that node's backward raises PyTorch's in-place error."""
    case = _case()
    payload, common = _payload(case, "gold", "gold", 1.0)
    # unpadded, one block, no labels: no torch op of the backward writes the logits (Numba's
    # writes are not in-place ops to autograd); the call marks them modified itself
    logits = case.student_logits[..., : case.vs].float().clone().requires_grad_(True)

    def call(into: bool):
        return parallel_kd_loss(
            logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
            case.chunk_exact, case.projection_rows(logits.shape[-1]),
            student_vocab_size=case.vs, mode="gold", common_student_ids=common,
            block_bytes=1 << 30, grad_into_logits=into)  # one block (it has chunk rows)

    # Made first, so its backward runs after the in-place call's (autograd runs later nodes
    # first; one made after the call would read the logits before they are overwritten).
    earlier = call(False).kd_sum if other == "second-loss" else (logits * logits).sum()
    in_place = call(True).kd_sum
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (in_place + 1e-3 * earlier).backward()


def test_first_of_two_calls_writes_over_the_logits():
    """Two losses on the same logits (several teachers: gold, then H-KL with CE): the first
    made, whose backward autograd runs last, writes over them (no buffer of its own; autograd
    adds it into the other call's); the summed gradient is the sum of the float64 references."""
    case = _case()
    logits = case.student_logits.float().clone().requires_grad_(True)
    total = torch.zeros(())
    for mode, into, with_ce in (("gold", True, False), ("hkl", False, True)):
        payload, common = _payload(case, mode, "gold", 1.0)
        terms = parallel_kd_loss(
            logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
            case.chunk_exact, case.projection_rows(logits.shape[-1]),
            student_vocab_size=case.vs, mode=mode, common_student_ids=common,
            labels=case.labels if with_ce else None, block_bytes=4 * logits.shape[-1] * 7,
            grad_into_logits=into)
        total = total + terms.kd_sum / terms.kd_count
        if with_ce:
            total = total + terms.ce_sum / terms.ce_count
    total.backward()
    ref_gold, grad_gold = case.reference_loss("gold")
    ref_hkl, grad_hkl = case.reference_loss("hkl", with_ce=True)
    assert total.item() == pytest.approx(ref_gold + ref_hkl, rel=1e-5)
    ref_grad = grad_gold + grad_hkl
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(logits.grad[..., : case.vs].double(), ref_grad, rtol=1e-5,
                               atol=1e-5 * scale)
