"""What the teacher ships to the student: per-sample, per-chunk teacher distributions.

A :class:`TeacherPayload` holds, for every chunk slot c in [0, C) of each sample, the chunk-level
teacher distribution the student loss needs. It is complete over the teacher vocabulary (the
teacher-TP reductions are done) and independent of both models' parallel layouts, so the runtime
routes its rows sample by sample. :meth:`TeacherPayload.to_flat` / :meth:`TeacherPayload.from_flat`
give one float32 row per sample whose width :class:`PayloadSpec` knows from sizes alone.

Forms (``PayloadSpec.form``):

``full``        ``logprobs`` [B, C, V_t]: chunk-mean teacher log-probs over all of V_t (exact).
``topk``        ``logprobs`` [B, C, k] on ``columns`` [B, k]: the teacher microbatch's top-k
                columns by largest logit (NeMo-RL ``vocab_topk``; the softmax is taken within K).
``chunk_topk``  ``logprobs`` [B, C, k] on ``columns`` [B, C, k] (each chunk's k most probable
                teacher tokens) + ``tail_logprob`` [B, C] (log of the rest's summed mass).
``gold``        ``logprobs`` [B, C, M] at the common teacher ids (in the order of the common
                pairs) + ``uncommon_probs`` [B, C, L], the uncommon probs sorted descending.
``gold_topk``   compact gold (docs/losses.md, "Compact gold"): ``logprobs`` [B, C, k] of the
                teacher's k most probable common pairs, descending, at ``columns`` [B, C, k]
                (indices into the common pairs) + ``tail_logprob`` [B, C] (log of its mass on
                the other pairs; unused when k = M) + ``uncommon_probs`` [B, C, k'] (its k'
                largest uncommon probabilities, descending) + ``uncommon_tail`` [B, C] (the sum
                of its ranks k'..n-1; n = ``PayloadSpec.span``).
``image``       the exact form's payload on W's image I only: ``probs`` [B, C, |I|], the teacher's
                P = exp(chunk-mean log-probs) at the teacher ids of I (ascending; probabilities,
                not logs: the student's pass over them then takes no exp) + ``sums``
                [B, C, 4], the float64 sum of P log P over all of V_t (0 log 0 = 0) and of P over
                the columns outside I, each as a float32 (hi, lo) pair + ``teacher_argmax``
                [B, C], the teacher's first argmax over all of V_t. Exact, like ``full``: a
                column outside I gets projected mass 0 whatever the student does, so the loss
                needs only those sums there. No ``logprobs``.

``has_teacher`` [B, C]: the chunk has at least one teacher predicting position. Rows of chunks
without one hold zeros (and column 0) and must not be used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMS = ("full", "topk", "chunk_topk", "gold", "gold_topk", "image")
#: the forms of the gold / H-KL losses
GOLD_FORMS = ("gold", "gold_topk")
_MAX_EXACT_ID = 1 << 24  # float32 holds every integer below this exactly


def float64_as_pair(x: torch.Tensor) -> torch.Tensor:
    """[..., 2] float32 (hi, lo) with hi + lo = ``x`` to ~2^-48 relative: a float64 sum through
    the float32 flat form (one float32 keeps 2^-24, which the image form's teacher-only sums,
    multiplied by log(EPS) in the KL, would lose)."""
    x = x.to(torch.float64)
    hi = x.to(torch.float32)
    return torch.stack([hi, (x - hi.to(torch.float64)).to(torch.float32)], dim=-1)


def pair_as_float64(pair: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`float64_as_pair`: [..., 2] float32 -> [...] float64."""
    return pair[..., 0].to(torch.float64) + pair[..., 1].to(torch.float64)


@dataclass(frozen=True)
class PayloadSpec:
    """Shape of a payload: ``form``, ``num_chunks`` C, ``width`` (columns per chunk row:
    V_t / k / k / M / k / |I|), ``uncommon`` (gold: L sorted uncommon probs per chunk; compact
    gold: k' of them). Compact gold only, not shipped: ``span`` (n, the sorted uncommon ranks
    the loss compares) and ``pairs`` (M, the common pairs the columns index)."""

    form: str
    num_chunks: int
    width: int
    uncommon: int = 0
    span: int = 0
    pairs: int = 0

    def __post_init__(self) -> None:
        if self.form not in FORMS:
            raise ValueError(f"payload form must be one of {FORMS}, got {self.form!r}")
        if self.num_chunks < 0 or self.width < 0 or self.uncommon < 0:
            raise ValueError(f"payload sizes must be >= 0: {self}")
        if self.uncommon and self.form not in GOLD_FORMS:
            raise ValueError("only the gold forms carry uncommon probabilities")
        if self.form == "gold_topk":
            if self.width > self.pairs or self.uncommon > self.span:
                raise ValueError(f"a compact gold payload ships at most its {self.pairs} common "
                                 f"pairs and {self.span} uncommon ranks: {self}")
        elif self.span or self.pairs:
            raise ValueError(f"only the compact gold form has span / pairs: {self}")

    def _parts(self) -> list[tuple[str, tuple[int, ...]]]:
        c, w = self.num_chunks, self.width
        parts = [("probs" if self.form == "image" else "logprobs", (c, w)), ("has_teacher", (c,))]
        if self.form == "topk":
            parts.append(("columns", (w,)))
        if self.form == "chunk_topk":
            parts += [("columns", (c, w)), ("tail_logprob", (c,))]
        if self.form == "gold":
            parts.append(("uncommon_probs", (c, self.uncommon)))
        if self.form == "gold_topk":
            parts += [("columns", (c, w)), ("tail_logprob", (c,)),
                      ("uncommon_probs", (c, self.uncommon)), ("uncommon_tail", (c,))]
        if self.form == "image":
            parts += [("sums", (c, 4)), ("teacher_argmax", (c,))]
        return parts

    @property
    def numel(self) -> int:
        """float32 elements per sample in the flat form."""
        total = 0
        for _, shape in self._parts():
            n = 1
            for s in shape:
                n *= s
            total += n
        return total

    @property
    def nbytes(self) -> int:
        """Bytes per sample in the flat form."""
        return 4 * self.numel

    def bytes_per_token(self, tokens_per_sample: int) -> float:
        """Transport cost per (student or teacher) token of a sample of that length."""
        return self.nbytes / max(tokens_per_sample, 1)


@dataclass
class TeacherPayload:
    """Chunk-level teacher distributions of one microbatch (see the module docstring)."""

    spec: PayloadSpec
    logprobs: torch.Tensor | None  # None in the image form (it ships ``probs``)
    has_teacher: torch.Tensor
    columns: torch.Tensor | None = None
    tail_logprob: torch.Tensor | None = None
    uncommon_probs: torch.Tensor | None = None
    uncommon_tail: torch.Tensor | None = None
    sums: torch.Tensor | None = None
    teacher_argmax: torch.Tensor | None = None
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b = self.has_teacher.shape[0]
        for name, shape in self.spec._parts():
            value = getattr(self, name)
            if value is None or tuple(value.shape) != (b, *shape):
                got = None if value is None else tuple(value.shape)
                raise ValueError(f"{self.spec.form} payload: {name} must be {(b, *shape)}, got {got}")

    @property
    def batch_size(self) -> int:
        return int(self.has_teacher.shape[0])

    @classmethod
    def of_parts(cls, spec: PayloadSpec, values: dict[str, torch.Tensor]) -> TeacherPayload:
        """A payload from its parts by name (``spec``'s; ``logprobs`` None where the form has
        none)."""
        return cls(spec=spec, **{"logprobs": None, **values})

    def to_flat(self) -> torch.Tensor:
        """One float32 row per sample: [B, spec.numel] (columns as exact float32 integers)."""
        rows = []
        for name, _ in self.spec._parts():
            value = getattr(self, name)
            if (name in ("columns", "teacher_argmax") and value.numel()
                    and int(value.max()) >= _MAX_EXACT_ID):
                raise ValueError("teacher ids >= 2**24 do not survive float32 transport")
            rows.append(value.reshape(self.batch_size, -1).to(torch.float32))
        if not rows:
            return torch.zeros(self.batch_size, 0)
        return torch.cat(rows, dim=1)

    @classmethod
    def from_flat(cls, flat: torch.Tensor, spec: PayloadSpec) -> TeacherPayload:
        """Inverse of :meth:`to_flat` (``flat`` [B, spec.numel], e.g. routed rows stacked)."""
        if flat.dim() != 2 or flat.shape[1] != spec.numel:
            raise ValueError(f"flat payload must be [B, {spec.numel}], got {tuple(flat.shape)}")
        values, offset = {}, 0
        for name, shape in spec._parts():
            n = 1
            for s in shape:
                n *= s
            part = flat[:, offset: offset + n].reshape(flat.shape[0], *shape)
            offset += n
            if name in ("columns", "teacher_argmax"):
                part = part.to(torch.int64)
            elif name == "has_teacher":
                part = part > 0.5
            values[name] = part
        return cls.of_parts(spec, values)

    def teacher_sums(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Image form: (sum of P log P over all of V_t, sum of P over the teacher columns
        outside W's image), float64 [B, C] each."""
        if self.spec.form != "image":
            raise ValueError("only image payloads carry the teacher's sums, not "
                             f"{self.spec.form!r}")
        return pair_as_float64(self.sums[..., 0:2]), pair_as_float64(self.sums[..., 2:4])

    def narrowed(self, k: int, k_uncommon: int | None = None) -> TeacherPayload:
        """A chunk top-k payload cut to its ``k`` most probable columns per chunk: the columns
        are held in descending order, so these are what a top-``k`` teacher ships, and the
        dropped columns' mass joins the tail. Rows without a teacher stay
        zeros. Lets a cache filled at a large k serve any smaller one. A compact gold payload
        likewise, to ``k`` pairs and ``k_uncommon`` sorted uncommon probabilities."""
        if self.spec.form == "gold_topk":
            return self._narrowed_gold(k, self.spec.uncommon if k_uncommon is None
                                       else k_uncommon)
        if self.spec.form != "chunk_topk":
            raise ValueError(f"only chunk top-k payloads can be narrowed, not {self.spec.form!r}")
        if not 0 < k <= self.spec.width:
            raise ValueError(f"cannot narrow a top-{self.spec.width} payload to top-{k}")
        # log-probs are <= 0: their exp cannot overflow (fp32 sum, as the teacher's own tail)
        dropped = self.logprobs[..., k:].exp().sum(-1)
        tail = (self.tail_logprob.exp() + dropped).log()
        tail = torch.where(self.has_teacher, tail, self.tail_logprob)
        return TeacherPayload(
            spec=PayloadSpec("chunk_topk", self.spec.num_chunks, k),
            logprobs=self.logprobs[..., :k].contiguous(), has_teacher=self.has_teacher,
            columns=self.columns[..., :k].contiguous(),
            tail_logprob=tail)

    def _narrowed_gold(self, k: int, k_uncommon: int) -> TeacherPayload:
        """:meth:`narrowed` of a compact gold payload: the dropped pairs' mass joins the
        bucket, the dropped uncommon probabilities the tail (what the teacher ships at the
        smaller sizes, up to the order of summation)."""
        spec = self.spec
        if not (0 < k <= spec.width and 0 <= k_uncommon <= spec.uncommon):
            raise ValueError(f"cannot narrow a compact gold payload of {spec.width} pairs and "
                             f"{spec.uncommon} uncommon probabilities to {k} and {k_uncommon}")
        bucket = (self.tail_logprob.exp() + self.logprobs[..., k:].exp().sum(-1)).log()
        tail = self.uncommon_tail + self.uncommon_probs[..., k_uncommon:].sum(-1)
        return TeacherPayload(
            spec=PayloadSpec("gold_topk", spec.num_chunks, k, k_uncommon, span=spec.span,
                             pairs=spec.pairs),
            logprobs=self.logprobs[..., :k].contiguous(), has_teacher=self.has_teacher,
            columns=self.columns[..., :k].contiguous(),
            tail_logprob=torch.where(self.has_teacher, bucket, self.tail_logprob),
            uncommon_probs=self.uncommon_probs[..., :k_uncommon].contiguous(),
            uncommon_tail=torch.where(self.has_teacher, tail, self.uncommon_tail))

    def select(self, samples: torch.Tensor | list[int]) -> TeacherPayload:
        """The payload of a subset of samples (rows in the given order)."""
        index = torch.as_tensor(samples, dtype=torch.int64, device=self.has_teacher.device)
        values = {name: getattr(self, name).index_select(0, index) for name, _ in self.spec._parts()}
        return TeacherPayload.of_parts(self.spec, values)
