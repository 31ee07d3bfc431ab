"""One loss call of the exact (image) P-KL or gold / H-KL (full or compact payload) on
whole-call Triton passes.

Where the fused passes serve (a CUDA device with Triton; tests force them on CPU tensors under
Triton's interpreter), :func:`student.parallel_loss.parallel_kd_loss` hands these forms here
instead of the blockwise plan: the TP-wide log-partitions of every position in one kernel (two
with CE at T != 1), then per group of chunk rows the form's few kernels (:mod:`fused.image`,
:mod:`fused.gold`, :mod:`fused.gold_topk`) and one kernel that writes the rows' positions' gradient, KD and CE together,
in the logits' dtype with one rounding; one more writes the positions that predict no chunk.
No Python loop over blocks of positions: the groups exist only to bound the [rows, V] buffers
(one group at the default budget up to about a tenth of the logits' bytes).

Given the loss's weights ahead (``loss_weights``), the forward writes the gradient and the
backward scales it; otherwise the backward runs the passes again with the upstream gradients.
"""

from __future__ import annotations

import functools
import os

import torch

from megatron_xdistill.loss.collectives import Group
from megatron_xdistill.loss.fused.layout import (
    CrossEntropy,
    GradientTarget,
    RowLayout,
    cross_entropy_inputs,
    log_partition,
)

#: the environment switch: "0" never, "1" always (CPU tensors need TRITON_INTERPRET=1), unset:
#: on CUDA devices
ENV = "XDISTILL_FUSED_FORMS"


@functools.cache
def _kernels():
    try:
        from megatron_xdistill.loss.gpu import triton_rows
    except ImportError:
        return None
    return triton_rows


_REFUSED: list[str] = []


def enabled(device: torch.device) -> bool:
    """Whether the fused passes take the image and gold forms' calls on ``device``."""
    choice = os.environ.get(ENV, "")
    if choice == "0" or _REFUSED or _kernels() is None:
        return False
    return choice == "1" or torch.device(device).type == "cuda"


def compile_errors() -> tuple[type[BaseException], ...]:
    """Triton's errors of a kernel that cannot be built for this device (compilation, too
    many registers or shared memory): raised at a kernel's first launch, alike on every rank."""
    try:
        from triton.compiler.errors import CompilationError
        from triton.runtime.errors import OutOfResources
    except ImportError:
        return ()
    return CompilationError, OutOfResources


def refuse(err: BaseException) -> None:
    """Turns the fused passes off for this process after ``err``, with one warning that says
    so and how to look into it (the blockwise plan computes the same sums, slower)."""
    import warnings

    _REFUSED.append(repr(err))
    warnings.warn(f"the fused Triton passes of the exact / gold losses could not be built on this "
                  f"device ({type(err).__name__}: {str(err)[:300]}); this process uses the "
                  f"blockwise plan instead (the same losses, slower). {ENV}=0 chooses it from "
                  f"the start; please report the error with the device and Triton version",
                  RuntimeWarning, stacklevel=3)


def takes(form_kernel: str, logits: torch.Tensor) -> bool:
    """Whether a call of the form's kernel (``"image"`` or ``"gold"``) on ``logits`` runs
    here: the fused passes on their device, logits in fp32 / bf16 / fp16 (float64, e.g.
    gradcheck, keeps the blockwise plan)."""
    return (form_kernel in ("image", "gold") and enabled(logits.device)
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16))


def group_rows(row_bytes: int, logits: torch.Tensor, budget: int | None,
               whole_rows: bool = False) -> int:
    """Rows a group takes: its buffers within ``budget`` bytes (None: a tenth of the logits'
    bytes, at least 16 MiB; with ``whole_rows``, where the whole-row kernels hold a few scratch
    rows per program whatever the group's size, every row in one group)."""
    if budget is None:
        if whole_rows:
            return 1 << 62
        budget = max(logits.numel() * logits.element_size() // 10, 16 << 20)
    return max(1, int(budget) // max(row_bytes, 1))


def upstream_scale(g_kd: torch.Tensor | None, g_ce: torch.Tensor | None,
                   weights: tuple[float, float], kd_live: bool, ce_live: bool) -> float:
    """s with (g_kd, g_ce) = s (a, b) for a forward that wrote the gradient of a * kd + b * ce,
    or a clear error where the upstream gradients come in another ratio (the recompute's
    inputs are gone). A sum that does not depend on the logits takes any upstream gradient."""
    a, b = weights
    terms = [(name, 0.0 if g is None else float(g), w)
             for name, g, w, live in (("kd_sum", g_kd, a, kd_live), ("ce_sum", g_ce, b, ce_live))
             if live]
    scale = next((got / w for _, got, w in terms if w != 0.0), 0.0)
    for name, got, weight in terms:
        want = scale * weight
        if abs(got - want) > 1e-5 * max(abs(got), abs(want)) + 1e-30:
            raise RuntimeError(
                f"parallel_kd_loss(loss_weights=({a!r}, {b!r})) wrote the gradient of "
                f"{a!r} * kd_sum + {b!r} * ce_sum in its forward, but the backward got "
                f"{got!r} for {name} (expected {want!r}, the loss's other term gave scale "
                f"{scale!r}): pass the weights the loss applies to the two sums, or none")
    return scale


class FusedCall:
    """Everything one call needs (see the module docstring)."""

    def __init__(self, form_pass, layout: RowLayout, *, num_real: int, vocab_start: int,
                 temperature: float, labels: torch.Tensor | None, tp_group: Group,
                 into_logits: bool, grad_weights: tuple[float, float] | None) -> None:
        self.form, self.layout = form_pass, layout
        self.num_real, self.vocab_start = num_real, vocab_start
        self.temp = float(temperature)
        self.labels, self.tp_group = labels, tp_group
        self.into_logits, self.grad_weights = into_logits, grad_weights
        self.image = bool(form_pass.image)  # the exact form's inputs, else the gold forms'
        self.wrote: torch.Tensor | None = None
        self.ce: CrossEntropy | None = None

    # ----------------------------------------------------------------- forward
    def forward(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits2d = logits.view(-1, logits.shape[-1])
        x = logits2d[:, : self.num_real]
        dev = logits.device
        self.lse = log_partition(x, 1.0 / self.temp, self.tp_group)
        if self.labels is not None:
            lse1 = self.lse if self.temp == 1.0 else log_partition(x, 1.0, self.tp_group)
            self.ce = cross_entropy_inputs(x, self.labels, self.vocab_start, lse1, self.tp_group)
        if not self.image:
            num = self.layout.first.numel() - 1
            rows = torch.where(self.layout.pos_row >= 0, self.layout.pos_row, num)
            self.lse_sum = torch.zeros(num + 1, dtype=torch.float32, device=dev).index_add_(
                0, rows, self.lse)
        kd, top1, self.wrote = self._passes(logits2d, None)
        self.kd_count = self.layout.owned_count
        self.top1 = top1
        self.ce_count = (torch.zeros((), dtype=torch.float64) if self.labels is None
                         else (self.labels >= 0).sum().double())
        ce = self.ce.total if self.ce is not None else torch.zeros((), dtype=torch.float64,
                                                                     device=dev)
        return (kd * self.temp ** 2).float(), ce.float()

    def _passes(self, logits2d: torch.Tensor, upstream):
        """(sum of the counted rows' weighted KL, their top-1 matches (float64), the gradient
        written with the weights ``upstream`` (a, b), or ``grad_weights`` in the forward; None
        without either)."""
        dev = logits2d.device
        weights = upstream if upstream is not None else self.grad_weights
        target = None if weights is None else self._target(logits2d, weights)
        kd = torch.zeros((), dtype=torch.float64, device=dev)
        top1 = torch.zeros((), dtype=torch.float64, device=dev)
        x = logits2d[:, : self.num_real]
        scale = 1.0 / self.temp
        lse = self.lse if self.image else self.lse_sum
        for group in self.layout.groups:
            kl, t1 = self.form.run(x, scale, lse, self.layout, group, target)
            kd += (kl * group.weight.double() * group.counted).sum()
            top1 += (t1 & group.counted).double().sum()
        if target is not None:
            self._write_plain(target)
        return kd, top1, None if target is None else target.out

    def _target(self, logits2d: torch.Tensor, weights) -> GradientTarget:
        """Where this pass writes the gradient of a * kd_sum + b * ce_sum."""
        dev = logits2d.device
        a, b = weights
        out = logits2d if self.into_logits else torch.empty_like(logits2d)
        ce = self.ce
        if ce is not None:
            ce_coef = (ce.has_label * torch.as_tensor(b, device=dev)).float().contiguous()
            label, lse1 = ce.label_col.contiguous(), ce.lse.contiguous()
        else:
            ce_coef, label, lse1 = self.lse, self.lse, self.lse  # not read
        dot = torch.zeros(logits2d.shape[0], dtype=torch.float32, device=dev) if self.image \
            else self.lse
        return GradientTarget(out, logits2d, self.num_real, self.temp, self.lse, self.layout,
                              torch.as_tensor(a, dtype=torch.float32, device=dev), ce_coef,
                              label, lse1, ce is not None,
                              ce is not None and self.temp != 1.0, dot)

    def _write_plain(self, target: GradientTarget) -> None:
        """The gradient of the positions that predict no chunk row: CE's, or 0."""
        from megatron_xdistill.loss.gpu import triton_rows

        x = target.logits
        if x.shape[0] == 0:
            return
        triton_rows.plain_gradient[(x.shape[0],)](
            target.out, target.out.stride(0), x, x.stride(0), x.shape[1], self.num_real,
            self.layout.pos_row, target.ce_coef, target.label, target.lse1, CE=target.has_ce,
            BLOCK=target.block)

    def gradient(self, logits: torch.Tensor, g_kd, g_ce) -> torch.Tensor:
        """The backward of a call whose forward did not write the gradient: the passes again,
        written with the upstream gradients as the weights."""
        logits2d = logits.view(-1, logits.shape[-1])
        zero = torch.zeros((), dtype=torch.float32, device=logits.device)
        weights = (zero if g_kd is None else g_kd.float(), zero if g_ce is None else g_ce.float())
        return self._passes(logits2d, weights)[2].view_as(logits)

    def scaled(self, g_kd, g_ce, shape) -> torch.Tensor:
        """The backward of a call whose forward wrote the gradient: that gradient times s."""
        if self.wrote is None:
            raise RuntimeError("parallel_kd_loss(loss_weights=...): the forward's gradient was "
                               "taken by an earlier backward (it is handed over, not kept); "
                               "call the loss again, or pass no loss_weights, to backward twice")
        scale = upstream_scale(g_kd, g_ce, self.grad_weights,
                               any(g.size for g in self.layout.groups), self.labels is not None)
        grad, self.wrote = self.wrote, None
        if scale != 1.0:
            grad.mul_(scale)
        if self.into_logits:
            torch.autograd.graph.increment_version(grad)
        return grad.view(shape)


class _FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, call: FusedCall):
        kd, ce = call.forward(logits)
        ctx.call = call
        ctx.shape = logits.shape
        if call.wrote is None:
            ctx.save_for_backward(logits)
        return kd, ce

    @staticmethod
    def backward(ctx, g_kd, g_ce):
        call = ctx.call
        if call.grad_weights is not None:
            return call.scaled(g_kd, g_ce, ctx.shape), None
        (logits,) = ctx.saved_tensors
        return call.gradient(logits, g_kd, g_ce), None


def run(call: FusedCall, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kd_sum, ce_sum) of the call, differentiable with respect to ``logits``."""
    return _FusedFunction.apply(logits, call)


__all__ = ["ENV", "FusedCall", "compile_errors", "enabled", "group_rows", "refuse", "run",
           "takes", "upstream_scale"]
