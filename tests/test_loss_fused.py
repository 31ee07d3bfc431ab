"""The fused dense passes of the loss (``loss/gpu/row_softmax.py``: Triton) against the float64
reference: the column P-KL forms and CE, one block per call and blockwise (padded vocabulary,
bf16 logits), T = 1 and T != 1.

Runs on CUDA (marked ``gpu``: ``make test-gpu``), and on CPU tensors through Triton's interpreter
when the session is started with ``TRITON_INTERPRET=1`` where Triton is installed (it must be set
before anything imports Triton; the interpreter needs NumPy < 2.4):
``TRITON_INTERPRET=1 pytest tests/test_loss_fused.py``.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_xdistill.loss import parallel_kd_loss
from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.common import predicting_chunk_id
from megatron_xdistill.loss.gpu import row_softmax
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.synthetic_kd import make_case

_HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICES = [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("cpu", marks=pytest.mark.skipif(
        not _HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 with Triton installed")),
]


@pytest.fixture
def fused(monkeypatch):
    """The fused kernels forced on; yields the row counts of each forward partition pass."""
    calls: list[int] = []
    partition = row_softmax.row_partition

    def counted(x, *args, **kwargs):
        calls.append(x.shape[0])
        return partition(x, *args, **kwargs)

    monkeypatch.setattr(row_softmax, "FORCE", True)
    monkeypatch.setattr(row_softmax, "row_partition", counted)
    yield calls


def _loss_and_grad(case, dev, form, topk, temperature, dtype, padded: bool, blocks: int):
    spec = None if form == "ce" else payload_spec(form, case.chunk_valid.shape[1], case.vt,
                                                 topk=topk)
    payload = None if spec is None else teacher_payload(
        case.teacher_logits.to(dev), predicting_chunk_id(case.teacher_chunk_id), spec,
        vocab_size=case.vt, temperature=temperature)
    width = case.student_logits.shape[-1] if padded else case.vs
    logits = case.student_logits[..., :width].to(dev, dtype).requires_grad_(True)
    terms = parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(width), student_vocab_size=case.vs,
        temperature=temperature, labels=case.labels.to(dev),
        block_bytes=4 * width * max(1, 120 // blocks))
    loss = terms.ce_sum / terms.ce_count
    if payload is not None:
        loss = loss + terms.kd_sum / terms.kd_count
    loss.backward()
    return loss.item(), logits.grad.float().cpu().double(), logits


def _reference(case, form, topk, temperature, dtype):
    z = case.real_student_logits.detach().to(dtype).double().requires_grad_(True)
    mask = case.labels >= 0
    ref = torch.nn.functional.cross_entropy(z[mask], case.labels[mask])
    if form != "ce":
        kw = {"vocab_topk": topk} if form == "topk" else {"chunk_topk": topk}
        ref = ref + reference.kd_loss(z, case.real_teacher_logits.double(),
                                      case.student_chunk_id, case.teacher_chunk_id,
                                      case.chunk_valid, case.chunk_exact,
                                      case.projection.double(), "pkl", temperature, **kw)
    ref.backward()
    return ref.item(), z.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form,topk", [("topk", 12), ("chunk_topk", 6), ("ce", None)])
@pytest.mark.parametrize("temperature", [1.0, 1.5])
@pytest.mark.parametrize("padded,blocks", [(False, 1), (True, 3)],
                         ids=["one-block", "padded-blocks"])
def test_fused_loss_matches_reference(fused, device, form, topk, temperature, padded, blocks):
    """fp32: loss and gradient rel 1e-5 of the float64 reference; the call ran fused (one
    block when the gradient is written in place: fp32, no padded columns)."""
    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=4, realistic=True, normalised_rows=True)
    dev = torch.device(device)
    loss, grad, _ = _loss_and_grad(case, dev, form, topk, temperature, torch.float32, padded,
                                   blocks)
    ref, ref_grad = _reference(case, form, topk, temperature, torch.float32)
    assert loss == pytest.approx(ref, rel=1e-5)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad[..., : case.vs], ref_grad, rtol=1e-5, atol=1e-5 * scale)
    assert torch.count_nonzero(grad[..., case.vs:]) == 0
    passes = 2 if temperature != 1.0 else 1  # CE at T != 1 has a partition of its own
    if blocks == 1:
        assert fused == [120] * passes
    else:
        assert len(fused) > passes and sum(fused) == 120 * passes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form,topk", [("chunk_topk", 6), ("ce", None)])
def test_fused_loss_on_bf16_logits(fused, device, form, topk):
    """bf16 logits (read as they are, computed in fp32, the gradient written in place in bf16
    with one rounding per element): the reference on the same bf16-rounded logits, to bf16's
    resolution of the gradient."""
    case = make_case(batch=3, ts=40, tt=32, vs=300, vt=250, vs_padded=320, vt_padded=256,
                     seed=5, realistic=True, normalised_rows=True)
    loss, grad, logits = _loss_and_grad(case, torch.device(device), form, topk, 1.0,
                                        torch.bfloat16, False, 1)
    assert fused == [120]  # one fused block: the bf16 gradient is written in place
    assert logits.grad.dtype == torch.bfloat16
    ref, ref_grad = _reference(case, form, topk, 1.0, torch.bfloat16)
    assert loss == pytest.approx(ref, rel=1e-5)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad[..., : case.vs], ref_grad, rtol=8e-3, atol=8e-3 * scale)


def test_fused_kernels_are_never_enabled_without_triton(monkeypatch):
    """``enabled`` is False where Triton cannot run (the loss then takes its blockwise torch
    path, computing the same quantities): never True without the kernels."""
    monkeypatch.setattr(row_softmax, "_triton", lambda: None)
    monkeypatch.setattr(row_softmax, "FORCE", True)
    assert not row_softmax.enabled(torch.device("cuda"))
    monkeypatch.setattr(row_softmax, "FORCE", None)
    assert not row_softmax.enabled(torch.device("cuda"))
