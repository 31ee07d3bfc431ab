"""Triton kernels of the exact (image) P-KL (:mod:`fused.image`).

Each step of a chunk row is a device function over its columns in tiles (``BLOCK``), keeping
nothing of size V in registers (the row buffers are the caller's): the row's summed softmax s,
its projection u = s W_I, the divergence on I and its gradient on u, the pull-back h = W_I g with
each position's <p, h>. :func:`image_rows` runs them all for one row after another in a
persistent program (one TP rank, rows held whole: no collective between the steps; a barrier
between steps, which read each other's buffers across lanes); the one-step kernels serve the
layouts whose steps wait on a TP / CP sum. Imported only where Triton is installed.
"""

import triton
import triton.language as tl

from megatron_xdistill.loss.gpu.triton_rows import write_chunk


@triton.jit
def _prob_sums(x_ptr, x_stride, lse_ptr, first, length, n_cols, scale, s_row,
               BLOCK: tl.constexpr):
    # s[i] = sum over the row's positions t of exp(scale * x[t, i] - lse[t])
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.range(0, length):
            t = (first + k).to(tl.int64)
            x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
            acc += tl.where(inside, tl.exp(x * scale - tl.load(lse_ptr + t)), 0.0)
        tl.store(s_row + cols, acc, mask=inside)


@triton.jit
def _project(s_row, u_row, order_ptr, start_ptr, degree_ptr, tile_degree_ptr, student_ptr,
             weight_ptr, n_image, BLOCK: tl.constexpr):
    # u[j] = sum over W's entries e of column j (CSC) of weight[e] * s[student[e]]: a gather,
    # no atomics. Columns are taken in ``order`` (by their number of entries), so a tile's loop
    # runs to about its columns' own count. Returns sum_j u[j].
    total = tl.zeros([BLOCK], tl.float32)
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
            acc += w * tl.load(s_row + student, mask=has, other=0.0)
        tl.store(u_row + col, acc, mask=inside)
        total += acc
    return tl.sum(total, 0)


@triton.jit
def _slope(q, p, logp, beta, eps, BETA_KIND: tl.constexpr):
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
def _divergence(u_row, mass, p_row, n_image, beta, tiny, eps, BETA_KIND: tl.constexpr,
                GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # q = u / mass on I: (sum_I f(q) in float64, the first argmax of u); with GRAD,
    # u <- d value / d u = (f'(q) - sum_I f'(q) q) / mass (the sum taken as 0 where
    # mass < TINY, as the floor holds it). mass = sum_I u.
    inv = 1.0 / tl.maximum(mass, tiny)
    total = tl.zeros([BLOCK], tl.float64)
    shift = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in tl.range(0, n_image, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_image
        u = tl.load(u_row + cols, mask=inside, other=0.0)
        p = tl.load(p_row + cols, mask=inside, other=0.0)
        q = u * inv
        value, slope = _slope(q, p, tl.log(tl.maximum(p, tiny)), beta, eps, BETA_KIND)
        total += tl.where(inside, value, 0.0).to(tl.float64)
        shift += tl.where(inside, slope * q, 0.0)
        better = inside & (u > best)
        best_at = tl.where(better, cols, best_at)
        best = tl.where(better, u, best)
    top = tl.max(best, 0)
    at = tl.min(tl.where(best == top, best_at, n_image), 0)
    if GRAD:
        c = tl.where(mass < tiny, 0.0, tl.sum(shift, 0))
        for start in tl.range(0, n_image, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_image
            u = tl.load(u_row + cols, mask=inside, other=0.0)
            p = tl.load(p_row + cols, mask=inside, other=0.0)
            _, slope = _slope(u * inv, p, tl.log(tl.maximum(p, tiny)), beta, eps, BETA_KIND)
            tl.store(u_row + cols, (slope - c) * inv, mask=inside)
    return tl.sum(total, 0), at


@triton.jit
def _pull_back(g_row, h_row, x_ptr, x_stride, lse_ptr, first, length, dot_ptr, table_col_ptr,
               table_w_ptr, table_width, n_cols, scale, BLOCK: tl.constexpr):
    # h[i] = sum over W's entries of student row i of weight * g[column] (a gather over the
    # padded [V_local, width] table); dot[t] = sum_i p[t, i] h[i] for the row's positions
    # (this shard's part).
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        h = tl.zeros([BLOCK], tl.float32)
        for m in tl.range(0, table_width):
            at = cols.to(tl.int64) * table_width + m
            col = tl.load(table_col_ptr + at, mask=inside, other=-1)
            w = tl.load(table_w_ptr + at, mask=inside, other=0.0)
            h += w * tl.load(g_row + col, mask=inside & (col >= 0), other=0.0)
        tl.store(h_row + cols, h, mask=inside)
    for k in tl.range(0, length):  # h from this lane's own stores: no barrier needed
        t = (first + k).to(tl.int64)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in tl.range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n_cols
            x = tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
            p = tl.where(inside, tl.exp(x * scale - tl.load(lse_ptr + t)), 0.0)
            acc += p * tl.load(h_row + cols, mask=inside, other=0.0)
        tl.store(dot_ptr + t, tl.sum(acc, 0))


# ----------------------------------------------------------------------- one step a launch
@triton.jit
def chunk_prob_sums(x_ptr, x_stride, lse_ptr, first_ptr, len_ptr, rows_ptr, n_cols, scale,
                    s_ptr, s_stride, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    row = tl.load(rows_ptr + g)
    _prob_sums(x_ptr, x_stride, lse_ptr, tl.load(first_ptr + row), tl.load(len_ptr + row),
               n_cols, scale, s_ptr + g.to(tl.int64) * s_stride, BLOCK)


@triton.jit
def project_on_image(s_ptr, s_stride, u_ptr, u_stride, order_ptr, start_ptr, degree_ptr,
                     tile_degree_ptr, student_ptr, weight_ptr, n_image,
                     BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    _project(s_ptr + g * s_stride, u_ptr + g * u_stride, order_ptr, start_ptr, degree_ptr,
             tile_degree_ptr, student_ptr, weight_ptr, n_image, BLOCK)


@triton.jit
def image_divergence(u_ptr, u_stride, mass_ptr, p_ptr, p_stride, keys_ptr, value_ptr,
                     argmax_ptr, n_image, beta, tiny, eps,
                     BETA_KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    value, at = _divergence(u_ptr + g * u_stride, tl.load(mass_ptr + g), p_ptr + key * p_stride,
                            n_image, beta, tiny, eps, BETA_KIND, GRAD, BLOCK)
    tl.store(value_ptr + g, value)
    tl.store(argmax_ptr + g, at)


@triton.jit
def pull_back(gu_ptr, gu_stride, h_ptr, h_stride, x_ptr, x_stride, lse_ptr, first_ptr,
              len_ptr, rows_ptr, dot_ptr, table_col_ptr, table_w_ptr, table_width, n_cols,
              scale, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + g)
    _pull_back(gu_ptr + g * gu_stride, h_ptr + g * h_stride, x_ptr, x_stride, lse_ptr,
               tl.load(first_ptr + row), tl.load(len_ptr + row), dot_ptr, table_col_ptr,
               table_w_ptr, table_width, n_cols, scale, BLOCK)


# ----------------------------------------------------------------------- whole rows
@triton.jit
def image_rows(x_ptr, x_stride, lse_ptr, first_ptr, len_ptr, rows_ptr, keys_ptr, n_rows,
               n_cols, scale, s_ptr, s_stride, u_ptr, u_stride, order_ptr, start_ptr,
               degree_ptr, tile_degree_ptr, student_ptr, weight_ptr, n_image, p_ptr, p_stride,
               value_ptr, argmax_ptr, dot_ptr, table_col_ptr, table_w_ptr, table_width,
               out_ptr, out_stride, n_out, coef_ptr, ce_ptr, label_ptr, lse1_ptr,
               beta, tiny, eps, BETA_KIND: tl.constexpr, GRAD: tl.constexpr,
               CE: tl.constexpr, CE_OWN: tl.constexpr, BLOCK: tl.constexpr,
               IMAGE_BLOCK: tl.constexpr, DIV_BLOCK: tl.constexpr):
    # Every step of the rows g = pid, pid + programs, ... with this program's scratch rows of
    # s / h and u / g; with GRAD the rows' positions' gradient written (write_chunk).
    pid = tl.program_id(0)
    s_row = s_ptr + pid.to(tl.int64) * s_stride
    u_row = u_ptr + pid.to(tl.int64) * u_stride
    for g in tl.range(pid, n_rows, tl.num_programs(0)):
        row = tl.load(rows_ptr + g)
        first = tl.load(first_ptr + row)
        length = tl.load(len_ptr + row)
        key = tl.load(keys_ptr + g).to(tl.int64)
        tl.debug_barrier()  # the last row's gathers are done with s and u
        _prob_sums(x_ptr, x_stride, lse_ptr, first, length, n_cols, scale, s_row, BLOCK)
        tl.debug_barrier()
        mass = _project(s_row, u_row, order_ptr, start_ptr, degree_ptr, tile_degree_ptr,
                        student_ptr, weight_ptr, n_image, IMAGE_BLOCK)
        tl.debug_barrier()
        value, at = _divergence(u_row, mass, p_ptr + key * p_stride, n_image, beta, tiny, eps,
                                BETA_KIND, GRAD, DIV_BLOCK)
        tl.store(value_ptr + g, value)
        tl.store(argmax_ptr + g, at)
        if GRAD:
            tl.debug_barrier()
            _pull_back(u_row, s_row, x_ptr, x_stride, lse_ptr, first, length, dot_ptr,
                       table_col_ptr, table_w_ptr, table_width, n_cols, scale, BLOCK)
            tl.debug_barrier()
            write_chunk(out_ptr, out_stride, x_ptr, x_stride, n_out, n_cols, scale, lse_ptr,
                        first, length, s_row, tl.load(coef_ptr + g), 0.0, dot_ptr, ce_ptr,
                        label_ptr, lse1_ptr, True, CE, CE_OWN, BLOCK)


__all__ = ["chunk_prob_sums", "image_divergence", "image_rows", "project_on_image", "pull_back"]
