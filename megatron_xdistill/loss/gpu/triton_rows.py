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


@triton.jit
def write_chunk(out_ptr, out_stride, x_ptr, x_stride, n_cols, n_real, scale, lse_ptr, first,
                length, h_row, coef, hsum, dot_ptr, ce_ptr, label_ptr, lse1_ptr,
                IMAGE: tl.constexpr, CE: tl.constexpr, CE_OWN: tl.constexpr,
                BLOCK: tl.constexpr):
    # The logits' gradient of one chunk row's positions [first, first + length), written once
    # in out's dtype: exact form coef * p * (h - dot[t]); gold coef * (h - p * hsum) (h, at
    # ``h_row``: the row's gradient on its summed probabilities / log-prob means); plus CE's
    # ce[t] * (p1 - onehot(label[t])), p1 = p at T = 1 (CE_OWN: exp(x - lse1[t])). Padded
    # columns get 0.
    for k in tl.range(0, length):
        t = (first + k).to(tl.int64)
        lse = tl.load(lse_ptr + t)
        dot = 0.0
        if IMAGE:
            dot = tl.load(dot_ptr + t)
        ce = 0.0
        label = -1
        lse1 = lse
        if CE:
            ce = tl.load(ce_ptr + t)
            label = tl.load(label_ptr + t)
            if CE_OWN:
                lse1 = tl.load(lse1_ptr + t)
        for start in tl.range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            real = cols < n_real
            x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
            h = tl.load(h_row + cols, mask=real, other=0.0)
            p = tl.exp(x * scale - lse)
            if IMAGE:
                value = coef * p * (h - dot)
            else:
                value = coef * (h - p * hsum)
            if CE:
                if CE_OWN:
                    p1 = tl.exp(x - lse1)
                else:
                    p1 = p
                value += ce * (p1 - tl.where(cols == label, 1.0, 0.0))
            value = tl.where(real, value, 0.0)
            tl.store(out_ptr + t * out_stride + cols, value.to(out_ptr.dtype.element_ty),
                     mask=inside)


@triton.jit
def chunk_gradient(out_ptr, out_stride, x_ptr, x_stride, n_cols, n_real, scale, lse_ptr,
                   first_ptr, len_ptr, rows_ptr, h_ptr, h_stride, coef_ptr, dot_ptr,
                   hsum_ptr, ce_ptr, label_ptr, lse1_ptr,
                   IMAGE: tl.constexpr, CE: tl.constexpr, CE_OWN: tl.constexpr,
                   BLOCK: tl.constexpr):
    # :func:`write_chunk` for the rows of a group, one program a row.
    g = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + g)
    hsum = 0.0
    if not IMAGE:
        hsum = tl.load(hsum_ptr + g)
    write_chunk(out_ptr, out_stride, x_ptr, x_stride, n_cols, n_real, scale, lse_ptr,
                tl.load(first_ptr + row), tl.load(len_ptr + row), h_ptr + g * h_stride,
                tl.load(coef_ptr + g), hsum, dot_ptr, ce_ptr, label_ptr, lse1_ptr,
                IMAGE, CE, CE_OWN, BLOCK)


@triton.jit
def plain_gradient(out_ptr, out_stride, x_ptr, x_stride, n_cols, n_real, pos_row_ptr,
                   ce_ptr, label_ptr, lse1_ptr, CE: tl.constexpr, BLOCK: tl.constexpr):
    # The gradient of a position that predicts no chunk row: CE's alone (or 0).
    t = tl.program_id(0).to(tl.int64)
    if tl.load(pos_row_ptr + t) < 0:
        if CE:
            ce = tl.load(ce_ptr + t)
            label = tl.load(label_ptr + t)
            lse1 = tl.load(lse1_ptr + t)
        for start in tl.range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            value = tl.zeros([BLOCK], tl.float32)
            if CE:
                x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
                value = ce * (tl.exp(x - lse1) - tl.where(cols == label, 1.0, 0.0))
            value = tl.where(cols < n_real, value, 0.0)
            tl.store(out_ptr + t * out_stride + cols, value.to(out_ptr.dtype.element_ty),
                     mask=inside)
