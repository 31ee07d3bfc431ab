"""The Triton kernels of :mod:`row_softmax` (imported only where Triton is installed)."""

import triton
import triton.language as tl


@triton.jit
def row_partition(x_ptr, x_stride, n_cols, scale, r_ptr, lse_ptr, mean_ptr,
                  HAS_R: tl.constexpr, BLOCK: tl.constexpr):
    # One row: online max and sum of exp(scale * x) (and of exp(..) * r) over column tiles.
    row = tl.program_id(0)
    base = x_ptr + row.to(tl.int64) * x_stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    w = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        v = tl.load(base + cols, mask=inside, other=float("-inf")).to(tl.float32) * scale
        m_new = tl.maximum(m, v)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        decay = tl.exp(m - ref)
        e = tl.exp(v - ref)
        s = s * decay + e
        if HAS_R:
            r = tl.load(r_ptr + cols, mask=inside, other=0.0).to(tl.float32)
            w = w * decay + e * r
        m = m_new
    top = tl.max(m, 0)
    ref = tl.where(top == float("-inf"), 0.0, top)
    decay = tl.exp(m - ref)
    total = tl.sum(s * decay, 0)
    tl.store(lse_ptr + row, ref + tl.log(total))
    if HAS_R:
        tl.store(mean_ptr + row, tl.sum(w * decay, 0) / total)

@triton.jit
def softmax_combine(out_ptr, out_stride, x_ptr, x_stride, n_cols, scale, lse_ptr, a_ptr,
                    c_ptr, r_ptr, lse1_ptr, b_ptr, HAS_R: tl.constexpr,
                    HAS_SECOND: tl.constexpr, BLOCK: tl.constexpr):
    # out = p * (a + c * r) [+ b * p1], p = exp(scale * x - lse), p1 = exp(x - lse1).
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row.to(tl.int64) * x_stride + cols, mask=inside,
                other=0.0).to(tl.float32)
    coef = tl.load(a_ptr + row)
    if HAS_R:
        r = tl.load(r_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        coef = coef + tl.load(c_ptr + row) * r
    value = tl.exp(x * scale - tl.load(lse_ptr + row)) * coef
    if HAS_SECOND:
        value += tl.exp(x - tl.load(lse1_ptr + row)) * tl.load(b_ptr + row)
    out = out_ptr + row.to(tl.int64) * out_stride + cols
    tl.store(out, value.to(out_ptr.dtype.element_ty), mask=inside)
