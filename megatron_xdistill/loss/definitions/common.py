"""Small pieces both the reference and the parallel losses use: constants, the next-token shift,
and the common-vocabulary split of the gold / H-KL losses."""

from __future__ import annotations

import torch

from megatron_xdistill.align.pack import predicting_chunk_id  # noqa: F401 (the loss's API)
from megatron_xdistill.projection.common_vocab import common_vocab

#: Added inside ``log`` of the student's projected chunk distribution (as NeMo-RL does), so a
#: teacher column that no student token projects onto costs ``-log(EPS)`` instead of infinity.
EPS = 1e-10
#: Floor of a renormalising sum (a chunk whose projected mass in K is exactly zero).
TINY = 1e-30
#: Default cap on the sorted uncommon remainders of the gold loss (NeMo-RL's default).
UNCOMMON_TOPK = 8192

MODES = ("pkl", "gold", "hkl")
GOLD_RULES = {"gold": "strict", "hkl": "xtoken"}


def divergence_beta(reverse: bool = False, jsd_beta: float | None = None) -> float:
    """The divergence as GKD's beta: 0 forward KL(P || Q) (teacher P, student Q), 1 reverse KL
    (Q || P), between them the generalized Jensen-Shannon divergence of :func:`divergence`."""
    if jsd_beta is None:
        return 1.0 if reverse else 0.0
    beta = float(jsd_beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"the JSD beta must be in [0, 1] (0: forward KL, 1: reverse KL), got {beta}")
    if reverse and beta != 1.0:
        raise ValueError(f"reverse KL is beta 1; it cannot be combined with JSD beta {beta}")
    return beta


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"loss mode must be one of {MODES}, got {mode!r}")


def dense_to_rows(projection: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense W [V_s, V_t] as fixed-width rows ``(indices, weights)`` [V_s, k], largest first."""
    nnz = (projection > 0).sum(dim=1)
    k = max(int(nnz.max()) if nnz.numel() else 0, 1)
    weights, indices = projection.float().topk(k, dim=1)
    indices = indices.masked_fill(weights <= 0, -1)
    return indices, weights.clamp_min(0)


def common_vocab_from_dense(projection: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(student_ids, teacher_ids) pairs of the gold ("strict") or H-KL ("xtoken") split of W.

    The rules are the projection package's (``ProjectionMatrix.common_vocab``), applied to the
    rows of a dense W, so the reference and the runtime split the vocabularies the same way.
    """
    if mode not in GOLD_RULES:
        raise ValueError(f"common vocabulary is for modes 'gold'/'hkl', got {mode!r}")
    indices, weights = dense_to_rows(projection)
    return common_vocab(indices, weights, GOLD_RULES[mode])


def gold_uncommon_len(vs: int, vt: int, n_common: int, cap: int) -> int:
    """How many sorted uncommon probabilities the gold L1 term compares (shorter side, capped)."""
    return max(0, min(vs - n_common, vt - n_common, cap))


def chunk_lengths(chunk_id: torch.Tensor, num_chunks: int) -> torch.Tensor:
    """[B, C] tokens per chunk, from unshifted chunk ids [B, T] (-1: no chunk)."""
    slot = torch.where(chunk_id >= 0, chunk_id, num_chunks).to(torch.int64)
    counts = torch.zeros(chunk_id.shape[0], num_chunks + 1, dtype=torch.int64,
                         device=chunk_id.device)
    return counts.scatter_add_(1, slot, torch.ones_like(slot))[:, :num_chunks]
