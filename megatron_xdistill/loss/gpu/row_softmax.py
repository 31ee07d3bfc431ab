"""Row-wise softmax passes over the student's logits, one fused kernel each on a GPU.

The column P-KL forms and CE need only two dense passes over a [positions, V_local] shard of
logits: the forward's log-partition of each row (plus, for the chunk top-k tail, the row's mean of
W's row sums under the softmax), and the backward's write of ``p * (a + c * r) + b * p1`` into the
gradient, where every other term of the gradient is a sparse correction. In plain torch each pass
is several kernels with [rows, V] temporaries (softmax, two maxima, the scaling), so the loss had
to work in small blocks of positions, one launch sequence per block. Here each pass is one Triton
kernel that reads the logits in any dtype, computes in fp32 and keeps nothing of size V: no block
buffer, so a whole call can be one block.

:func:`enabled` says whether the fused kernels serve a device (CUDA with Triton installed; tests
may force them on CPU tensors under ``TRITON_INTERPRET=1``). Where they do not, the loss keeps its
blockwise torch path: the same quantities, only slower.
"""

from __future__ import annotations

import functools
import os

import torch

#: Set by tests: True forces the fused kernels (on CPU tensors they need TRITON_INTERPRET=1),
#: False turns them off; None chooses by device.
FORCE: bool | None = None
#: Columns per step of a row: a multiple of 32 lanes, large enough to keep loads wide.
_BLOCK = 2048


@functools.cache
def _triton():
    if os.environ.get("XDISTILL_FUSED_SOFTMAX", "1") == "0":
        return None
    try:
        from megatron_xdistill.loss.gpu import triton_rows as triton_row_kernels
    except ImportError:
        return None
    return triton_row_kernels.row_partition, triton_row_kernels.softmax_combine


def enabled(device: torch.device) -> bool:
    """Whether the loss runs its dense passes through the fused kernels on ``device``."""
    if FORCE is not None:
        return FORCE and _triton() is not None
    return torch.device(device).type == "cuda" and _triton() is not None


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(f"{name} must be [rows, V] with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def row_partition(x: torch.Tensor, scale: float, row_weights: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per row of ``x`` [n, V] (any float dtype, rows may be strided): the log-partition
    log sum_j exp(scale * x_j) in fp32 and, with ``row_weights`` r [V], the softmax mean
    sum_j p_j r_j. One read of ``x``."""
    _check_rows(x, "x")
    n, v = x.shape
    lse = torch.empty(n, dtype=torch.float32, device=x.device)
    mean = None if row_weights is None else torch.empty_like(lse)
    if n:
        row_kernel, _ = _triton()
        r = x if row_weights is None else row_weights.to(torch.float32).contiguous()
        row_kernel[(n,)](x, x.stride(0), v, float(scale), r, lse,
                         lse if mean is None else mean, HAS_R=row_weights is not None,
                         BLOCK=_BLOCK, num_warps=8)
    return lse, mean


def softmax_combine_(out: torch.Tensor, x: torch.Tensor, scale: float, lse: torch.Tensor,
                     a: torch.Tensor, c: torch.Tensor | None = None,
                     r: torch.Tensor | None = None, lse1: torch.Tensor | None = None,
                     b: torch.Tensor | None = None) -> torch.Tensor:
    """``out`` [n, V] <- p * (a + c * r) (+ b * p1): p = exp(scale * x - lse) and
    p1 = exp(x - lse1) per row, ``a``/``c``/``b`` [n] per row, ``r`` [V] per column, computed
    in fp32 and stored in ``out``'s dtype. One read of ``x``, one write of ``out``."""
    _check_rows(x, "x")
    _check_rows(out, "out")
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} and x {tuple(x.shape)} differ")
    n, v = x.shape
    if n == 0 or v == 0:
        return out
    _, combine = _triton()
    f32 = torch.float32

    def rowvec(t):
        return None if t is None else t.to(f32).contiguous()

    a, c, b, lse, lse1 = rowvec(a), rowvec(c), rowvec(b), rowvec(lse), rowvec(lse1)
    has_r = r is not None
    r = r.to(f32).contiguous() if has_r else a
    grid = (n, -(-v // _BLOCK))
    combine[grid](out, out.stride(0), x, x.stride(0), v, float(scale), lse, a,
                  c if has_r else a, r, lse1 if lse1 is not None else lse,
                  b if b is not None else a, HAS_R=has_r, HAS_SECOND=lse1 is not None,
                  BLOCK=_BLOCK, num_warps=8)
    return out


def values_at(x: torch.Tensor, lin: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``x`` [n, V] (rows may be strided) at flat [n, V] indices ``lin`` of rows ``pos``, in
    fp32: where the fused passes' sparse terms read the logits."""
    n, width = x.shape
    stride = x.stride(0) if n > 1 else width
    flat = x.as_strided((max(0, (n - 1) * stride + width),), (1,))
    idx = lin if stride == width else lin + pos * (stride - width)
    return flat.index_select(0, idx).float()


__all__ = ["FORCE", "enabled", "row_partition", "softmax_combine_", "values_at"]
