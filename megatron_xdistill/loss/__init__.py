"""loss stage: vocab-parallel cross-tokenizer distillation losses (P-KL, gold, H-KL) + CE.

Where things are (imports only go down this list)::

    definitions/  the math, once: constants and the next-token shift, the per-chunk formulas,
                  the dense reference every implementation equals (``kd_loss``), the payload
    collectives.py, workspace.py   TP / CP collectives; scratch buffers kept between calls
    cpu/          the CPU backend: Numba passes, a module per form's work
    gpu/          the GPU backend: fused Triton row passes
    blocks/       one call's layout: chunk rows, blocks of positions, W's rows on this rank
    kernels/      each form's student kernel (pkl, image, gold): torch on any device, handing
                  its passes to cpu/ or gpu/ where those serve
    fused/        the exact (image) and gold / H-KL (full and compact payload) forms as
                  whole-call Triton passes (gpu/'s
                  triton_image, triton_gold, triton_rows): taken on CUDA instead of the blocks
    student/      the student-side driver: parallel_kd_loss, its plan, the totals
    teacher.py    the teacher side: logits to a payload

Definitions are docs/design.md's; :mod:`definitions.reference` is the dense single-process
version of them, and the parallel implementation must equal it. The training runtime uses
three pieces, decoupled by a payload:

**1. Teacher side** (every rank of the teacher's last pipeline stage, per microbatch)::

    spec = payload_spec(form, num_chunks, teacher_vocab_size, topk=k, num_common=M,
                        num_image=image.numel())
    payload = teacher_payload(logits, teacher_pred_chunk_id, spec, vocab_size=V_t,
                              temperature=T, common_teacher_ids=ct, image_teacher_ids=image,
                              tp_group=t_tp, cp_group=t_cp)

``logits`` [b, s_local, V_t_local]: GPTModel's output with ``labels=None`` (it returns [b, s, v];
pass ``logits.transpose(0, 1)`` if you hold Megatron's [s, b, v] — that costs a copy). ``form``:
"full" (exact P-KL, K = V_t), "image" (the same exact P-KL from the teacher's probabilities on
the columns of W's image only, ``image = teacher_image(indices, weights, V_s)``, with its sums of
P log P over V_t and of P over the other columns: |I| / V_t of the full payload), "topk"
(NeMo-RL ``vocab_topk``: the microbatch's k columns with the largest teacher logit, softmax
within K), "chunk_topk" (compressed: each chunk's top-k teacher tokens + one tail bucket) or
"gold" (gold/H-KL: teacher chunk log-probs on the M common teacher ids ``ct`` + the sorted
uncommon probabilities). The result is identical on every teacher TP/CP rank of
the replica and independent of the teacher layout.

**2. Transport**: ``payload.to_flat()`` gives one float32 row per sample ([B, spec.numel],
``spec.nbytes`` bytes per sample, ``spec.bytes_per_token(n)``); route rows by sample, then
``TeacherPayload.from_flat(torch.stack(rows), spec)`` on the student side. Sizes depend on the
configuration only (``payload_spec``), so routing plans can be made from sizes.

**3. Student side** (student's last pipeline stage, every TP/CP rank)::

    terms = parallel_kd_loss(logits, payload, student_pred_chunk_id, chunk_valid, chunk_exact,
                             projection_shard, student_vocab_size=V_s, mode="pkl"|"gold"|"hkl",
                             temperature=T, reverse=False, exact_only=False,
                             common_student_ids=cs, labels=labels_local,
                             tp_group=s_tp, cp_group=s_cp)
    loss, metrics = total_loss(terms, kd_weight=..., ce_weight=..., dynamic_scaling=...,
                               kd_denominator=N_chunks, ce_denominator=N_tokens,
                               dp_cp_group=s_dp_cp)

``logits`` [b, s_local, V_s_local] (this TP rank's vocab shard, Megatron-padded; this CP rank's
positions). ``projection_shard``: ``ProjectionMatrix.local_shard(vocab_start, vocab_end)`` with
``vocab_start = tp_rank * V_s_local`` (or a prebuilt :class:`ProjectionShard`, cheaper per call).
``cs, ct = ProjectionMatrix.common_vocab("strict")`` for gold, ``("xtoken")`` for H-KL.
``labels_local`` [b, s_local]: next-token ids (< 0 = no CE), sliced like the logits; they add the
fused vocab-parallel CE (T = 1; one pass with the KD, and unlike Megatron's
``vocab_parallel_cross_entropy`` it leaves fp32 logits intact and gives padded columns no mass).

Chunk ids and CP: both sides take *predicting* chunk ids per local position. The runtime shifts the
full-sequence alignment ids, then slices them like the tokens::

    pred = predicting_chunk_id(student_chunk_id)      # [B, T_full], pred[:, i] = ids[:, i + 1]
    local = slice_for_cp_rank(pred, 1, cp_rank, cp)    # parallel.context_parallel

(the same for the teacher with its own CP), which handles shifts across CP boundaries for free.
``chunk_valid``/``chunk_exact`` [b, C] and the payload are per sample, not sliced.

Normalisation: ``terms.kd_sum`` is the sum over the chunks this rank counts of T^2 * KL_c,
``terms.kd_count`` their number (a chunk split over CP ranks is counted by its lowest CP rank; TP
ranks return identical values). Divide by the count summed over DP x CP only (never TP or PP):
``total_loss`` does this with ``kd_denominator`` (e.g. :func:`counted_chunks` summed over the
global batch) or, by default, the microbatch's DP x CP sum; same for CE with ``ce_count``. The
returned loss is this rank's share: summing the shares over DP x CP gives the loss, so with
Megatron's DDP (gradients averaged over DP x CP) scale it by dp * cp. Gradients of a chunk split
over CP reach every CP rank holding it, weighted by the owning rank's upstream gradient.

Memory and time: positions are processed in blocks of whole chunks of about ``block_bytes`` of
fp32 [block, V_local]; backward recomputes softmaxes from saved log-partitions. Per block the
forward does one TP max and one TP sum all-reduce ([block] / [block, 2-4]); the [chunks, |K|]
partial sums take one TP all-reduce (after all blocks for "topk"/"chunk_topk", per block for
"full"/gold); chunks split over CP take one CP all-reduce. Backward repeats the [chunks, |K|]
reduction (recomputed, not stored) and one [block] TP all-reduce (P-KL).
"""

from megatron_xdistill.loss.blocks.block_size import BLOCK_BYTES
from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.definitions.common import (
    EPS,
    UNCOMMON_TOPK,
    common_vocab_from_dense,
    predicting_chunk_id,
)
from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload
from megatron_xdistill.loss.definitions.reference import kd_loss
from megatron_xdistill.loss.kernels.image_projection import teacher_image
from megatron_xdistill.loss.student.parallel_loss import (
    KDTerms,
    forward_writes_gradient,
    parallel_kd_loss,
)
from megatron_xdistill.loss.student.total import (
    combined_loss,
    counted_chunks,
    global_sums,
    student_split_chunks,
    total_loss,
)
from megatron_xdistill.loss.teacher import payload_spec, teacher_payload

__all__ = [
    "BLOCK_BYTES",
    "EPS",
    "KDTerms",
    "PayloadSpec",
    "ProjectionShard",
    "TeacherPayload",
    "UNCOMMON_TOPK",
    "combined_loss",
    "common_vocab_from_dense",
    "counted_chunks",
    "student_split_chunks",
    "forward_writes_gradient",
    "global_sums",
    "kd_loss",
    "parallel_kd_loss",
    "payload_spec",
    "predicting_chunk_id",
    "teacher_image",
    "teacher_payload",
    "total_loss",
]
