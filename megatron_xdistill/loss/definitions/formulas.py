"""Per-chunk formulas of DESIGN.md on chunk-level quantities, shared by the reference and the
parallel loss (which differ in how they get there: dense vs sharded, chunked, recomputed)."""

from __future__ import annotations

import math

import torch

from megatron_xdistill.loss.definitions.common import EPS, TINY


def divergence(log_p: torch.Tensor, q: torch.Tensor | None, log_q: torch.Tensor, beta: float
               ) -> torch.Tensor:
    """Per-row divergence of the student Q (``q`` and its log; ``q`` None: exp(log_q), computed
    only where needed) from the teacher P (``log_p``).

    ``beta`` (GKD's): 0 forward KL(P || Q), 1 reverse KL(Q || P), between them the generalized
    Jensen-Shannon divergence beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q
    (as TRL's GKD trainer defines it: beta -> 0 gives 0, not the forward KL, hence the ends are
    the plain KLs).
    """
    if beta == 0.0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if q is None:
        q = log_q.exp()
    if beta == 1.0:
        return (q * (log_q - log_p)).sum(-1)
    p = log_p.exp()
    log_m = torch.log(beta * p + (1.0 - beta) * q)
    return (beta * (p * (log_p - log_m)).sum(-1)
            + (1.0 - beta) * (q * (log_q - log_m)).sum(-1))


def teacher_only_terms(beta: float, plogp: torch.Tensor, outside_mass: torch.Tensor
                       ) -> torch.Tensor:
    """The divergence's terms on the teacher columns where the projected student mass is 0
    (outside W's image, q = EPS there), float64 [rows]: forward KL ``plogp`` - log(EPS) *
    (P's mass there), ``plogp`` the sum of P log P over the columns it covers; reverse KL
    nothing; JSD beta KL(P || beta P) = -beta log(beta) * the mass there."""
    plogp, outside_mass = plogp.to(torch.float64), outside_mass.to(torch.float64)
    if beta == 0.0:
        return plogp - math.log(EPS) * outside_mass
    if beta == 1.0:
        return torch.zeros_like(outside_mass)
    return -beta * math.log(beta) * outside_mass


def projected_kl(
    log_p: torch.Tensor, q_sum: torch.Tensor, q_total: torch.Tensor | None, beta: float,
    tail_log_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Divergence (:func:`divergence`, ``beta``) between the teacher's chunk log-probs on K and
    the student's projected mass on K.

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
    return divergence(log_p, q, torch.log(q + EPS), beta)


def gold_kl(
    a_common: torch.Tensor, b_common: torch.Tensor, s_sorted: torch.Tensor,
    t_sorted: torch.Tensor, beta: float,
) -> torch.Tensor:
    """Divergence (``beta``) on the common columns (student chunk-mean log-probs a, teacher b)
    + L1 of the sorted uncommon probs."""
    kl = divergence(b_common, a_common.exp(), a_common, beta)
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


def normaliser(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum u, 1 / sum u floored at TINY) per row: the projected student mass u [rows, |K|]
    normalised to q = u / sum u (the exact forms' Q on all of V_t, of which u is the part on
    W's image)."""
    sums = u.sum(-1)
    return sums, sums.clamp_min(TINY).reciprocal_()


def grad_scale(weight: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """Per row weight / total: q = u / total, dq_t/du_k = (delta_tk - q_t [sum above TINY])
    / total."""
    return (weight.to(inv.dtype).expand(inv.shape[0]) * inv).contiguous()


def gold_topk_teacher(
    b_common: torch.Tensor, t_sorted: torch.Tensor, k: int, k_uncommon: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compact gold payload of a chunk from today's: teacher chunk-mean log-probs on the
    M common pairs ``b_common`` [.., M] and the n sorted uncommon probabilities ``t_sorted``
    [.., n] -> (columns [.., k]: the pairs of the k largest b, descending; their log-probs
    [.., k]; the log of the other pairs' summed probability (floored at TINY) [..]; the k'
    largest uncommon probabilities [.., k']; the sum of the n - k' others [..]).
    ``k`` <= M and ``k_uncommon`` <= n (:func:`gold_topk_sizes`)."""
    values, columns = b_common.topk(k, dim=-1)
    rest = b_common.scatter(-1, columns, float("-inf")).exp().sum(-1)
    t_tail = t_sorted[..., k_uncommon:].sum(-1)
    return values, columns, rest.clamp_min(TINY).log(), t_sorted[..., :k_uncommon], t_tail


def gold_topk_sizes(k: int, k_uncommon: int, num_common: int, span: int) -> tuple[int, int]:
    """(common pairs, sorted uncommon probabilities) a compact gold payload ships: the flags'
    ``k`` / ``k_uncommon`` (0: all) capped at the M pairs and the n compared ranks."""
    if k < 0 or k_uncommon < 0:
        raise ValueError(f"compact gold sizes must be >= 0 (0: all), got {k}, {k_uncommon}")
    return (min(k or num_common, num_common), min(k_uncommon or span, span))


def gold_topk_kl(
    a_common: torch.Tensor, columns: torch.Tensor, b_top: torch.Tensor,
    b_rest_log: torch.Tensor, s_sorted: torch.Tensor, t_head: torch.Tensor,
    t_tail: torch.Tensor, beta: float,
) -> torch.Tensor:
    """Compact gold / H-KL of a chunk (docs/losses.md, "Compact gold"): :func:`gold_kl` with
    the teacher's common pairs outside its top k merged into one bucket and its sorted uncommon
    probabilities past rank k' into one tail, the student's alike.

    ``a_common`` [.., M]: the student's chunk-mean log-probs on all M common pairs;
    ``columns`` / ``b_top`` [.., k] and ``b_rest_log`` [..]: the teacher's top k pairs, their
    log-probs and the log of the rest's mass (:func:`gold_topk_teacher`); ``s_sorted``
    [.., n]: the student's n largest uncommon probabilities, descending; ``t_head`` [.., k']
    and ``t_tail`` [..]: the teacher's k' largest and the sum of its ranks k'..n-1.

    Common part: the divergence (``beta``) between (b on K, log of the teacher's mass off K)
    and (a on K, logsumexp of a off K); no bucket when K holds all M pairs. Uncommon part:
    sum over ranks j < k' of |s_j - t_j| plus |sum_{k'<=j<n} s_j - t_tail|. With k = M and
    k' = n it is :func:`gold_kl` (up to the order of summation). Merging terms can only lower
    each part (log-sum inequality; triangle inequality), so for nested top sets the value
    grows with k and with k' up to :func:`gold_kl`, and the uncommon part falls short of it by
    at most the two tails' masses (sum_{j>=k'} s_j + t_tail).
    """
    a_top = a_common.gather(-1, columns)
    log_p, log_q = b_top, a_top
    if columns.shape[-1] < a_common.shape[-1]:  # a bucket: the pairs off the teacher's top k
        a_rest = a_common.scatter(-1, columns, float("-inf")).logsumexp(-1)
        log_p = torch.cat([b_top, b_rest_log[..., None].to(b_top.dtype)], dim=-1)
        log_q = torch.cat([a_top, a_rest[..., None]], dim=-1)
    kl = divergence(log_p, None, log_q, beta)
    head = t_head.shape[-1]
    l1 = (s_sorted[..., :head] - t_head).abs().sum(-1)
    return kl + l1 + (s_sorted[..., head:].sum(-1) - t_tail).abs()
