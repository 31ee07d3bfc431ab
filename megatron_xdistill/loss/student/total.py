"""Total loss from one rank's local sums: KD and CE normalised by global counts, and metrics.

L = w_kd * KD + w_ce * CE, or with dynamic scaling L = sg(CE / KD) * KD + CE (NeMo-RL's
``dynamic_loss_scaling``: the KD term is rescaled to the CE term's magnitude, the scale carries no
gradient). KD = T^2 * sum_c KL_c / N_chunks, CE = sum of token CE / N_tokens, where the counts are
summed over the DP x CP ranks (TP and PP ranks hold the same chunks and are not counted).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_xdistill.loss.collectives import Group, all_reduce
from megatron_xdistill.loss.definitions.common import chunk_lengths, predicting_chunk_id
from megatron_xdistill.loss.student.parallel_loss import KDTerms


def counted_chunks(student_chunk_id: torch.Tensor, teacher_chunk_id: torch.Tensor,
                   chunk_valid: torch.Tensor, chunk_exact: torch.Tensor | None = None,
                   exact_only: bool = False) -> torch.Tensor:
    """[B, C] chunks the KD loss counts, from the full-sequence *unshifted* chunk ids.

    Valid (and exact with ``exact_only``) chunks with a predicting position on both sides: what
    :func:`parallel_kd_loss` counts over all CP ranks, computable before any forward pass (e.g. to
    get the global N_chunks of a whole global batch up front).
    """
    out = chunk_valid.bool().clone()
    for ids in (predicting_chunk_id(student_chunk_id), predicting_chunk_id(teacher_chunk_id)):
        has = torch.zeros_like(out)
        b, c = torch.nonzero(ids >= 0, as_tuple=True)
        has[b, ids[b, c]] = True
        out &= has
    if exact_only:
        out &= chunk_exact.bool()
    return out


def student_split_chunks(student_chunk_id: torch.Tensor, teacher_chunk_id: torch.Tensor,
                         num_chunks: int) -> torch.Tensor:
    """[B, C] chunks that the student spells in more tokens than the teacher, from the
    full-sequence *unshifted* chunk ids (e.g. student 'de' + 'f' against teacher 'def').

    P-KL cannot fit them: the teacher's mass sits on its one token, which no student token of
    the chunk projects to (W maps a student token to the teacher tokens that spell it), so
    their KL stays high and its gradient favours other spellings of the text than the
    student's own."""
    return chunk_lengths(student_chunk_id, num_chunks) > chunk_lengths(teacher_chunk_id,
                                                                       num_chunks)


def global_sums(terms: KDTerms, dp_cp_group: Group) -> dict[str, torch.Tensor]:
    """This microbatch's sums over the DP x CP group (detached; one all-reduce)."""
    return _global_sums_of_all([terms], dp_cp_group)[0]


def _global_sums_of_all(terms: Sequence[KDTerms], dp_cp_group: Group
                        ) -> list[dict[str, torch.Tensor]]:
    """:func:`global_sums` of several teachers' terms in one all-reduce."""
    local = torch.stack([torch.stack([t.kd_sum.detach().double(), t.kd_count.double(),
                                      t.top1.double(), t.ce_sum.detach().double(),
                                      t.ce_count.double()]) for t in terms])
    total = all_reduce(local.contiguous(), dp_cp_group)
    return [dict(zip(("kd_sum", "kd_count", "top1", "ce_sum", "ce_count"), row))
            for row in total]


def total_loss(
    terms: KDTerms,
    *,
    kd_weight: float = 1.0,
    ce_weight: float = 1.0,
    dynamic_scaling: bool = False,
    kd_denominator: float | torch.Tensor | None = None,
    ce_denominator: float | torch.Tensor | None = None,
    dp_cp_group: Group = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """(this rank's share of the loss, metrics); the shares summed over DP x CP are the loss.

    Denominators default to this microbatch's counts summed over ``dp_cp_group``; pass the
    global batch's counts (:func:`counted_chunks`, label tokens) to normalise over many
    microbatches. Dynamic scaling uses this microbatch's DP x CP means of KD and CE (and no
    weights). If the gradient reduction averages over DP x CP (Megatron's DDP), multiply the
    share by dp * cp. Metrics are this microbatch's DP x CP means (kd, ce, top1_agree) and counts.
    """
    loss, metrics = combined_loss(
        [terms], kd_weights=[1.0 if dynamic_scaling else kd_weight], ce_weight=ce_weight,
        dynamic_scaling=dynamic_scaling, kd_denominators=[kd_denominator],
        ce_denominator=ce_denominator, dp_cp_group=dp_cp_group)
    teacher = metrics.pop("teachers")[0]
    metrics.update(kd=teacher["kd"], top1_agree=teacher["top1_agree"],
                   valid_chunks=teacher["valid_chunks"])
    return loss, metrics


def combined_loss(
    terms: Sequence[KDTerms],
    *,
    kd_weights: Sequence[float],
    ce_weight: float = 1.0,
    dynamic_scaling: bool = False,
    kd_denominators: Sequence[float | torch.Tensor | None],
    ce_denominator: float | torch.Tensor | None = None,
    dp_cp_group: Group = None,
    shared_denominator: bool = False,
) -> tuple[torch.Tensor, dict]:
    """Several teachers' KD terms with one CE: L = sum_k w_k KD_k + w_ce CE, or with dynamic
    scaling L = sg(CE / KD) KD + CE where KD = sum_k w_k KD_k.

    ``terms[k]``: teacher k's local sums; CE is the sum of the terms' CE sums (one call computes
    it, the others pass no labels). ``kd_denominators[k]``: teacher k's global chunk count (None:
    this microbatch's DP x CP count). ``shared_denominator``: the teachers' chunks are counted
    together (per-sample selection), so the microbatch's KD mean that dynamic scaling divides by
    is pooled the same way. Returns this rank's share of the loss and metrics: CE, the weighted
    KD and, per teacher, its KD mean, top-1 agreement and counted chunks. One all-reduce.
    """
    if len(terms) != len(kd_weights) or len(terms) != len(kd_denominators):
        raise ValueError(f"{len(terms)} teachers' terms need as many weights and denominators, "
                         f"got {len(kd_weights)} and {len(kd_denominators)}")
    sums = _global_sums_of_all(terms, dp_cp_group)
    ce_sum = sum(t.ce_sum for t in terms)
    ce_global = sum(s["ce_sum"] for s in sums)
    ce_count = sum(s["ce_count"] for s in sums)
    n_ce = ce_count if ce_denominator is None else torch.as_tensor(ce_denominator)
    ce = ce_sum / n_ce.double().clamp_min(1.0).to(ce_sum)
    ce_mean = ce_global / ce_count.clamp_min(1.0)
    kd = torch.zeros((), dtype=ce.dtype, device=ce.device)
    kd_mean = torch.zeros((), dtype=torch.float64)
    teachers = []
    for t, s, weight, denominator in zip(terms, sums, kd_weights, kd_denominators, strict=True):
        n_kd = s["kd_count"] if denominator is None else torch.as_tensor(denominator)
        kd = kd + weight * (t.kd_sum / n_kd.double().clamp_min(1.0).to(t.kd_sum))
        mean = s["kd_sum"] / s["kd_count"].clamp_min(1.0)
        kd_mean = kd_mean + weight * mean.cpu()
        teachers.append({"kd": float(mean),
                         "top1_agree": float(s["top1"] / s["kd_count"].clamp_min(1.0)),
                         "valid_chunks": float(s["kd_count"])})
    if shared_denominator:
        pooled = sum(s["kd_count"] for s in sums).clamp_min(1.0)
        kd_mean = sum(w * s["kd_sum"] for w, s in zip(kd_weights, sums, strict=True)).cpu() / \
            pooled.cpu()
    if dynamic_scaling:
        scale = (ce_mean.cpu() / kd_mean) if float(kd_mean) > 0 else torch.ones(
            (), dtype=torch.float64)
        loss = scale.to(kd) * kd + ce
    else:
        scale = torch.ones((), dtype=torch.float64)
        loss = kd + ce_weight * ce
    metrics = {"kd": float(kd_mean), "ce": float(ce_mean), "ce_tokens": float(ce_count),
               "kd_scale": float(scale), "teachers": teachers}
    return loss, metrics
