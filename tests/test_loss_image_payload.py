"""The ``image`` payload: the exact P-KL's teacher probabilities on W's image I only, with the
teacher's float64 sums (P log P over all of V_t, P outside I) and its argmax over all of V_t.

The teacher side against the full payload of the same logits (the exp of its columns of I,
sums taken here in float64, the first argmax); the loss from it against the float64 dense
reference (forward KL, with and without CE, the CPU's direct passes and the torch path a GPU
takes, the default backward and the forward-written gradient) and against the full form's
loss for the reverse KL and the JSD. Layouts (TP, CP) are in ``test_loss_parallel.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_loss_grad_into_logits import _assert_reference, _case

from megatron_xdistill.loss import (
    PayloadSpec,
    TeacherPayload,
    parallel_kd_loss,
    payload_spec,
    teacher_image,
    teacher_payload,
)
from megatron_xdistill.loss.cpu import exact as exact_rows
from megatron_xdistill.loss.definitions.common import EPS, predicting_chunk_id
from megatron_xdistill.loss.definitions.payload import float64_as_pair, pair_as_float64
from megatron_xdistill.loss.kernels import image as image_kernel


def _image(case) -> torch.Tensor:
    return teacher_image(*case.projection_rows(case.student_logits.shape[-1]), case.vs)


def _payload(case, form: str, temperature: float = 1.0, image=None) -> TeacherPayload:
    image = _image(case) if image is None else image
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt, num_image=image.numel())
    return teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                           spec, vocab_size=case.vt, temperature=temperature,
                           image_teacher_ids=image if form == "image" else None)


def test_image_payload_is_the_full_payload_on_the_image_with_the_teachers_sums():
    case = _case()
    image = _image(case)
    assert 0 < image.numel() < case.vt
    full, got = _payload(case, "full", 1.5), _payload(case, "image", 1.5)
    has = full.has_teacher
    assert torch.equal(got.has_teacher, has)
    assert got.logprobs is None
    torch.testing.assert_close(got.probs[has], full.logprobs[has][:, image].double().exp().float(),
                               rtol=1e-6, atol=1e-12)
    rest = torch.ones(case.vt, dtype=torch.bool)
    rest[image] = False
    lp = full.logprobs[has].double()
    plogp, mass = got.teacher_sums()  # float32 terms (the CPU's vectorised exp), float64 sums
    torch.testing.assert_close(plogp[has], (lp.exp() * lp).sum(-1), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(mass[has], lp[:, rest].exp().sum(-1), rtol=1e-6, atol=1e-12)
    assert torch.equal(got.teacher_argmax[has], full.logprobs[has].argmax(-1))
    back = TeacherPayload.from_flat(got.to_flat(), got.spec)  # the transport's float32 row
    assert torch.equal(back.teacher_sums()[0], plogp) and torch.equal(back.teacher_argmax,
                                                                      got.teacher_argmax)
    assert torch.equal(back.probs, got.probs) and back.logprobs is None
    assert got.spec.numel < full.spec.numel


def test_a_float64_sum_survives_the_float32_pair():
    x = torch.tensor([1.0 / 3.0, -2.718281828459045, 1e-30, 123456.789012345], dtype=torch.float64)
    pair = float64_as_pair(x)
    assert pair.dtype == torch.float32
    torch.testing.assert_close(pair_as_float64(pair), x, rtol=1e-14, atol=0.0)
    assert (pair[..., 0].double() - x).abs().max() > 1e-9  # one float32 would not do


def _loss(case, payload, logits, with_ce, weights, **kw):
    return parallel_kd_loss(
        logits, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(logits.shape[-1]), student_vocab_size=case.vs,
        mode="pkl", labels=case.labels if with_ce else None,
        block_bytes=4 * logits.shape[-1] * 7, loss_weights=weights, **kw)  # several blocks


def _loss_and_grad(case, payload, with_ce, weighted, temperature=1.0, **kw):
    """(kd / kd_count + ce / ce_count, its gradient)."""
    with torch.no_grad():
        first = _loss(case, payload, case.student_logits.float().clone(), with_ce, None,
                      temperature=temperature, **kw)
    n_kd, n_ce = max(float(first.kd_count), 1.0), max(float(first.ce_count), 1.0)
    weights = (1.0 / n_kd, 1.0 / n_ce if with_ce else 0.0) if weighted else None
    logits = case.student_logits.float().clone().requires_grad_(True)
    terms = _loss(case, payload, logits, with_ce, weights, temperature=temperature, **kw)
    loss = terms.kd_sum / n_kd + (terms.ce_sum / n_ce if with_ce else 0.0)
    loss.backward()
    return loss.item(), logits.grad


@pytest.mark.parametrize("with_ce", [False, True], ids=["kd", "kd-ce"])
@pytest.mark.parametrize("weighted", [False, True], ids=["recomputing", "forward-written"])
@pytest.mark.parametrize("path", ["cpu-passes", "torch"])
def test_image_form_matches_the_dense_reference(monkeypatch, with_ce, weighted, path):
    """fp32: loss rel 1e-5 and gradient 1e-5 of its largest entry against float64."""
    if path == "torch":  # the path a GPU takes: no Numba pass, projection or unnormalised rows
        _without_numba(monkeypatch)
    case = _case()
    loss, grad = _loss_and_grad(case, _payload(case, "image", 2.0), with_ce, weighted, 2.0)
    ref, ref_grad = case.reference_loss("pkl", 2.0, with_ce)
    _assert_reference(case, loss, grad, ref, ref_grad)


@pytest.mark.parametrize("divergence", [dict(reverse=True), dict(jsd_beta=0.3)],
                         ids=["reverse", "jsd"])
def test_image_form_equals_the_full_form_for_the_other_divergences(divergence):
    case = _case()
    full = _loss_and_grad(case, _payload(case, "full"), True, False, **divergence)
    got = _loss_and_grad(case, _payload(case, "image"), True, False, **divergence)
    assert got[0] == pytest.approx(full[0], rel=1e-6)
    scale = full[1].abs().max().item()
    torch.testing.assert_close(got[1], full[1], rtol=1e-5, atol=1e-6 * scale)


def test_an_image_payload_of_another_projection_is_refused():
    case = _case()
    image = _image(case)
    payload = _payload(case, "image", image=image[:-3])
    with pytest.raises(ValueError, match="image payload has .* columns"):
        _loss(case, payload, case.student_logits.float(), False, None)


def test_the_image_form_needs_its_ids():
    case = _case()
    spec = PayloadSpec("image", case.chunk_valid.shape[1], 5)
    with pytest.raises(ValueError, match="image_teacher_ids"):
        teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id), spec,
                        vocab_size=case.vt)
    with pytest.raises(ValueError, match="num_image"):
        payload_spec("image", 4, case.vt)
    with pytest.raises(ValueError, match="ascending"):
        teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id), spec,
                        vocab_size=case.vt, image_teacher_ids=torch.tensor([1, 9, 4, 12, 20]))


def _without_numba(monkeypatch) -> None:
    """The image form as a GPU runs it, on CPU tensors: torch operations for the rows' KL and
    gradient, the projection and the block's softmax."""
    from megatron_xdistill.loss.kernels.image_projection import ImageProjection
    from megatron_xdistill.loss.student import plan as student_plan

    monkeypatch.setattr(image_kernel, "_rows_on_cpu", lambda t: False)
    monkeypatch.setattr(image_kernel, "numba_takes", lambda t: False)
    monkeypatch.setattr(ImageProjection, "_numba", staticmethod(lambda t: False))
    monkeypatch.setattr(student_plan, "numba_takes", lambda t: False)


@pytest.mark.parametrize("path", ["cpu-passes", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_image_rows_pass_equals_the_full_rows_pass(monkeypatch, dtype, path):
    """The pass over P on I's columns alone, plus the teacher's sums (entropy over all
    columns, -log EPS x the mass outside I), against exact_rows' pass over full log-prob rows
    (checked against autograd in test_loss_kernels): KL, u's argmax and the gradient; in
    float64 also rows with no and with almost no projected mass (the floor holds their sum).
    Numba's pass and the torch operations a GPU takes."""
    gen = torch.Generator().manual_seed(3)
    n, vt = 9, 5000
    lp = torch.log_softmax(3 * torch.randn(n, vt, generator=gen, dtype=dtype), -1)
    lp[2, 7] = float("-inf")  # 0 log 0 = 0 on I
    image = torch.nonzero(torch.rand(vt, generator=gen) < 0.4, as_tuple=True)[0]
    lp[4, image[: image.numel() // 2]] = float("-inf")
    keys = torch.tensor([0, 2, 4, 5, 8, 2])
    u = torch.rand(keys.numel(), image.numel(), generator=gen, dtype=dtype)
    if dtype == torch.float64:
        u[3] = 0.0
        u[5] = 1e-35  # a sum under TINY but not 0: q = u / TINY, the normalisation's term 0
    outside = torch.ones(vt, dtype=dtype)
    outside[image] = 0.0
    weight = torch.tensor([0.5, 2.0, 1.0, 1.5, 3.0, 1.0], dtype=dtype)
    kl, at, _, g = exact_rows.image_kl(u, lp, keys, image, outside, weight)
    probs = lp[:, image].exp()
    if path == "torch":
        monkeypatch.setattr(image_kernel, "_rows_on_cpu", lambda t: False)
    monkeypatch.setattr(image_kernel, "numba_takes", lambda t: False)
    on, at_on, g_on = image_kernel.image_kl_on_image(u, probs, keys, weight)
    every = lp.double()
    p = every.exp()
    const = ((p * every.clamp_min(-1e30)).sum(-1)
             - torch.log(torch.tensor(EPS, dtype=torch.float64)) * p[:, outside.bool()].sum(-1))
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close((on + const[keys]).to(dtype), kl, rtol=tol, atol=tol)
    assert torch.equal(at_on, at)
    torch.testing.assert_close(g_on, g, rtol=tol, atol=tol * float(g.abs().max()))
    no_grad = image_kernel.image_kl_on_image(u, probs, keys)
    torch.testing.assert_close(no_grad[0], on, rtol=tol, atol=0.0)
    assert no_grad[2] is None


def test_training_ships_the_image_form_for_the_exact_loss():
    """``--kd-topk 0`` (the exact P-KL) ships W's image: the ids of the matrix's entries over
    its student rows, ascending, with no empty row's -1 or a zero weight among them."""
    from megatron_xdistill.projection.runtime import ProjectionMatrix
    from megatron_xdistill.training.kd_adapter import payload_columns, payload_form

    assert payload_form("pkl", 0, "chunk") == "image"
    assert payload_form("pkl", 64, "chunk") == "chunk_topk"
    indices = torch.tensor([[7, 2], [7, -1], [-1, -1], [11, 4]])
    weights = torch.tensor([[0.5, 0.5], [1.0, 0.0], [0.0, 0.0], [0.9, 0.0]])
    matrix = ProjectionMatrix(indices, weights, 4, 12)
    assert payload_columns("image", matrix, "pkl").tolist() == [2, 7, 11]
    assert payload_columns("chunk_topk", matrix, "pkl") is None


@pytest.mark.parametrize("temperature,with_ce,threads,into,lift",
                         [(1.0, True, 1, True, 0.0), (2.0, False, 2, False, 0.0),
                          (1.0, False, 2, True, 100.0)])
def test_image_from_logits_path_matches_reference(monkeypatch, temperature, with_ce, threads,
                                                  into, lift):
    """The image form on CPU with one TP rank and the loss's weights given ahead: each block
    with chunk rows goes from its logits to its gradient a chunk row at a time
    (``loss/cpu/image_block.py``; no raw sums, no [rows, |I|] products). The float64 reference's
    loss and gradient; positions of no chunk row among the blocks, the rows split over the
    threads, the logits' gradient written over them or into a buffer of its own; ``lift``:
    logits 100 nats higher past column 256 (the exp pass moves its shift up)."""
    from megatron_xdistill.loss.cpu import image_block
    from megatron_xdistill.loss.kernels import pkl as kernels

    case = _case()
    assert bool((predicting_chunk_id(case.student_chunk_id) < 0).any())  # orphan positions
    case.student_logits[..., 256: case.vs] += lift
    payload = _payload(case, "image", temperature)
    with torch.no_grad():
        first = _loss(case, payload, case.student_logits.float().clone(), with_ce, None,
                      temperature=temperature)
    n_kd, n_ce = float(first.kd_count), max(float(first.ce_count), 1.0)
    calls = []
    real = image_block.image_block
    monkeypatch.setattr(image_block, "image_block",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(kernels.DenseKernel, "raw",
                        lambda self, blk: pytest.fail("raw sums made on the row path"))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        logits = case.student_logits.float().clone().requires_grad_(True)
        terms = _loss(case, payload, logits, with_ce, (1.0 / n_kd, 1.0 / n_ce),
                      temperature=temperature, grad_into_logits=into)
        loss = terms.kd_sum / n_kd + terms.ce_sum / n_ce
        loss.backward()
    finally:
        torch.set_num_threads(before)
    ref, ref_grad = case.reference_loss("pkl", temperature, with_ce)
    _assert_reference(case, loss.item(), logits.grad, ref, ref_grad)
    assert len(calls) > 2


def test_row_layout_is_the_projection_on_its_image():
    """:class:`image_block.RowLayout` (one-entry weight-1 rows as a column each, the others
    by their entries) holds exactly W on I, for a W with every kind of row."""
    from megatron_xdistill.loss.cpu.image_block import RowLayout

    gen = torch.Generator().manual_seed(3)
    vs, width = 40, 25
    dense = torch.zeros(vs, width)
    for s in range(vs):
        kind = s % 4  # empty, one entry of weight 1, one of another weight, several
        cols = torch.randperm(width, generator=gen)[: (0, 1, 1, 3)[kind]]
        dense[s, cols] = 1.0 if kind == 1 else torch.rand(cols.numel(), generator=gen) + 0.1
    crow = torch.zeros(vs + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum((dense > 0).sum(1), 0)
    rows, col = torch.nonzero(dense, as_tuple=True)
    layout = RowLayout.of(crow, col, dense[rows, col], width, torch.float64)
    rebuilt = torch.zeros(vs, width + 1, dtype=torch.float64)
    one = layout.single < width
    rebuilt[torch.nonzero(one, as_tuple=True)[0], layout.single[one].long()] = 1.0
    assert not bool(one[layout.multi_row.long()].any())
    rebuilt[layout.multi_row.long(), layout.multi_col.long()] = layout.multi_val
    assert torch.equal(rebuilt[:, :width], dense.double())
    assert int(one.sum()) == vs // 4


def test_sample_weights_on_the_row_path_equal_the_recomputing_call(monkeypatch):
    """Per-sample weights with the loss's weights given ahead (the row path, which must weight
    each chunk row's KL and gradient) give the recomputing call's loss and gradient."""
    from megatron_xdistill.loss.cpu import image_block

    case = _case()
    payload = _payload(case, "image")
    weights = torch.tensor([0.5, 2.0, 0.0])
    taken = []
    real = image_block.image_block
    monkeypatch.setattr(image_block, "image_block",
                        lambda *a, **k: taken.append(1) or real(*a, **k))
    loss, grad = _loss_and_grad(case, payload, True, True, sample_weights=weights)
    assert taken
    taken.clear()
    loss0, grad0 = _loss_and_grad(case, payload, True, False, sample_weights=weights)
    assert not taken
    assert loss == pytest.approx(loss0, rel=1e-6)
    torch.testing.assert_close(grad, grad0, rtol=1e-5, atol=1e-7)
    _, unweighted = _loss_and_grad(case, payload, True, True)
    assert not torch.allclose(grad, unweighted, rtol=1e-3, atol=1e-5)  # the weights count


@pytest.mark.slow  # the suite's 30 minutes: the same path in float32 against the float64
# reference stays in the default run (test_image_from_logits_path_matches_reference)
def test_image_from_logits_path_in_float64_matches_reference(monkeypatch):
    """Float64 logits (gradcheck's precision) on the row path: the blockwise passes' loss and
    gradient in float64 to 1e-11 (the same sums in another order), and the float64 reference's
    to 1e-6 (the payload's P is float32: 6e-8 relative an element)."""
    from megatron_xdistill.loss.cpu import image_block

    case = _case()
    payload = _payload(case, "image")
    with torch.no_grad():
        first = _loss(case, payload, case.student_logits.double().clone(), True, None)
    n_kd, n_ce = float(first.kd_count), float(first.ce_count)
    calls = []
    real = image_block.image_block
    monkeypatch.setattr(image_block, "image_block",
                        lambda *a, **k: calls.append(a[1].dtype) or real(*a, **k))

    def loss_and_grad(weights):
        logits = case.student_logits.double().clone().requires_grad_(True)
        terms = _loss(case, payload, logits, True, weights)
        loss = terms.kd_sum / n_kd + terms.ce_sum / n_ce
        loss.backward()
        return loss.item(), logits.grad[..., : case.vs]

    loss, grad = loss_and_grad((1.0 / n_kd, 1.0 / n_ce))
    assert calls and set(calls) == {torch.float64}
    calls.clear()
    blockwise, blockwise_grad = loss_and_grad(None)  # the recomputing backward: blockwise
    assert not calls
    assert loss == pytest.approx(blockwise, rel=1e-11)
    scale = blockwise_grad.abs().max().item()
    torch.testing.assert_close(grad, blockwise_grad, rtol=1e-11, atol=1e-11 * scale)
    ref, ref_grad = case.reference_loss("pkl", 1.0, True)
    assert loss == pytest.approx(ref, rel=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6 * scale)
