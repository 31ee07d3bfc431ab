"""Triton kernels of gold / H-KL (:mod:`gpu.gold_pass`), one program per chunk row.

The uncommon term compares the n largest uncommon student probabilities, sorted, with the
teacher's sorted ones. No full sort of a row: a radix select finds the n-th largest value (four
8-bit passes over the bits of the probabilities, which order as integers), the values above it
are compacted into a list of n, and only that list is sorted. Imported only where Triton is
installed.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_logit_sums(x_ptr, x_stride, first_ptr, len_ptr, rows_ptr, n_cols, scale, s_ptr,
                     s_stride, BLOCK: tl.constexpr):
    # s[g, i] = sum over the row's positions t of scale * x[t, i].
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
            acc += tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(s_ptr + g.to(tl.int64) * s_stride + cols, acc * scale, mask=inside)


@triton.jit
def _mean(s_ptr, s_stride, g, cols, mask, lsum, count):
    # the chunk-mean log-probs a = (sum x / T - sum lse) / count on ``cols``
    s = tl.load(s_ptr + g * s_stride + cols, mask=mask, other=0.0)
    return (s - lsum) / count


@triton.jit
def common_divergence(s_ptr, s_stride, lsum_ptr, count_ptr, keys_ptr, b_ptr, b_stride,
                      pair_col_ptr, pair_ptr, n_pairs, h_ptr, h_stride, value_ptr,
                      best_ptr, best_at_ptr, beta, BETA_KIND: tl.constexpr,
                      GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # The divergence on this shard's common pairs (student column pair_col, pair index pair):
    # value (float64 sum of this shard's part), its largest a and the first pair holding it,
    # and with GRAD its gradient on a written into h at the pairs' columns.
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    lsum = tl.load(lsum_ptr + g)
    count = tl.load(count_ptr + g)
    total = tl.zeros([BLOCK], tl.float64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 2147483647, tl.int32)
    for start in tl.range(0, n_pairs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < n_pairs
        col = tl.load(pair_col_ptr + idx, mask=inside, other=0)
        pair = tl.load(pair_ptr + idx, mask=inside, other=0)
        a = _mean(s_ptr, s_stride, g, col, inside, lsum, count)
        b = tl.load(b_ptr + key * b_stride + pair, mask=inside, other=0.0)
        q = tl.exp(a)
        if BETA_KIND == 0:
            p = tl.exp(b)
            value = p * (b - a)
            slope = -p
        elif BETA_KIND == 1:
            value = q * (a - b)
            slope = q * (a - b + 1.0)
        else:
            p = tl.exp(b)
            log_m = tl.log(beta * p + (1.0 - beta) * q)
            value = beta * p * (b - log_m) + (1.0 - beta) * q * (a - log_m)
            slope = (1.0 - beta) * q * (a - log_m)
        total += tl.where(inside, value, 0.0).to(tl.float64)
        better = inside & ((a > best) | ((a == best) & (pair < best_at)))
        best_at = tl.where(better, pair, best_at)
        best = tl.where(better, a, best)
        if GRAD:
            tl.store(h_ptr + g * h_stride + col, slope, mask=inside)
    top = tl.max(best, 0)
    tl.store(value_ptr + g, tl.sum(total, 0))
    tl.store(best_ptr + g, top)
    tl.store(best_at_ptr + g, tl.min(tl.where(best == top, best_at, 2147483647), 0))


@triton.jit
def _uncommon_bits(s_ptr, s_stride, g, cols, n_real, common_ptr, lsum, count):
    # (bits of exp(a) as int32, whether the column is an uncommon real one)
    inside = cols < n_real
    uncommon = inside & (tl.load(common_ptr + cols, mask=inside, other=1) == 0)
    a = _mean(s_ptr, s_stride, g, cols, uncommon, lsum, count)
    p = tl.where(uncommon, tl.exp(a), 0.0)
    return p.to(tl.int32, bitcast=True), uncommon


@triton.jit
def radix_histogram(s_ptr, s_stride, lsum_ptr, count_ptr, common_ptr, n_real, prefix_ptr,
                    hist_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    # hist[g, d] = how many uncommon probabilities of the row have the bits above ``SHIFT + 8``
    # equal to prefix[g]'s and digit d at ``SHIFT`` (bits of non-negative floats order as
    # their values).
    g = tl.program_id(0).to(tl.int64)
    lsum = tl.load(lsum_ptr + g)
    count = tl.load(count_ptr + g)
    prefix = tl.load(prefix_ptr + g)
    hist = tl.zeros([256], tl.int32)
    for start in tl.range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        bits, uncommon = _uncommon_bits(s_ptr, s_stride, g, cols, n_real, common_ptr, lsum,
                                        count)
        if SHIFT == 24:
            above = uncommon
        else:
            above = (bits >> (SHIFT + 8)) == (prefix >> (SHIFT + 8))
        digit = (bits >> SHIFT) & 255
        hist += tl.histogram(digit, 256, mask=uncommon & above)
    tl.store(hist_ptr + g * 256 + tl.arange(0, 256), hist)


@triton.jit
def compact_top(s_ptr, s_stride, lsum_ptr, count_ptr, common_ptr, n_real, theta_ptr,
                gt_base_ptr, eq_base_ptr, eq_take_ptr, val_ptr, col_ptr, n_list,
                BLOCK: tl.constexpr):
    # The row's uncommon probabilities above the n-th largest (theta) and the first eq_take
    # equal to it, written at slots gt_base + i / eq_base + i of the row's list (values and
    # their columns).
    g = tl.program_id(0).to(tl.int64)
    lsum = tl.load(lsum_ptr + g)
    count = tl.load(count_ptr + g)
    theta = tl.load(theta_ptr + g)
    gt_next = tl.load(gt_base_ptr + g)
    eq_next = tl.load(eq_base_ptr + g)
    eq_end = eq_next + tl.load(eq_take_ptr + g)
    for start in tl.range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        bits, uncommon = _uncommon_bits(s_ptr, s_stride, g, cols, n_real, common_ptr, lsum,
                                        count)
        gt = uncommon & (bits > theta)
        eq = uncommon & (bits == theta)
        gt_slot = gt_next + tl.cumsum(gt.to(tl.int32), 0) - 1
        eq_slot = eq_next + tl.cumsum(eq.to(tl.int32), 0) - 1
        eq = eq & (eq_slot < eq_end)
        slot = tl.where(gt, gt_slot, eq_slot)
        keep = gt | eq
        value = bits.to(tl.float32, bitcast=True)
        tl.store(val_ptr + g * n_list + slot, value, mask=keep)
        tl.store(col_ptr + g * n_list + slot, cols, mask=keep)
        gt_next += tl.sum(gt.to(tl.int32), 0)
        eq_next += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def sorted_l1(val_ptr, n_list, n_rows, keys_ptr, t_ptr, t_stride, value_ptr, grad_ptr,
              ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows' lists of n student probabilities sorted descending against the teacher's
    # sorted t: value = sum_k |s_k - t_k|; grad[g, slot] = d value / d a at each slot's student
    # column = sign(s_k - t_k) * s_k (0 where they tie, as autograd's abs).
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    live = g < n_rows
    key = tl.load(keys_ptr + g, mask=live, other=0).to(tl.int64)
    slot = tl.arange(0, BLOCK)[None, :]
    inside = live & (slot < n_list)
    s = tl.load(val_ptr + g * n_list + slot, mask=inside, other=0.0)
    bits = tl.where(inside, s.to(tl.int32, bitcast=True), -1).to(tl.int64)
    packed = tl.sort((bits << 32) | slot.to(tl.int64), 1, descending=True)
    where = (packed & 0xFFFFFFFF).to(tl.int32)
    s_sorted = (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    t = tl.load(t_ptr + key * t_stride + slot, mask=inside, other=0.0)
    diff = tl.where(inside, s_sorted - t, 0.0)
    total = tl.sum(tl.abs(diff).to(tl.float64), 1)
    tl.store(value_ptr + g, total[:, None], mask=live)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    tl.store(grad_ptr + g * n_list + where, sign * s_sorted, mask=inside)
