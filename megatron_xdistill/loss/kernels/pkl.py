"""The student-side loss kernels of P-KL, each split the same way for the chunked autograd Function.

A kernel turns one block of positions into per-chunk-row *raw* sums that are linear in the
positions (so they can be summed over blocks and over CP ranks), computes the per-chunk KL from
raw sums (``kl``: TP reductions inside, differentiable), and maps a gradient with respect to the
raw sums back to the block's logits (``backward_block``: the Jacobian of one position's
contribution, transposed).

``ColumnsKernel``  P-KL on teacher columns per row (microbatch top-k, or per-chunk top-k + tail):
                   raw = projected mass on the row's columns [+ total projected mass].
``DenseKernel``    P-KL on all teacher columns: raw = projected mass on the image of W [r, |I|].

Gold / H-KL's kernel is :mod:`kernels.gold`'s, the exact form over an ``image`` payload
:mod:`kernels.image`'s (a ``DenseKernel``); what they read of a block is :mod:`blocks.block_data`'s.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import BlockData, Raw, rows_of, with_zero_row
from megatron_xdistill.loss.blocks.block_entries import BlockSlice, expand_block_entries
from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows
from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.collectives import Group, all_reduce, replicated_sum
from megatron_xdistill.loss.cpu import exact as exact_rows
from megatron_xdistill.loss.definitions.common import EPS, TINY
from megatron_xdistill.loss.definitions.formulas import divergence, projected_kl, teacher_only_terms
from megatron_xdistill.loss.definitions.payload import TeacherPayload
from megatron_xdistill.loss.gpu.fused_grad import FusedGradWriter
from megatron_xdistill.loss.kernels.image_projection import ImageProjection
from megatron_xdistill.loss.workspace import scratch

#: Row sums within this relative distance of the common value count as equal to it.
ROW_SUM_RTOL = 1e-6


class TailRowSums:
    """W's row sums r on this shard's real student columns: what the tail bucket needs.

    The tail takes each position's projected mass p.r, and its backward scales p by (b + a r).
    Projection rows sum to 1 except empty ones (r = 0), so r is a constant c plus a few
    exceptions S; this shard's softmax sums to 1, so p.r = c + p[:, S].(r_S - c) and
    p * (b + a r) = p * (b + a c) plus a p[:, S] (r_S - c) on S: a gather of |S| columns
    instead of passes over [n, V_local] and an [n, V_local] buffer. With many exceptions
    (more than 1/8 of the columns) the dense products are used.
    """

    def __init__(self, rowsum: torch.Tensor) -> None:
        self.dense = rowsum
        values, counts = torch.unique(rowsum, return_counts=True)
        const = values[counts.argmax()] if values.numel() else rowsum.new_zeros(())
        self.const = float(const)
        # Rows normalised in fp32 sum to c within a few ulps: those count as c (a relative
        # change of the tail mass below 1e-6, under the loss's own fp32 rounding).
        off = (rowsum - const).abs() > ROW_SUM_RTOL * abs(self.const)
        self.cols = torch.nonzero(off, as_tuple=True)[0]
        self.delta = rowsum.index_select(0, self.cols) - const
        self.excess = rowsum - const  # [V_real] r - c: the fused forward's mass, c + p.(r - c)
        self.sparse = self.cols.numel() * 8 <= rowsum.numel()

    @classmethod
    def of(cls, shard: ProjectionShard, num_real: int) -> TailRowSums:
        """The row sums of ``shard``'s first ``num_real`` rows, kept on the shard (a run's
        shard lives as long as the run; finding the exceptions waits on the device)."""
        cache = shard.__dict__.setdefault("_tail_row_sums", {})
        if num_real not in cache:
            cache[num_real] = cls(shard.rowsum[:num_real].contiguous())
        return cache[num_real]

    def to(self, dtype: torch.dtype) -> TailRowSums:
        """These row sums in ``dtype`` (the loss's compute dtype)."""
        return self if self.dense.dtype == dtype else TailRowSums(self.dense.to(dtype))

    def mass(self, probs: torch.Tensor) -> torch.Tensor:
        """p.r per row of ``probs`` [n, V_real] (each row a softmax over the shard)."""
        if probs.shape[1] == 0:
            return probs.new_zeros(probs.shape[0])
        if self.sparse:
            return probs.index_select(1, self.cols) @ self.delta + self.const
        return probs @ self.dense

    def scale_(self, out: torch.Tensor, base: torch.Tensor, a: torch.Tensor) -> None:
        """``out <- out * (base[:, None] + a[:, None] * r)`` in place."""
        if self.sparse:
            picked = out.index_select(1, self.cols)
            out.mul_((base + a * self.const)[:, None])
            out.index_add_(1, self.cols, picked.mul_(a[:, None] * self.delta))
            return
        coef = scratch("outer", out.numel(), out.device, out.dtype).view_as(out)
        torch.outer(a, self.dense, out=coef)
        out.mul_(coef.add_(base[:, None]))


class ColumnsKernel:
    """P-KL on the payload's teacher columns (``topk`` or ``chunk_topk`` forms)."""

    per_block = False
    #: whether raw / backward_block read the block's logits (``BlockData.x``) besides its
    #: softmax: if not, the forward may write the softmax over the logits (``grad_into_logits``)
    reads_logits = False

    def __init__(self, payload: TeacherPayload, shard: ProjectionShard, num_real: int,
                 rows: ChunkRows, beta: float, tp_group: Group) -> None:
        self.payload, self.shard, self.num_real = payload, shard, num_real
        self.beta, self.tp_group = beta, tp_group
        self.tail = payload.spec.form == "chunk_topk"
        self.k = payload.spec.width
        self.rows = rows
        self.row_sums = TailRowSums.of(shard, num_real) if self.tail else None
        self._blocks: list[BlockSlice] | None = None

    def _columns(self, keys: torch.Tensor) -> torch.Tensor:
        cols = self.payload.columns
        if cols.dim() == 2:  # microbatch-global: one column set per sample
            return cols.index_select(0, torch.div(keys, self.payload.spec.num_chunks,
                                                  rounding_mode="floor"))
        return rows_of(cols, keys)

    def empty_raw(self, n: int, like: torch.Tensor) -> Raw:
        out = {"q": like.new_zeros(n, self.k)}
        if self.tail:
            out["total"] = like.new_zeros(n)
        return out

    def _expand(self, blk: BlockData) -> BlockSlice:
        """The W entries of the block (expanded for all blocks on first use; see
        :mod:`block_entries`)."""
        if self._blocks is None:
            dev = blk.x.device
            keys = self.rows.keys.to(dev)
            entries = self.shard.column_entries(self._columns(keys), self.num_real)
            self._blocks = expand_block_entries(self.rows, entries, self.num_real, self.k, dev)
        return self._blocks[blk.index]

    def raw(self, blk: BlockData) -> Raw:
        e = self._expand(blk)
        mass = blk.probs_at(e.pos, e.lin).mul_(e.weight)
        if not blk.unit_factor:
            mass.mul_(blk.factor.index_select(0, e.pos))
        q = blk.logz.new_zeros(blk.num_rows * self.k).index_add_(0, e.flat, mass)
        out = {"q": q.view(blk.num_rows, self.k)}
        if self.tail:
            out["total"] = blk.logz.new_zeros(blk.num_rows + 1).index_add_(
                0, blk.seg_dummy, blk.extra)[:-1]
        return out

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q = replicated_sum(raw["q"], self.tp_group)
        log_p = rows_of(self.payload.logprobs, keys)
        if self.tail:
            total = replicated_sum(raw["total"], self.tp_group)
            tail = self.payload.tail_logprob.reshape(-1).index_select(0, keys)
            kl = projected_kl(log_p, q, total, self.beta, tail)
        else:
            kl = projected_kl(log_p, q, None, self.beta)
        return kl, (q.argmax(-1) == log_p.argmax(-1)) if top1 else None

    def _backward_terms(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """inv_t * dKL/dx + coef * p of a block = p * (base + a * r) plus sparse entries
        (r: W's row sums, tail form only): returns (base, a or None, lin, values)."""
        e = self._expand(blk)
        contrib = blk.probs_at(e.pos, e.lin).mul_(e.weight).mul_(
            grad["q"].reshape(-1).index_select(0, e.flat))
        if not blk.unit_factor:
            contrib.mul_(blk.factor.index_select(0, e.pos))
        dot = torch.zeros_like(blk.logz).index_add_(0, e.pos, contrib)
        if self.tail:
            g_total = with_zero_row(grad["total"])[blk.seg_dummy]
            dot += g_total * blk.extra
        all_reduce(dot, self.tp_group)
        # dKL/dp = entries (+ g_total * rowsum); dKL/dx = p * (dKL/dp - <p, dKL/dp>)
        base = torch.add(coef, dot, alpha=-inv_t)
        scale = g_total * inv_t if self.tail else None
        if not blk.unit_factor:
            base.mul_(blk.factor)
            if self.tail:
                scale.mul_(blk.factor)
        return base, scale, e.lin, contrib.mul_(inv_t)

    def backward_block(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor,
                       out: torch.Tensor) -> None:
        """``out`` holds ``probs_local``; leaves inv_t * dKL/dx + coef * p in it."""
        base, scale, lin, values = self._backward_terms(blk, grad, inv_t, coef)
        if self.tail:
            self.row_sums.scale_(out, base, scale)
        else:
            out.mul_(base[:, None])
        out.view(-1).index_add_(0, lin, values)  # contiguous [n, V_real]

    def backward_fused(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor,
                       writer: FusedGradWriter) -> None:
        """The same gradient through ``writer``: its dense pass p * (base + a * r), then the
        entries."""
        base, scale, lin, values = self._backward_terms(blk, grad, inv_t, coef)
        writer.dense(base, scale, self.row_sums.dense if self.tail else None)
        writer.add(lin, values)


class DenseKernel:
    """P-KL on all teacher columns (``full`` form), projected onto W's image I only.

    raw = each row's projected student mass on I [r, |I|] (:class:`ImageProjection`). Columns
    outside I have q = 0, so their part of the KL is the teacher's alone: forward KL =
    sum_t P_t log P_t - log(EPS) * (mass of P outside I) - sum_{t in I} P_t log(q_t + EPS),
    whose first two terms are the teacher's alone (``_teacher_terms``, once per payload row;
    on CPU the forward KL takes them in its own pass over each row); the reverse KL has no
    term outside I; the JSD's there is beta P_t log(1 / beta) (M = beta P). Equal to
    ``formulas.projected_kl`` over all of V_t. On CPU the per-row work is :mod:`cpu.exact`'
    (few vectorised passes; the forward KL's gradient written directly).
    """

    per_block = True
    reads_logits = False
    #: reads the block's softmax only as ``probs_local * factor`` (the projection and its
    #: backward): the forward may hand it exp(x - max x) with 1 / sum in the factor
    takes_unnormalised_softmax = True
    #: fp32 [block, V_local] temporaries at a block's peak: the growth of the extra memory per
    #: block buffer, measured on one H200 (16k tokens, V_s 49,152) between 682 and 2,730
    #: positions a block (12.7 buffers at 85, with the call's fixed part)
    block_buffers = 12.3
    #: rows of [rows, V_t] teacher log-probs read at a time for the per-row teacher terms (CPU:
    #: a cache-sized slice, in reused buffers)
    TEACHER_ROWS = 32
    #: elsewhere (a GPU) at most this many slices: each is ~9 kernels, so 32-row slices made the
    #: pass launch-bound (3,000+ kernels at 16k tokens); 1/64 of the payload per slice keeps its
    #: two temporaries at ~3% of the payload
    TEACHER_STEPS = 64

    @classmethod
    def teacher_rows_per_step(cls, num_rows: int, device: torch.device) -> int:
        """Rows of the teacher terms' pass per slice on ``device``."""
        if torch.device(device).type == "cpu":
            return cls.TEACHER_ROWS
        return max(cls.TEACHER_ROWS, -(-num_rows // cls.TEACHER_STEPS))

    def __init__(self, payload: TeacherPayload, shard: ProjectionShard, num_real: int,
                 beta: float, tp_group: Group, keys: torch.Tensor) -> None:
        self.payload, self.num_real = payload, num_real
        self.beta, self.tp_group = beta, tp_group
        self.proj = ImageProjection.of(shard, num_real, tp_group)
        self.logprobs = payload.logprobs.reshape(-1, payload.spec.width)
        width, dev = self.logprobs.shape[1], self.logprobs.device
        self.in_image = torch.zeros(width, dtype=torch.bool, device=dev)
        self.in_image[self.proj.image] = True
        self.keys = keys
        self._terms: tuple[torch.Tensor, torch.Tensor] | None = None
        # :mod:`cpu.exact`' forward KL takes the teacher-only terms in its own pass over
        # each payload row; the other paths read them from one pass here, made on first use.
        self.outside = (~self.in_image).to(self.logprobs.dtype)

    @property
    def const(self) -> torch.Tensor:
        return self._teacher_terms()[0]

    @property
    def argmax(self) -> torch.Tensor:
        return self._teacher_terms()[1]

    def _teacher_terms(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per payload row (filled for the call's keys): the divergence's teacher-only terms
        (outside W's image) and the teacher's argmax over all of V_t, made once. A few passes
        over each row, into reused buffers."""
        if self._terms is None:
            self._terms = self._make_teacher_terms(self.keys)
        return self._terms

    def _make_teacher_terms(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, width = self.logprobs.shape
        dev = self.logprobs.device
        in_image = self.in_image
        step = self.teacher_rows_per_step(keys.numel(), dev)
        if exact_rows.supported(self.logprobs):
            return exact_rows.teacher_terms(self.logprobs, keys.to(dev), in_image, self.beta,
                                            step)
        const = torch.zeros(n, dtype=torch.float64, device=dev)
        argmax = torch.zeros(n, dtype=torch.int64, device=dev)
        keys = torch.unique(keys.to(dev))
        outside_cols = torch.nonzero(~in_image, as_tuple=True)[0]
        reuse = dev.type == "cpu"  # a GPU's caching allocator reuses freed blocks already

        def buffer(name: str, m: int) -> torch.Tensor:
            if reuse:
                return scratch(name, m * width, dev, self.logprobs.dtype).view(m, width)
            return torch.empty(m, width, device=dev, dtype=self.logprobs.dtype)

        for lo in range(0, keys.numel(), step):
            part = keys[lo: lo + step]
            m = part.numel()
            lp = buffer("teacher_lp", m)
            torch.index_select(self.logprobs, 0, part, out=lp)
            argmax[part] = lp.argmax(-1)
            if self.beta == 1.0:  # reverse KL: nothing outside I
                continue
            p = buffer("teacher_p", m)
            torch.exp(lp, out=p)
            # Both sums accumulate in fp64: a row's entropy and the mass outside I (summed over
            # its own columns, not 1 - the mass on I) feed every step's KL of that row.
            plogp = torch.sum(p.mul_(lp), -1, dtype=torch.float64)
            torch.exp(lp, out=p)
            outside = torch.sum(p.index_select(1, outside_cols), -1, dtype=torch.float64)
            const[part] = teacher_only_terms(self.beta, plogp, outside)
        return const, argmax

    def empty_raw(self, n: int, like: torch.Tensor) -> Raw:
        return {"q": like.new_zeros(n, self.proj.size)}

    def raw(self, blk: BlockData) -> Raw:
        return {"q": self.proj.project(blk.probs_local, blk.factor, blk.seg, blk.num_rows,
                                       seg_dummy=blk.seg_dummy, unit_factor=blk.unit_factor)}

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        u = replicated_sum(raw["q"], self.tp_group)
        if self._direct(u) and not u.requires_grad:
            kl, at, teacher_at, _ = self._exact(u, keys, None)
            return kl, self._top1(at, teacher_at) if top1 else None
        q = u / u.sum(-1, keepdim=True).clamp_min(TINY)
        log_q = torch.log(q + EPS)
        if self.beta == 0.0:
            p = self._p_on_image(keys).to(q.dtype)
            kl = self.const.index_select(0, keys).to(q.dtype) - (p * log_q).sum(-1)
        else:  # on I as formulas.divergence, plus the teacher-only part outside I
            kl = divergence(self._logp_on_image(keys).to(q.dtype), q, log_q, self.beta)
            if self.beta != 1.0:
                kl = kl + self.const.index_select(0, keys).to(q.dtype)
        if not top1:
            return kl, None
        return kl, self.proj.image[u.argmax(-1)] == self.argmax.index_select(0, keys)

    def _top1(self, at: torch.Tensor, teacher_at: torch.Tensor) -> torch.Tensor:
        """Whether the projected mass's argmax (column ``at`` of I) is the teacher's."""
        if self.proj.size == 0:
            return torch.zeros_like(at, dtype=torch.bool)
        return self.proj.image[at] == teacher_at

    def kl_with_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Raw] | None:
        """(:meth:`kl`, top-1, :meth:`raw_grad`) from one pass over each payload row, for a
        forward that writes the gradient (CPU forward KL); None elsewhere."""
        u = raw["q"]
        if not self._direct(u):
            return None
        u = replicated_sum(u.detach(), self.tp_group)
        kl, at, teacher_at, g = self._exact(u, keys, weight)
        return kl, self._top1(at, teacher_at), {"q": g}

    def _logp_on_image(self, keys: torch.Tensor) -> torch.Tensor:
        """The payload rows ``keys`` on the columns of I [r, |I|]."""
        return self.logprobs.index_select(0, keys).index_select(1, self.proj.image)

    def _p_on_image(self, keys: torch.Tensor) -> torch.Tensor:
        """P on the columns of I of the payload rows ``keys`` [r, |I|]."""
        return self._logp_on_image(keys).exp()

    def _exact(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor | None):
        """:func:`cpu.exact.image_kl` of the rows ``keys`` (KL, u's argmax on I, the
        teacher's argmax, the gradient on u with ``weight``)."""
        return exact_rows.image_kl(u, self.logprobs, keys, self.proj.image, self.outside, weight)

    def _exact_grad(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
        return exact_rows.image_kl_grad(u, self.logprobs, keys, self.proj.image, weight)

    def _direct(self, u: torch.Tensor) -> bool:
        """Whether the forward KL on I takes :mod:`cpu.exact` (CPU): its value without
        autograd, its gradient written directly."""
        return self.beta == 0.0 and exact_rows.supported(u) and exact_rows.supported(
            self.logprobs)

    def raw_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                 weight: torch.Tensor) -> Raw | None:
        """d(sum_r weight_r KL_r) / d raw for the forward KL on CPU (:mod:`cpu.exact`), else
        None (the caller differentiates :meth:`kl`). Every TP rank's share of u gets the
        gradient of the sum (the replicated sum's backward is the identity)."""
        u = raw["q"]
        if not self._direct(u):
            return None
        u = replicated_sum(u.detach(), self.tp_group)
        return {"q": self._exact_grad(u, keys, weight)}

    def backward_block(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor,
                       out: torch.Tensor) -> None:
        self.proj.backward_into(out, blk.factor, blk.seg, grad["q"], inv_t, coef, self.tp_group,
                                seg_dummy=blk.seg_dummy, unit_factor=blk.unit_factor)


__all__ = ["ColumnsKernel", "DenseKernel", "TailRowSums"]
