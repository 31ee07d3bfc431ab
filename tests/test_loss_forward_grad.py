"""``parallel_kd_loss(..., loss_weights=(a, b))``: the forward writes the gradient of
a * kd_sum + b * ce_sum from the softmax and raw sums it has just made, the backward scales it.

Against the float64 reference (``reference.kd_loss``, torch's ``cross_entropy``) for the forms
that have one, into the logits and into a buffer of its own, over several blocks, a padded
vocabulary and T != 1; the top-k forms and sample weights against the default call. The
kernel's raw sums are made once per block (no recompute in the backward); upstream gradients
in another ratio raise; without a backward to serve (no grad mode) nothing is written.
"""

from __future__ import annotations

import pytest
import torch
from test_loss_grad_into_logits import (
    EXACT,
    _assert_reference,
    _case,
    _force_softmax_buffer,
    _payload,
)

from megatron_xdistill.loss import forward_writes_gradient, parallel_kd_loss
from megatron_xdistill.loss.cpu import exact as exact_rows
from megatron_xdistill.loss.definitions.common import predicting_chunk_id
from megatron_xdistill.loss.kernels import pkl as kernels


def _call(case, logits, mode, form, temperature, with_ce, into, weights, sample_weights=None):
    payload, common = _payload(case, mode, form, temperature)
    return parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(logits.shape[-1]), student_vocab_size=case.vs,
        mode="pkl" if mode == "ce" else mode, temperature=temperature,
        common_student_ids=common, labels=case.labels if with_ce else None,
        block_bytes=4 * logits.shape[-1] * 7, grad_into_logits=into,  # several blocks
        loss_weights=weights, sample_weights=sample_weights)


def _counts(case, mode, form, temperature, with_ce):
    """(kd_count, ce_count) of the configuration: what a trainer knows before the call."""
    with torch.no_grad():
        terms = _call(case, case.student_logits.float().clone(), mode, form, temperature,
                      with_ce, False, None)
    return max(float(terms.kd_count), 1.0), max(float(terms.ce_count), 1.0)


def _grad(case, mode, form, temperature, with_ce, into, weighted, scale=3.0,
          sample_weights=None, counts=None, padded=True):
    """(loss, gradient) of scale * (kd / kd_count + ce / ce_count), with ``loss_weights`` if
    ``weighted``; ``padded`` False: the logits without the padded columns."""
    n_kd, n_ce = counts or _counts(case, mode, form, temperature, with_ce)
    weights = (1.0 / n_kd, 1.0 / n_ce if with_ce else 0.0) if weighted else None
    width = case.student_logits.shape[-1] if padded else case.vs
    logits = case.student_logits[..., :width].float().clone().requires_grad_(True)
    terms = _call(case, logits, mode, form, temperature, with_ce, into, weights,
                  sample_weights)
    loss = terms.ce_sum / n_ce if with_ce else torch.zeros(())
    if mode != "ce":
        loss = loss + terms.kd_sum / n_kd
    (scale * loss).backward()
    return loss.item(), logits.grad


@pytest.mark.parametrize("mode,form,temperature,with_ce", EXACT,
                         ids=[f"{m}-{f}-T{t}{'-ce' if c else ''}" for m, f, t, c in EXACT])
@pytest.mark.parametrize("into", [True, False], ids=["over-logits", "own-buffer"])
@pytest.mark.parametrize("path", ["logits", "softmax"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_forward_gradient_matches_reference(monkeypatch, mode, form, temperature, with_ce, into,
                                            path, padded):
    """fp32: loss rel 1e-5 and gradient 1e-5 of its largest entry against float64 (times the
    loss's scale 3), zeros on the padded columns; both CPU paths (logits only; the softmax
    buffer a GPU takes, forced here). Unpadded, the blocks' softmax goes straight into the
    gradient's rows (over the logits where nothing reads them afterwards)."""
    if path == "softmax":
        _force_softmax_buffer(monkeypatch)
    case = _case()
    loss, grad = _grad(case, mode, form, temperature, with_ce, into, weighted=True,
                       padded=padded)
    ref, ref_grad = case.reference_loss(mode, temperature, with_ce)
    _assert_reference(case, loss, grad, ref, 3.0 * ref_grad)


@pytest.mark.parametrize("form", ["topk", "chunk_topk"])
@pytest.mark.parametrize("with_ce", [False, True], ids=["kd", "kd-ce"])
def test_topk_forms_forward_gradient_equals_the_default_call(form, with_ce):
    """The top-k forms (no dense reference) give the default call's gradient."""
    case = _case()
    loss, grad = _grad(case, "pkl", form, 1.0, with_ce, True, weighted=True)
    loss0, grad0 = _grad(case, "pkl", form, 1.0, with_ce, False, weighted=False)
    assert loss == loss0
    torch.testing.assert_close(grad, grad0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode,form", [("pkl", "full"), ("gold", "gold")])
def test_sample_weights_forward_gradient_equals_the_default_call(monkeypatch, mode, form):
    """Per-sample weights in the forward-written call (gold: its pass from the logits, which
    must weight each row too) give the recomputing call's loss and gradient."""
    from megatron_xdistill.loss.cpu import gold_block

    fused = []
    real = gold_block.forward_block
    monkeypatch.setattr(gold_block, "forward_block",
                        lambda *a, **k: fused.append(1) or real(*a, **k))
    case = _case()
    weights = torch.tensor([0.5, 2.0, 0.0])
    loss, grad = _grad(case, mode, form, 1.0, True, True, weighted=True,
                       sample_weights=weights)
    assert bool(fused) == (mode == "gold")
    loss0, grad0 = _grad(case, mode, form, 1.0, True, False, weighted=False,
                         sample_weights=weights)
    assert loss == pytest.approx(loss0, rel=1e-6)
    torch.testing.assert_close(grad, grad0, rtol=1e-6, atol=1e-7)
    _, unweighted = _grad(case, mode, form, 1.0, True, True, weighted=True)
    assert not torch.allclose(grad, unweighted, rtol=1e-3, atol=1e-5)  # the weights count


def test_raw_sums_are_made_once_per_block(monkeypatch):
    """The exact form's projection runs once per block with ``loss_weights`` (the backward
    recomputes none) and its gradient comes from the KL's own pass over the payload rows;
    without, the projection runs twice and the gradient takes a pass of its own."""
    calls, grads = [], []
    raw = kernels.DenseKernel.raw
    monkeypatch.setattr(kernels.DenseKernel, "raw",
                        lambda self, blk: calls.append(blk.index) or raw(self, blk))
    grad = exact_rows.image_kl_grad
    monkeypatch.setattr(exact_rows, "image_kl_grad",
                        lambda *a, **k: grads.append(1) or grad(*a, **k))
    case = _case()
    counts = _counts(case, "pkl", "full", 1.0, True)
    calls.clear()
    _grad(case, "pkl", "full", 1.0, True, True, weighted=True, counts=counts)
    once = list(calls)
    assert not grads
    calls.clear()
    _grad(case, "pkl", "full", 1.0, True, True, weighted=False, counts=counts)
    assert len(set(once)) > 2 and sorted(once) == sorted(set(once))
    assert sorted(calls) == sorted(once + once)
    assert len(grads) == len(once)


@pytest.mark.parametrize("mode,form,writes", [
    ("pkl", "full", True), ("gold", "gold", True), ("hkl", "gold", True),
    ("pkl", "chunk_topk", False), ("pkl", "topk", False)])
def test_forward_writes_gradient_says_when_the_backward_reads_no_logits(mode, form, writes):
    """Where ``forward_writes_gradient`` says so, a call given ``loss_weights`` reads no logits
    in its backward: the logits scrambled after its forward (no version bump) leave its
    gradient bit for bit as it was (what lets a trainer make teacher 0's call, which writes
    over the logits, after the other teachers' calls). Where it says no (the top-k forms'
    kernels finish all rows together: the backward recomputes), the same scramble changes the
    gradient: the check can fail. Never with chunks that may be split over CP ranks."""
    assert forward_writes_gradient(mode, form, 1) == writes
    assert not forward_writes_gradient(mode, form, 2)
    case = _case()
    n_kd, _ = _counts(case, mode, form, 1.0, False)

    def gradient(scramble: bool) -> torch.Tensor:
        logits = case.student_logits.float().clone().requires_grad_(True)
        terms = _call(case, logits, mode, form, 1.0, False, False, (1.0 / n_kd, 0.0))
        if scramble:  # what the backward would read, were it to read the logits
            logits.data.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(5))
        (terms.kd_sum / n_kd).backward()
        return logits.grad

    clean, scrambled = gradient(False), gradient(True)
    assert clean.abs().max() > 0
    if writes:
        assert torch.equal(scrambled, clean)
    else:
        assert not torch.allclose(scrambled, clean, rtol=1e-3, atol=1e-6)


def test_upstream_gradients_in_another_ratio_raise():
    """kd and ce weighted 1 : 1 in the loss, declared 1 : 2: the backward cannot serve it."""
    case = _case()
    logits = case.student_logits.float().clone().requires_grad_(True)
    terms = _call(case, logits, "pkl", "full", 1.0, True, True, (1.0, 2.0))
    with pytest.raises(RuntimeError, match=r"loss_weights=\(1.0, 2.0\).*ce_sum"):
        (terms.kd_sum + terms.ce_sum).backward()


@pytest.mark.parametrize("bad", [(1.0,), ("a", 1.0), (float("nan"), 1.0)])
def test_bad_loss_weights_raise(bad):
    case = _case()
    logits = case.student_logits.float().clone().requires_grad_(True)
    with pytest.raises(ValueError, match="loss_weights"):
        _call(case, logits, "pkl", "full", 1.0, True, True, bad)


def test_no_gradient_written_without_a_backward():
    """Under no_grad the forward leaves the logits as they are (nothing to serve)."""
    case = _case()
    logits = case.student_logits.float().clone().requires_grad_(True)
    before = logits.detach().clone()
    with torch.no_grad():
        terms = _call(case, logits, "pkl", "full", 1.0, True, True, (1.0, 1.0))
    ref, _ = case.reference_loss("pkl", 1.0, True)
    assert (terms.kd_sum / terms.kd_count + terms.ce_sum / terms.ce_count).item() == \
        pytest.approx(ref, rel=1e-5)
    assert torch.equal(logits.detach(), before)


class _Identity(torch.autograd.Function):
    """An identity that returns a view of its input (as training's loss clock)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def test_logits_from_a_custom_functions_view_take_the_forward_gradient():
    """Logits that are a custom Function's view (written over in the forward, never saved):
    the gradient reaches the leaf, equal to the reference."""
    case = _case()
    n_kd, n_ce = _counts(case, "pkl", "full", 1.0, True)
    leaf = case.student_logits.float().clone().requires_grad_(True)
    terms = _call(case, _Identity.apply(leaf * 1.0), "pkl", "full", 1.0, True, True,
                  (1.0 / n_kd, 1.0 / n_ce))
    (terms.kd_sum / n_kd + terms.ce_sum / n_ce).backward()
    _, ref_grad = case.reference_loss("pkl", 1.0, True)
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(leaf.grad[..., : case.vs].double(), ref_grad, rtol=1e-5,
                               atol=1e-5 * scale)


def test_exact_form_torch_path_forward_gradient_matches_reference(monkeypatch):
    """The exact form as a GPU runs it (no Numba: the projection by sparse products, the KL's
    gradient by autograd inside the forward), forced on CPU: the reference's gradient."""
    from megatron_xdistill.loss.kernels import image_projection

    monkeypatch.setattr(exact_rows, "supported", lambda t: False)
    monkeypatch.setattr(image_projection.ImageProjection, "_numba",
                        staticmethod(lambda t: False))
    _force_softmax_buffer(monkeypatch)
    case = _case()
    loss, grad = _grad(case, "pkl", "full", 1.0, True, True, weighted=True)
    ref, ref_grad = case.reference_loss("pkl", 1.0, True)
    _assert_reference(case, loss, grad, ref, 3.0 * ref_grad)


@pytest.mark.parametrize("mode,temperature,with_ce", [("gold", 1.0, True), ("hkl", 1.5, False)])
@pytest.mark.parametrize("weighted", [True, False], ids=["forward-written", "recomputing"])
def test_gold_torch_path_matches_reference(monkeypatch, mode, temperature, with_ce, weighted):
    """Gold / H-KL as a GPU runs them (softmax blocks, torch's top-k; the forward KL and its
    gradient made together, not by autograd), forced on CPU: the reference's loss and
    gradient, with the loss's weights given ahead and with the recomputing backward."""
    from megatron_xdistill.loss.cpu import sorted_l1
    from megatron_xdistill.loss.kernels import gold as gold_kernel

    monkeypatch.setattr(sorted_l1, "supported", lambda t: False)
    _force_softmax_buffer(monkeypatch)
    made = []
    forward_kl = gold_kernel.GoldKernel._forward_kl
    monkeypatch.setattr(gold_kernel.GoldKernel, "_forward_kl",
                        lambda self, *a, **k: made.append(1) or forward_kl(self, *a, **k))
    case = _case()
    loss, grad = _grad(case, mode, "gold", temperature, with_ce, True, weighted=weighted)
    ref, ref_grad = case.reference_loss(mode, temperature, with_ce)
    _assert_reference(case, loss, grad, ref, 3.0 * ref_grad)
    assert made  # the path under test ran


@pytest.mark.parametrize("mode,temperature,with_ce,threads",
                         [("gold", 1.0, True, 1), ("hkl", 2.0, False, 2), ("gold", 1.0, False, 2)])
@pytest.mark.parametrize("into", [True, False], ids=["over-logits", "own-buffer"])
def test_gold_from_logits_path_matches_reference(monkeypatch, mode, temperature, with_ce,
                                                 threads, into):
    """Gold / H-KL on CPU with one TP rank and the loss's weights given ahead: each block's
    log-partitions, KL and gradient straight from its logits (``loss/cpu/gold_block.py``, no raw
    sums made). The float64 reference's loss and gradient; every block with chunk rows takes
    that path (positions of no chunk row among them), its rows split over the threads."""
    from megatron_xdistill.loss.cpu import gold_block
    from megatron_xdistill.loss.kernels import gold as gold_kernel

    case = _case()
    assert bool((predicting_chunk_id(case.student_chunk_id) < 0).any())  # orphan positions
    counts = _counts(case, mode, "gold", temperature, with_ce)
    calls = []
    for name in ("forward_block", "spread_block"):
        real = getattr(gold_block, name)
        monkeypatch.setattr(gold_block, name, lambda *a, _f=real, _n=name, **k:
                            calls.append(_n) or _f(*a, **k))
    monkeypatch.setattr(gold_kernel.GoldKernel, "raw",
                        lambda self, blk: pytest.fail("raw sums made on the fused path"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loss, grad = _grad(case, mode, "gold", temperature, with_ce, into, weighted=True,
                           counts=counts)
    finally:
        torch.set_num_threads(before)
    ref, ref_grad = case.reference_loss(mode, temperature, with_ce)
    _assert_reference(case, loss, grad, ref, 3.0 * ref_grad)
    blocks = calls.count("forward_block")
    assert blocks > 2 and calls.count("spread_block") == blocks


def test_a_second_backward_raises_clearly():
    """The forward's gradient is handed to the first backward, not kept: a second one (with
    retain_graph) says so instead of failing on a missing buffer."""
    case = _case()
    logits = case.student_logits.float().clone().requires_grad_(True)
    terms = _call(case, logits, "pkl", "full", 1.0, True, False, (1.0, 1.0))
    loss = terms.kd_sum + terms.ce_sum
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="taken by an earlier backward"):
        loss.backward()


@pytest.mark.parametrize("lift", [40.0, 100.0])
def test_forward_gradient_with_logits_far_above_the_first_columns(lift):
    """The exact form's forward leaves each block's softmax unnormalised, shifted by its
    first 256 columns' maximum (``cpu_rows.row_exp_``): student logits ``lift`` nats higher
    past column 256 (exps up to e^40 read through the per-row factor; at 100 the shift
    moves up) still give the float64 reference's loss and gradient."""
    case = _case()
    case.student_logits[..., 256: case.vs] += lift
    loss, grad = _grad(case, "pkl", "full", 1.0, True, True, weighted=True, padded=False)
    ref, ref_grad = case.reference_loss("pkl", 1.0, True)
    _assert_reference(case, loss, grad, ref, 3.0 * ref_grad)
