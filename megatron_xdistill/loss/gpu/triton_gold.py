"""Triton kernels of gold / H-KL, from the full payload (:mod:`fused.gold`) and the compact one
(:mod:`fused.gold_topk`: the teacher's top k common pairs + a bucket, its k' largest sorted
uncommon probabilities + a tail; :func:`_top_pairs`, :func:`_rest_scan`, :func:`_bucket` and
the head / tail of :func:`_sorted_l1`, on the same chunk sums, radix select and sort).

The uncommon term compares the n largest uncommon student probabilities, sorted, with the
teacher's sorted ones. No full sort of a row: a radix select finds the n-th largest value (four
8-bit passes over the bits of the probabilities, which order as integers), the values above it
are compacted into a list of n, and only that list is sorted. Each step is a device function
over one row; :func:`gold_rows` runs them all for one row after another in a persistent program
(one TP rank, rows held whole: the radix digits are chosen in the kernel), the one-step kernels
serve the layouts whose steps wait on a TP / CP sum. Imported only where Triton is installed.
"""

import triton
import triton.language as tl

from megatron_xdistill.loss.gpu.triton_rows import write_chunk


@triton.jit
def _logit_sums(x_ptr, x_stride, first, length, n_cols, scale, s_row, BLOCK: tl.constexpr):
    # s[i] = sum over the row's positions t of scale * x[t, i]
    for start in tl.range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n_cols
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.range(0, length):
            t = (first + k).to(tl.int64)
            acc += tl.load(x_ptr + t * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(s_row + cols, acc * scale, mask=inside)


@triton.jit
def _divergence(a, b, beta, BETA_KIND: tl.constexpr):
    # One entry's term of the divergence (student log-prob a, teacher b; BETA_KIND 0 forward
    # KL, 1 reverse KL, 2 the JSD at beta) and its slope d / d a.
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
    return value, slope


@triton.jit
def _best(a, pair, inside, best, best_at):
    # The running largest a per lane and the first pair holding it.
    better = inside & ((a > best) | ((a == best) & (pair < best_at)))
    return tl.where(better, a, best), tl.where(better, pair, best_at)


@triton.jit
def _common(s_row, lsum, count, b_row, pair_col_ptr, pair_ptr, n_pairs, h_row, beta,
            BETA_KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # The divergence on the common pairs held here (student column pair_col, pair index pair)
    # of a = (s - lsum) / count against the teacher's b: (float64 sum, largest a, the first
    # pair holding it); with GRAD its gradient on a written into h at the pairs' columns.
    total = tl.zeros([BLOCK], tl.float64)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 2147483647, tl.int32)
    for start in tl.range(0, n_pairs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < n_pairs
        col = tl.load(pair_col_ptr + idx, mask=inside, other=0)
        pair = tl.load(pair_ptr + idx, mask=inside, other=0).to(tl.int32)
        a = (tl.load(s_row + col, mask=inside, other=0.0) - lsum) / count
        b = tl.load(b_row + pair, mask=inside, other=0.0)
        value, slope = _divergence(a, b, beta, BETA_KIND)
        total += tl.where(inside, value, 0.0).to(tl.float64)
        best, best_at = _best(a, pair, inside, best, best_at)
        if GRAD:
            tl.store(h_row + col, slope, mask=inside)
    top = tl.max(best, 0)
    return tl.sum(total, 0), top, tl.min(tl.where(best == top, best_at, 2147483647), 0)


# ------------------------------------------------- the compact payload's common part (gold_topk)
@triton.jit
def _top_pairs(s_row, lsum, count, top_row, k, b_row, pair_at_ptr, stamp_row, tag, h_row, beta,
               BETA_KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # The divergence on the teacher's top k pairs (``top_row``: their pair indices, ``b_row``
    # their log-probs) whose student column is held here (``pair_at``: -1 elsewhere), float64;
    # every one of the k marked ``tag`` in ``stamp_row`` [M]; with GRAD the slopes into h.
    total = tl.zeros([BLOCK], tl.float64)
    for start in tl.range(0, k, BLOCK):
        j = start + tl.arange(0, BLOCK)
        inside = j < k
        pair = tl.load(top_row + j, mask=inside, other=0).to(tl.int32)
        col = tl.load(pair_at_ptr + pair, mask=inside, other=-1)
        here = inside & (col >= 0)
        a = (tl.load(s_row + col, mask=here, other=0.0) - lsum) / count
        b = tl.load(b_row + j, mask=here, other=0.0)
        value, slope = _divergence(a, b, beta, BETA_KIND)
        total += tl.where(here, value, 0.0).to(tl.float64)
        tl.store(stamp_row + pair, tl.zeros([BLOCK], tl.int32) + tag, mask=inside)
        if GRAD:
            tl.store(h_row + col, slope, mask=here)
    return tl.sum(total, 0)


@triton.jit
def _rest_scan(s_row, lsum, count, pair_col_ptr, pair_ptr, n_pairs, stamp_row, tag,
               BLOCK: tl.constexpr):
    # Over the common pairs held here: the largest a and the first pair holding it, and the
    # logsumexp of a over the pairs not marked ``tag`` (the bucket) as (max m, sum exp(a - m)).
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 2147483647, tl.int32)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in tl.range(0, n_pairs, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        inside = idx < n_pairs
        col = tl.load(pair_col_ptr + idx, mask=inside, other=0)
        pair = tl.load(pair_ptr + idx, mask=inside, other=0).to(tl.int32)
        a = (tl.load(s_row + col, mask=inside, other=0.0) - lsum) / count
        best, best_at = _best(a, pair, inside, best, best_at)
        rest = inside & (tl.load(stamp_row + pair, mask=inside, other=0) != tag)
        v = tl.where(rest, a, float("-inf"))
        m_new = tl.maximum(m, v)
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        acc = acc * tl.exp(m - ref) + tl.exp(v - ref)
        m = m_new
    top = tl.max(best, 0)
    m_top = tl.max(m, 0)
    ref = tl.where(m_top == float("-inf"), 0.0, m_top)
    return (top, tl.min(tl.where(best == top, best_at, 2147483647), 0), m_top,
            tl.sum(acc * tl.exp(m - ref), 0))


@triton.jit
def _bucket(s_row, lsum, count, pair_col_ptr, pair_ptr, n_pairs, stamp_row, tag, a_rest,
            b_rest, h_row, beta, BETA_KIND: tl.constexpr, GRAD: tl.constexpr,
            BLOCK: tl.constexpr):
    # The bucket's term of the divergence (the student's a_rest, the logsumexp of a over the
    # pairs off the teacher's top k, against the teacher's b_rest); with GRAD its gradient on
    # each such pair held here, slope * d a_rest / d a = slope * exp(a - a_rest), into h.
    value, slope = _divergence(a_rest, b_rest, beta, BETA_KIND)
    if GRAD:
        for start in tl.range(0, n_pairs, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            inside = idx < n_pairs
            col = tl.load(pair_col_ptr + idx, mask=inside, other=0)
            pair = tl.load(pair_ptr + idx, mask=inside, other=0).to(tl.int32)
            rest = inside & (tl.load(stamp_row + pair, mask=inside, other=0) != tag)
            a = (tl.load(s_row + col, mask=rest, other=0.0) - lsum) / count
            tl.store(h_row + col, slope * tl.exp(a - a_rest), mask=rest)
    return value.to(tl.float64)


@triton.jit
def _uncommon_bits(s_row, cols, n_real, common_ptr, lsum, count):
    # (bits of exp(a) as int32, whether the column is an uncommon real one)
    inside = cols < n_real
    uncommon = inside & (tl.load(common_ptr + cols, mask=inside, other=1) == 0)
    a = (tl.load(s_row + cols, mask=uncommon, other=0.0) - lsum) / count
    p = tl.where(uncommon, tl.exp(a), 0.0)
    return p.to(tl.int32, bitcast=True), uncommon


@triton.jit
def _histogram(s_row, lsum, count, common_ptr, n_real, prefix, SHIFT: tl.constexpr,
               BLOCK: tl.constexpr):
    # [256]: how many uncommon probabilities have the bits above SHIFT + 8 equal to prefix's
    # and digit d at SHIFT (bits of non-negative floats order as their values)
    hist = tl.zeros([256], tl.int32)
    for start in tl.range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        bits, uncommon = _uncommon_bits(s_row, cols, n_real, common_ptr, lsum, count)
        if SHIFT == 24:
            above = uncommon
        else:
            above = uncommon & ((bits >> (SHIFT + 8)) == (prefix >> (SHIFT + 8)))
        hist += tl.histogram((bits >> SHIFT) & 255, 256, mask=above)
    return hist


@triton.jit
def _compact(s_row, lsum, count, common_ptr, n_real, theta, gt_next, eq_next, eq_take,
             val_row, col_row, BLOCK: tl.constexpr):
    # The uncommon probabilities above theta (the n-th largest) and the first eq_take equal to
    # it, written at slots gt_next + i / eq_next + i of the list (values and their columns).
    eq_end = eq_next + eq_take
    for start in tl.range(0, n_real, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        bits, uncommon = _uncommon_bits(s_row, cols, n_real, common_ptr, lsum, count)
        gt = uncommon & (bits > theta)
        eq = uncommon & (bits == theta)
        gt_slot = gt_next + tl.cumsum(gt.to(tl.int32), 0) - 1
        eq_slot = eq_next + tl.cumsum(eq.to(tl.int32), 0) - 1
        eq = eq & (eq_slot < eq_end)
        slot = tl.where(gt, gt_slot, eq_slot)
        keep = gt | eq
        tl.store(val_row + slot, bits.to(tl.float32, bitcast=True), mask=keep)
        tl.store(col_row + slot, cols, mask=keep)
        gt_next += tl.sum(gt.to(tl.int32), 0)
        eq_next += tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _sorted_l1(val_ptr, grad_ptr, g, live, key, n_list, head, t_ptr, t_stride, tail_ptr,
               TAIL: tl.constexpr, BLOCK: tl.constexpr):
    # Rows g [R, 1] (``live`` where real) of n student probabilities sorted descending against
    # the teacher's sorted t (row ``key``, its first ``head``): sum_{k < head} |s_k - t_k| [R],
    # and with TAIL (the compact payload) + |sum_{head <= k < n} s_k - tail[key]|;
    # grad[slot] = d / d a at each slot's student column = sign(s_k - t_k) * s_k in the head,
    # sign(tail sums' difference) * s_k past it (0 where they tie, as autograd's abs).
    slot = tl.arange(0, BLOCK)[None, :]
    inside = live & (slot < n_list)
    s = tl.load(val_ptr + g * n_list + slot, mask=inside, other=0.0)
    bits = tl.where(inside, s.to(tl.int32, bitcast=True), -1).to(tl.int64)
    packed = tl.sort((bits << 32) | slot.to(tl.int64), 1, descending=True)
    where = (packed & 0xFFFFFFFF).to(tl.int32)
    s_sorted = (packed >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    in_head = inside & (slot < head)
    t = tl.load(t_ptr + key * t_stride + slot, mask=in_head, other=0.0)
    diff = tl.where(in_head, s_sorted - t, 0.0)
    sign = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
    total = tl.sum(tl.abs(diff).to(tl.float64), 1)
    grad = sign * s_sorted
    if TAIL:
        in_tail = inside & (slot >= head)
        s_tail = tl.sum(tl.where(in_tail, s_sorted, 0.0).to(tl.float64), 1, keep_dims=True)
        t_tail = tl.load(tail_ptr + key, mask=live, other=0.0).to(tl.float64)
        tail_diff = s_tail - t_tail  # [R, 1]
        tail_sign = tl.where(tail_diff > 0, 1.0, tl.where(tail_diff < 0, -1.0, 0.0))
        total += tl.sum(tl.abs(tail_diff), 1)
        grad = tl.where(in_tail, tail_sign.to(tl.float32) * s_sorted, grad)
    tl.store(grad_ptr + g * n_list + where, grad, mask=inside)
    return total


# ----------------------------------------------------------------------- one step a launch
@triton.jit
def chunk_logit_sums(x_ptr, x_stride, first_ptr, len_ptr, rows_ptr, n_cols, scale, s_ptr,
                     s_stride, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    row = tl.load(rows_ptr + g)
    _logit_sums(x_ptr, x_stride, tl.load(first_ptr + row), tl.load(len_ptr + row), n_cols,
                scale, s_ptr + g.to(tl.int64) * s_stride, BLOCK)


@triton.jit
def common_divergence(s_ptr, s_stride, lsum_ptr, count_ptr, keys_ptr, b_ptr, b_stride,
                      pair_col_ptr, pair_ptr, n_pairs, h_ptr, h_stride, value_ptr,
                      best_ptr, best_at_ptr, beta, BETA_KIND: tl.constexpr,
                      GRAD: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    value, top, at = _common(s_ptr + g * s_stride, tl.load(lsum_ptr + g), tl.load(count_ptr + g),
                             b_ptr + key * b_stride, pair_col_ptr, pair_ptr, n_pairs,
                             h_ptr + g * h_stride, beta, BETA_KIND, GRAD, BLOCK)
    tl.store(value_ptr + g, value)
    tl.store(best_ptr + g, top)
    tl.store(best_at_ptr + g, at)


@triton.jit
def radix_histogram(s_ptr, s_stride, lsum_ptr, count_ptr, common_ptr, n_real, prefix_ptr,
                    hist_ptr, SHIFT: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    hist = _histogram(s_ptr + g * s_stride, tl.load(lsum_ptr + g), tl.load(count_ptr + g),
                      common_ptr, n_real, tl.load(prefix_ptr + g), SHIFT, BLOCK)
    tl.store(hist_ptr + g * 256 + tl.arange(0, 256), hist)


@triton.jit
def compact_top(s_ptr, s_stride, lsum_ptr, count_ptr, common_ptr, n_real, theta_ptr,
                gt_base_ptr, eq_base_ptr, eq_take_ptr, val_ptr, col_ptr, n_list,
                BLOCK: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    _compact(s_ptr + g * s_stride, tl.load(lsum_ptr + g), tl.load(count_ptr + g), common_ptr,
             n_real, tl.load(theta_ptr + g), tl.load(gt_base_ptr + g), tl.load(eq_base_ptr + g),
             tl.load(eq_take_ptr + g), val_ptr + g * n_list, col_ptr + g * n_list, BLOCK)


@triton.jit
def sorted_l1(val_ptr, n_list, n_rows, keys_ptr, head, t_ptr, t_stride, tail_ptr, value_ptr,
              grad_ptr, TAIL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows a program: short lists sort together
    g = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]  # [ROWS, 1]
    live = g < n_rows
    key = tl.load(keys_ptr + g, mask=live, other=0).to(tl.int64)
    total = _sorted_l1(val_ptr, grad_ptr, g, live, key, n_list, head, t_ptr, t_stride, tail_ptr,
                       TAIL, BLOCK)
    tl.store(value_ptr + g, total[:, None], mask=live)


@triton.jit
def top_pairs(s_ptr, s_stride, lsum_ptr, count_ptr, keys_ptr, top_ptr, top_stride, k, b_ptr,
              b_stride, pair_at_ptr, pair_col_ptr, pair_ptr, n_pairs, stamp_ptr, stamp_stride,
              h_ptr, h_stride, value_ptr, best_ptr, best_at_ptr, m_ptr, acc_ptr, beta,
              BETA_KIND: tl.constexpr, GRAD: tl.constexpr, BLOCK: tl.constexpr):
    # The compact payload's top pairs held here (_top_pairs), then _rest_scan's argmax and
    # bucket parts, to be summed over TP.
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    s_row = s_ptr + g * s_stride
    lsum = tl.load(lsum_ptr + g)
    count = tl.load(count_ptr + g)
    stamp_row = stamp_ptr + g * stamp_stride
    value = _top_pairs(s_row, lsum, count, top_ptr + key * top_stride, k, b_ptr + key * b_stride,
                       pair_at_ptr, stamp_row, 1, h_ptr + g * h_stride, beta, BETA_KIND, GRAD,
                       BLOCK)
    tl.debug_barrier()  # the marks are in
    top, at, m, acc = _rest_scan(s_row, lsum, count, pair_col_ptr, pair_ptr, n_pairs, stamp_row,
                                 1, BLOCK)
    tl.store(value_ptr + g, value)
    tl.store(best_ptr + g, top)
    tl.store(best_at_ptr + g, at)
    tl.store(m_ptr + g, m)
    tl.store(acc_ptr + g, acc)


@triton.jit
def bucket_terms(s_ptr, s_stride, lsum_ptr, count_ptr, keys_ptr, rest_ptr, a_rest_ptr,
                 pair_col_ptr, pair_ptr, n_pairs, stamp_ptr, stamp_stride, h_ptr, h_stride,
                 value_ptr, beta, BETA_KIND: tl.constexpr, GRAD: tl.constexpr,
                 BLOCK: tl.constexpr):
    # The bucket's term (every TP rank the same) and its gradient on the pairs held here.
    g = tl.program_id(0).to(tl.int64)
    key = tl.load(keys_ptr + g).to(tl.int64)
    value = _bucket(s_ptr + g * s_stride, tl.load(lsum_ptr + g), tl.load(count_ptr + g),
                    pair_col_ptr, pair_ptr, n_pairs, stamp_ptr + g * stamp_stride, 1,
                    tl.load(a_rest_ptr + g), tl.load(rest_ptr + key), h_ptr + g * h_stride, beta,
                    BETA_KIND, GRAD, BLOCK)
    tl.store(value_ptr + g, value)


# ----------------------------------------------------------------------- whole rows
@triton.jit
def gold_rows(x_ptr, x_stride, first_ptr, len_ptr, rows_ptr, keys_ptr, count_ptr, lsum_ptr,
              n_rows, n_real, scale, s_ptr, s_stride, h_ptr, h_stride, val_ptr, col_ptr,
              gl_ptr, b_ptr, b_stride, pair_col_ptr, pair_ptr, n_pairs, common_ptr, t_ptr,
              t_stride, n_list, value_ptr, best_at_ptr, lse_ptr, out_ptr, out_stride, n_out,
              coef_ptr, ce_ptr, label_ptr, lse1_ptr, beta, top_ptr, top_stride, k, rest_ptr,
              pair_at_ptr, stamp_ptr, stamp_stride, head, tail_ptr, BETA_KIND: tl.constexpr,
              GRAD: tl.constexpr, CE: tl.constexpr, CE_OWN: tl.constexpr,
              COMPACT: tl.constexpr, BUCKET: tl.constexpr, BLOCK: tl.constexpr,
              PAIR_BLOCK: tl.constexpr, LIST_BLOCK: tl.constexpr):
    # Every step of the rows g = pid, pid + programs, ... with this program's scratch rows (s,
    # h, the list's values, columns and gradient; COMPACT: the marks of the teacher's top
    # pairs); with GRAD the rows' positions' gradient written (write_chunk). COMPACT (the
    # gold_topk payload): the teacher's top k pairs (``top``, log-probs ``b``), with BUCKET the
    # rest's log-mass ``rest``, its first ``head`` sorted uncommon probabilities and the
    # ``tail``; else all M pairs' log-probs ``b`` and n sorted uncommon ones (head = n).
    pid = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + pid * s_stride
    h_row = h_ptr + pid * h_stride
    val_row = val_ptr + pid * n_list
    col_row = col_ptr + pid * n_list
    stamp_row = stamp_ptr + pid * stamp_stride
    digits = tl.arange(0, 256)
    for g in tl.range(pid, n_rows, tl.num_programs(0)):
        row = tl.load(rows_ptr + g)
        first = tl.load(first_ptr + row)
        length = tl.load(len_ptr + row)
        key = tl.load(keys_ptr + g).to(tl.int64)
        lsum = tl.load(lsum_ptr + g)
        count = tl.load(count_ptr + g)
        tl.debug_barrier()  # the last row is done with the scratch rows
        _logit_sums(x_ptr, x_stride, first, length, n_real, scale, s_row, BLOCK)
        if GRAD:
            for start in tl.range(0, n_real, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(h_row + cols, tl.zeros([BLOCK], tl.float32), mask=cols < n_real)
        tl.debug_barrier()
        if COMPACT:
            tag = (tl.zeros([], tl.int64) + g + 1).to(tl.int32)  # this row's marks: never cleared
            value = _top_pairs(s_row, lsum, count, top_ptr + key * top_stride, k,
                               b_ptr + key * b_stride, pair_at_ptr, stamp_row, tag, h_row, beta,
                               BETA_KIND, GRAD, PAIR_BLOCK)
            tl.debug_barrier()
            top, at, m, acc = _rest_scan(s_row, lsum, count, pair_col_ptr, pair_ptr, n_pairs,
                                         stamp_row, tag, PAIR_BLOCK)
            if BUCKET:
                value += _bucket(s_row, lsum, count, pair_col_ptr, pair_ptr, n_pairs,
                                 stamp_row, tag, m + tl.log(acc), tl.load(rest_ptr + key),
                                 h_row, beta, BETA_KIND, GRAD, PAIR_BLOCK)
        else:
            value, top, at = _common(s_row, lsum, count, b_ptr + key * b_stride, pair_col_ptr,
                                     pair_ptr, n_pairs, h_row, beta, BETA_KIND, GRAD, PAIR_BLOCK)
        tl.store(best_at_ptr + g, at)
        if n_list > 0:
            prefix = tl.zeros([], tl.int32)
            left = n_list
            for i in tl.static_range(4):
                hist = _histogram(s_row, lsum, count, common_ptr, n_real, prefix, 24 - 8 * i,
                                  BLOCK)
                at_least = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist  # digit >= d
                digit = tl.sum((at_least >= left).to(tl.int32), 0) - 1
                left -= tl.sum(tl.where(digits == digit, at_least - hist, 0), 0)
                prefix = prefix | (digit << (24 - 8 * i))
            _compact(s_row, lsum, count, common_ptr, n_real, prefix, tl.zeros([], tl.int32),
                     n_list - left, left, val_row, col_row, BLOCK)
            tl.debug_barrier()
            live = tl.full([1, 1], 1, tl.int1)
            total = _sorted_l1(val_ptr, gl_ptr, pid + tl.zeros([1, 1], tl.int64), live,
                               key + tl.zeros([1, 1], tl.int64), n_list, head, t_ptr, t_stride,
                               tail_ptr, COMPACT, LIST_BLOCK)
            value += tl.sum(total, 0)
            if GRAD:
                tl.debug_barrier()
                for start in tl.range(0, n_list, BLOCK):
                    slot = start + tl.arange(0, BLOCK)
                    inside = slot < n_list
                    col = tl.load(col_row + slot, mask=inside, other=0)
                    tl.store(h_row + col, tl.load(gl_ptr + pid * n_list + slot, mask=inside),
                             mask=inside)
        tl.store(value_ptr + g, value)
        if GRAD:
            tl.debug_barrier()
            hsum = tl.zeros([BLOCK], tl.float32)
            for start in tl.range(0, n_real, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                hsum += tl.load(h_row + cols, mask=cols < n_real, other=0.0)
            write_chunk(out_ptr, out_stride, x_ptr, x_stride, n_out, n_real, scale, lse_ptr,
                        first, length, h_row, tl.load(coef_ptr + g), tl.sum(hsum, 0), lse_ptr,
                        ce_ptr, label_ptr, lse1_ptr, False, CE, CE_OWN, BLOCK)
