"""The gradient half of :class:`student.plan.StudentLossPlan`: a block's gradient on its
logits, written by the backward (each block's softmax and raw sums recomputed from the saved
log-partitions) or, when the caller gives the loss's weights on the KD and CE sums ahead, by the
forward right after the block's sums (the backward then only scales it).

:class:`BlockGradients` is a mixin: it reads the plan's chunk rows, kernel, saved
log-partitions, workspaces and per-block data (``_x``, ``_block``, ``_factor``, ``_workspace``).
"""

from __future__ import annotations

import torch

from megatron_xdistill.loss.blocks.block_data import BlockData, Raw
from megatron_xdistill.loss.collectives import all_gather
from megatron_xdistill.loss.cpu import rows as cpu_rows
from megatron_xdistill.loss.fused.call import upstream_scale
from megatron_xdistill.loss.gpu.fused_grad import FusedGradWriter


def take_rows(raw: dict[str, torch.Tensor], index: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``index`` of every raw sum."""
    return {k: v.index_select(0, index) for k, v in raw.items()}


class BlockGradients:
    """Writing the gradient block by block (see the module docstring)."""

    # ----------------------------------------------------------------- forward's gradient
    def _can_grad_now(self) -> bool:
        """Whether the forward writes the gradient (:attr:`grad_weights` given): every block
        must be finished in the forward, so not with chunks split over CP (their sums wait
        for the CP all-reduce) nor with kernels that finish all rows together; nor with the
        fused GPU passes (their whole-call block has its own writer). The same on every rank
        (the rows' split is global)."""
        return (self.grad_weights is not None and not self.fused
                and self.rows.split_keys.numel() == 0
                and (self.kernel.per_block or self.rows.num_rows == 0))

    def _softmax_in_grad(self) -> torch.Tensor | None:
        """The gradient buffer as [positions, V_local] where the forward may write each block's
        softmax straight into its rows (the block's gradient is then made from it in place:
        no [block, V] copy a block, 0.45 s of 6.0 at 16k tokens x V_s 49,152 on CPU), else
        None. Not where the buffer is the logits and something reads them after the softmax
        (CE at T != 1 takes its own softmax of them; gold's sums read them), nor where its
        rows are not the compute dtype's or hold padded columns."""
        if not self.grad_now or self.logits_only:
            return None
        grad = self.grad_full.view(-1, self.grad_full.shape[-1])
        if grad.dtype != self.dtype or grad.shape[1] != self.num_real:
            return None
        if self.into_logits and (self._ce_extra or getattr(self.kernel, "reads_logits", True)):
            return None
        return grad

    def _start_grad_now(self, logits: torch.Tensor) -> None:
        """The gradient's buffer and CE's coefficients at upstream weight b."""
        a, b = self.grad_weights
        self.grad_full = self._gradient_buffer(logits)
        self.grad_ce = self._ce_terms(torch.tensor(b, dtype=self.dtype, device=logits.device))
        self.grad_kd = torch.tensor(a, dtype=self.dtype, device=logits.device)
        # the KL rows' weight in the kernels' own gradients (the KD sum carries T^2)
        self.grad_kd_t2 = self.grad_kd * (self.temp * self.temp)

    def _grad_now(self, logits2d: torch.Tensor, blk, index: int, x: torch.Tensor,
                  probs: torch.Tensor | None, raw: Raw | None,
                  raw_grad: Raw | None = None, kernel_pass=None) -> None:
        """Block ``blk``'s gradient of a * kd + b * ce, written by the forward right after its
        sums: its softmax (``probs``, written over), raw sums and (where the kernel made it
        with the KL) their gradient are at hand, so nothing is recomputed. ``kernel_pass``:
        (inv_t, coef, dx) -> None writes the kernel's part in place of its backward (a kernel
        that makes the KL and the gradient together: ``_forward_from_logits``)."""
        grad = self.grad_full.view(-1, self.grad_full.shape[-1])
        self._write_block(grad, logits2d, blk, index, (None, None, self.grad_kd), self.grad_ce,
                          x=x, probs=probs, raw=raw, raw_grad=raw_grad, kernel_pass=kernel_pass)

    def scaled_forward_grad(self, g_kd: torch.Tensor | None, g_ce: torch.Tensor | None
                            ) -> torch.Tensor:
        """The backward of a call whose forward wrote the gradient of a * kd + b * ce: that
        gradient times s, where (g_kd, g_ce) = s (a, b). Upstream gradients in another ratio
        cannot be served (the recompute's inputs are gone): a clear error. The logits are not
        saved for it (saving a tensor the forward then wrote over fails to unpack when the
        logits are a custom Function's view, as a loss clock's identity)."""
        a, b = self.grad_weights
        if not hasattr(self, "grad_full"):
            raise RuntimeError("parallel_kd_loss(loss_weights=...): the forward's gradient was "
                               "taken by an earlier backward (it is handed over, not kept); "
                               "call the loss again, or pass no loss_weights, to backward twice")
        # A sum that does not depend on these logits (no chunk rows here; no labels) takes
        # any upstream gradient.
        scale = upstream_scale(g_kd, g_ce, (a, b), self.rows.num_rows > 0,
                               self.labels is not None)
        grad = self.grad_full
        del self.grad_full
        # A scale within the compute dtype's half-ulp of 1 (the upstream gradient 1 / n in
        # fp32 against the weight 1 / n in fp64: 1 + 6e-8) changes no element by more than
        # its rounding: a pass over [positions, V] saved (0.17 s at 16k x 49,152, one thread)
        if abs(scale - 1.0) > torch.finfo(self.dtype).eps / 2:
            grad.mul_(scale)
        if self.into_logits:  # another autograd user of these logits now fails loudly
            torch.autograd.graph.increment_version(grad)  # (shares the logits' counter)
        return grad

    # ----------------------------------------------------------------- backward
    def _grad_of(self, raw: Raw, keys, counts, weight) -> Raw:
        """d(sum_r weight_r * T^2 * KL_r) / d raw (weight: scalar or per row): the kernel's
        own where it writes it directly, else by autograd through its ``kl``."""
        direct = getattr(self.kernel, "raw_grad", None)
        if direct is not None:
            grads = direct(raw, keys, counts, weight * (self.temp * self.temp))
            if grads is not None:
                return grads
        leaves = {k: v.detach().requires_grad_(True) for k, v in raw.items()}
        with torch.enable_grad():
            kl, _ = self.kernel.kl(leaves, keys, counts, top1=False)
            total = (kl * weight).sum() * (self.temp * self.temp)
            names = list(leaves)
            grads = torch.autograd.grad(total, [leaves[k] for k in names], allow_unused=True)
        return {k: (torch.zeros_like(leaves[k]) if g is None else g)
                for k, g in zip(names, grads)}

    def backward(self, logits: torch.Tensor, g_kd: torch.Tensor | None,
                 g_ce: torch.Tensor | None) -> torch.Tensor:
        rows, kernel = self.rows, self.kernel
        dev = logits.device
        g_kd = (torch.zeros((), device=dev) if g_kd is None else g_kd).to(self.dtype)
        g_ce = (torch.zeros((), device=dev) if g_ce is None else g_ce).to(self.dtype)
        logits2d = logits.view(-1, logits.shape[-1])
        grad_full = self._gradient_buffer(logits)
        grad = grad_full.view(-1, logits.shape[-1])
        g_split = None
        if self.split_raw is not None:  # weighted by the owning CP rank's upstream gradient
            owner_g = torch.stack(all_gather(g_kd.reshape(1), self.cp_group))[:, 0]
            g_split = self._grad_of(self.split_raw, rows.split_keys,
                                    rows.key_count[rows.split_keys], owner_g[rows.split_owner])
        g_all = None
        if not kernel.per_block and rows.num_rows:
            local = rows.local_rows
            g_local = self._grad_of(self.raw_local, rows.keys[local], rows.count[local], g_kd)
            g_all = {k: torch.zeros_like(v) for k, v in self.raw_all.items()}
            split = rows.split_rows
            for k in g_all:
                g_all[k][local] = g_local[k]
                if g_split is not None and split.numel():
                    g_all[k][split] = g_split[k][rows.split_slot[split]]
        ce = self._ce_terms(g_ce)
        for index, blk in enumerate(rows.blocks):
            self._write_block(grad, logits2d, blk, index, (g_all, g_split, g_kd), ce)
        if self.into_logits:  # another autograd user of these logits now fails loudly
            torch.autograd.graph.increment_version(logits)
        return grad_full

    def _gradient_buffer(self, logits: torch.Tensor) -> torch.Tensor:
        """Where the logits' gradient goes: over the logits (``into_logits``) or a new
        [B, T, V_local] tensor; the padded columns zeroed."""
        grad_full = logits.detach() if self.into_logits else torch.empty_like(logits)
        if self.num_real < grad_full.shape[-1]:
            grad_full[..., self.num_real:] = 0
        return grad_full

    def _ce_terms(self, g_ce: torch.Tensor):
        """Per position, for all blocks at once: CE's weight g_ce * has_label, the part of it
        folded into the KD gradient's coefficient (CE shares the softmax at T = 1; else a
        zero coefficient) and the -weight that CE puts on the label's column (0 where the
        label is on another shard). Nones without labels."""
        ce_scale = ce_coef = ce_label = None
        if self.labels is not None:
            ce_scale = g_ce * self.has_label
            ce_label = torch.where(self.label_local, -ce_scale, 0.0)[:, None]
            if not self._ce_extra:
                ce_coef = ce_scale
        no_coef = (torch.zeros(self.max_block, dtype=self.dtype, device=self.lz_local.device)
                   if ce_coef is None else None)
        return ce_scale, ce_coef, ce_label, no_coef

    def _write_block(self, grad: torch.Tensor, logits2d: torch.Tensor, blk, index: int, grads,
                     ce, x: torch.Tensor | None = None, probs: torch.Tensor | None = None,
                     raw: Raw | None = None, raw_grad: Raw | None = None,
                     kernel_pass=None) -> None:
        """Block ``blk``'s gradient into its rows of ``grad`` [positions, V_local]. From the
        forward (``_grad_now``): its ``x``, softmax ``probs`` (written over) and raw sums, so
        nothing is recomputed; from the backward: all recomputed."""
        ce_scale, ce_coef, ce_label, no_coef = ce
        out = grad[blk.start: blk.end, : self.num_real]
        has_rows = blk.row_end > blk.row_start
        if not has_rows and self.labels is None:
            out.zero_()
            return
        n = blk.end - blk.start
        coef = no_coef[:n] if ce_coef is None else ce_coef[blk.start: blk.end]
        args = (logits2d, blk, index, coef, grads, ce_scale, ce_label)
        if self.fused:  # any dtype is written in place (low-precision gradients exactly; see
            # fused_grad)
            dx = out if out.is_contiguous() else self._workspace(n, out, "dx")
            self._block_backward_fused(dx, *args)
            if dx is not out:
                out.copy_(dx)
            return
        # In place, a block's gradient may overwrite its own logits directly only where
        # nothing reads them afterwards (the logits-only path without CE's second softmax);
        # elsewhere it goes through a block workspace (from the forward: its softmax buffer).
        # Blocks read only their own positions.
        alias_ok = not self.into_logits or (self.logits_only and not self._ce_extra)
        if probs is not None:
            dx = probs
        elif out.is_contiguous() and out.dtype == self.dtype and alias_ok:
            dx = out
        else:
            dx = self._workspace(n, out, "dx")
        self._block_backward(dx, *args, x=x, softmax_ready=probs is not None,
                             known=(raw, raw_grad), kernel_pass=kernel_pass)
        if dx.data_ptr() != out.data_ptr():  # (the forward's softmax may be in ``out``)
            out.copy_(dx)

    def _block_backward(self, dx, logits2d, blk, index: int, coef, grads, ce_scale, ce_label,
                        x: torch.Tensor | None = None, softmax_ready: bool = False,
                        known: tuple[Raw | None, Raw | None] = (None, None),
                        kernel_pass=None) -> None:
        """A block's gradient into ``dx`` (contiguous, compute dtype): its softmax, then the
        kernel's and CE's terms in place (``logits_only``: written from the logits).
        ``softmax_ready``: dx holds the block's softmax already; ``x``, ``known``: the block's
        logits / T and (raw sums, their gradient) where the forward has them."""
        lz_local = self.lz_local[blk.start: blk.end]
        if x is None:
            x = self._x(logits2d, blk.start, blk.end)
        if self.logits_only:  # the kernel writes dx from the logits (no softmax pass here)
            if kernel_pass is not None:
                kernel_pass(1.0 / self.temp, coef, dx)
            elif blk.row_end > blk.row_start:
                data = self._block(x, None, lz_local, blk, index)
                self.kernel.backward_block(data, self._block_grad(data, *grads, blk, *known),
                                           1.0 / self.temp, coef, dx)
            else:
                cpu_rows.exp_spread_(dx, x, lz_local,
                                     coef * self._factor(lz_local, blk.start, blk.end))
        else:
            if not softmax_ready:
                torch.ops.aten._softmax.out(x, 1, False, out=dx)  # this shard's softmax
            self._softmax_backward(dx, x, lz_local, blk, index, coef, grads, known)
        if self._ce_extra:
            self._ce_extra_backward(dx, logits2d, blk.start, blk.end, ce_scale)
        if self.labels is not None and dx.shape[1]:  # CE's -weight on the label's column
            dx.scatter_add_(1, self.label_col[blk.start: blk.end], ce_label[blk.start: blk.end])

    def _softmax_backward(self, dx, x, lz_local, blk, index: int, coef, grads,
                          known: tuple[Raw | None, Raw | None] = (None, None)) -> None:
        """The kernel's part of a block's gradient from the block's softmax, held in ``dx``
        and written over."""
        if blk.row_end > blk.row_start:
            data = self._block(x, dx, lz_local, blk, index)
            self.kernel.backward_block(data, self._block_grad(data, *grads, blk, *known),
                                       1.0 / self.temp, coef, dx)
        else:
            dx.mul_((coef * self._factor(lz_local, blk.start, blk.end))[:, None])

    def _block_backward_fused(self, dx, logits2d, blk, index: int, coef, grads, ce_scale,
                              ce_label) -> None:
        """The same gradient into ``dx`` (contiguous, any dtype) in one fused dense pass over
        the block's logits plus sparse corrections (:class:`FusedGradWriter`)."""
        start, end = blk.start, blk.end
        lz_local = self.lz_local[start:end]
        z = logits2d[start:end, : self.num_real]
        writer = self._writer(dx, z, start, end, ce_scale)
        if blk.row_end > blk.row_start:
            data = self._block(z, None, lz_local, blk, index)
            self.kernel.backward_fused(data, self._block_grad(data, *grads, blk),
                                       1.0 / self.temp, coef, writer)
        else:
            writer.dense(coef * self._factor(lz_local, start, end))
        if self.labels is not None and dx.shape[1]:  # CE's -weight on the label's column
            lin = (torch.arange(end - start, device=dx.device) * dx.shape[1]
                   + self.label_col[start:end, 0])
            writer.add(lin, ce_label[start:end, 0])
        writer.finish()

    def _ce_weight(self, scale: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """CE's weight on the T = 1 softmax of this shard (CE at T != 1)."""
        weight = scale[start:end]
        if not self.single:
            weight = weight * torch.exp(self.lz1_local[start:end] - self.logz1[start:end])
        return weight

    def _writer(self, dx: torch.Tensor, z: torch.Tensor, start: int, end: int,
                ce_scale: torch.Tensor | None) -> FusedGradWriter:
        """The fused gradient writer of positions [start, end) into ``dx`` from their logits
        ``z`` (p: this shard's softmax of z / T), with CE's own softmax term at T != 1."""
        lz1 = b = None
        if self._ce_extra:
            lz1, b = self.lz1_local[start:end], self._ce_weight(ce_scale, start, end)
        return FusedGradWriter(dx, z, 1.0 / self.temp, self.lz_local[start:end], lz1, b)

    def _block_grad(self, data: BlockData, g_all, g_split, g_kd, blk, raw: Raw | None = None,
                    raw_grad: Raw | None = None) -> Raw:
        """Gradient of the KD sum with respect to the block rows' raw sums (``raw``: the
        forward's, else recomputed; ``raw_grad``: the gradient itself, made with the KL)."""
        rows, kernel = self.rows, self.kernel
        if raw_grad is not None:
            return raw_grad
        if g_all is not None:
            return {k: v[blk.row_start: blk.row_end] for k, v in g_all.items()}
        if raw is None:  # per-block kernels: recompute, then the KL's gradient
            raw = kernel.raw(data)
        keys = rows.keys[blk.row_start: blk.row_end]
        counts = rows.count[blk.row_start: blk.row_end]
        if rows.all_local(data.index):  # all rows, in order: no [rows, V] copies
            return self._grad_of(raw, keys, counts, g_kd)
        out = {k: torch.zeros_like(v) for k, v in raw.items()}
        slot = rows.split_slot[blk.row_start: blk.row_end]
        local = rows.local_of_block(data.index)
        if local.numel():
            g = self._grad_of(take_rows(raw, local), keys[local], counts[local], g_kd)
            for k in out:
                out[k][local] = g[k]
        split = rows.split_of_block(data.index)
        if split.numel():
            for k in out:
                out[k][split] = g_split[k][slot[split]]
        return out

    def _ce_extra_backward(self, dx, logits2d, start: int, end: int, scale: torch.Tensor
                           ) -> None:
        """CE's softmax part scale * softmax(z) at T != 1 (at T = 1 it is folded into the KD
        gradient's coefficient)."""
        z = self._x(logits2d, start, end, unscaled=True)
        p1 = self._workspace(end - start, dx, "p1")
        torch.ops.aten._softmax.out(z, 1, False, out=p1)
        dx.addcmul_(p1, self._ce_weight(scale, start, end)[:, None])
