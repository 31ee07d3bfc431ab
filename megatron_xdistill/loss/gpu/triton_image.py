"""Triton kernels of the exact (image) P-KL (:mod:`gpu.image_pass`), one program per chunk row.

Imported only where Triton is installed. Every kernel walks the columns of one row in tiles
(``BLOCK``) and keeps nothing of size V in registers; the row buffers are the caller's.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_prob_sums(x_ptr, x_stride, lse_ptr, first_ptr, len_ptr, rows_ptr, n_cols, scale,
                    s_ptr, s_stride, BLOCK: tl.constexpr):
    # s[g, i] = sum over the row's positions t of exp(scale * x[t, i] - lse[t]).
    g = tl.program_id(0)
    row = tl.load(rows_ptr + g)
    first = tl.load(first_ptr + row)
    length = tl.load(len_ptr + row)
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.range(0, length):
            t = (first + k).to(tl.int64)
            x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
            acc += tl.where(inside, tl.exp(x * scale - tl.load(lse_ptr + t)), 0.0)
        tl.store(s_ptr + g.to(tl.int64) * s_stride + cols, acc, mask=inside)


@triton.jit
def project_on_image(s_ptr, s_stride, u_ptr, u_stride, order_ptr, start_ptr, degree_ptr,
                     tile_degree_ptr, student_ptr, weight_ptr, n_image,
                     BLOCK: tl.constexpr):
    # u[g, j] = sum over W's entries e of column j (CSC) of weight[e] * s[g, student[e]]: a
    # gather, no atomics. Columns are taken in ``order`` (by their number of entries), so a
    # tile's loop runs to about its columns' own count.
    g = tl.program_id(0).to(tl.int64)
    for tile_start in tl.range(0, n_image, BLOCK):
        slot = tile_start + tl.arange(0, BLOCK)
        inside = slot < n_image
        col = tl.load(order_ptr + slot, mask=inside, other=0)
        first = tl.load(start_ptr + col, mask=inside, other=0)
        degree = tl.load(degree_ptr + col, mask=inside, other=0)
        acc = tl.zeros([BLOCK], tl.float32)
        for m in tl.range(0, tl.load(tile_degree_ptr + tile_start // BLOCK)):
            has = inside & (m < degree)
            e = first + m
            student = tl.load(student_ptr + e, mask=has, other=0)
            w = tl.load(weight_ptr + e, mask=has, other=0.0)
            acc += w * tl.load(s_ptr + g * s_stride + student, mask=has, other=0.0)
        tl.store(u_ptr + g * u_stride + col, acc, mask=inside)


@triton.jit
def _slope(q, p, logp, beta, tiny, eps, BETA_KIND: tl.constexpr):
    # f(q) on one column of I and f'(q), the divergence's terms as formulas.divergence writes
    # them with log q = log(q + EPS): forward KL -P log(q + EPS) (P log P is the teacher's,
    # added by the caller); reverse q (log(q + EPS) - log P); the JSD.
    log_q = tl.log(q + eps)
    if BETA_KIND == 0:
        value = -p * log_q
        slope = -p / (q + eps)
    elif BETA_KIND == 1:
        value = q * (log_q - logp)
        slope = log_q - logp + q / (q + eps)
    else:
        pf = tl.exp(logp)
        log_m = tl.log(beta * pf + (1.0 - beta) * q)
        value = beta * pf * (logp - log_m) + (1.0 - beta) * q * (log_q - log_m)
        slope = (1.0 - beta) * (log_q - log_m + q / (q + eps) - 1.0)
    return value, slope


@triton.jit
def image_divergence(u_ptr, u_stride, mass_ptr, p_ptr, p_stride, keys_ptr, value_ptr,
                     argmax_ptr, n_image, beta, tiny, eps,
                     BETA_KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # Per row: q = u / mass on I; value = sum_I f(q) (float32 tiles, summed in float64), the
    # first argmax of u; with GRAD, u <- d value / d u = (f'(q) - sum_I f'(q) q) / mass (the
    # sum taken as 0 where mass < TINY, as the floor holds it). mass = sum_I u.
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    mass = tl.load(mass_ptr + g)
    inv = 1.0 / tl.maximum(mass, tiny)
    total = tl.zeros([BLOCK], tl.float64)
    shift = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, n_image, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_image
        u = tl.load(u_ptr + g * u_stride + cols, mask=inside, other=0.0)
        p = tl.load(p_ptr + key * p_stride + cols, mask=inside, other=0.0)
        logp = tl.log(tl.maximum(p, tiny))
        q = u * inv
        value, slope = _slope(q, p, logp, beta, tiny, eps, BETA_KIND)
        total += tl.where(inside, value, 0.0).to(tl.float64)
        shift += tl.where(inside, slope * q, 0.0)
        better = inside & (u > best)
        best_at = tl.where(better, cols, best_at)
        best = tl.where(better, u, best)
    top = tl.max(best, 0)
    at = tl.min(tl.where(best == top, best_at, n_image), 0)
    tl.store(value_ptr + g, tl.sum(total, 0))
    tl.store(argmax_ptr + g, at)
    if GRAD:
        c = tl.where(mass < tiny, 0.0, tl.sum(shift, 0))
        scale = inv
        for start in tl.range(0, n_image, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_image
            u = tl.load(u_ptr + g * u_stride + cols, mask=inside, other=0.0)
            p = tl.load(p_ptr + key * p_stride + cols, mask=inside, other=0.0)
            logp = tl.log(tl.maximum(p, tiny))
            _, slope = _slope(u * inv, p, logp, beta, tiny, eps, BETA_KIND)
            tl.store(u_ptr + g * u_stride + cols, (slope - c) * scale, mask=inside)


@triton.jit
def pull_back(gu_ptr, gu_stride, h_ptr, h_stride, x_ptr, x_stride, lse_ptr, first_ptr,
              len_ptr, rows_ptr, dot_ptr, table_col_ptr, table_w_ptr, table_width, n_cols,
              scale, BLOCK: tl.constexpr):
    # h[g, i] = sum over W's entries of student row i of weight * gu[g, column] (a gather over
    # the padded [V_local, width] table); dot[t] = sum_i p[t, i] h[g, i] for the row's
    # positions (this shard's part; the caller sums it over TP).
    g = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + g)
    first = tl.load(first_ptr + row)
    length = tl.load(len_ptr + row)
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        h = tl.zeros([BLOCK], tl.float32)
        for m in tl.range(0, table_width):
            at = cols.to(tl.int64) * table_width + m
            col = tl.load(table_col_ptr + at, mask=inside, other=-1)
            w = tl.load(table_w_ptr + at, mask=inside, other=0.0)
            has = inside & (col >= 0)
            h += w * tl.load(gu_ptr + g * gu_stride + col, mask=has, other=0.0)
        tl.store(h_ptr + g * h_stride + cols, h, mask=inside)
        for k in tl.range(0, length):
            t = (first + k).to(tl.int64)
            x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.where(inside, tl.exp(x * scale - tl.load(lse_ptr + t)), 0.0)
            tl.store(dot_ptr + t, tl.load(dot_ptr + t) + tl.sum(p * h, 0))
