"""One call of the student-side loss, planned once: its chunk rows, kernel and blocks, and the
forward and backward passes over them (the autograd Function of :mod:`student.parallel_loss`
runs these; the block gradients are :mod:`student.gradients`').

Forward: per block of positions, the log-partition (one max and one sum all-reduce over TP, the
latter also carrying CE's target logit), then the kernel's per-chunk raw sums; chunks held whole
by the rank are finished from their TP-reduced sums, chunks split over CP are summed over CP
first. Backward recomputes each block's softmax from the saved log-partitions and writes the
gradient block by block. Kernels that read only the logits and log-partitions (gold, CE alone)
take no softmax buffer on CPU: log-partitions alone in the forward, the gradient written from
the logits in the backward (:mod:`cpu.rows`). When the caller gives the loss's weights on the
KD and CE sums ahead (``grad_weights``), the forward writes each block's gradient right after
its sums, from the softmax and raw sums at hand, and the backward only scales it. With one TP
rank on CPU, gold and the exact (image) form then take each block straight from its logits, a
chunk row at a time (:mod:`cpu.gold_block`, :mod:`cpu.image_block`): no softmax buffer, no raw sums.
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import BlockData, Raw
from megatron_xdistill.loss.blocks.chunk_rows import ChunkRows
from megatron_xdistill.loss.collectives import Group, all_reduce, group_rank, group_size
from megatron_xdistill.loss.cpu import rows as cpu_rows
from megatron_xdistill.loss.cpu.threads import numba_takes
from megatron_xdistill.loss.gpu import row_softmax
from megatron_xdistill.loss.student.gradients import BlockGradients, take_rows
from megatron_xdistill.loss.workspace import scratch


class StudentLossPlan(BlockGradients):
    """Everything one call needs; forward/backward of the autograd Function live here."""

    def __init__(self, *, rows: ChunkRows, kernel, num_real: int, vocab_start: int,
                 temperature: float, labels: torch.Tensor | None, tp_group: Group,
                 cp_group: Group, max_block: int, fused: bool = False,
                 grad_into_logits: bool = False,
                 grad_weights: tuple[float, float] | None = None) -> None:
        self.rows, self.kernel = rows, kernel
        # (a, b): the caller's loss is s * (a * kd + b * ce) for a scalar s. The forward then
        # writes the gradient of a * kd + b * ce block by block, from the softmax and raw sums
        # it has just made, and the backward only scales it by s (``_grad_now``).
        self.grad_weights = grad_weights
        self.grad_now = False
        self.block_grad: Raw | None = None  # the block's raw gradient, made with its KL
        # The backward writes the logits' gradient over the logits (Megatron's CE does the
        # same): no [positions, V] gradient allocated. Not with the fused GPU passes (their
        # whole-call block keeps its own buffer).
        self.into_logits = grad_into_logits and not fused
        # Dense passes through ``row_softmax``'s fused kernels: no [block, V] softmax buffer.
        self.fused = fused
        # A kernel that reads only the logits and log-partitions on CPU (gold, CE alone): the
        # forward takes log-partitions alone and the backward writes the gradient from the
        # logits (``cpu_rows``), no softmax buffer. Set per call from the logits (forward).
        self.logits_only = False
        # Blocks with chunk rows taken from their logits by the kernel in one pass
        # (``_fuses_blocks``). Set per call from the logits (forward).
        self.from_logits = False
        self.num_real, self.vocab_start = num_real, vocab_start
        self.temp = float(temperature)
        self.labels = labels
        self.tp_group, self.cp_group = tp_group, cp_group
        self.max_block = max_block
        self.dtype = torch.float32  # compute dtype (float64 for float64 logits, e.g. gradcheck)
        self.split_raw: Raw | None = None
        # Per position, 1 / the sum of its unnormalised softmax row (``_unnormalised``), during
        # the forward only; None otherwise.
        self.norm: torch.Tensor | None = None
        # One TP rank: the shard's softmax is the softmax (no reductions, factor 1).
        self.single = group_size(tp_group) == 1

    # ----------------------------------------------------------------- shared helpers
    def _workspace(self, n: int, like: torch.Tensor, name: str) -> torch.Tensor:
        """A [n, V_real] view of a persistent scratch buffer (see :func:`scratch`)."""
        return scratch(name, n * self.num_real, like.device, self.dtype).view(n, self.num_real)

    def _x(self, logits2d: torch.Tensor, start: int, end: int, unscaled: bool = False
           ) -> torch.Tensor:
        """logits / T (or the logits) of the block in the compute dtype (a view if possible)."""
        scale = 1.0 if unscaled else 1.0 / self.temp
        z = logits2d[start:end, : self.num_real]
        if z.dtype == self.dtype and scale == 1.0:
            return z
        x = self._workspace(end - start, z, "z" if unscaled else "x")
        if z.dtype == self.dtype:
            return torch.mul(z, scale, out=x)
        x.copy_(z)
        return x if scale == 1.0 else x.mul_(scale)

    def _local_softmax(self, x: torch.Tensor, out: torch.Tensor,
                       lz_out: torch.Tensor | None = None) -> torch.Tensor:
        """Softmax of x over this shard's columns into ``out``; returns its log-partition
        (written into ``lz_out`` where given)."""
        if self.num_real == 0:
            lz = x.new_full((x.shape[0],), float("-inf"))
            return lz if lz_out is None else lz_out.copy_(lz)
        top = x.amax(1)  # before the softmax: ``out`` may be x itself
        torch.ops.aten._softmax.out(x, 1, False, out=out)
        # the largest p is 1 / sum exp(x - max x)
        return torch.sub(top, out.amax(1).log_(), out=lz_out)

    def _targets(self) -> None:
        """Per position, once per call: has a label (as 0/1 in the compute dtype), the label's
        local column (clamped to 0 where it is elsewhere, for gathers) and whether it is
        local. Blocks take slices: no per-block index arithmetic."""
        y = self.labels
        col = y - self.vocab_start
        local = (y >= 0) & (col >= 0) & (col < self.num_real)
        self.has_label = (y >= 0).to(self.dtype)
        self.label_local = local
        self.label_col = torch.where(local, col, 0)[:, None]

    @property
    def _ce_extra(self) -> bool:
        """CE needs its own softmax (T != 1)."""
        return self.labels is not None and self.temp != 1.0

    def _factor(self, lz_local: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """exp(shard log-partition - TP-wide log-partition) of positions [lo, hi): what turns
        this shard's softmax into the TP-wide one (ones with one TP rank). In a forward whose
        blocks hold their softmax unnormalised, times 1 / each row's sum (``norm``)."""
        if self.norm is not None:
            norm = self.norm[lo:hi]
            return norm if self.single else torch.exp(lz_local - self.logz[lo:hi]).mul_(norm)
        return self.ones[lo:hi] if self.single else torch.exp(lz_local - self.logz[lo:hi])

    def _block(self, x, probs_local, lz_local, blk, index: int) -> BlockData:
        rows, lo, hi = self.rows, blk.start, blk.end
        extra = None if self.extra is None else self.extra[lo:hi]
        return BlockData(x, probs_local, self._factor(lz_local, lo, hi), self.logz[lo:hi],
                         rows.block_seg[lo:hi],
                         blk.row_end - blk.row_start, blk.row_start, rows.block_seg_dummy[lo:hi],
                         extra, index, unit_factor=self.single and self.norm is None,
                         lz_local=lz_local if self.fused or probs_local is None else None,
                         scale=1.0 / self.temp)

    def _unnormalised(self, logits2d: torch.Tensor) -> bool:
        """Whether the forward leaves each block's softmax as exp(x - max x)
        (:func:`cpu_rows.row_exp_`) with 1 / its sum folded into the factor: kernels that read
        it only as ``probs_local * factor`` (``takes_unnormalised_softmax``), Numba on CPU. The
        softmax's normalising pass over the block (and a second row maximum) are saved."""
        return (not self.fused and not self.logits_only and self.tail is None
                and getattr(self.kernel, "takes_unnormalised_softmax", False)
                and numba_takes(logits2d.new_empty(0, dtype=self.dtype)))

    # ----------------------------------------------------------------- forward
    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, kernel = self.rows, self.kernel
        logits2d = logits.view(-1, logits.shape[-1])
        n_pos = logits2d.shape[0]
        dev = logits.device
        self.dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
        # The tail bucket (chunk top-k): W's row sums on the real local rows, in the compute
        # dtype for the forward here and the kernel's backward.
        self.tail = getattr(kernel, "row_sums", None)
        if self.tail is not None:
            self.tail = kernel.row_sums = self.tail.to(self.dtype)
        like = logits2d.new_empty(0, dtype=self.dtype)
        self.grad_now = self._can_grad_now()
        self.from_logits = self._fuses_blocks(like)
        needs_softmax = getattr(kernel, "needs_softmax", None)
        self.logits_only = not self.fused and (
            self.from_logits or (needs_softmax is not None and not needs_softmax(like)))
        opts = {"device": dev, "dtype": self.dtype}
        self.lz_local = torch.empty(n_pos, **opts)
        self.logz = self.lz_local if self.single else torch.empty(n_pos, **opts)
        self.ones = torch.ones(n_pos, **opts) if self.single else None
        if self._ce_extra:
            self.lz1_local = torch.empty(n_pos, **opts)
            self.logz1 = self.lz1_local if self.single else torch.empty(n_pos, **opts)
        if self.labels is not None:
            self._targets()
        self.extra = torch.empty(n_pos, **opts) if self.tail is not None else None
        self.norm = torch.empty(n_pos, **opts) if self._unnormalised(logits2d) else None
        acc = torch.zeros(3, dtype=torch.float64, device=dev)  # kd, top1, ce
        # per block: (KL sum, top-1 matches) of its rows held whole here, summed once
        block_sums = torch.zeros(len(rows.blocks), 2, dtype=torch.float64, device=dev)
        raws, split_buf = [], None
        # The label's logit is read before any block's gradient may be written over it.
        picked = self._picked(logits2d) if self.labels is not None else None
        if self.grad_now:
            self._start_grad_now(logits)
        in_grad = self._softmax_in_grad()
        for index, blk in enumerate(rows.blocks):
            if self.fused:  # the block's logits as they are; no softmax buffer
                x, probs = logits2d[blk.start: blk.end, : self.num_real], None
                lz_local = self._partition_fused(x, blk.start, blk.end)
            elif self.logits_only:  # logits / T and their log-partitions; no softmax
                x, probs = self._x(logits2d, blk.start, blk.end), None
                if self.from_logits and blk.row_end > blk.row_start:
                    self._forward_from_logits(logits2d, x, blk, index, block_sums[index])
                    continue
                lz_local = self._partition_logits(x, logits2d, blk.start, blk.end)
            else:
                x = self._x(logits2d, blk.start, blk.end)
                probs = (in_grad[blk.start: blk.end] if in_grad is not None
                         else self._workspace(blk.end - blk.start, x, "p"))
                lz_local = self._partition(x, probs, logits2d, blk.start, blk.end)
            if blk.row_end == blk.row_start:
                if self.grad_now:
                    self._grad_now(logits2d, blk, index, x, probs, None)
                continue
            data = self._block(x, probs, lz_local, blk, index)
            raw = kernel.raw(data)
            if kernel.per_block:
                split_buf = self._stash_split(raw, blk, split_buf, index)
                self._finish_local(raw, blk, index, block_sums[index])
                if self.grad_now:
                    self._grad_now(logits2d, blk, index, x, probs, raw, self.block_grad)
                    self.block_grad = None
            else:
                raws.append(raw)
        if not kernel.per_block:
            self.raw_all = {k: torch.cat([r[k] for r in raws]) for k in raws[0]} if raws else {}
            if raws:
                local = rows.local_rows
                self.raw_local = take_rows(self.raw_all, local)
                kl, t1 = kernel.kl(self.raw_local, rows.keys[local], rows.count[local])
                acc[0] += kl.double().sum()
                acc[1] += t1.double().sum()
                split_buf = self._stash_split(self.raw_all, None, split_buf)
        acc[:2] += block_sums.sum(0) + self._finish_split(split_buf, logits2d)
        if self.labels is not None:
            acc[2] += self._ce_sum(picked)
        self.norm = None  # the backward recomputes its softmaxes normalised
        self.kd_count = rows.owned.sum().double()
        self.top1 = acc[1]
        self.ce_count = (torch.zeros((), dtype=torch.float64) if self.labels is None
                         else (self.labels >= 0).sum().double())
        return (acc[0] * self.temp ** 2).to(self.dtype), acc[2].to(self.dtype)

    def _picked(self, logits2d: torch.Tensor) -> torch.Tensor:
        """Each position's label logit, gathered by the shard that holds it (0 on the
        others): what CE takes from the logits besides their log-partitions."""
        picked = logits2d.gather(1, self.label_col)[:, 0].to(self.dtype)
        return picked.mul_(self.label_local)

    def _ce_sum(self, picked: torch.Tensor) -> torch.Tensor:
        """Next-token CE summed over the labelled positions, for all blocks at once: the
        label's logit (:meth:`_picked`, summed over TP) against the saved log-partitions."""
        picked = all_reduce(picked, self.tp_group)
        logz1 = self.logz1 if self._ce_extra else self.logz
        return ((logz1 - picked) * self.has_label).sum()

    def _partition(self, x, probs, logits2d, start: int, end: int) -> torch.Tensor:
        """Local softmax into ``probs``; TP-wide log-partitions (and CE's at T = 1) into the
        saved per-position values (with TP: one max and one sum all-reduce). Returns the local
        log-partition."""
        lz_local = self.lz_local[start:end]
        if self.norm is not None:  # left unnormalised: 1 / sum goes into the factor
            lz, norm = cpu_rows.row_exp_(probs, x)
            lz_local.copy_(lz)
            self.norm[start:end].copy_(norm)
        else:
            self._local_softmax(x, probs, lz_local)
        lz1 = None
        if self._ce_extra:  # CE's partition at T = 1 needs a softmax of its own
            z = self._x(logits2d, start, end, unscaled=True)
            lz1 = self.lz1_local[start:end]
            self._local_softmax(z, self._workspace(end - start, x, "p1"), lz1)
        mass = None if self.extra is None else self.tail.mass(probs)
        self._reduce_partition(lz_local, lz1, mass, start, end)
        return lz_local

    def _partition_logits(self, x, logits2d, start: int, end: int) -> torch.Tensor:
        """:meth:`_partition` without the softmax (``logits_only``): the log-partitions by
        :func:`cpu_rows.row_logsumexp`."""
        lz_local = self.lz_local[start:end]
        lz_local.copy_(cpu_rows.row_logsumexp(x))
        lz1 = None
        if self._ce_extra:
            lz1 = self.lz1_local[start:end]
            lz1.copy_(cpu_rows.row_logsumexp(self._x(logits2d, start, end, unscaled=True)))
        self._reduce_partition(lz_local, lz1, None, start, end)
        return lz_local

    def _fuses_blocks(self, like: torch.Tensor) -> bool:
        """Whether the kernel takes each block with chunk rows from its logits in one pass
        (:meth:`_forward_from_logits`; gold and the exact form on CPU): a forward that writes
        the gradient (so every chunk row is held whole: no CP split), one TP rank (the
        shard's log-partitions are the TP-wide ones), no second softmax for CE, no tail."""
        fuses = getattr(self.kernel, "fuses_block", None)
        return (fuses is not None and not self.fused and self.grad_now and self.single
                and not self._ce_extra and self.tail is None and fuses(like))

    def _forward_from_logits(self, logits2d: torch.Tensor, x: torch.Tensor, blk, index: int,
                             sums: torch.Tensor) -> None:
        """Block ``blk`` by the kernel's pass from its logits: its (KL sum, top-1 matches) into
        ``sums``, its log-partitions saved, its gradient written (``_grad_now``): by the
        kernel's ``block_from_logits`` as it makes the KL (the exact form: a chunk row's
        positions are still in the caches), or from the raw gradient that its
        ``forward_from_logits`` returns (gold)."""
        rows, kernel = self.rows, self.kernel
        lz_local = self.lz_local[blk.start: blk.end]  # written by the kernel
        data = self._block(x, None, lz_local, blk, index)
        keys = rows.keys[blk.row_start: blk.row_end]
        counts = rows.count[blk.row_start: blk.row_end]
        if getattr(kernel, "writes_block_gradient", False):
            made: list[torch.Tensor] = []

            def kernel_pass(inv_t: float, coef: torch.Tensor, dx: torch.Tensor) -> None:
                made.extend(kernel.block_from_logits(data, keys, counts, self.grad_kd_t2,
                                                     inv_t, coef, dx))

            self._grad_now(logits2d, blk, index, x, None, None, kernel_pass=kernel_pass)
            kl, t1 = made
        else:
            kl, t1, raw_grad = kernel.forward_from_logits(data, keys, counts, self.grad_kd_t2)
            self._grad_now(logits2d, blk, index, x, None, None, raw_grad)
        torch.sum(kl, 0, dtype=torch.float64, out=sums[0])
        torch.sum(t1, 0, dtype=torch.float64, out=sums[1])

    def _partition_fused(self, z: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """:meth:`_partition` from the logits ``z`` in one fused pass (two with CE at T != 1):
        the local log-partitions and, for the tail, the softmax mean of W's row sums."""
        lz_local = self.lz_local[start:end]
        excess = None if self.extra is None else self.tail.excess
        lse, mean = row_softmax.row_partition(z, 1.0 / self.temp, excess)
        lz_local.copy_(lse)
        lz1 = None
        if self._ce_extra:
            lz1 = self.lz1_local[start:end]
            lz1.copy_(row_softmax.row_partition(z, 1.0)[0])
        mass = None if mean is None else mean.to(self.dtype).add_(self.tail.const)
        self._reduce_partition(lz_local, lz1, mass, start, end)
        return lz_local

    def _reduce_partition(self, lz_local, lz1, mass, start: int, end: int) -> None:
        """TP-wide log-partitions of the positions [start, end) from this shard's (nothing to
        do with one TP rank) and the tail's projected mass of this shard (``mass``, scaled to
        the TP-wide softmax) into ``self.extra``."""
        if self.single:
            if mass is not None:  # this shard's share of the projected mass (summed in kl)
                self.extra[start:end] = mass
            return
        maxes = [lz_local] if lz1 is None else [lz_local, lz1]
        top = all_reduce(torch.stack(maxes, 1), self.tp_group, "max")
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        sums = torch.exp(torch.stack(maxes, 1) - top)
        stats = all_reduce(sums, self.tp_group)
        logz = self.logz[start:end]
        torch.add(top[:, 0], stats[:, 0].log(), out=logz)
        if lz1 is not None:
            torch.add(top[:, 1], stats[:, 1].log(), out=self.logz1[start:end])
        if mass is not None:
            self.extra[start:end] = mass * torch.exp(lz_local - logz)

    def _stash_split(self, raw: Raw, blk, buf: Raw | None, index: int = 0) -> Raw | None:
        """Copy the raw sums of split rows (of block ``blk``, number ``index``, or of all rows)
        into the CP buffer."""
        rows = self.rows
        if rows.split_keys.numel() == 0:
            return None
        if buf is None:
            n = rows.split_keys.numel()
            buf = {k: v.new_zeros(n, *v.shape[1:]) for k, v in raw.items()}
        if blk is None:
            lo, hi, sel = 0, rows.num_rows, rows.split_rows
        else:
            lo, hi, sel = blk.row_start, blk.row_end, rows.split_of_block(index)
        slot = rows.split_slot[lo:hi]
        if sel.numel():
            dst = slot[sel]
            for k, v in raw.items():
                buf[k][dst] = v.index_select(0, sel)
        return buf

    def _finish_local(self, raw: Raw, blk, index: int, sums: torch.Tensor) -> None:
        """(KL sum, top-1 matches) of the rows of block ``blk`` (number ``index``) held whole
        by this rank, written into ``sums`` [2] (float64; left as it is where the block holds
        none): two reductions a block, no stack or accumulation (a GPU's launches)."""
        rows = self.rows
        sel = rows.local_of_block(index)
        if sel.numel() == 0:
            return
        keys = rows.keys[blk.row_start: blk.row_end]
        counts = rows.count[blk.row_start: blk.row_end]
        kl = None
        if not rows.all_local(index):  # else all rows, in order: no [rows, V] copies
            raw, keys, counts = take_rows(raw, sel), keys[sel], counts[sel]
        elif self.grad_now:  # the KL and its gradient from one pass, where the kernel can
            fused = getattr(self.kernel, "kl_with_grad", None)
            out = None if fused is None else fused(raw, keys, counts, self.grad_kd_t2)
            if out is not None:
                kl, t1, self.block_grad = out
        if kl is None:
            kl, t1 = self.kernel.kl(raw, keys, counts)
        torch.sum(kl, 0, dtype=torch.float64, out=sums[0])
        torch.sum(t1, 0, dtype=torch.float64, out=sums[1])

    def _finish_split(self, buf: Raw | None, like: torch.Tensor) -> torch.Tensor:
        """(KL sum, top-1 matches) of the split chunks this rank owns, after the CP sum."""
        rows = self.rows
        out = torch.zeros(2, dtype=torch.float64, device=like.device)
        if rows.split_keys.numel() == 0:
            return out
        if buf is None:  # no rows here: contribute zeros to the CP sum
            buf = self.kernel.empty_raw(rows.split_keys.numel(), like.new_empty(0, dtype=self.dtype))
        for v in buf.values():
            all_reduce(v, self.cp_group)
        self.split_raw = buf
        owner = rows.split_owner == group_rank(self.cp_group)
        kl, t1 = self.kernel.kl(buf, rows.split_keys, rows.key_count[rows.split_keys])
        return torch.stack([(kl.double() * owner).sum(), (t1.double() * owner).sum()])
