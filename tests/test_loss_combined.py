"""``loss.combined_loss``: several teachers' KD sums and one CE, written out by hand.

Single process (no group): the sums are the microbatch's and the denominators are given, so
every quantity of the formula is known; the gradient reaching each teacher's KD sum is its
weight over its denominator (scaled by the stop-gradient factor with dynamic scaling).
"""

from __future__ import annotations

import pytest
import torch

from megatron_xdistill.loss import KDTerms, combined_loss, total_loss


def _terms(kd_sum: float, kd_count: float, top1: float, ce_sum: float = 0.0,
           ce_count: float = 0.0) -> KDTerms:
    return KDTerms(torch.tensor(kd_sum, requires_grad=True), torch.tensor(kd_count),
                   torch.tensor(top1), torch.tensor(ce_sum, requires_grad=True),
                   torch.tensor(ce_count))


def _three():
    # teacher 0 carries the CE (its call has the labels); 1 and 2 carry KD only
    return [_terms(12.0, 30.0, 9.0, ce_sum=80.0, ce_count=40.0), _terms(5.0, 10.0, 4.0),
            _terms(7.5, 20.0, 2.0)]


def test_weighted_sum_of_teachers():
    terms, weights, dens = _three(), [0.5, 0.3, 0.2], [60.0, 25.0, 40.0]
    loss, metrics = combined_loss(terms, kd_weights=weights, ce_weight=0.7,
                                  kd_denominators=dens, ce_denominator=50.0)
    want = 0.5 * 12 / 60 + 0.3 * 5 / 25 + 0.2 * 7.5 / 40 + 0.7 * 80 / 50
    assert float(loss) == pytest.approx(want, rel=1e-6)
    loss.backward()
    for t, w, n in zip(terms, weights, dens, strict=True):
        assert float(t.kd_sum.grad) == pytest.approx(w / n, rel=1e-6)
    assert float(terms[0].ce_sum.grad) == pytest.approx(0.7 / 50, rel=1e-6)
    assert [m["kd"] for m in metrics["teachers"]] == pytest.approx([0.4, 0.5, 0.375])
    assert [m["top1_agree"] for m in metrics["teachers"]] == pytest.approx([0.3, 0.4, 0.1])
    assert metrics["ce"] == pytest.approx(2.0)


def test_dynamic_scaling_rescales_the_weighted_kd_to_ce():
    terms, weights, dens = _three(), [0.5, 0.3, 0.2], [60.0, 25.0, 40.0]
    loss, metrics = combined_loss(terms, kd_weights=weights, dynamic_scaling=True,
                                  kd_denominators=dens, ce_denominator=50.0)
    kd_mean = 0.5 * 0.4 + 0.3 * 0.5 + 0.2 * 0.375  # microbatch means, weighted
    scale = 2.0 / kd_mean  # CE mean 80 / 40
    kd = 0.5 * 12 / 60 + 0.3 * 5 / 25 + 0.2 * 7.5 / 40
    assert metrics["kd_scale"] == pytest.approx(scale)
    assert float(loss) == pytest.approx(scale * kd + 80 / 50, rel=1e-6)
    loss.backward()  # the scale carries no gradient
    assert float(terms[1].kd_sum.grad) == pytest.approx(scale * 0.3 / 25, rel=1e-6)


def test_selection_pools_the_chunks_of_the_chosen_teachers():
    """Selection: one denominator for all teachers' chunks; dynamic scaling divides by the
    pooled mean, so the KD term's size is what CE's is."""
    terms, weights = _three(), [1.0, 1.0, 1.0]
    pooled = 30.0 + 10.0 + 20.0
    loss, metrics = combined_loss(terms, kd_weights=weights, dynamic_scaling=True,
                                  kd_denominators=[pooled] * 3, ce_denominator=40.0,
                                  shared_denominator=True)
    kd = (12 + 5 + 7.5) / pooled
    assert metrics["kd_scale"] == pytest.approx(2.0 / kd)
    assert float(loss) == pytest.approx(2.0 / kd * kd + 2.0, rel=1e-6)  # = 2 x CE


def test_one_teacher_total_loss_is_the_one_teacher_combination():
    """total_loss (one teacher) = combined_loss of one; under dynamic scaling its weight does
    not apply (as documented for --kd-weight)."""
    for dynamic in (False, True):
        one = _terms(12.0, 30.0, 9.0, ce_sum=80.0, ce_count=40.0)
        loss, metrics = total_loss(one, kd_weight=0.25, ce_weight=0.5, dynamic_scaling=dynamic,
                                   kd_denominator=60.0, ce_denominator=50.0)
        weight = 1.0 if dynamic else 0.25
        same, _ = combined_loss([_terms(12.0, 30.0, 9.0, ce_sum=80.0, ce_count=40.0)],
                                kd_weights=[weight], ce_weight=0.5, dynamic_scaling=dynamic,
                                kd_denominators=[60.0], ce_denominator=50.0)
        assert float(loss) == pytest.approx(float(same), rel=1e-7)
        assert metrics["kd"] == pytest.approx(0.4) and metrics["top1_agree"] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="2 teachers' terms need as many weights"):
        combined_loss(_three()[:2], kd_weights=[1.0], kd_denominators=[1.0, 1.0])
