"""Compact gold / H-KL (``gold_topk``): its definition against a per-chunk loop, its limit
(today's gold and H-KL at full sizes) and how it converges as k and k' grow."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_xdistill.loss.definitions import reference
from megatron_xdistill.loss.definitions.formulas import (
    gold_kl,
    gold_topk_kl,
    gold_topk_teacher,
)
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
    """The dense reference (float32) in its compact form: (0, 0) and (M, n) are today's gold / H-KL; smaller
    sizes fall short by an amount that shrinks monotonically as k and k' grow (printed)."""
    case = make_case(batch=3, ts=40, tt=36, vs=300, vt=260, seed=3, realistic=True)
    full = _reference(case, mode)
    assert _reference(case, mode, gold_topk=(0, 0)) == pytest.approx(full, rel=1e-6)
    assert _reference(case, mode, gold_topk=(10**6, 10**6)) == pytest.approx(full, rel=1e-6)
    sizes = [(1, 1), (4, 8), (16, 32), (64, 64), (128, 128), (0, 0)]
    values = [_reference(case, mode, gold_topk=size) for size in sizes]
    print(f"{mode} {full:.5f}; relative shortfall by (k, k'):",
          {size: f"{(full - v) / full:.2e}" for size, v in zip(sizes, values)})
    assert all(lo <= hi * (1 + 1e-6) for lo, hi in zip(values, values[1:]))
