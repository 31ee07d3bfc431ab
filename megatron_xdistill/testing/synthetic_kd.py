"""Synthetic distillation batches (alignment, W, logits, labels) for tests and benchmarks.

Alignments are random chunk partitions after a BOS on each side (1-3 tokens per side and chunk),
with some invalid and some inexact chunks and trailing padding; W mixes one-to-one rows (the common
vocabulary), dominated multi-token rows, spread rows and empty rows. Logits are Gaussian, or with
``realistic=True`` peaked like a language model's (Zipf prior over the vocabulary, noise, one
strongly preferred token per position). Padded vocabulary columns carry large garbage values, so a
loss that lets them take probability is caught. W's non-empty rows sum to various values, or to 1
(up to fp32 rounding, like the projection builders' rows) with ``normalised_rows=True``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.definitions.common import dense_to_rows


@dataclass
class SyntheticCase:
    student_logits: torch.Tensor   # [B, T_s, V_s_padded]
    teacher_logits: torch.Tensor   # [B, T_t, V_t_padded]
    student_chunk_id: torch.Tensor  # [B, T_s] unshifted
    teacher_chunk_id: torch.Tensor  # [B, T_t]
    chunk_valid: torch.Tensor
    chunk_exact: torch.Tensor
    projection: torch.Tensor       # dense [V_s, V_t]
    labels: torch.Tensor           # [B, T_s] next-token ids, -1 where none
    vs: int
    vt: int

    @property
    def real_student_logits(self) -> torch.Tensor:
        return self.student_logits[..., : self.vs]

    @property
    def real_teacher_logits(self) -> torch.Tensor:
        return self.teacher_logits[..., : self.vt]

    def reference_loss(self, mode: str, temperature: float = 1.0, with_ce: bool = False,
                       rounded_to: torch.dtype | None = None) -> tuple[float, torch.Tensor]:
        """(loss, gradient [B, T_s, V_s]) in float64 of the mean CE over the labels (with
        ``with_ce``) plus ``reference.kd_loss`` (``mode`` "ce": CE alone), on the real student
        logits (first rounded to ``rounded_to``, e.g. bf16, when given)."""
        from megatron_xdistill.loss.definitions import reference

        z = self.real_student_logits
        z = (z if rounded_to is None else z.to(rounded_to)).double().requires_grad_(True)
        loss = torch.zeros((), dtype=torch.float64)
        if with_ce:
            mask = self.labels >= 0
            loss = torch.nn.functional.cross_entropy(z[mask], self.labels[mask])
        if mode != "ce":
            loss = loss + reference.kd_loss(
                z, self.real_teacher_logits.double(), self.student_chunk_id,
                self.teacher_chunk_id, self.chunk_valid, self.chunk_exact,
                self.projection.double(), mode, temperature)
        loss.backward()
        return loss.item(), z.grad

    def projection_rows(self, padded_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """W as (indices, weights) [V_s_padded, k] (padded rows empty)."""
        idx, w = dense_to_rows(self.projection)
        pad = (padded_rows or self.vs) - self.vs
        if pad:
            idx = torch.cat([idx, torch.full((pad, idx.shape[1]), -1, dtype=idx.dtype)])
            w = torch.cat([w, torch.zeros(pad, w.shape[1])])
        return idx, w


def _alignment(gen: torch.Generator, ts: int, tt: int) -> tuple[list[int], list[int], int]:
    s_ids, t_ids = [-1], [-1]
    c = 0
    s_end = ts - int(torch.randint(0, 3, (1,), generator=gen))
    t_end = tt - int(torch.randint(0, 3, (1,), generator=gen))
    while True:
        ls = int(torch.randint(1, 4, (1,), generator=gen))
        lt = int(torch.randint(1, 4, (1,), generator=gen))
        if len(s_ids) + ls > s_end or len(t_ids) + lt > t_end:
            break
        s_ids += [c] * ls
        t_ids += [c] * lt
        c += 1
    return s_ids + [-1] * (ts - len(s_ids)), t_ids + [-1] * (tt - len(t_ids)), c


def _projection(gen: torch.Generator, vs: int, vt: int) -> torch.Tensor:
    w = torch.zeros(vs, vt)
    kind = torch.rand(vs, generator=gen)
    perm = torch.randperm(vt, generator=gen)
    for s in range(vs):
        r = float(kind[s])
        if r < 0.45:  # one-to-one (mostly distinct columns: the common vocabulary)
            w[s, perm[s % vt]] = 1.0
        elif r < 0.65:  # dominated multi-token row: top weight >= 0.6
            cols = torch.randint(0, vt, (3,), generator=gen)
            w[s, cols[1]] += 0.2
            w[s, cols[2]] += 0.1
            w[s, cols[0]] = 0.7
        elif r < 0.92:  # spread row
            cols = torch.randint(0, vt, (4,), generator=gen)
            w[s, cols] += torch.rand(4, generator=gen) * 0.5 + 0.05
    return w


def _logits(gen: torch.Generator, shape: tuple[int, ...], real: int, padded: int,
            realistic: bool) -> torch.Tensor:
    b, t = shape
    if realistic:
        prior = -1.1 * torch.log(torch.arange(1, real + 1, dtype=torch.float32))
        prior = prior[torch.randperm(real, generator=gen)]
        x = prior + 1.5 * torch.randn(b, t, real, generator=gen)
        peak = torch.randint(0, real, (b, t, 1), generator=gen)
        x.scatter_add_(2, peak, torch.full((b, t, 1), 6.0))
    else:
        x = 2.0 * torch.randn(b, t, real, generator=gen)
    pad = 10.0 + torch.randn(b, t, padded - real, generator=gen)
    return torch.cat([x, pad], dim=2)


def make_case(batch: int = 3, ts: int = 24, tt: int = 20, vs: int = 90, vt: int = 70,
              vs_padded: int | None = None, vt_padded: int | None = None, seed: int = 0,
              realistic: bool = False, normalised_rows: bool = False) -> SyntheticCase:
    """A random batch (see the module docstring); CP slicing needs T divisible by 2 * CP."""
    gen = torch.Generator().manual_seed(seed)
    s_rows, t_rows, n_chunks = [], [], []
    for _ in range(batch):
        s_ids, t_ids, c = _alignment(gen, ts, tt)
        s_rows.append(s_ids)
        t_rows.append(t_ids)
        n_chunks.append(c)
    num_chunks = max(n_chunks) + 1
    valid = torch.zeros(batch, num_chunks, dtype=torch.bool)
    for b, c in enumerate(n_chunks):
        valid[b, :c] = True
    valid &= torch.rand(batch, num_chunks, generator=gen) > 0.1
    exact = valid & (torch.rand(batch, num_chunks, generator=gen) > 0.4)
    student_ids = torch.randint(0, vs, (batch, ts), generator=gen)
    labels = torch.full((batch, ts), -1, dtype=torch.int64)
    labels[:, :-1] = student_ids[:, 1:]
    labels[:, -3:] = -1
    projection = _projection(gen, vs, vt)
    if normalised_rows:
        projection /= projection.sum(1, keepdim=True).clamp_min(1e-30)
    return SyntheticCase(
        student_logits=_logits(gen, (batch, ts), vs, vs_padded or vs, realistic),
        teacher_logits=_logits(gen, (batch, tt), vt, vt_padded or vt, realistic),
        student_chunk_id=torch.tensor(s_rows), teacher_chunk_id=torch.tensor(t_rows),
        chunk_valid=valid, chunk_exact=exact, projection=projection,
        labels=labels, vs=vs, vt=vt,
    )
