"""Glue between the runtime's batches and the loss package: payload form, shards, chunk ids.

One object per run holds what the loss needs and never changes: the payload spec (sizes known
before any data, for the routing plan), this student TP rank's projection rows, and the common
vocabulary for gold/H-KL. It turns a collated batch into the arguments of the teacher-side
reduction and of the student-side loss, with the next-token shift done on the full sequence and
the CP slice taken after it (DESIGN.md, "Next-token shift").
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss import (
    ProjectionShard,
    TeacherPayload,
    counted_chunks,
    forward_writes_gradient,
    parallel_kd_loss,
    payload_spec,
    predicting_chunk_id,
    student_split_chunks,
    teacher_image,
    teacher_payload,
)
from megatron_xdistill.loss.collectives import all_reduce
from megatron_xdistill.loss.definitions.chunk_starts import (
    chunk_start_ids,
    merge_into_heads,
    single_teacher_token_chunks,
)
from megatron_xdistill.loss.definitions.payload import GOLD_FORMS
from megatron_xdistill.parallel.layout import ModelParallelGroups
from megatron_xdistill.teachers.spec import TeacherSpec


def payload_form(kd_loss: str, kd_topk: int, kd_topk_mode: str, gold_topk: int = 0,
                 gold_uncommon_topk: int = 0) -> str:
    """Which teacher payload a configuration ships (see loss.payload_spec). The exact P-KL
    (``--kd-topk 0``) ships the teacher's columns on W's image with its sums over the rest
    ("image": exact, |I| / V_t of the full rows); gold / H-KL the compact form
    ("gold_topk") unless ``--kd-gold-topk`` and ``--kd-gold-uncommon-topk`` are both 0."""
    if kd_loss in ("gold", "hkl"):
        return "gold_topk" if gold_topk or gold_uncommon_topk else "gold"
    if kd_topk == 0:
        return "image"
    return "topk" if kd_topk_mode == "global" else "chunk_topk"


def common_vocab_rule(kd_loss: str) -> str:
    """The projection's common-vocabulary rule of a gold-form loss: gold pairs ids whose texts
    match exactly ("strict"), H-KL also the cross-token matches ("xtoken")."""
    return "strict" if kd_loss == "gold" else "xtoken"


def payload_columns(form: str, matrix, kd_loss: str):
    """The teacher ids of a payload's fixed columns: the common pairs' (gold forms), W's image
    over the student tokens (image form: the rows of W; a model's rows past them are empty),
    else None."""
    if matrix is None:
        return None
    if form in GOLD_FORMS:
        return matrix.common_vocab(common_vocab_rule(kd_loss))[1]
    if form == "image":
        rows = matrix.student_vocab_size
        return teacher_image(*matrix.local_shard(0, rows), rows)
    return None


def gold_topk_sizes(spec, student_vocab_size: int) -> dict:
    """``payload_spec``'s compact gold arguments of a teacher's settings (``spec``: a
    TeacherSpec, or a run's arguments as a teacher sees them)."""
    return {"gold_topk": spec.kd_gold_topk, "gold_uncommon_topk": spec.kd_gold_uncommon_topk,
            "student_vocab_size": student_vocab_size}


def load_or_build_projection(projection_path: str | None, student_tokenizer: str,
                             teacher_tokenizer: str, log=print, shared_vocab: int | None = None):
    """The projection at ``projection_path`` (hashes checked against both tokenizers), or one
    built now from the tokenizers when no path is given. ``shared_vocab``: the teacher uses the
    student's tokenizer; W is the identity over that many ids (no file, nothing to build)."""
    from megatron_xdistill.projection import (
        BuildOptions,
        build_projection,
        identity_projection,
        load_projection,
    )

    if shared_vocab is not None:
        return identity_projection(shared_vocab)
    if projection_path:
        return load_projection(projection_path, student_tokenizer, teacher_tokenizer)
    log("> no --projection-path: building the projection from the tokenizers "
        "(save one with `xdistill-projection build` to skip this)")
    return build_projection(student_tokenizer, teacher_tokenizer, BuildOptions())


class KDObjective:
    """The loss configuration of a run, bound to the student's and the teacher's layouts."""

    def __init__(self, teacher_spec: TeacherSpec, student_info, teacher_info,
                 student: ModelParallelGroups, teacher: ModelParallelGroups, *,
                 student_tokenizer: str, seq_length: int, ce_only: bool, log=print,
                 same_tokenizer: bool = False, ships_text_nats: bool = False) -> None:
        """``teacher_spec``: this teacher's loss settings (form, top-k, temperature, divergence,
        projection, tokenizer); ``seq_length``: the student's; ``ce_only``: the run trains on CE
        alone (``trains_ce_only``). ``same_tokenizer``: the teacher uses the student's
        tokenizer (chunks are single tokens, W the identity). ``ships_text_nats``: each payload
        row also carries the teacher's CE on the sample's text (for per-sample selection)."""
        self.teacher_spec = spec = teacher_spec
        self.seq_length = seq_length
        self.student, self.teacher = student, teacher
        self.student_vocab = student_info.vocab_size
        self.teacher_vocab = teacher_info.vocab_size
        self.same_tokenizer = same_tokenizer
        self.ships_text_nats = ships_text_nats
        # CE alone (--kd-weight 0) never projects anything: W is neither loaded nor built.
        self.ce_only = ce_only
        shared = min(self.student_vocab, self.teacher_vocab) if same_tokenizer else None
        matrix = None if ce_only else load_or_build_projection(
            spec.projection_path, student_tokenizer, spec.tokenizer_model, log, shared)
        if matrix is not None and (matrix.student_vocab_size > self.student_vocab
                                   or matrix.teacher_vocab_size > self.teacher_vocab):
            raise ValueError(
                f"projection is {matrix.student_vocab_size} x {matrix.teacher_vocab_size} but the "
                f"models' vocabularies are {self.student_vocab} (student) and {self.teacher_vocab} "
                f"(teacher): was it built for other tokenizers?")
        self.mode = spec.kd_loss
        self.form = payload_form(spec.kd_loss, spec.kd_topk, spec.kd_topk_mode,
                                 spec.kd_gold_topk, spec.kd_gold_uncommon_topk)
        common_student = common_teacher = None
        if self.form in GOLD_FORMS and matrix is not None:
            common_student, common_teacher = matrix.common_vocab(common_vocab_rule(spec.kd_loss))
        self.common_student, self.common_teacher = common_student, common_teacher
        self.image = (payload_columns(self.form, matrix, spec.kd_loss)
                      if self.form == "image" else None)
        self.num_chunks = seq_length + 1  # chunk slots: collate_samples' upper bound
        self.spec = None if self.ce_only else payload_spec(
            self.form, self.num_chunks, self.teacher_vocab, topk=spec.kd_topk or None,
            num_common=None if common_teacher is None else len(common_teacher),
            num_image=None if self.image is None else self.image.numel(),
            **gold_topk_sizes(spec, self.student_vocab))
        self.heads = self.unreached = None  # --kd-first-token: where teacher mass moves
        if spec.kd_first_token and student.member and matrix is not None:
            self.heads, self.unreached = first_token_heads_of(
                matrix, student_tokenizer, spec.tokenizer_model, self.teacher_vocab, log)
        self.shard = None  # the student side's projection rows (none on teacher-only ranks)
        if student.member and matrix is not None:
            padded = student_info.padded_vocab_size(student.layout.tp)
            local = padded // student.layout.tp
            start = student.coords["tp"] * local
            indices, weights = matrix.local_shard(start, start + local)
            self.shard = ProjectionShard(indices, weights, start, self.teacher_vocab)

    @property
    def payload_numel(self) -> int:
        """Floats per sample shipped to the student: the payload, and the text's nats when
        teachers are selected per sample."""
        return 0 if self.spec is None else self.spec.numel + int(self.ships_text_nats)

    @property
    def payload_bytes_per_token(self) -> float:
        return 0.0 if self.spec is None else self.spec.bytes_per_token(self.seq_length)

    # ---------------------------------------------------------------- teacher side
    def teacher_payload(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """Flat payload rows [b, numel] of one teacher microbatch (teacher's last stage)."""
        groups = self.teacher
        width = logits.shape[1] * groups.layout.cp
        pred = predicting_chunk_id(batch["teacher_chunk_id"])[:, :width]
        pred = groups.cp_local(pred)
        payload = teacher_payload(
            logits.float(), pred, self.spec, vocab_size=self.teacher_vocab,
            temperature=self.teacher_spec.kd_temperature, common_teacher_ids=self.common_teacher,
            image_teacher_ids=self.image,
            tp_group=groups.pg_collection.tp, cp_group=groups.pg_collection.cp)
        flat = payload.to_flat()
        if self.ships_text_nats:
            flat = torch.cat([flat, self.text_nats(logits, batch).to(flat)[:, None]], dim=1)
        return flat

    def text_nats(self, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        """[b] the teacher's CE of each sample's text: nats summed over its own next-token
        predictions (a sum, not a mean, so teachers with different tokenizers compare on the
        same text). Collective over the teacher's TP and CP groups."""
        groups = self.teacher
        tokens = batch["teacher_tokens"]
        labels = tokens[:, 1:].clone()
        positions = torch.arange(labels.shape[1]).unsqueeze(0)
        labels[positions >= (batch["teacher_length"].unsqueeze(1) - 1)] = -1
        labels = groups.cp_local(labels)
        nats = torch.zeros(logits.shape[0], dtype=torch.float64, device=logits.device)
        with torch.no_grad():
            for row in range(logits.shape[0]):
                terms = parallel_kd_loss(
                    logits[row : row + 1].float(), None, None, None, None, None,
                    student_vocab_size=self.teacher_vocab, labels=labels[row : row + 1],
                    tp_group=groups.pg_collection.tp, cp_group=groups.pg_collection.cp)
                nats[row] = terms.ce_sum.double()
        return all_reduce(nats, groups.pg_collection.cp)

    # ---------------------------------------------------------------- student side
    def count_chunks(self, batch: dict, samples: torch.Tensor | None = None) -> int:
        """Chunks the KD loss counts in a (full-sequence) batch: for the global denominator.
        ``samples`` (bool [B]): only those samples' chunks."""
        counted = counted_chunks(self.student_chunk_id(batch), batch["teacher_chunk_id"],
                                 self.chunk_valid(batch), batch["chunk_exact"])
        if samples is not None:
            counted = counted[samples.to(counted.device)]
        return int(counted.sum())

    def chunk_valid(self, batch: dict) -> torch.Tensor:
        """[B, C] the chunks the KD loss may count: the batch's valid chunks, less those the
        student spells in more tokens than the teacher under ``kd_skip_student_split_chunks``
        and, under ``kd_first_token``, those of several teacher tokens."""
        valid = batch["chunk_valid"]
        if self.teacher_spec.kd_skip_student_split_chunks:
            valid = valid & ~student_split_chunks(
                batch["student_chunk_id"], batch["teacher_chunk_id"], valid.shape[1]
            ).to(valid.device)
        if self.teacher_spec.kd_first_token:
            valid = valid & single_teacher_token_chunks(
                batch["teacher_chunk_id"], valid.shape[1]).to(valid.device)
        return valid

    def student_chunk_id(self, batch: dict) -> torch.Tensor:
        """The student's unshifted chunk ids the loss reads: under ``kd_first_token`` only each
        chunk's first token (its one predicting position is the chunk start)."""
        ids = batch["student_chunk_id"]
        return chunk_start_ids(ids) if self.teacher_spec.kd_first_token else ids

    def labels(self, batch: dict) -> torch.Tensor:
        """Next-token labels (-1 where the loss mask is 0), this CP rank's slice."""
        groups = self.student
        labels = batch["tokens"][:, 1:].clone()
        labels[batch["loss_mask"] <= 0] = -1
        return groups.cp_local(labels)

    def writes_gradient_in_forward(self) -> bool:
        """Whether :meth:`student_terms` given ``loss_weights`` surely writes the logits'
        gradient in its forward and reads no logits in its backward (the exact / image / gold
        forms, one student CP rank; :func:`~megatron_xdistill.loss.forward_writes_gradient`)."""
        return (not self.ce_only and self.spec is not None
                and forward_writes_gradient(self.mode, self.form, self.student.layout.cp))

    def student_terms(self, logits: torch.Tensor, batch: dict,
                      payload_rows: torch.Tensor | None = None, with_ce: bool = True,
                      grad_into_logits: bool = False,
                      loss_weights: tuple[float, float] | None = None):
        """Local KD and CE sums of one student microbatch (student's last stage). Without
        ``payload_rows`` (the microbatch's flat teacher payloads, [b, numel]) CE alone.
        ``with_ce=False``: KD only (another teacher's call takes the CE).
        ``grad_into_logits``: the backward overwrites the logits with their gradient (for the
        loss call whose backward reads them last; see :func:`parallel_kd_loss`).
        ``loss_weights``: the loss's weights on the KD and CE sums, known ahead: the forward
        writes the gradient (see :func:`parallel_kd_loss`)."""
        groups = self.student
        width = logits.shape[1] * groups.layout.cp
        payload = pred = None
        if payload_rows is not None:
            payload = TeacherPayload.from_flat(payload_rows[:, : self.spec.numel], self.spec)
            if self.heads is not None:
                payload = merge_into_heads(payload, self.heads, self.unreached)
            pred = predicting_chunk_id(self.student_chunk_id(batch))[:, :width]
            pred = groups.cp_local(pred)
        return parallel_kd_loss(
            logits, payload, pred, self.chunk_valid(batch), batch["chunk_exact"], self.shard,
            student_vocab_size=self.student_vocab, mode=self.mode,
            temperature=self.teacher_spec.kd_temperature, reverse=self.teacher_spec.kd_reverse,
            jsd_beta=self.teacher_spec.gkd_beta,
            common_student_ids=self.common_student,
            labels=self.labels(batch) if with_ce else None,
            tp_group=groups.pg_collection.tp, cp_group=groups.pg_collection.cp,
            sample_weights=batch.get("sample_weight"), grad_into_logits=grad_into_logits,
            loss_weights=loss_weights)


def first_token_heads_of(matrix, student_tokenizer: str, teacher_tokenizer: str,
                         teacher_vocab: int, log=print) -> tuple[torch.Tensor, int]:
    """``--kd-first-token``: (heads [V_t], a teacher id outside W's image) from the tokenizers.
    The unreached id takes the probability-0 rest of merged payload entries."""
    from megatron_xdistill.projection.first_token import first_token_heads
    from megatron_xdistill.projection.vocab import load_tokenizer

    heads = torch.from_numpy(first_token_heads(load_tokenizer(student_tokenizer),
                                               load_tokenizer(teacher_tokenizer), teacher_vocab))
    reached = torch.zeros(teacher_vocab, dtype=torch.bool)  # W fits it (checked on load)
    reached[matrix.indices[matrix.indices >= 0]] = True
    free = torch.nonzero(~reached).flatten()
    if not len(free):
        raise ValueError("--kd-first-token needs a teacher id that no student token projects "
                         "to (W reaches every teacher id); the projection is not of a "
                         "smaller student vocabulary")
    moved = int((heads != torch.arange(len(heads))).sum())
    log(f"> --kd-first-token: {moved:,} of {len(heads):,} teacher tokens move their mass to "
        f"the twin of the student token their text begins with")
    return heads, int(free[0])
