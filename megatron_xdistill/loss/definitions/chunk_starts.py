"""Next-token KD at chunk starts (``--kd-first-token``): what both models predict the text
continues with, compared where both have just finished the same text.

A chunk's P-KL normally averages each side over all of the chunk's positions. When the student
spells the teacher's one token in pieces (teacher ``'def'``, student ``'de'`` + ``'f'``) the
average mixes the student's prediction of ``'de'`` with that of ``'f'`` against the teacher's
``'def'``, which no student token projects to. At the chunk's start both models predict the
same thing, what the text begins with, so this form keeps

* the student position that predicts the chunk's first student token (:func:`chunk_start_ids`);
* chunks of one teacher token, whose payload is that one position's distribution
  (:func:`single_teacher_token_chunks`; the teacher side and its caches are unchanged);
* the teacher's mass moved to the twin of the student token each teacher token's text begins
  with (``projection.first_token.first_token_heads``; :func:`merge_into_heads`), so ``'def'``
  counts for the student's ``'de'``.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.definitions.common import TINY, chunk_lengths
from megatron_xdistill.loss.definitions.payload import TeacherPayload


def chunk_start_ids(chunk_id: torch.Tensor) -> torch.Tensor:
    """Unshifted chunk ids [B, T] with each chunk's first token kept and the rest -1 (chunks
    are contiguous runs of tokens)."""
    previous = torch.nn.functional.pad(chunk_id[:, :-1], (1, 0), value=-1)
    return torch.where(chunk_id != previous, chunk_id, torch.full_like(chunk_id, -1))


def single_teacher_token_chunks(teacher_chunk_id: torch.Tensor, num_chunks: int
                                ) -> torch.Tensor:
    """[B, C] chunks of exactly one teacher token, from the unshifted teacher chunk ids."""
    return chunk_lengths(teacher_chunk_id, num_chunks) == 1


def merge_into_heads(payload: TeacherPayload, heads: torch.Tensor, unreached: int
                     ) -> TeacherPayload:
    """A chunk top-k payload with each column's mass moved to ``heads[column]``.

    Entries of a row that land on the same head are merged (their probabilities summed) into
    the first of them; the others keep probability ~0 (``TINY``) on column ``unreached``, a
    teacher id no student token projects to, where they count for nothing (the student's mass
    there is 0) and leave the tail as it was. The tail (the mass outside the teacher's top k)
    is unchanged: it is moved nowhere.
    """
    if payload.spec.form != "chunk_topk":
        raise ValueError(f"--kd-first-token moves chunk top-k payloads only, not the "
                         f"{payload.spec.form!r} form (use --kd-topk-mode chunk, --kd-topk > 0)")
    columns = heads.to(payload.columns.device)[payload.columns]
    order = columns.argsort(dim=-1, stable=True)
    ranked = columns.gather(-1, order)
    logprobs = payload.logprobs.gather(-1, order)
    first = torch.ones_like(ranked, dtype=torch.bool)
    first[..., 1:] = ranked[..., 1:] != ranked[..., :-1]
    group = first.long().cumsum(-1) - 1  # each entry's run of equal heads, 0..k-1
    top = torch.full_like(logprobs, float("-inf")).scatter_reduce(-1, group, logprobs, "amax")
    total = torch.zeros_like(logprobs).scatter_add(-1, group, (logprobs - top.gather(-1, group))
                                                   .exp())
    merged = (top + total.log()).gather(-1, group)
    ranked_logprobs = torch.where(first, merged, torch.full_like(merged, TINY).log())
    ranked_columns = torch.where(first, ranked, torch.full_like(ranked, unreached))
    back = order.argsort(dim=-1)
    return TeacherPayload(spec=payload.spec, logprobs=ranked_logprobs.gather(-1, back),
                          has_teacher=payload.has_teacher,
                          columns=ranked_columns.gather(-1, back),
                          tail_logprob=payload.tail_logprob)
