"""The per-chunk formulas of ``loss.definitions.formulas`` against their definitions written out
here in float64 (sums over columns, ``torch.nn.functional.kl_div``, a mixture in log space)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_xdistill.loss.definitions.common import EPS, TINY
from megatron_xdistill.loss.definitions.formulas import (
    chunk_topk_columns,
    divergence,
    gold_kl,
    gold_topk_sizes,
    grad_scale,
    normaliser,
    projected_kl,
    teacher_only_terms,
)


def _logits(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64) * 2


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(A || B) per row by torch's kl_div."""
    return F.kl_div(log_b, log_a, log_target=True, reduction="none").sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "q-from-log"])
def test_divergence_is_forward_kl_jsd_or_reverse_kl(beta, with_q):
    log_p = torch.log_softmax(_logits(5, 11, 0), -1)
    log_q = torch.log_softmax(_logits(5, 11, 1), -1)
    got = divergence(log_p, log_q.exp() if with_q else None, log_q, beta)
    if beta == 0.0:
        want = _kl(log_p, log_q)
    elif beta == 1.0:
        want = _kl(log_q, log_p)
    else:
        log_m = torch.logsumexp(torch.stack([log_p + math.log(beta),
                                             log_q + math.log(1 - beta)]), 0)
        want = beta * _kl(log_p, log_m) + (1 - beta) * _kl(log_q, log_m)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert (want > 0).all()


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_teacher_only_terms_are_the_divergence_where_the_student_has_no_mass(beta):
    """Columns where the projected student mass is 0: forward KL counts q = EPS there, the JSD
    its mixture beta P, reverse KL nothing; summed over those columns only."""
    p = torch.softmax(_logits(4, 9, 2), -1)
    outside = torch.zeros(9, dtype=torch.bool)
    outside[[1, 4, 5]] = True
    po = p[:, outside]
    if beta == 0.0:
        want = (po * (po.log() - math.log(EPS))).sum(-1)
    elif beta == 1.0:
        want = torch.zeros(4, dtype=torch.float64)
    else:
        want = (beta * po * (po.log() - (beta * po).log())).sum(-1)
    got = teacher_only_terms(beta, (po * po.log()).sum(-1).float(), po.sum(-1).float())
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_projected_kl_without_and_with_a_tail_bucket(beta):
    log_p = torch.log_softmax(_logits(3, 6, 3), -1)
    q_sum = torch.rand(3, 6, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    q = q_sum / q_sum.sum(-1, keepdim=True)
    log_q = (q + EPS).log()
    want = _kl(log_p, log_q) if beta == 0.0 else (q * (log_q - log_p)).sum(-1)
    torch.testing.assert_close(projected_kl(log_p, q_sum, None, beta), want, rtol=1e-12,
                               atol=1e-14)
    # K = the first 4 columns, the rest one bucket on both sides; Q over all of V_t by q_total
    total = q_sum.sum(-1) * 1.5
    tail_p = log_p[:, 4:].exp().sum(-1)
    p_k = torch.cat([log_p[:, :4].exp(), tail_p[:, None]], -1)
    q_k = torch.cat([q_sum[:, :4] / total[:, None], (1 - q_sum[:, :4].sum(-1) / total)[:, None]],
                    -1)
    log_qk = (q_k + EPS).log()
    want = (p_k * (p_k.log() - log_qk)).sum(-1) if beta == 0.0 else \
        (q_k * (log_qk - p_k.log())).sum(-1)
    got = projected_kl(log_p[:, :4], q_sum[:, :4], total, beta, tail_p.log())
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    # student mass on K above its total: the bucket is 0, not negative
    got = projected_kl(log_p[:, :4], q_sum[:, :4], q_sum[:, :4].sum(-1) * 0.5, beta, tail_p.log())
    assert torch.isfinite(got).all()


def test_gold_kl_is_the_common_kl_plus_the_sorted_l1():
    a = torch.log_softmax(_logits(2, 5, 5), -1)
    b = torch.log_softmax(_logits(2, 5, 6), -1)
    s_sorted = torch.tensor([[0.3, 0.2], [0.1, 0.05]], dtype=torch.float64)
    t_sorted = torch.tensor([[0.1, 0.25], [0.1, 0.0]], dtype=torch.float64)
    want = _kl(b, a) + torch.tensor([0.2 + 0.05, 0.05], dtype=torch.float64)
    torch.testing.assert_close(gold_kl(a, b, s_sorted, t_sorted, 0.0), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(gold_kl(a, b, s_sorted, t_sorted, 1.0),
                               _kl(a, b) + want - _kl(b, a), rtol=1e-12, atol=0)


def test_chunk_topk_columns_keep_the_top_k_and_bucket_the_rest():
    t = torch.log_softmax(_logits(3, 8, 7), -1)
    values, columns, tail = chunk_topk_columns(t, 3)
    for r in range(3):
        order = sorted(range(8), key=lambda c: -float(t[r, c]))
        assert columns[r].tolist() == order[:3]
        torch.testing.assert_close(values[r], t[r, order[:3]], rtol=0, atol=0)
        rest = sum(math.exp(float(t[r, c])) for c in order[3:])
        assert float(tail[r]) == pytest.approx(math.log(rest), rel=1e-12)
    _, _, empty = chunk_topk_columns(t, 8)  # nothing left: the floor
    torch.testing.assert_close(empty, torch.full((3,), math.log(TINY), dtype=torch.float64))


def test_normaliser_and_grad_scale():
    u = torch.tensor([[1.0, 3.0], [0.0, 0.0], [0.5, 0.25]], dtype=torch.float64)
    sums, inv = normaliser(u)
    assert sums.tolist() == [4.0, 0.0, 0.75]
    torch.testing.assert_close(inv, torch.tensor([0.25, 1 / TINY, 1 / 0.75],
                                                 dtype=torch.float64), rtol=1e-15, atol=0)
    scale = grad_scale(torch.tensor(2.0, dtype=torch.float32), inv)
    assert scale.dtype == torch.float64 and scale.is_contiguous()
    torch.testing.assert_close(scale, 2.0 * inv, rtol=0, atol=0)
    rows = torch.tensor([1.0, 0.0, 3.0])
    torch.testing.assert_close(grad_scale(rows, inv), rows.double() * inv, rtol=0, atol=0)


def test_gold_topk_sizes_cap_at_the_pairs_and_ranks_and_take_zero_for_all():
    """The compact payload's sizes: a flag's k / k' capped at the M common pairs and the n ranks,
    0 meaning all of them; a negative size is refused naming both."""
    assert gold_topk_sizes(64, 256, 30000, 2000) == (64, 256)
    assert gold_topk_sizes(64, 256, 40, 30) == (40, 30)  # a chunk smaller than the flags
    assert gold_topk_sizes(40, 30, 40, 30) == (40, 30)
    assert gold_topk_sizes(0, 0, 40, 30) == (40, 30)  # 0: all (today's gold)
    assert gold_topk_sizes(0, 7, 40, 30) == (40, 7)
    assert gold_topk_sizes(5, 0, 40, 30) == (5, 30)
    for bad in [(-1, 0), (0, -1), (-1, -1)]:
        with pytest.raises(ValueError, match=f"must be >= 0 .*got {bad[0]}, {bad[1]}"):
            gold_topk_sizes(*bad, 40, 30)
