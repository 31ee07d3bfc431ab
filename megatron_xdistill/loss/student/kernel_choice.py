"""Which kernel a loss call uses, and its inputs: chunk rows of the rank, the projection shard,
the common vocabulary of gold / H-KL, checked against the payload and the logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows, build_chunk_rows
from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.collectives import Group, all_reduce
from megatron_xdistill.loss.cpu.threads import numba_takes
from megatron_xdistill.loss.definitions.common import GOLD_RULES
from megatron_xdistill.loss.definitions.payload import GOLD_FORMS, TeacherPayload
from megatron_xdistill.loss.kernels.gold import GoldKernel
from megatron_xdistill.loss.kernels.gold_topk import CompactGoldKernel
from megatron_xdistill.loss.kernels.image import ImageKernel
from megatron_xdistill.loss.kernels.pkl import ColumnsKernel, DenseKernel


class NoKernel:
    """CE only: no chunk rows."""

    per_block = False
    reads_logits = False

    @staticmethod
    def needs_softmax(like: torch.Tensor) -> bool:
        """CE reads the log-partitions and the label's logit: on CPU no softmax buffer
        (:mod:`cpu.rows`)."""
        return not numba_takes(like)


def kernel_class_for(mode: str, form: str) -> type:
    """The kernel for a loss mode and a teacher payload form (P-KL: all of V_t, W's image or
    columns; gold / H-KL: common + uncommon, in full or compact)."""
    if (mode == "pkl") == (form in GOLD_FORMS):
        raise ValueError(f"mode {mode!r} cannot use a {form!r} teacher payload")
    if mode != "pkl":
        return CompactGoldKernel if form == "gold_topk" else GoldKernel
    return {"full": DenseKernel, "image": ImageKernel}.get(form, ColumnsKernel)


@dataclass(frozen=True)
class KernelOptions:
    """What the loss computes (see :func:`parallel_kd_loss`)."""

    mode: str
    beta: float  # the divergence (formulas.divergence): 0 forward KL, 1 reverse KL, else JSD
    exact_only: bool
    common_student_ids: torch.Tensor | None
    uncommon_topk: int


@dataclass(frozen=True)
class VocabShard:
    """Where this TP rank's logits sit in the student vocabulary."""

    vocab_size: int  # V_s, real tokens
    start: int       # first column's token id
    width: int       # V_local, padded columns included
    num_real: int    # of them, real tokens
    device: torch.device


def chunk_rows_for(payload: TeacherPayload, chunk_id, chunk_valid, chunk_exact, exact_only: bool,
          cp_group: Group, max_block: int) -> ChunkRows:
    """The rank's chunk rows (on the CPU): valid chunks with a teacher row (exact only, if
    asked), cut into blocks."""
    b = chunk_id.shape[0]
    if payload.batch_size != b or chunk_valid.shape != (b, payload.spec.num_chunks):
        raise ValueError(
            f"payload ({payload.batch_size} samples, {payload.spec.num_chunks} chunks) and "
            f"chunk_valid {tuple(chunk_valid.shape)} disagree with {b} samples")
    include = chunk_valid.bool().cpu() & payload.has_teacher.bool().cpu()
    if exact_only:
        include &= chunk_exact.bool().cpu()
    return build_chunk_rows(chunk_id, payload.spec.num_chunks, include, cp_group, max_block)


def build_kernel(kernel_class: type, payload: TeacherPayload, rows: ChunkRows, projection,
            options: KernelOptions, vocab: VocabShard, tp_group: Group):
    """The kernel of ``kernel_class`` for this call, its inputs checked."""
    dev, num_real = vocab.device, vocab.num_real
    if options.mode == "pkl":
        shard = projection if isinstance(projection, ProjectionShard) else ProjectionShard(
            projection[0], projection[1], vocab.start,
            teacher_vocab(payload, projection, tp_group))
        if shard.num_rows != vocab.width:
            raise ValueError(f"projection shard has {shard.num_rows} rows, logits {vocab.width}")
        shard = shard.to(dev)
        if kernel_class in (DenseKernel, ImageKernel):
            return kernel_class(payload, shard, num_real, options.beta, tp_group,
                                torch.cat([rows.keys, rows.split_keys]))
        return ColumnsKernel(payload, shard, num_real, rows, options.beta, tp_group)
    if options.common_student_ids is None:
        raise ValueError(f"mode {options.mode!r} needs common_student_ids "
                         f"(ProjectionMatrix.common_vocab({GOLD_RULES[options.mode]!r}))")
    common = torch.as_tensor(options.common_student_ids, dtype=torch.int64, device=dev)
    if payload.spec.form == "gold_topk":
        if common.numel() != payload.spec.pairs:
            raise ValueError(f"{common.numel()} common ids but the compact gold payload was "
                             f"made for {payload.spec.pairs} common pairs")
        if payload.spec.span > options.uncommon_topk:
            raise ValueError(f"the compact gold payload compares {payload.spec.span} sorted "
                             f"uncommon probabilities, more than uncommon_topk "
                             f"{options.uncommon_topk}: make it with the same uncommon_topk")
        return CompactGoldKernel(payload, common, vocab.start, num_real, options.beta, tp_group)
    if common.numel() != payload.spec.width:
        raise ValueError(f"{common.numel()} common ids but the payload has "
                         f"{payload.spec.width} common columns")
    n_unc = max(0, min(payload.spec.uncommon, vocab.vocab_size - common.numel(),
                       options.uncommon_topk))
    return GoldKernel(payload, common, vocab.start, num_real, n_unc, options.beta, tp_group)


class SampleWeighted:
    """A kernel whose per-chunk divergences count ``weights[sample]`` times (reward-weighted
    distillation). Weighting the kernel's ``kl`` weights the forward sums and, through the
    autograd of ``kl``, the gradient alike; every other attribute is the kernel's."""

    def __init__(self, kernel, weights: torch.Tensor, num_chunks: int) -> None:
        object.__setattr__(self, "kernel", kernel)
        object.__setattr__(self, "weights", weights)
        object.__setattr__(self, "num_chunks", num_chunks)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.kernel, name, value)

    def _of_rows(self, keys: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        sample = torch.div(keys, self.num_chunks, rounding_mode="floor")
        return self.weights.to(like.device, like.dtype).index_select(0, sample)

    def kl(self, raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True):
        kl, t1 = self.kernel.kl(raw, keys, counts, top1)
        return kl * self._of_rows(keys, kl), t1

    def kl_with_grad(self, raw, keys: torch.Tensor, counts: torch.Tensor,
                     weight: torch.Tensor):
        """The kernel's fused KL and direct gradient (if it has them), each row weighted."""
        fused = getattr(self.kernel, "kl_with_grad", None)
        if fused is None:
            return None
        rows = self._of_rows(keys, weight)
        out = fused(raw, keys, counts, weight * rows)
        if out is None:
            return None
        kl, t1, grad = out
        return kl * rows.to(kl.dtype), t1, grad

    def forward_from_logits(self, blk, keys: torch.Tensor, counts: torch.Tensor,
                            weight: torch.Tensor):
        """The kernel's pass from a block's logits (:meth:`.GoldKernel.forward_from_logits`),
        each row's KL and gradient weighted."""
        rows = self._of_rows(keys, weight)
        kl, t1, grad = self.kernel.forward_from_logits(blk, keys, counts, weight * rows)
        return kl * rows.to(kl.dtype), t1, grad

    def block_from_logits(self, blk, keys: torch.Tensor, counts: torch.Tensor,
                          weight: torch.Tensor, inv_t: float, coef: torch.Tensor,
                          out: torch.Tensor):
        """The kernel's pass that writes a block's gradient from its logits
        (:meth:`.ImageKernel.block_from_logits`), each row's KL and gradient weighted."""
        rows = self._of_rows(keys, weight)
        kl, t1 = self.kernel.block_from_logits(blk, keys, counts, weight * rows, inv_t, coef,
                                               out)
        return kl * rows.to(kl.dtype), t1

    def raw_grad(self, raw, keys: torch.Tensor, counts: torch.Tensor, weight: torch.Tensor):
        """The kernel's direct gradient (if it has one) with each row's weight scaled."""
        direct = getattr(self.kernel, "raw_grad", None)
        if direct is None:
            return None
        return direct(raw, keys, counts, weight * self._of_rows(keys, weight))


def teacher_vocab(payload: TeacherPayload, projection, tp_group: Group = None) -> int:
    """V_t as far as the call can tell: the full form's width, else the largest teacher id of
    W's rows and the payload's columns (image form: also the teacher's argmax, and the largest
    over TP, since every TP rank must build W's image over the same range; a collective for
    that form only, on every rank alike)."""
    if payload.spec.form == "full":
        return payload.spec.width
    idx = torch.as_tensor(projection[0])
    hi = int(idx.max()) + 1 if idx.numel() else 0
    cols = payload.teacher_argmax if payload.spec.form == "image" else payload.columns
    size = max(hi, int(cols.max()) + 1 if cols.numel() else 0, 1)
    if payload.spec.form == "image":
        total = torch.tensor([size], dtype=torch.int64, device=payload.has_teacher.device)
        all_reduce(total, tp_group, "max")
        size = int(total)
    return size


__all__ = ["KernelOptions", "NoKernel", "VocabShard", "build_kernel", "chunk_rows_for",
           "kernel_class_for", "teacher_vocab"]
