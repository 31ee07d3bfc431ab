"""The exact (image) P-KL and gold / H-KL (full and compact payload) on the fused Triton passes (``loss/fused``) against the
dense float64 reference (``loss.definitions.reference``): loss and gradient, rel 1e-5 in fp32,
forward / reverse KL and the JSD, with and without CE, T = 1 and T != 1, padded vocabulary
columns, ragged and empty chunks, several row groups, the forward that writes the gradient, per
sample weights, bf16 logits; and in TP = 2, CP = 2 and TP x CP = 2 x 2 (gloo ranks, chunks split
over CP) through test_loss_parallel's layouts.

On a machine without a GPU the kernels run under Triton's interpreter (the CPU suite sets
``TRITON_INTERPRET=1``, tests/conftest.py); on CUDA (``make test-gpu``) compiled.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import test_loss_parallel as layouts
import torch

from megatron_xdistill.loss import parallel_kd_loss
from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.common import common_vocab_from_dense, predicting_chunk_id
from megatron_xdistill.loss.fused import call as fused_call
from megatron_xdistill.loss.fused import gold as fused_gold
from megatron_xdistill.loss.fused import image as fused_image
from megatron_xdistill.loss.fused.gold_topk import CompactGoldPass
from megatron_xdistill.loss.kernels.image_projection import teacher_image
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.synthetic_kd import make_case

RTOL = 1e-5
_HAS_TRITON = importlib.util.find_spec("triton") is not None
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
pytestmark = pytest.mark.skipif(not _HAS_TRITON, reason="the fused passes need Triton")
_ON_CPU = pytest.mark.skipif(
    not _INTERPRETED, reason="CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before "
                             "Triton is imported; the CPU suite's conftest sets it)")
DEVICES = [
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("cpu", marks=_ON_CPU),
]
#: the forms the fused passes take, by their index in test_loss_parallel.CONFIGS: gold forward
#: KL; gold reverse at T 2 with CE and 5 uncommon values; H-KL with CE (dynamic); H-KL reverse
#: exact-only at T 1.5; image forward with CE; image reverse at T 2; image JSD
FUSED = [6, 7, 8, 9, 12, 13, 14]


@pytest.fixture
def counted(monkeypatch):
    """The fused passes forced on; yields how many calls they took."""
    calls = []
    run = fused_call.run

    def counting(call, logits):
        calls.append(call)
        return run(call, logits)

    monkeypatch.setenv(fused_call.ENV, "1")
    monkeypatch.setattr(fused_call, "run", counting)
    return calls


def _inputs(case, mode, form, temperature, uncommon, device, gold_topk=(0, 0)):
    width = case.student_logits.shape[-1]
    rows = case.projection_rows(width)
    common = common_vocab_from_dense(case.projection, mode) if mode != "pkl" else (None, None)
    image = teacher_image(*rows, case.vs) if form == "image" else None
    spec = payload_spec(form, case.chunk_valid.shape[1], case.vt,
                        num_common=None if common[0] is None else common[0].numel(),
                        uncommon_topk=uncommon,
                        num_image=None if image is None else image.numel(),
                        gold_topk=gold_topk[0], gold_uncommon_topk=gold_topk[1],
                        student_vocab_size=case.vs)
    payload = teacher_payload(case.teacher_logits.to(device),
                              predicting_chunk_id(case.teacher_chunk_id).to(device), spec,
                              vocab_size=case.vt, temperature=temperature,
                              common_teacher_ids=common[1], image_teacher_ids=image)
    return rows, common, payload


def _loss(case, mode, form, temperature, reverse, ce_weight, *, device, uncommon=8192,
          block_bytes=None, ahead=False, dtype=torch.float32, sample_weights=None,
          gold_topk=(0, 0)):
    """(loss, gradient on the real columns, gradient on the padded ones) of
    kd_sum / kd_count + ce_weight * ce_sum / ce_count (form "gold_topk": the compact payload
    of ``gold_topk`` (k, k'))."""
    rows, common, payload = _inputs(case, mode, form, temperature, uncommon, device, gold_topk)
    logits = case.student_logits.detach().to(device, dtype).clone().requires_grad_(True)
    jsd = None if isinstance(reverse, bool) else reverse
    kw = dict(student_vocab_size=case.vs, mode=mode, temperature=temperature,
              reverse=reverse is True, jsd_beta=jsd, common_student_ids=common[0],
              uncommon_topk=uncommon, labels=case.labels.to(device) if ce_weight else None,
              block_bytes=block_bytes, sample_weights=sample_weights)
    args = (logits, payload, predicting_chunk_id(case.student_chunk_id).to(device),
            case.chunk_valid.to(device), case.chunk_exact.to(device), rows)
    weights = None
    if ahead:
        with torch.no_grad():
            first = parallel_kd_loss(*args, **kw)
        weights = (1.0 / max(first.kd_count.item(), 1.0),
                   ce_weight / max(first.ce_count.item(), 1.0))
    terms = parallel_kd_loss(*args, **kw, loss_weights=weights)
    loss = terms.kd_sum / terms.kd_count.clamp_min(1)
    if ce_weight:
        loss = loss + ce_weight * terms.ce_sum / terms.ce_count
    loss.backward()
    grad = logits.grad.double().cpu()
    return loss.item(), grad[..., : case.vs], grad[..., case.vs:], terms


def _reference(case, mode, temperature, reverse, ce_weight, *, uncommon=8192,
               rounded_to=None, sample_weights=None, gold_topk=None):
    z = case.real_student_logits
    z = (z if rounded_to is None else z.to(rounded_to)).double().requires_grad_(True)
    details = reference.kd_loss_details(
        z, case.real_teacher_logits.double(), case.student_chunk_id, case.teacher_chunk_id,
        case.chunk_valid, case.chunk_exact, case.projection.double(), mode, temperature,
        reverse is True, uncommon_topk=uncommon,
        jsd_beta=None if isinstance(reverse, bool) else reverse, gold_topk=gold_topk)
    per_chunk = details.per_chunk
    if sample_weights is not None:
        per_chunk = per_chunk * sample_weights.double()[:, None]
    loss = per_chunk.sum() / details.counted.sum().clamp_min(1)
    if ce_weight:
        mask = case.labels >= 0
        loss = loss + ce_weight * torch.nn.functional.cross_entropy(z[mask], case.labels[mask])
    loss.backward()
    return loss.item(), z.grad, details


def _close(got, want, grad, ref_grad, what, rtol=RTOL):
    assert got == pytest.approx(want, rel=rtol), what
    scale = ref_grad.abs().max().item()
    torch.testing.assert_close(grad, ref_grad, rtol=rtol, atol=rtol * scale,
                               msg=lambda m: f"{what}: {m}")


def _case(form: str):
    """Ragged chunks, some invalid or inexact, positions predicting none, padded columns
    (gold's a little shorter: the interpreter sorts each row's list on its own)."""
    ts, tt = (24, 20) if form == "image" else (16, 14)
    return make_case(batch=3 if form == "image" else 2, ts=ts, tt=tt, vs=70, vt=62,
                     vs_padded=96, vt_padded=72, seed=3, normalised_rows=True)


CASES = [
    # mode, form, T, reverse (or JSD beta), CE weight, uncommon cap
    ("pkl", "image", 1.0, False, 0.5, 8192),
    ("pkl", "image", 2.0, True, 0.0, 8192),
    ("pkl", "image", 1.5, 0.5, 1.0, 8192),
    ("gold", "gold", 1.0, False, 0.0, 8192),
    ("gold", "gold", 2.0, True, 1.0, 5),
    ("hkl", "gold", 1.0, False, 1.0, 8192),
    ("hkl", "gold", 1.5, 0.3, 0.0, 7),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[2]}-{c[3]}-ce{c[4]}")
def test_fused_forms_match_reference(counted, config, device):
    """One process, padded vocabulary, ragged and invalid chunks, positions predicting none."""
    mode, form, temp, reverse, ce_w, unc = config
    case = _case(form)
    loss, grad, padded, terms = _loss(case, mode, form, temp, reverse, ce_w, uncommon=unc,
                                      device=device)
    ref, ref_grad, details = _reference(case, mode, temp, reverse, ce_w, uncommon=unc)
    assert len(counted) == 1  # the fused passes took the call
    _close(loss, ref, grad, ref_grad, str(config))
    assert torch.count_nonzero(padded) == 0
    assert terms.kd_count.item() == details.counted.sum().item()
    assert terms.top1.item() == details.top1.sum().item()


#: the compact payload (gold_topk): mode, T, reverse (or JSD beta), CE weight, uncommon cap,
#: (k, k'), the whole-row kernel (else the one-step kernels at one TP rank). Its 32 / 40 common
#: pairs and n = 30 / 22, or the cap, sorted uncommon ranks (gold / H-KL): a bucket and a
#: tail; k' past n (no tail); k past M (no bucket); the smallest sizes; a tail of one rank;
#: (0, 0), all of both (today's gold)
COMPACT_CASES = [
    ("gold", 1.0, False, 0.0, 8192, (4, 3), True),
    ("gold", 2.0, True, 1.0, 5, (6, 10**6), False),
    ("hkl", 1.5, 0.3, 0.5, 8192, (10**6, 2), True),
    ("hkl", 1.0, False, 1.0, 7, (1, 1), False),
    ("hkl", 2.0, True, 0.0, 8192, (5, 21), True),
    ("gold", 1.5, 0.5, 1.0, 8192, (0, 0), False),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", COMPACT_CASES,
                         ids=lambda c: f"{c[0]}-T{c[1]}-{c[2]}-ce{c[3]}-n{c[4]}-k{c[5]}-"
                                       f"{'whole' if c[6] else 'steps'}")
def test_fused_compact_gold_matches_reference(counted, config, device, monkeypatch):
    """Compact gold / H-KL (``gold_topk``): the teacher's top-k pairs and the bucket of the
    rest, the sorted uncommon head of k' and the tail of ranks k'..n-1, loss and gradient
    against the float64 reference of the definition (rel 1e-5), CE, T != 1, all divergences,
    by the whole-row kernel and the one-step ones."""
    mode, temp, reverse, ce_w, unc, sizes, whole = config
    monkeypatch.setattr(fused_gold, "WHOLE_ROWS", whole)
    case = _case("gold")
    loss, grad, padded, terms = _loss(case, mode, "gold_topk", temp, reverse, ce_w,
                                      uncommon=unc, device=device, gold_topk=sizes)
    ref, ref_grad, details = _reference(case, mode, temp, reverse, ce_w, uncommon=unc,
                                        gold_topk=sizes)
    assert len(counted) == 1 and type(counted[0].form) is CompactGoldPass
    _close(loss, ref, grad, ref_grad, str(config))
    assert torch.count_nonzero(padded) == 0
    assert terms.kd_count.item() == details.counted.sum().item()
    assert terms.top1.item() == details.top1.sum().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["image", "gold"])
def test_one_step_kernels_at_one_tp_rank(counted, form, device, monkeypatch):
    """The kernels a step (what TP / CP layouts run, with their sums between) at one TP rank,
    where the whole-row kernel otherwise takes the rows: the same sums."""
    monkeypatch.setattr(fused_image, "WHOLE_ROWS", False)
    monkeypatch.setattr(fused_gold, "WHOLE_ROWS", False)
    mode, temp, reverse, unc = ("pkl", 2.0, 0.5, 8192) if form == "image" else \
        ("hkl", 1.5, True, 6)
    case = _case(form)
    loss, grad, padded, terms = _loss(case, mode, form, temp, reverse, 1.0, uncommon=unc,
                                      device=device)
    ref, ref_grad, details = _reference(case, mode, temp, reverse, 1.0, uncommon=unc)
    _close(loss, ref, grad, ref_grad, form)
    assert torch.count_nonzero(padded) == 0
    assert terms.top1.item() == details.top1.sum().item()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["image", "gold", "gold_topk"])
def test_several_groups_and_the_forward_written_gradient(counted, form, device):
    """Row groups of a few rows each (a small budget), the forward that writes the gradient
    (``loss_weights``), and per-sample weights: the same as the reference (the compact
    payload at (k, k') = (3, 2) of n = 6)."""
    mode = "pkl" if form == "image" else "hkl"
    sizes = (3, 2) if form == "gold_topk" else None
    case = make_case(batch=4 if form == "image" else 2, ts=20, tt=18, vs=60, vt=50,
                     vs_padded=64, seed=8)
    weights = torch.tensor([1.0, 0.0, 2.5, 0.5])[: case.chunk_valid.shape[0]]
    loss, grad, padded, _ = _loss(case, mode, form, 2.0, False, 0.5, uncommon=6,
                                  block_bytes=4 * 300, ahead=True, device=device,
                                  sample_weights=weights.to(device), gold_topk=sizes or (0, 0))
    ref, ref_grad, _ = _reference(case, mode, 2.0, False, 0.5, uncommon=6,
                                  sample_weights=weights, gold_topk=sizes)
    assert len(counted) == 2 and len(counted[1].layout.groups) > 1
    assert counted[1].wrote is None  # handed to the backward
    _close(loss, ref, grad, ref_grad, form)
    assert torch.count_nonzero(padded) == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["image", "gold"])
def test_no_chunk_rows_and_an_empty_sample(counted, form, device):
    """A sample whose chunks are all invalid, and a call with no chunk at all (CE alone is
    left): the gradient of the positions predicting none is CE's."""
    mode = "pkl" if form == "image" else "gold"
    case = make_case(batch=2, ts=16, tt=14, vs=40, vt=36, seed=5)
    case.chunk_valid[0] = False
    loss, grad, _, _ = _loss(case, mode, form, 1.0, False, 1.0, device=device)
    ref, ref_grad, _ = _reference(case, mode, 1.0, False, 1.0)
    _close(loss, ref, grad, ref_grad, f"{form}, one empty sample")
    case.chunk_valid[:] = False
    loss, grad, _, terms = _loss(case, mode, form, 1.0, False, 1.0, device=device)
    ref, ref_grad, _ = _reference(case, mode, 1.0, False, 1.0)
    assert terms.kd_count.item() == 0
    _close(loss, ref, grad, ref_grad, f"{form}, no chunk")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["gold", "gold_topk"])
@pytest.mark.parametrize("whole_rows", [True, False])
def test_gold_ties_at_the_cut(counted, device, form, whole_rows, monkeypatch):
    """Eight uncommon student tokens with the same logits at every position, the largest
    uncommon ones, and five compared: the radix select's cut falls inside the tie (the compact
    payload's head of k' = 3 too: its cut to the tail as well). Which tied columns are taken is
    arbitrary (the reference's topk takes others), so the loss and, per position, the gradient
    summed over the tied columns equal the reference's; elsewhere each element does."""
    monkeypatch.setattr(fused_gold, "WHOLE_ROWS", whole_rows)
    sizes = (4, 3) if form == "gold_topk" else None
    case = _case("gold")
    common, _ = common_vocab_from_dense(case.projection, "gold")
    uncommon = torch.ones(case.vs, dtype=torch.bool)
    uncommon[common] = False
    tied = torch.nonzero(uncommon, as_tuple=True)[0][:8]
    case.student_logits[..., tied] = 4.0
    loss, grad, padded, _ = _loss(case, "gold", form, 1.0, False, 0.5, uncommon=5,
                                  device=device, gold_topk=sizes or (0, 0))
    ref, ref_grad, _ = _reference(case, "gold", 1.0, False, 0.5, uncommon=5, gold_topk=sizes)
    assert loss == pytest.approx(ref, rel=RTOL)
    rest = torch.ones(case.vs, dtype=torch.bool)
    rest[tied] = False
    _close(loss, ref, grad[..., rest], ref_grad[..., rest], "outside the tie")
    _close(loss, ref, grad[..., tied].sum(-1), ref_grad[..., tied].sum(-1), "over the tie")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["image", "gold"])
def test_bf16_logits(counted, form, device):
    """bf16 logits: fp32 inside, the gradient stored once in bf16 (within bf16's rounding of
    the reference on the same rounded logits)."""
    mode = "pkl" if form == "image" else "gold"
    case = make_case(batch=2, ts=16, tt=14, vs=50, vt=44, vs_padded=64, seed=2)
    loss, grad, padded, _ = _loss(case, mode, form, 1.0, False, 0.5, dtype=torch.bfloat16,
                                  device=device)
    ref, ref_grad, _ = _reference(case, mode, 1.0, False, 0.5, rounded_to=torch.bfloat16)
    _close(loss, ref, grad, ref_grad, f"{form} bf16", rtol=1e-2)
    assert torch.count_nonzero(padded) == 0


def _run_fused_layout(tp: int, cp: int, case_kwargs: dict, configs: list, block_bytes: int,
                      weights_ahead: bool = False) -> dict:
    """test_loss_parallel's layout run with the fused passes forced on in this rank; the
    number of calls they took comes back with the results."""
    os.environ[fused_call.ENV] = "1"
    taken = []
    run = fused_call.run

    def counting(call, logits):
        taken.append(len(call.layout.groups))
        return run(call, logits)

    fused_call.run = counting
    try:
        out = layouts._run_layout(tp, cp, case_kwargs, configs, block_bytes, weights_ahead)
    finally:
        fused_call.run = run
    out["fused_calls"] = len(taken)
    return out


#: test_loss_parallel's case, shorter (the interpreter runs a kernel's programs one by one)
SMALL = dict(layouts.CASE, batch=2, ts=16, tt=12)
#: a layout call's limit: the interpreter on a busy 2-core machine
LIMIT_S = 1500


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def expected():
    """test_loss_parallel's references and payloads for :data:`SMALL` (the FUSED configs)."""
    case = make_case(**SMALL)
    made: dict = {}

    def get(n_dp: int):
        if n_dp not in made:
            made[n_dp] = (case,
                          {i: layouts._reference(case, layouts.CONFIGS[i], n_dp) for i in FUSED},
                          {i: layouts._payload(case, layouts.CONFIGS[i], n_dp) for i in FUSED})
        return made[n_dp]

    return get


@_ON_CPU
@pytest.mark.parametrize("tp,cp", [
    pytest.param(2, 1, marks=pytest.mark.slow),  # TP 2 x CP 2 below holds both in the default run
    pytest.param(1, 2, marks=pytest.mark.slow),
    (2, 2)])
def test_fused_forms_in_parallel_layouts(pool, expected, tp, cp):
    """TP 2 (vocabulary-parallel partitions, pair sums, radix histograms and lists summed over
    TP), CP 2 (chunks split over CP summed over CP, counted by their owner) and both."""
    configs = [layouts.CONFIGS[i] for i in FUSED]
    outs = pool.run(_run_fused_layout, tp, cp, SMALL, configs, 4 * 16 * 5, timeout=LIMIT_S)
    assert all(out["fused_calls"] == len(configs) for out in outs)
    layouts._check_layout(outs, expected, tp, cp, FUSED)


@_ON_CPU
def test_fused_forward_gradient_in_tp_cp(pool, expected):
    """``loss_weights`` in TP 2 x CP 2: the forward writes the gradient, split chunks too."""
    which = [7, 12]
    outs = pool.run(_run_fused_layout, 2, 2, SMALL, [layouts.CONFIGS[i] for i in which],
                    4 * 16 * 5, True, timeout=LIMIT_S)
    assert all(out["fused_calls"] == 2 * len(which) for out in outs)  # the no-grad call too
    layouts._check_layout(outs, expected, 2, 2, which)


#: compact gold in test_loss_parallel's format (the topk slot holds (k, k')): forward KL with a
#: bucket and a tail; reverse at T 2 with CE, 5 uncommon ranks, k' past them; H-KL JSD with CE
#: (dynamic), k past M
COMPACT = [
    ("gold", "gold_topk", (4, 3), 1.0, False, False, 0.0, False, 8192),
    ("gold", "gold_topk", (6, 10**6), 2.0, True, False, 1.0, False, 5),
    ("hkl", "gold_topk", (10**6, 2), 1.5, 0.3, False, 1.0, True, 8192),
]


@pytest.fixture(scope="module")
def expected_compact():
    """test_loss_parallel's references and payloads for :data:`SMALL` (the COMPACT configs)."""
    return layouts.references_by_dp(make_case(**SMALL), COMPACT)


@_ON_CPU
@pytest.mark.parametrize("tp,cp,ahead,which", [
    (2, 2, False, [0]),  # the bucket over TP and the tail, split chunks: the default run's
    pytest.param(2, 2, False, [0, 1, 2], marks=pytest.mark.slow),
    pytest.param(2, 1, False, [0, 1, 2], marks=pytest.mark.slow),
    pytest.param(1, 2, False, [0, 1, 2], marks=pytest.mark.slow),
    # the forward's gradient (the default run has it at one process; not with dynamic scaling,
    # whose KD weight is known only after the call)
    pytest.param(2, 2, True, [0, 1], marks=pytest.mark.slow),
], ids=lambda v: "-".join(map(str, v)) if isinstance(v, list) else str(v))
def test_fused_compact_gold_in_parallel_layouts(pool, expected_compact, tp, cp, ahead, which):
    """The compact payload in TP 2 (top pairs summed over TP, the bucket's logsumexp from
    each rank's (max, sum), the radix select's lists summed), CP 2 (chunks split over CP) and
    both; ``ahead``: the forward writes the gradient."""
    configs = [COMPACT[i] for i in which]
    outs = pool.run(_run_fused_layout, tp, cp, SMALL, configs, 4 * 16 * 5, ahead,
                    timeout=LIMIT_S)
    assert all(out["fused_calls"] == (2 if ahead else 1) * len(configs) for out in outs)
    layouts._check_layout(outs, expected_compact, tp, cp, which, configs=COMPACT)
