"""Per-chunk formulas of DESIGN.md on chunk-level quantities, shared by the reference and the
parallel loss (which differ in how they get there: dense vs sharded, chunked, recomputed)."""

from __future__ import annotations

import torch

from .common import EPS, TINY


def projected_kl(
    log_p: torch.Tensor, q_sum: torch.Tensor, q_total: torch.Tensor | None, reverse: bool,
    tail_log_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """KL_c between the teacher's chunk log-probs on K and the student's projected mass on K.

    ``q_sum`` [.., k]: the student's projected chunk mass (sums or means) on K, renormalised
    within K. With a tail bucket (``tail_log_p``), Q is normalised over all of V_t by
    ``q_total`` and the bucket holds the rest. Shared by the reference and the parallel loss.
    """
    if tail_log_p is None:
        q = q_sum / q_sum.sum(-1, keepdim=True).clamp_min(TINY)
    else:
        total = q_total.clamp_min(TINY)
        q_k = q_sum / total[..., None]
        q_tail = ((q_total - q_sum.sum(-1)) / total).clamp_min(0)
        q = torch.cat([q_k, q_tail[..., None]], dim=-1)
        log_p = torch.cat([log_p, tail_log_p[..., None]], dim=-1)
    log_q = torch.log(q + EPS)
    if reverse:
        return (q * (log_q - log_p)).sum(-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def gold_kl(
    a_common: torch.Tensor, b_common: torch.Tensor, s_sorted: torch.Tensor,
    t_sorted: torch.Tensor, reverse: bool,
) -> torch.Tensor:
    """KL on the common columns (chunk-mean log-probs a vs b) + L1 of sorted uncommon probs."""
    if reverse:
        kl = (a_common.exp() * (a_common - b_common)).sum(-1)
    else:
        kl = (b_common.exp() * (b_common - a_common)).sum(-1)
    return kl + (s_sorted - t_sorted).abs().sum(-1)


def chunk_topk_columns(
    t_mean: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compressed teacher form from chunk-mean log-probs [.., V_t]: (log-probs, columns, tail).

    The tail is the summed probability P_c of all columns outside the top k (log, floored).
    """
    values, columns = t_mean.topk(k, dim=-1)
    rest = t_mean.scatter(-1, columns, float("-inf")).exp().sum(-1)
    return values, columns, rest.clamp_min(TINY).log()
