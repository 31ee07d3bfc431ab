"""Compact gold / H-KL (``gold_topk``): its definition against a per-chunk loop, its limit
(today's gold and H-KL at full sizes) and how it converges as k and k' grow; the teacher's
payload and the student's loss against the dense reference, single process and in TP / CP
layouts (test_loss_parallel's machinery), and equal to the gold payload's at full sizes."""

from __future__ import annotations

import math

import pytest
import test_loss_parallel as layouts
import torch

from megatron_xdistill.loss import parallel_kd_loss
from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.common import common_vocab_from_dense, predicting_chunk_id
from megatron_xdistill.loss.definitions.formulas import (
    gold_kl,
    gold_topk_kl,
    gold_topk_teacher,
)
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload
from megatron_xdistill.testing.multirank import RankPool
from megatron_xdistill.testing.synthetic_kd import make_case


def _loop_compact(a, b, s, t, k, k_unc):
    """Forward KL of one chunk from the definition, by hand: the teacher's k most probable
    pairs, one bucket of the rest on both sides, the sorted uncommon head and one tail."""
    order = sorted(range(len(b)), key=lambda i: -b[i])
    top, rest = order[:k], order[k:]
    kl = sum(math.exp(b[i]) * (b[i] - a[i]) for i in top)
    if rest:
        p_rest = sum(math.exp(b[i]) for i in rest)
        q_rest = sum(math.exp(a[i]) for i in rest)
        kl += p_rest * (math.log(p_rest) - math.log(q_rest))
    kl += sum(abs(s[j] - t[j]) for j in range(k_unc))
    return kl + abs(sum(s[k_unc:]) - sum(t[k_unc:]))


def _chunks(seed: int, rows: int = 6, m: int = 40, n: int = 30):
    """Chunk-level quantities like a loss call's: sub-normalised log-probs on M common pairs,
    n sorted uncommon probabilities a side."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.log_softmax(2 * torch.randn(rows, m + n + 20, generator=gen, dtype=torch.float64), 1)
    b = torch.log_softmax(2 * torch.randn(rows, m + n + 20, generator=gen, dtype=torch.float64), 1)
    s = a[:, m:].exp().sort(1, descending=True).values[:, :n]
    t = b[:, m:].exp().sort(1, descending=True).values[:, :n]
    return a[:, :m], b[:, :m], s, t


def test_formula_equals_a_loop_and_gold_at_full_sizes():
    a, b, s, t = _chunks(0)
    m, n = a.shape[1], s.shape[1]
    for k, k_unc in [(1, 1), (5, 7), (m - 1, n - 1), (m, n), (m, 3), (4, n)]:
        b_top, cols, rest, t_head, t_tail = gold_topk_teacher(b, t, k, k_unc)
        got = gold_topk_kl(a, cols, b_top, rest, s, t_head, t_tail, 0.0)
        want = [_loop_compact(a[r].tolist(), b[r].tolist(), s[r].tolist(), t[r].tolist(), k,
                              k_unc) for r in range(a.shape[0])]
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12,
                                   atol=0)
    for beta in (0.0, 1.0, 0.4):
        b_top, cols, rest, t_head, t_tail = gold_topk_teacher(b, t, m, n)
        torch.testing.assert_close(gold_topk_kl(a, cols, b_top, rest, s, t_head, t_tail, beta),
                                   gold_kl(a, b, s, t, beta), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("beta", [0.0, 1.0, 0.5], ids=["forward", "reverse", "jsd"])
def test_formula_grows_to_gold_within_the_tail_bound(beta):
    """Merging pairs into the bucket, ranks into the tail, can only lower each part (log-sum
    and triangle inequalities): nested top sets give values that grow with k and k' up to
    gold, and the uncommon part falls short by at most the two tails' masses."""
    a, b, s, t = _chunks(1)
    m, n = a.shape[1], s.shape[1]
    full = gold_kl(a, b, s, t, beta)
    ks = (1, 2, 5, 10, 20, 39, 40)
    for k_unc in (1, 8, n):
        values = []
        for k in ks:
            b_top, cols, rest, t_head, t_tail = gold_topk_teacher(b, t, k, k_unc)
            values.append(gold_topk_kl(a, cols, b_top, rest, s, t_head, t_tail, beta))
        for lo, hi in zip(values, values[1:]):
            assert bool((lo <= hi + 1e-12).all())
        assert bool((values[-1] <= full + 1e-12).all())
    l1_full = (s - t).abs().sum(1)
    for k_unc in range(0, n + 1):
        b_top, cols, rest, t_head, t_tail = gold_topk_teacher(b, t, m, k_unc)
        short = full - gold_topk_kl(a, cols, b_top, rest, s, t_head, t_tail, beta)
        assert bool((short >= -1e-12).all())
        assert bool((short <= s[:, k_unc:].sum(1) + t[:, k_unc:].sum(1) + 1e-12).all())
    assert bool((l1_full > 0).all())


def _reference(case, mode, **kw):
    return float(reference.kd_loss(
        case.real_student_logits.double(), case.real_teacher_logits.double(),
        case.student_chunk_id, case.teacher_chunk_id, case.chunk_valid, case.chunk_exact,
        case.projection.double(), mode, **kw))


@pytest.mark.parametrize("mode", ["gold", "hkl"])
def test_reference_converges_to_todays_gold(mode):
    """The dense reference (float32) in its compact form: (0, 0) and (M, n) are today's
    gold / H-KL; smaller sizes fall short by an amount that shrinks monotonically as k and k'
    grow (printed)."""
    case = make_case(batch=3, ts=40, tt=36, vs=300, vt=260, seed=3, realistic=True)
    full = _reference(case, mode)
    assert _reference(case, mode, gold_topk=(0, 0)) == pytest.approx(full, rel=1e-6)
    assert _reference(case, mode, gold_topk=(10**6, 10**6)) == pytest.approx(full, rel=1e-6)
    sizes = [(1, 1), (4, 8), (16, 32), (64, 64), (128, 128), (0, 0)]
    values = [_reference(case, mode, gold_topk=size) for size in sizes]
    print(f"{mode} {full:.5f}; relative shortfall by (k, k'):",
          {size: f"{(full - v) / full:.2e}" for size, v in zip(sizes, values)})
    assert all(lo <= hi * (1 + 1e-6) for lo, hi in zip(values, values[1:]))


# ----------------------------------------------------------------- the student and teacher sides
#: (mode, form, (k, k'), temperature, reverse, exact_only, ce_weight, dynamic, uncommon_topk), as
#: test_loss_parallel.CONFIGS: forward KL; reverse at T 2 with CE; H-KL JSD with CE (dynamic);
#: H-KL exact-only at T 1.5 with 12 uncommon ranks; k = M and k' = n (today's gold)
COMPACT = [
    ("gold", "gold_topk", (4, 3), 1.0, False, False, 0.0, False, 8192),
    ("gold", "gold_topk", (6, 5), 2.0, True, False, 1.0, False, 8192),
    ("hkl", "gold_topk", (5, 4), 1.0, 0.5, False, 1.0, True, 8192),
    ("hkl", "gold_topk", (3, 2), 1.5, False, True, 0.0, False, 12),
    ("gold", "gold_topk", (0, 0), 1.0, False, False, 0.0, False, 8192),
]


@pytest.fixture(scope="module")
def pool():
    with RankPool(4) as ranks:
        yield ranks


@pytest.fixture(scope="module")
def expected():
    """test_loss_parallel's references and single-process payloads of :data:`COMPACT`."""
    return layouts.references_by_dp(make_case(**layouts.CASE), COMPACT)


@pytest.mark.parametrize("tp,cp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_compact_gold_in_parallel_layouts(pool, expected, tp, cp):
    """Teacher payload from sharded teacher logits, student loss from sharded student logits,
    total over DP x CP, backward: loss, gradient, metrics and payload against the dense
    reference (rel 1e-5) in TP x CP = 1x1, 2x1, 1x2 (chunks split over CP) and 2x2."""
    outs = pool.run(layouts._run_layout, tp, cp, layouts.CASE, COMPACT, 4 * 24 * 5)
    layouts._check_layout(outs, expected, tp, cp, configs=COMPACT)


def test_compact_gold_forward_gradient_tp2(pool, expected):
    """``loss_weights`` (the forward writes the gradient) at TP 2, against the references."""
    which = [0, 1]
    outs = pool.run(layouts._run_layout, 2, 1, layouts.CASE, [COMPACT[i] for i in which],
                    4 * 24 * 5, True)
    layouts._check_layout(outs, expected, 2, 1, which, configs=COMPACT)


def _student(case, payload, mode, common, reverse):
    z = case.student_logits.clone().requires_grad_(True)
    terms = parallel_kd_loss(
        z, payload, predicting_chunk_id(case.student_chunk_id), case.chunk_valid,
        case.chunk_exact, case.projection_rows(z.shape[-1]), student_vocab_size=case.vs,
        mode=mode, reverse=reverse, common_student_ids=common[0], block_bytes=4 * 24 * 5)
    terms.kd_sum.backward()
    return terms.kd_sum.item(), z.grad


@pytest.mark.parametrize("mode,reverse", [("gold", False), ("hkl", False), ("hkl", True)])
def test_full_sizes_equal_todays_gold(mode, reverse):
    """k = M and k' = n: the compact payload's loss and gradient are the gold payload's
    (rel 1e-5), by the student side (a vocabulary larger than the teacher's: n from V_t)."""
    case = make_case(**{**layouts.CASE, "vs": 90})
    common = common_vocab_from_dense(case.projection, mode)
    ids = predicting_chunk_id(case.teacher_chunk_id)
    made = {}
    for form in ("gold", "gold_topk"):
        spec = payload_spec(form, case.chunk_valid.shape[1], case.vt,
                            num_common=common[0].numel(), student_vocab_size=case.vs)
        payload = teacher_payload(case.teacher_logits, ids, spec, vocab_size=case.vt,
                                  common_teacher_ids=common[1])
        made[form] = _student(case, payload, mode, common, reverse)
    assert made["gold_topk"][0] == pytest.approx(made["gold"][0], rel=1e-5)
    scale = made["gold"][1].abs().max().item()
    torch.testing.assert_close(made["gold_topk"][1], made["gold"][1], rtol=1e-5,
                               atol=1e-5 * scale)


def test_payload_sizes_and_round_trip():
    """Sizes from the configuration alone (2k + k' + 3 floats a chunk), the flat form's round
    trip (columns as exact integers), and clear errors for a mismatched payload."""
    spec = payload_spec("gold_topk", 10, 49152, num_common=30000, gold_topk=64,
                        gold_uncommon_topk=256, student_vocab_size=32000)
    assert (spec.width, spec.uncommon, spec.span, spec.pairs) == (64, 256, 2000, 30000)
    assert spec.numel == 10 * (2 * 64 + 256 + 3)
    full = payload_spec("gold_topk", 10, 49152, num_common=30000, student_vocab_size=32000)
    assert (full.width, full.uncommon) == (30000, 2000)
    case = make_case(**layouts.CASE)
    common = common_vocab_from_dense(case.projection, "gold")
    spec = payload_spec("gold_topk", case.chunk_valid.shape[1], case.vt,
                        num_common=common[0].numel(), gold_topk=5, gold_uncommon_topk=4,
                        student_vocab_size=case.vs)
    payload = teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id),
                              spec, vocab_size=case.vt, common_teacher_ids=common[1])
    back = TeacherPayload.from_flat(payload.to_flat(), spec)
    for name, _ in spec._parts():
        assert torch.equal(getattr(back, name), getattr(payload, name)), name
    assert back.columns.dtype == torch.int64
    with pytest.raises(ValueError, match="common pairs"):
        _student(case, payload, "hkl", common_vocab_from_dense(case.projection, "hkl"), False)
    with pytest.raises(ValueError, match="payload of"):
        teacher_payload(case.teacher_logits, predicting_chunk_id(case.teacher_chunk_id), spec,
                        vocab_size=case.vt, common_teacher_ids=common[1][:-1])


def test_a_narrowed_payload_is_what_the_teacher_ships_at_smaller_sizes():
    """A compact gold payload cut to fewer pairs / uncommon probabilities (a cache read at
    smaller sizes) equals the teacher's payload made at those sizes; the cache's plan of it
    from the two keys, and none where the ranks n differ or a size grows."""
    from megatron_xdistill.teacher_cache.narrowing import narrowing

    case = make_case(**layouts.CASE)
    common = common_vocab_from_dense(case.projection, "hkl")
    ids = predicting_chunk_id(case.teacher_chunk_id)

    def made(k, k_unc):
        spec = payload_spec("gold_topk", case.chunk_valid.shape[1], case.vt,
                            num_common=common[0].numel(), gold_topk=k, gold_uncommon_topk=k_unc,
                            student_vocab_size=case.vs)
        return teacher_payload(case.teacher_logits, ids, spec, vocab_size=case.vt,
                               common_teacher_ids=common[1])

    big, small = made(7, 6), made(3, 2)
    for k, k_unc in [(3, 2), (7, 2), (3, 6)]:
        got = big.narrowed(k, k_unc)
        want = small if (k, k_unc) == (3, 2) else made(k, k_unc)
        assert got.spec == want.spec
        torch.testing.assert_close(got.to_flat(), want.to_flat(), rtol=1e-6, atol=1e-7)

    def key(payload):
        s = payload.spec
        return {"data": {"seq_length": s.num_chunks - 1},
                "payload": {"form": "gold_topk", "numel": s.numel,
                            "gold_topk": [s.width, s.uncommon, s.span, s.pairs]}}

    plan = narrowing(key(big), key(small), big.spec.numel)
    torch.testing.assert_close(plan(big.to_flat()), small.to_flat(), rtol=1e-6, atol=1e-7)
    assert narrowing(key(small), key(big), small.spec.numel) is None
    other = key(small)
    other["payload"]["gold_topk"][2] -= 1
    assert narrowing(key(big), other, big.spec.numel) is None
    with pytest.raises(ValueError, match="cannot narrow"):
        small.narrowed(4, 2)
