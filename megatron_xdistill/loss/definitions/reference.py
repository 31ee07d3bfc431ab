"""Dense single-process reference of the cross-tokenizer losses, straight from DESIGN.md.

Everything is materialised ([B, T, V] probabilities, dense W, one-hot chunk membership), so it is
only for small vocabularies: tests and benchmarks compare the parallel implementation with it.

Chunk ids are the *unshifted* chunk index of each token (-1 none); the next-token shift is applied
here. A chunk counts when it is valid (and exact, with ``exact_only``) and has at least one
predicting position on both sides. Loss = T^2 * sum_c KL_c / (number of counted chunks).

Teacher column set K of P-KL: all of V_t by default; ``vocab_topk=k`` takes NeMo-RL's
microbatch-global top-k (largest teacher logit anywhere in the batch, per column);
``chunk_topk=k`` the compressed form (each chunk's k most probable teacher tokens plus one bucket
holding the rest of V_t).

Gold / H-KL: the divergence on the common pairs of the student's and the teacher's chunk-mean
log-probs a, b plus the L1 between their n = min(V_s - M, V_t - M, ``uncommon_topk``) largest
uncommon probabilities, sorted. ``gold_topk=(k, k')``, the compact form
(:func:`formulas.gold_topk_kl`): the teacher's top k common pairs and one bucket for the rest
of its common mass, its top k' sorted uncommon probabilities and one tail for ranks k'..n-1;
(M, n) or (0, 0) is today's gold exactly, and the value grows towards it with k and k'.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_xdistill.loss.definitions.common import (
    EPS,
    TINY,
    UNCOMMON_TOPK,
    check_mode,
    common_vocab_from_dense,
    divergence_beta,
    gold_uncommon_len,
    predicting_chunk_id,
)
from megatron_xdistill.loss.definitions.formulas import (
    chunk_topk_columns,
    gold_kl,
    gold_topk_kl,
    gold_topk_sizes,
    gold_topk_teacher,
    projected_kl,
)


@dataclass
class ReferenceDetails:
    """Per-chunk view: ``per_chunk`` [B, C] = T^2 * KL_c (0 where not counted)."""

    per_chunk: torch.Tensor
    counted: torch.Tensor
    top1: torch.Tensor

    @property
    def loss(self) -> torch.Tensor:
        return self.per_chunk.sum() / self.counted.sum().clamp_min(1)


def _membership(chunk_id: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """One-hot [B, C, T]: position t predicts chunk c."""
    ids = predicting_chunk_id(chunk_id)
    return (ids[:, None, :] == torch.arange(num_chunks)[None, :, None]).float()


def _chunk_mean(member: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` [B, T, V] over each chunk's predicting positions -> [B, C, V]."""
    return member @ values / member.sum(-1, keepdim=True).clamp_min(1)


def _project(probs: torch.Tensor, projection: torch.Tensor) -> torch.Tensor:
    """``probs`` [..., V_s] @ W [V_s, V_t]; W dense or sparse COO (real vocabularies: a dense
    W of 49k x 152k would take 30 GB)."""
    if not projection.is_sparse:
        return probs @ projection.float()
    flat = probs.reshape(-1, probs.shape[-1])
    out = torch.sparse.mm(projection.float().t().coalesce(), flat.t()).t()
    return out.reshape(*probs.shape[:-1], projection.shape[1])


def kd_loss_details(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_chunk_id: torch.Tensor,
    teacher_chunk_id: torch.Tensor,
    chunk_valid: torch.Tensor,
    chunk_exact: torch.Tensor,
    projection: torch.Tensor,
    mode: str = "pkl",
    temperature: float = 1.0,
    reverse: bool = False,
    exact_only: bool = False,
    *,
    vocab_topk: int | None = None,
    chunk_topk: int | None = None,
    uncommon_topk: int = UNCOMMON_TOPK,
    common: tuple[torch.Tensor, torch.Tensor] | None = None,
    jsd_beta: float | None = None,
    teacher_heads: torch.Tensor | None = None,
    gold_topk: tuple[int, int] | None = None,
) -> ReferenceDetails:
    """Per-chunk losses; see :func:`kd_loss`. ``teacher_heads`` [V_t] (forward P-KL with
    ``chunk_topk``): the chunk's top-k teacher mass summed onto ``teacher_heads[column]``
    before the KL, as ``--kd-first-token`` does (its chunk ids and chunks are the caller's)."""
    check_mode(mode)
    beta = divergence_beta(reverse, jsd_beta)
    temp = float(temperature)
    num_chunks = chunk_valid.shape[1]
    m_s = _membership(student_chunk_id, num_chunks)
    m_t = _membership(teacher_chunk_id, num_chunks)
    counted = chunk_valid.bool() & (m_s.sum(-1) > 0) & (m_t.sum(-1) > 0)
    if exact_only:
        counted &= chunk_exact.bool()
    z = student_logits.float() / temp
    u = teacher_logits.float() / temp
    logp_s = F.log_softmax(z, dim=-1)
    logp_t = F.log_softmax(u, dim=-1)

    if mode == "pkl":
        q_mean = _chunk_mean(m_s, _project(logp_s.exp(), projection))  # [B, C, V_t]
        tail = total = None
        if vocab_topk is not None:
            # over the positions that predict a chunk (padding chooses nothing)
            importance = teacher_logits.float()[m_t.sum(1) > 0].amax(0)
            cols = importance.topk(min(vocab_topk, importance.numel())).indices.sort().values
            t_log = _chunk_mean(m_t, F.log_softmax(u[..., cols], dim=-1))
            q_k = q_mean[..., cols]
        elif chunk_topk is not None and teacher_heads is not None:
            if beta != 0.0:
                raise ValueError("teacher_heads: forward KL only")
            t_log, cols, tail = chunk_topk_columns(_chunk_mean(m_t, logp_t), chunk_topk)
            kl, top1 = _headed_kl(t_log, cols, tail, q_mean, teacher_heads)
            per_chunk = torch.where(counted, kl * temp * temp, torch.zeros_like(kl))
            return ReferenceDetails(per_chunk, counted, top1 & counted)
        elif chunk_topk is not None:
            t_log, cols, tail = chunk_topk_columns(_chunk_mean(m_t, logp_t), chunk_topk)
            q_k = q_mean.gather(-1, cols)
            total = q_mean.sum(-1)
        else:
            t_log, q_k = _chunk_mean(m_t, logp_t), q_mean
        kl = projected_kl(t_log, q_k, total, beta, tail)
        top1 = q_k.argmax(-1) == t_log.argmax(-1)
    else:
        common_s, common_t = common or common_vocab_from_dense(projection, mode)
        a = _chunk_mean(m_s, logp_s)
        b = _chunk_mean(m_t, logp_t)
        vs, vt = a.shape[-1], b.shape[-1]
        unc_s = torch.ones(vs, dtype=torch.bool)
        unc_s[common_s] = False
        unc_t = torch.ones(vt, dtype=torch.bool)
        unc_t[common_t] = False
        n = gold_uncommon_len(vs, vt, common_s.numel(), uncommon_topk)
        s_sorted = a[..., unc_s].exp().topk(n, dim=-1).values
        t_sorted = b[..., unc_t].exp().topk(n, dim=-1).values
        a_c, b_c = a[..., common_s], b[..., common_t]
        if gold_topk is not None:  # the compact form: what the teacher ships, then its loss
            k, k_unc = gold_topk_sizes(*gold_topk, common_s.numel(), n)
            b_top, cols, rest, t_head, t_tail = gold_topk_teacher(b_c, t_sorted, k, k_unc)
            kl = gold_topk_kl(a_c, cols, b_top, rest, s_sorted, t_head, t_tail, beta)
        else:
            kl = gold_kl(a_c, b_c, s_sorted, t_sorted, beta)
        if common_s.numel():
            top1 = a_c.argmax(-1) == b_c.argmax(-1)
        else:
            top1 = torch.zeros_like(counted)
    per_chunk = torch.where(counted, kl * temp * temp, torch.zeros_like(kl))
    return ReferenceDetails(per_chunk, counted, top1 & counted)


def _headed_kl(t_log: torch.Tensor, cols: torch.Tensor, tail: torch.Tensor,
               q_mean: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward KL of the chunk top-k teacher mass moved onto its heads (dense over V_t: the
    teacher's probability on each head column, the tail bucket as it was) from the student's
    projected mass, renormalised over V_t; and whether the argmaxes agree."""
    moved = torch.zeros_like(q_mean).scatter_add(-1, heads[cols], t_log.exp())
    support = moved > 0
    total = q_mean.sum(-1)
    q = q_mean / total.clamp_min(TINY)[..., None]
    q_tail = ((total - (q_mean * support).sum(-1)) / total.clamp_min(TINY)).clamp_min(0)
    terms = torch.where(support, moved * (moved.clamp_min(TINY).log() - torch.log(q + EPS)),
                        torch.zeros_like(moved))
    p_tail = tail.exp()
    kl = terms.sum(-1) + p_tail * (tail - torch.log(q_tail + EPS))
    top1 = torch.where(support, q, torch.full_like(q, -1.0)).argmax(-1) == moved.argmax(-1)
    return kl, top1


def kd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    student_chunk_id: torch.Tensor,
    teacher_chunk_id: torch.Tensor,
    chunk_valid: torch.Tensor,
    chunk_exact: torch.Tensor,
    projection: torch.Tensor,
    mode: str = "pkl",
    temperature: float = 1.0,
    reverse: bool = False,
    exact_only: bool = False,
    *,
    vocab_topk: int | None = None,
    chunk_topk: int | None = None,
    uncommon_topk: int = UNCOMMON_TOPK,
    common: tuple[torch.Tensor, torch.Tensor] | None = None,
    jsd_beta: float | None = None,
    gold_topk: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Cross-tokenizer KD loss (scalar): T^2 * mean over counted chunks of KL_c.

    ``student_logits`` [B, T_s, V_s], ``teacher_logits`` [B, T_t, V_t], chunk ids [B, T] (the
    unshifted chunk of each token, -1 none), ``chunk_valid``/``chunk_exact`` [B, C], ``projection``
    W [V_s, V_t] (dense, or sparse COO for real vocabularies). ``mode``: "pkl" (projected KL),
    "gold" (strict common vocabulary) or "hkl" (xtoken common vocabulary); ``common``: their
    (student_ids, teacher_ids) pairs when already known (else taken from a dense W).
    ``reverse``: KL(student || teacher); ``jsd_beta``: GKD's generalized JSD instead
    (:func:`definitions.formulas.divergence`; 0 forward KL, 1 reverse KL). ``gold_topk``
    (k, k'): gold / H-KL from the compact payload (0: all; see the module docstring).
    """
    return kd_loss_details(
        student_logits, teacher_logits, student_chunk_id, teacher_chunk_id, chunk_valid,
        chunk_exact, projection, mode, temperature, reverse, exact_only,
        vocab_topk=vocab_topk, chunk_topk=chunk_topk, uncommon_topk=uncommon_topk, common=common,
        jsd_beta=jsd_beta, gold_topk=gold_topk,
    ).loss
