"""Student side: the vocab-parallel, CP-aware, chunked cross-tokenizer loss (+ fused CE).

:func:`parallel_kd_loss` runs one custom autograd Function over the student's local logits
[B, T_local, V_local] (this TP rank's vocabulary shard of this CP rank's positions): it chooses
the kernel for the payload form and the blocks of positions (whole chunks, about
``block_bytes`` of fp32 logits), and :class:`student.plan.StudentLossPlan` runs the forward
and backward over them. Chunks held whole by the rank are finished with the TP reduction of their
[rows, |K|] sums; chunks split over CP are summed over CP first. Backward recomputes the block's
softmax from the saved log-partitions (never storing [T, V] probabilities) and writes the
gradient block by block, so the extra memory is a few [block, V_local] buffers. Given the
loss's weights on its two sums (``loss_weights``, as training gives each teacher's call where
they are known), the forward writes the gradient instead and the backward scales it: nothing is
made twice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_xdistill.loss.blocks.block_size import block_positions
from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows, build_chunk_rows
from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.collectives import Group, group_rank, group_size
from megatron_xdistill.loss.definitions.common import UNCOMMON_TOPK, check_mode, divergence_beta
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.fused import call as fused_call
from megatron_xdistill.loss.fused.gold import GoldPass
from megatron_xdistill.loss.fused.gold_topk import CompactGoldPass
from megatron_xdistill.loss.fused.image import ImagePass
from megatron_xdistill.loss.fused.layout import row_layout
from megatron_xdistill.loss.gpu import row_softmax
from megatron_xdistill.loss.kernels.gold import GoldKernel
from megatron_xdistill.loss.kernels.gold_topk import CompactGoldKernel
from megatron_xdistill.loss.kernels.image import ImageKernel
from megatron_xdistill.loss.kernels.pkl import ColumnsKernel
from megatron_xdistill.loss.student.kernel_choice import (
    KernelOptions,
    NoKernel,
    SampleWeighted,
    VocabShard,
    build_kernel,
    chunk_rows_for,
    kernel_class_for,
)
from megatron_xdistill.loss.student.plan import StudentLossPlan


@dataclass
class KDTerms:
    """Local sums of one microbatch on one rank (divide by counts summed over DP x CP).

    ``kd_sum``: sum over the chunks this rank counts of T^2 * KL_c (differentiable).
    ``kd_count``: those chunks. ``top1``: of them, chunks whose projected (or common-vocabulary)
    argmax equals the teacher's. ``ce_sum``/``ce_count``: next-token CE (T = 1) over this rank's
    labelled positions (0 without labels; differentiable).
    """

    kd_sum: torch.Tensor
    kd_count: torch.Tensor
    top1: torch.Tensor
    ce_sum: torch.Tensor
    ce_count: torch.Tensor


class _KDFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, plan: StudentLossPlan):
        kd, ce = plan.forward(logits)
        ctx.plan = plan
        if not plan.grad_now:  # the forward wrote the gradient: the logits are not read again
            ctx.save_for_backward(logits)
        return kd, ce

    @staticmethod
    def backward(ctx, g_kd, g_ce):
        if ctx.plan.grad_now:
            return ctx.plan.scaled_forward_grad(g_kd, g_ce), None
        (logits,) = ctx.saved_tensors
        return ctx.plan.backward(logits, g_kd, g_ce), None


def parallel_kd_loss(
    student_logits: torch.Tensor,
    payload: TeacherPayload | None,
    student_chunk_id: torch.Tensor | None,
    chunk_valid: torch.Tensor | None,
    chunk_exact: torch.Tensor | None,
    projection: ProjectionShard | tuple[torch.Tensor, torch.Tensor] | None,
    *,
    student_vocab_size: int,
    mode: str = "pkl",
    temperature: float = 1.0,
    reverse: bool = False,
    jsd_beta: float | None = None,
    exact_only: bool = False,
    common_student_ids: torch.Tensor | None = None,
    uncommon_topk: int = UNCOMMON_TOPK,
    labels: torch.Tensor | None = None,
    tp_group: Group = None,
    cp_group: Group = None,
    block_bytes: int | None = None,
    sample_weights: torch.Tensor | None = None,
    grad_into_logits: bool = False,
    loss_weights: tuple[float, float] | None = None,
) -> KDTerms:
    """Local KD (and optionally CE) sums of one microbatch; see the package docstring.

    ``student_logits`` [B, T_local, V_local]: this TP rank's vocabulary shard (Megatron's padded
    vocabulary; columns >= ``student_vocab_size`` get no probability) of this CP rank's
    positions, as GPTModel returns them with ``labels=None`` ([b, s, v]). ``student_chunk_id``
    [B, T_local]: each local position's *predicting* chunk id (shift on the full sequence, then
    slice for the CP rank). ``payload``: the teacher's rows for these B samples. ``projection``:
    this rank's rows of W (``ProjectionMatrix.local_shard(vocab_start, vocab_end)`` or a
    :class:`ProjectionShard`). Gold / H-KL take ``common_student_ids`` (the student side of
    ``ProjectionMatrix.common_vocab("strict" | "xtoken")``, in pair order). ``labels`` [B, T_local]
    (next-token ids, < 0 = none) adds the fused CE. With ``payload=None`` only CE is computed.
    ``block_bytes``: the size of one block's fp32 [block, V_local] buffer (a quarter of it for
    the exact and gold forms); None: :func:`block_positions`.
    ``reverse``: KL(student || teacher); ``jsd_beta``: GKD's generalized JSD (0 forward KL,
    1 reverse KL; :func:`definitions.formulas.divergence`). ``sample_weights``
    [B]: each sample's chunks count that many times in the KD sum (reward weighting; the chunk
    count, the KD denominator, is unweighted).
    ``grad_into_logits``: the backward writes the logits' gradient over ``student_logits``
    (as Megatron's ``vocab_parallel_cross_entropy`` overwrites its logits), saving a
    [B, T, V_local] buffer; only where no other user reads the logits after this call's
    backward (autograd runs backwards in reverse order of creation: the first of several calls
    on them, or the only one; another user that saved them and runs later raises).
    ``loss_weights`` (a, b): the caller's loss takes the two sums as s * (a * kd_sum +
    b * ce_sum) for some scalar s (e.g. the global-batch weights over their denominators).
    The forward then writes the logits' gradient of a * kd_sum + b * ce_sum block by block
    from the softmax and sums it has just made, and the backward only multiplies it by s: no
    block's softmax, projection or pass over the teacher rows is made twice (the backward's
    recompute; a fifth of the exact form's time on CPU at 34afc02). Upstream gradients in another ratio
    raise. Taken when the logits require a gradient under grad mode and no chunk is split over
    CP (otherwise the usual backward). With ``grad_into_logits`` the forward writes it over
    the logits: this call must then be the logits' last reader, forward and backward (one
    teacher's call); without it the gradient's buffer lives from the forward to the backward.
    """
    if student_logits.dim() != 3:
        raise ValueError(f"student logits must be [B, T, V_local], got {tuple(student_logits.shape)}")
    if not student_logits.is_contiguous():
        student_logits = student_logits.contiguous()
    check_mode(mode)
    b, t, v_local = student_logits.shape
    dev = student_logits.device
    tp_rank = group_rank(tp_group)
    vocab_start = tp_rank * v_local
    num_real = max(0, min(v_local, student_vocab_size - vocab_start))
    # Blocks of whole chunks (same length on every TP rank); see block_positions. With the
    # fused dense passes (row_softmax: CE and the column forms, on a GPU) a block holds no
    # [rows, V] buffer when the gradient can be written in place (no padded columns): the
    # whole call is one block.
    kernel_class = NoKernel if payload is None else kernel_class_for(mode, payload.spec.form)
    fused = (kernel_class in (NoKernel, ColumnsKernel) and row_softmax.enabled(dev)
             and student_logits.dtype in (torch.float32, torch.bfloat16, torch.float16))
    max_block = block_positions(kernel_class, b * t, v_local, student_logits.element_size(),
                                dev, block_bytes)
    padded = student_vocab_size < group_size(tp_group) * v_local  # some shard has padding
    if fused and not padded:
        max_block = b * t
    if labels is not None:
        labels = labels.to(dev, torch.int64).reshape(-1)
        if labels.numel() != b * t:
            raise ValueError("labels must be [B, T_local] like the logits")

    if payload is None:
        rows = build_chunk_rows(torch.full((b, t), -1, dtype=torch.int64), 0, None, None,
                                max_block).to(dev)
        kernel = None
    else:
        options = KernelOptions(mode, divergence_beta(reverse, jsd_beta), exact_only,
                                common_student_ids, uncommon_topk)
        vocab = VocabShard(student_vocab_size, vocab_start, v_local, num_real, dev)
        rows_cpu = chunk_rows_for(payload, student_chunk_id, chunk_valid, chunk_exact,
                                  exact_only, cp_group, max_block)
        rows = rows_cpu.to(dev)  # once: kernel and plan index with them
        kernel = build_kernel(kernel_class, payload, rows, projection, options, vocab, tp_group)
        if sample_weights is not None:
            if sample_weights.shape != (b,):
                raise ValueError(f"sample_weights must be [B] = [{b}], got "
                                 f"{tuple(sample_weights.shape)}")
            kernel = SampleWeighted(kernel, sample_weights.to(dev), payload.spec.num_chunks)
    grad_weights = None
    if loss_weights is not None:
        grad_weights = _checked_weights(loss_weights)
        if not (torch.is_grad_enabled() and student_logits.requires_grad):
            grad_weights = None  # no backward to serve
    if payload is not None and fused_call.takes(_FUSED_FORMS.get(kernel_class),
                                                student_logits):
        try:
            return _fused_terms(kernel, rows_cpu, rows, student_logits, sample_weights,
                                num_real=num_real, vocab_start=vocab_start,
                                temperature=temperature, labels=labels, tp_group=tp_group,
                                cp_group=cp_group, block_bytes=block_bytes,
                                into_logits=grad_into_logits, grad_weights=grad_weights)
        except fused_call.compile_errors() as err:  # the same kernels fail on every rank
            fused_call.refuse(err)  # loudly, once; the blockwise plan gives the same sums
    plan = StudentLossPlan(rows=rows, kernel=kernel or NoKernel(), num_real=num_real,
                 vocab_start=vocab_start, temperature=temperature, labels=labels,
                 tp_group=tp_group, cp_group=cp_group, max_block=_longest(rows), fused=fused,
                 grad_into_logits=grad_into_logits, grad_weights=grad_weights)
    kd_sum, ce_sum = _KDFunction.apply(student_logits, plan)
    return KDTerms(kd_sum=kd_sum, kd_count=plan.kd_count.to(dev), top1=plan.top1.to(dev),
                   ce_sum=ce_sum, ce_count=plan.ce_count.to(dev))


#: the kernels whose forms the fused passes take (:mod:`fused.call`)
_FUSED_FORMS = {ImageKernel: "image", GoldKernel: "gold", CompactGoldKernel: "gold"}


def _fused_terms(kernel, rows_cpu: ChunkRows, rows: ChunkRows, logits: torch.Tensor,
                 sample_weights: torch.Tensor | None, *, num_real: int, vocab_start: int,
                 temperature: float, labels: torch.Tensor | None, tp_group: Group,
                 cp_group: Group, block_bytes: int | None, into_logits: bool,
                 grad_weights: tuple[float, float] | None) -> KDTerms:
    """:func:`parallel_kd_loss` by the fused passes (:mod:`fused.call`), from the blockwise
    kernel made for the call (its inputs checked, the projection's image built)."""
    inner = kernel.kernel if isinstance(kernel, SampleWeighted) else kernel
    if isinstance(inner, ImageKernel):
        form = ImagePass(inner.payload, inner.proj, num_real, inner.beta, tp_group, cp_group)
    else:  # the full or the compact gold payload
        made = CompactGoldPass if isinstance(inner, CompactGoldKernel) else GoldPass
        form = made(inner.payload, inner.pair_local, inner.col_common, inner.num_common,
                    num_real, inner.num_uncommon, inner.beta, tp_group, cp_group)
    dev = logits.device
    size = fused_call.group_rows(form.row_bytes(), logits, block_bytes,
                                 whole_rows=group_size(tp_group) == 1)
    layout = row_layout(rows_cpu, rows, rows_cpu.pos_row.numel(), size, sample_weights,
                        cp_group, dev)
    call = fused_call.FusedCall(form, layout, num_real=num_real, vocab_start=vocab_start,
                                temperature=temperature, labels=labels, tp_group=tp_group,
                                into_logits=into_logits, grad_weights=grad_weights)
    kd_sum, ce_sum = fused_call.run(call, logits)
    return KDTerms(kd_sum=kd_sum, kd_count=call.kd_count.to(dev), top1=call.top1.to(dev),
                   ce_sum=ce_sum, ce_count=call.ce_count.to(dev))


def forward_writes_gradient(mode: str, form: str, cp_size: int) -> bool:
    """Whether :func:`parallel_kd_loss` given ``loss_weights``, on logits that require a
    gradient, surely writes the gradient in its forward and so reads no logits in its backward
    (what a caller making several calls on the same logits needs to order them): the kernels
    that finish each block in the forward (the exact / image / gold forms), with no chunk split
    over CP (one CP rank). Conservative: False may still write it (CP ranks that split no
    chunk); True never fails to. A caller's order that trusts it wrongly fails loudly (the
    logits' version counter), not silently."""
    return cp_size == 1 and kernel_class_for(mode, form).per_block


def _checked_weights(weights) -> tuple[float, float]:
    """``loss_weights`` as two finite floats, or a clear error."""
    try:
        a, b = (float(w) for w in weights)
    except (TypeError, ValueError) as err:
        raise ValueError(f"loss_weights must be two numbers (the loss's weights on kd_sum and "
                         f"ce_sum), got {weights!r}") from err
    if not (math.isfinite(a) and math.isfinite(b)):
        raise ValueError(f"loss_weights must be finite, got {weights!r}")
    return a, b


def _longest(rows: ChunkRows) -> int:
    return max((blk.end - blk.start for blk in rows.blocks), default=0)


__all__ = ["KDTerms", "forward_writes_gradient", "parallel_kd_loss"]
