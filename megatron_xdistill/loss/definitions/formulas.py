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
