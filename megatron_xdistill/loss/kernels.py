"""The three student-side loss kernels, each split the same way for the chunked autograd Function.

A kernel turns one block of positions into per-chunk-row *raw* sums that are linear in the
positions (so they can be summed over blocks and over CP ranks), computes the per-chunk KL from
raw sums (``kl``: TP reductions inside, differentiable), and maps a gradient with respect to the
raw sums back to the block's logits (``backward_block``: the Jacobian of one position's
contribution, transposed).

``ColumnsKernel``  P-KL on teacher columns per row (microbatch top-k, or per-chunk top-k + tail):
                   raw = projected mass on the row's columns [+ total projected mass].
``DenseKernel``    P-KL on all teacher columns: raw = projected mass on the image of W [r, |I|].
``GoldKernel``     gold / H-KL: raw = summed logits / T [r, V_local] and summed log-partitions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import cpu_rows, exact_rows, gold_rows, row_softmax, sorted_l1
from .block_entries import BlockSlice, expand_block_entries
from .chunk_rows import ChunkRows
from .collectives import Group, all_reduce, group_size, replicated_gather, replicated_sum
from .common import EPS, TINY
from .formulas import divergence, projected_kl, teacher_only_terms
from .fused_grad import FusedGradWriter
from .image_projection import ImageProjection
from .numba_cpu import numba_takes
from .payload import TeacherPayload
from .shard import ProjectionShard
from .sorted_top import sorted_top
from .workspace import scratch

Raw = dict[str, torch.Tensor]


@dataclass
class BlockData:
    """One block of positions. The softmax p over the TP-wide vocabulary of x = logits / T is
    ``probs_local * factor[:, None]`` (this shard's softmax, rescaled)."""

    x: torch.Tensor            # [n, V_real] logits / T
    probs_local: torch.Tensor  # [n, V_real] softmax of x over this shard's columns (forward,
    # kernels with ``takes_unnormalised_softmax`` on CPU: exp(x - max x), 1 / sum in factor)
    factor: torch.Tensor       # [n] exp(shard log-partition - TP-wide log-partition)
    logz: torch.Tensor         # [n] TP-wide log-partition of x
    seg: torch.Tensor          # [n] row within the block, -1 for none
    num_rows: int
    row_start: int             # first row's index among the rank's rows
    seg_dummy: torch.Tensor    # [n] ``seg`` with 'none' = ``num_rows`` (for index_add / gather)
    extra: torch.Tensor | None = None  # [n] this shard's projected mass (tail bucket)
    index: int = 0             # the block's place among the call's blocks
    unit_factor: bool = False  # factor is all ones (one TP rank): kernels may skip it
    # Fused mode (``row_softmax``): no dense softmax; x holds the logits (any dtype, rows
    # possibly strided), probabilities come from x * scale and this shard's log-partitions.
    # CPU kernels that read only the logits (``needs_softmax`` False): probs_local None, x the
    # logits / T, the shard's softmax exp(x - lz_local).
    lz_local: torch.Tensor | None = None  # [n]
    scale: float = 1.0

    def probs_at(self, pos: torch.Tensor, lin: torch.Tensor) -> torch.Tensor:
        """This shard's softmax at flat [n, V_real] indices ``lin`` (of rows ``pos``), in the
        compute dtype (a new tensor)."""
        if self.probs_local is not None:
            return self.probs_local.reshape(-1).index_select(0, lin)
        v = row_softmax.values_at(self.x, lin, pos).to(self.logz.dtype)
        if self.scale != 1.0:
            v.mul_(self.scale)
        return v.sub_(self.lz_local.index_select(0, pos)).exp_()


def _rows_of(payload_part: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """Rows ``keys`` (flat b * C + c) of a payload part [B, C, ...]. With several samples the
    part is a strided view into the flat payloads: gather the rows, never reshape the whole
    part (a copy of all of it, per call: per block for the full and gold forms)."""
    if payload_part.is_contiguous():
        return payload_part.reshape(-1, *payload_part.shape[2:]).index_select(0, keys)
    chunks = payload_part.shape[1]
    return payload_part[torch.div(keys, chunks, rounding_mode="floor"), keys % chunks]


def _row_table(payload_part: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, row of the table for each key) in ``dtype``, for kernels that read
    payload rows ``keys`` where they lie: the part as a [B * C, ...] view and the keys when it
    is one contiguous table of ``dtype``; else its rows gathered (and converted), in order."""
    if payload_part.is_contiguous() and payload_part.dtype == dtype:
        return payload_part.reshape(-1, *payload_part.shape[2:]), keys
    rows = _rows_of(payload_part, keys).to(dtype)
    return rows, torch.arange(rows.shape[0], device=rows.device)


def _with_zero_row(t: torch.Tensor) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])], dim=0)


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
        return _rows_of(cols, keys)

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
        log_p = _rows_of(self.payload.logprobs, keys)
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
            g_total = _with_zero_row(grad["total"])[blk.seg_dummy]
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
    ``formulas.projected_kl`` over all of V_t. On CPU the per-row work is :mod:`.exact_rows`'
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
        # :mod:`.exact_rows`' forward KL takes the teacher-only terms in its own pass over
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
        return {"q": self.proj.project(blk.probs_local, blk.factor, blk.seg, blk.num_rows)}

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
        """:func:`.exact_rows.image_kl` of the rows ``keys`` (KL, u's argmax on I, the
        teacher's argmax, the gradient on u with ``weight``)."""
        return exact_rows.image_kl(u, self.logprobs, keys, self.proj.image, self.outside, weight)

    def _exact_grad(self, u: torch.Tensor, keys: torch.Tensor, weight: torch.Tensor
                    ) -> torch.Tensor:
        return exact_rows.image_kl_grad(u, self.logprobs, keys, self.proj.image, weight)

    def _direct(self, u: torch.Tensor) -> bool:
        """Whether the forward KL on I takes :mod:`.exact_rows` (CPU): its value without
        autograd, its gradient written directly."""
        return self.beta == 0.0 and exact_rows.supported(u) and exact_rows.supported(
            self.logprobs)

    def raw_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                 weight: torch.Tensor) -> Raw | None:
        """d(sum_r weight_r KL_r) / d raw for the forward KL on CPU (:mod:`.exact_rows`), else
        None (the caller differentiates :meth:`kl`). Every TP rank's share of u gets the
        gradient of the sum (the replicated sum's backward is the identity)."""
        u = raw["q"]
        if not self._direct(u):
            return None
        u = replicated_sum(u.detach(), self.tp_group)
        return {"q": self._exact_grad(u, keys, weight)}

    def backward_block(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor,
                       out: torch.Tensor) -> None:
        self.proj.backward_into(out, blk.factor, blk.seg, grad["q"], inv_t, coef, self.tp_group)


class GoldKernel:
    """Gold / H-KL: KL on the common vocabulary + L1 of the sorted uncommon remainders."""

    per_block = True
    reads_logits = True
    #: fp32 [block, V_local] temporaries at a block's peak (measured as DenseKernel's; 6.4 at 85)
    block_buffers = 6.2

    def __init__(self, payload: TeacherPayload, common_student: torch.Tensor, vocab_start: int,
                 num_real: int, num_uncommon: int, beta: float, tp_group: Group) -> None:
        self.payload, self.beta, self.tp_group = payload, beta, tp_group
        self.num_real = num_real
        self.num_common = int(common_student.numel())
        local = (common_student >= vocab_start) & (common_student < vocab_start + num_real)
        self.pair_local = torch.nonzero(local, as_tuple=True)[0]
        self.col_common = common_student[local] - vocab_start
        uncommon = torch.ones(num_real, dtype=torch.bool, device=common_student.device)
        uncommon[self.col_common] = False
        self.col_uncommon = torch.nonzero(uncommon, as_tuple=True)[0]
        self.num_uncommon = num_uncommon
        self.runs: sorted_l1.RunMemo | None = None  # the forward's sign runs (CPU, TP 1)

    @staticmethod
    def needs_softmax(like: torch.Tensor) -> bool:
        """Whether the blocks need their softmax in a buffer. The raw sums read the logits
        and log-partitions only, so on CPU none: the backward writes the gradient from the
        logits (:func:`.cpu_rows.exp_spread_`)."""
        return not numba_takes(like)

    def empty_raw(self, n: int, like: torch.Tensor) -> Raw:
        return {"x": like.new_zeros(n, self.num_real), "lz": like.new_zeros(n)}

    def raw(self, blk: BlockData) -> Raw:
        seg = blk.seg_dummy
        xsum = blk.x.new_zeros(blk.num_rows + 1, blk.x.shape[1]).index_add_(0, seg, blk.x)
        lz = blk.x.new_zeros(blk.num_rows + 1).index_add_(0, seg, blk.logz)
        return {"x": xsum[:-1], "lz": lz[:-1]}

    @staticmethod
    def _means(raw: Raw, counts: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Chunk means of this shard's log-probs, (x - lz) / count, on columns ``cols``."""
        x = raw["x"]
        return (x.index_select(1, cols) - raw["lz"][:, None]) / counts.to(x.dtype)[:, None]

    def _by_runs(self, like: torch.Tensor) -> bool:
        """Whether the uncommon L1 takes :mod:`.sorted_l1`'s sign runs (one TP rank, CPU)."""
        return group_size(self.tp_group) == 1 and sorted_l1.supported(like)

    def _by_rows(self, x: torch.Tensor) -> bool:
        """Whether :mod:`.gold_rows`' CPU passes take these rows (forward KL, one TP rank, CPU,
        every uncommon column a candidate); else torch's operations."""
        return (self.beta == 0.0 and self._by_runs(x)
                and self.col_uncommon.numel() >= self.num_uncommon)

    def _memo(self) -> sorted_l1.RunMemo:
        """The forward's sign runs, kept for the backward (one table per call, made once)."""
        if self.runs is None:
            part = self.payload.uncommon_probs
            self.runs = sorted_l1.RunMemo(part.shape[0] * part.shape[1])
        return self.runs

    def kl(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor, top1: bool = True
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = raw["x"]
        rows = x.shape[0]
        n = self.num_uncommon
        t_sorted = _rows_of(self.payload.uncommon_probs, keys)[:, :n]
        if self._by_rows(x) and not any(v.requires_grad for v in raw.values()):
            a_unc, checksum, kl, agree = gold_rows.forward_rows(
                x, raw["lz"], counts, self.col_common, self.col_uncommon,
                *_row_table(self.payload.logprobs, keys, x.dtype))
            kl = kl + sorted_l1.sign_runs(a_unc, t_sorted, self._memo(), keys, checksum,
                                          keep=True).value
            return kl, (agree if top1 else None)
        b_common = _rows_of(self.payload.logprobs, keys)
        a_common = self._means(raw, counts, self.col_common)
        if self.pair_local.numel() < self.num_common:  # TP > 1: this shard's pairs only
            a_common = a_common.new_zeros(rows, self.num_common).index_copy(
                1, self.pair_local, a_common)
        a_common = replicated_sum(a_common, self.tp_group)
        a_unc = self._means(raw, counts, self.col_uncommon)
        if a_unc.shape[1] < n:  # every rank offers n candidates; -inf pads a short shard
            a_unc = torch.cat([a_unc, x.new_full((rows, n - a_unc.shape[1]), float("-inf"))], 1)
        kl = divergence(b_common, None, a_common, self.beta)
        if self._by_runs(a_unc):
            kl = kl + sorted_l1.sorted_l1(a_unc, t_sorted, self._memo(), keys)
        else:
            merged = sorted_top(a_unc, n)  # descending
            if group_size(self.tp_group) > 1:  # the n largest of every rank's n largest
                merged = sorted_top(replicated_gather(merged, self.tp_group, dim=1), n)
            kl = kl + (merged.exp() - t_sorted).abs().sum(-1)
        if not top1:
            return kl, None
        if self.num_common:
            return kl, a_common.argmax(-1) == b_common.argmax(-1)
        return kl, torch.zeros(rows, dtype=torch.bool, device=x.device)

    def raw_grad(self, raw: Raw, keys: torch.Tensor, counts: torch.Tensor,
                 weight: torch.Tensor) -> Raw | None:
        """d(sum_r weight_r KL_r) / d raw written directly where :mod:`.gold_rows` runs
        (forward KL, one TP rank, CPU): the common part's is -p_teacher (no recompute of the
        student's common means), the uncommon part's the L1's sign times exp(a). None elsewhere
        (the caller differentiates :meth:`kl`). Same quantities as autograd's through ``kl``."""
        x = raw["x"]
        if not self._by_rows(x):
            return None
        scale = weight.to(x.dtype).expand(x.shape[0]) / counts.to(x.dtype)
        a_unc, checksum = gold_rows.uncommon_means(x, raw["lz"], counts, self.col_uncommon)
        t_sorted = _rows_of(self.payload.uncommon_probs, keys)[:, : self.num_uncommon]
        runs = sorted_l1.sign_runs(a_unc, t_sorted, self._memo(), keys, checksum)
        table, b_keys = _row_table(self.payload.logprobs, keys, x.dtype)
        g, g_lz = gold_rows.gradient_rows(a_unc, runs, self.col_common, self.col_uncommon,
                                          table, b_keys, scale, x.shape[1])
        return {"x": g, "lz": g_lz}

    def backward_block(self, blk: BlockData, grad: Raw, inv_t: float, coef: torch.Tensor,
                       out: torch.Tensor) -> None:
        seg = blk.seg_dummy
        # lz (the TP-wide log-partition) feeds every rank's columns: sum their gradients.
        g_lz = all_reduce(grad["lz"].clone(), self.tp_group)
        scale = blk.factor * (inv_t * _with_zero_row(g_lz)[seg] + coef)
        if blk.probs_local is None:  # out from the logits: exp(x - lz_local) scale + g / T
            cpu_rows.exp_spread_(out, blk.x, blk.lz_local, scale, seg, grad["x"], inv_t)
            return
        out.mul_(scale[:, None])
        out.add_(_with_zero_row(grad["x"])[seg], alpha=inv_t)
