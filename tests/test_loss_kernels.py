"""The loss's two fast building blocks against plain dense computations.

``ImageProjection`` (the exact P-KL's projection onto the image of W; Numba on CPU, torch on other
devices: both paths run here) against a dense [V_s, V_t] product; ``sorted_top`` (gold's sorted
uncommon values; NumPy on CPU) and ``sorted_l1`` (gold's L1 of the sorted values, whose backward
finds each element's sign run instead of sorting) against ``torch.topk``, values and gradients.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_xdistill.loss.blocks.shard import ProjectionShard
from megatron_xdistill.loss.cpu import sorted_l1 as l1
from megatron_xdistill.loss.cpu.sorted_top import sorted_top, top_values
from megatron_xdistill.loss.kernels.image_projection import ImageProjection

VS, VT = 40, 90


def _shard(seed: int = 0, vs: int = VS, vt: int = VT) -> tuple[ProjectionShard, torch.Tensor]:
    """A W [vs, vt] with up to 3 entries per row, some empty rows, and its dense form."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vt, (vs, 3), generator=gen)
    w = torch.rand(vs, 3, generator=gen, dtype=torch.float64)
    idx[torch.rand(vs, 3, generator=gen) < 0.3] = -1
    idx[:3] = -1
    dense = torch.zeros(vs, vt, dtype=torch.float64)
    for s in range(vs):
        for j in range(3):
            if idx[s, j] >= 0:
                dense[s, idx[s, j]] += w[s, j].float().double()
    return ProjectionShard(idx, w.float(), 0, vt), dense


#: rows of a block: one, a few and more than a SIMD vector's lanes (the Numba projection
#: takes all of a block's rows as one transposed line)
ROWS = [1, 5, 19]
#: vocabularies (V_s, V_t): one tile of the Numba kernels' lines (256) and several, the last
#: one partial (|I| ~ 770, 700 student rows)
SIZES = [(VS, VT), (700, 1000)]


def _segments(rows: int, seed: int) -> torch.Tensor:
    """The row of each position of a block of ``rows`` rows: runs of 1-3 positions, some
    positions in no row (-1)."""
    if rows == 5:
        return torch.tensor([-1, 0, 0, 1, -1, 2, 2, 2, 3, 4, -1, 4])
    gen = torch.Generator().manual_seed(seed)
    runs = torch.randint(1, 4, (rows,), generator=gen)
    seg = torch.repeat_interleave(torch.arange(rows), runs)
    gaps = torch.rand(seg.numel(), generator=gen) < 0.2
    return torch.where(gaps, -1, seg)


def _block(seed: int, dtype: torch.dtype, rows: int = 5, vs: int = VS):
    """Positions of ``rows`` rows (:func:`_segments`), their probabilities and factors."""
    gen = torch.Generator().manual_seed(seed)
    seg = _segments(rows, seed)
    probs = torch.softmax(torch.randn(seg.numel(), vs, generator=gen, dtype=torch.float64), 1)
    factor = torch.rand(seg.numel(), generator=gen, dtype=torch.float64) + 0.5
    return probs.to(dtype), factor.to(dtype), seg


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("use_numba", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_image_projection_equals_the_dense_product(use_numba, dtype, rows, sizes):
    shard, dense = _shard(0, *sizes)
    proj = ImageProjection.build(shard, sizes[0], None)
    assert torch.equal(proj.image, torch.nonzero(dense.sum(0) > 0, as_tuple=True)[0])
    probs, factor, seg = _block(1, dtype, rows, sizes[0])
    got = proj.project(probs, factor, seg, rows, use_numba=use_numba)
    p = probs.double() * factor.double()[:, None]
    rows = torch.stack([p[seg == r].sum(0) for r in range(rows)])
    want = (rows @ dense)[:, proj.image]
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("use_numba", [True, False])
def test_image_projection_backward_equals_autograd_of_the_dense_product(use_numba, num_rows,
                                                                        sizes):
    """backward_into leaves the gradient on logits / T of sum <g, q_I> (x inv_t) plus coef * p,
    where p = softmax over the whole vocabulary = probs_local * factor (one TP rank here)."""
    shard, dense = _shard(2, *sizes)
    proj = ImageProjection.build(shard, sizes[0], None)
    gen = torch.Generator().manual_seed(3)
    seg = _segments(num_rows, 3)
    x = torch.randn(seg.numel(), sizes[0], generator=gen, dtype=torch.float64,
                    requires_grad=True)
    g = torch.randn(num_rows, proj.size, generator=gen, dtype=torch.float64)
    coef = torch.randn(seg.numel(), generator=gen, dtype=torch.float64)
    inv_t = 0.5
    p = torch.softmax(x, 1)
    rows = torch.stack([p[seg == r].sum(0) for r in range(num_rows)])
    (inv_t * ((rows @ dense)[:, proj.image] * g).sum()).backward()
    want = x.grad + coef[:, None] * p.detach()
    out = p.detach().clone()
    proj.backward_into(out, torch.ones(seg.numel(), dtype=torch.float64), seg, g, inv_t, coef,
                       None, use_numba=use_numba)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alias", [False, True])
def test_row_exp_leaves_the_softmax_for_its_norm(dtype, alias):
    """out * norm is torch's softmax and lz its logsumexp, in float64; -inf columns; a row of
    -inf gives NaN probabilities; strided rows (a view of wider logits); out may be x."""
    from megatron_xdistill.loss.cpu.rows import row_exp_

    gen = torch.Generator().manual_seed(2)
    for width in (1, 17, 5000):
        wide = (torch.randn(6, width + 7, generator=gen, dtype=torch.float64) * 4).to(dtype)
        x = wide[:, :width]
        x[2, : width // 2] = -math.inf
        x[4] = -math.inf
        want = torch.softmax(x.double(), 1)
        want_lz = torch.logsumexp(x.double(), 1)
        out = x if alias else torch.empty_like(x)
        lz, norm = row_exp_(out, x)
        tol = 1e-6 if dtype == torch.float32 else 1e-13
        keep = torch.arange(6) != 4
        torch.testing.assert_close((out * norm[:, None]).double()[keep], want[keep],
                                   rtol=tol, atol=tol)
        torch.testing.assert_close(lz.double()[keep], want_lz[keep], rtol=tol, atol=0)
        assert bool((out[4] * norm[4]).isnan().all())
    lz, norm = row_exp_(torch.empty(3, 0, dtype=dtype), torch.empty(3, 0, dtype=dtype))
    assert bool((lz == -math.inf).all())
    assert row_exp_(torch.empty(0, 5, dtype=dtype), torch.empty(0, 5, dtype=dtype))[0].shape == (0,)
    with pytest.raises(ValueError, match="unit stride"):
        row_exp_(torch.empty(5, 3, dtype=dtype), torch.empty(3, 5, dtype=dtype).t())


@pytest.mark.parametrize("alias", [False, True])
def test_row_exp_moves_its_shift_up_where_a_later_piece_would_overflow(alias):
    """The shift is the first 256-column piece's maximum until a later piece's exps pass
    ~e^62: rows whose maximum lies 40 (kept: exps up to e^40), 100 and 1,000 nats above
    their first piece (moved, once and twice), a first piece of -inf, +inf in a later piece
    (NaN, as torch), against float64."""
    from megatron_xdistill.loss.cpu.rows import row_exp_

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 1000, generator=gen, dtype=torch.float64) * 3
    x[0, 300:] += 40.0
    x[1, 300:] += 100.0
    x[2, 300:600] += 100.0
    x[2, 800:] += 1000.0
    x[3, :256] = -math.inf
    x[3, 600:] -= 500.0
    x[4, 700] = math.inf
    x = x.float()
    want = torch.softmax(x.double(), 1)
    want_lz = torch.logsumexp(x.double(), 1)
    out = x.clone() if alias else torch.empty_like(x)
    lz, norm = row_exp_(out, out if alias else x)
    assert float(out[0].max()) > math.exp(35)  # the first piece's shift kept
    torch.testing.assert_close((out * norm[:, None]).double()[:4], want[:4], rtol=1e-6,
                               atol=1e-6)
    torch.testing.assert_close(lz.double()[[0, 1, 2, 3, 5]], want_lz[[0, 1, 2, 3, 5]],
                               rtol=1e-6, atol=0)
    assert bool((out[4] * norm[4]).isnan().all()) and bool(want[4].isnan().all())


def test_image_projection_backward_takes_the_projection_itself_as_its_gradient():
    """The backward reuses the projection's buffers (the projection is valid until the next
    projection or backward); given the projection's own output as the gradient, it still
    reads it whole: as with a copy of it."""
    shard, _ = _shard(2, 700, 1000)
    proj = ImageProjection.build(shard, 700, None)
    probs, factor, seg = _block(4, torch.float32, 19, 700)
    coef = torch.linspace(-1.0, 1.0, seg.numel())
    q = proj.project(probs, factor, seg, 19, use_numba=True).clone()
    want = probs.clone()
    proj.backward_into(want, factor, seg, q, 0.5, coef, None, use_numba=True)
    got = probs.clone()
    q_in_place = proj.project(probs, factor, seg, 19, use_numba=True)
    assert torch.equal(q_in_place, q)
    proj.backward_into(got, factor, seg, q_in_place, 0.5, coef, None, use_numba=True)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 7, 50])
def test_sorted_top_equals_topk_with_its_gradient(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    x[0, :10] = float("-inf")  # a short shard's padding
    weight = torch.randn(6, n, generator=gen, dtype=torch.float64)
    mine = x.clone().requires_grad_(True)
    (sorted_top(mine, n) * weight).sum().backward()
    ref = x.clone().requires_grad_(True)
    (ref.topk(n, dim=1).values * weight).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(sorted_top(x, n), x.topk(n, dim=1).values)
    finite = torch.isfinite(x)  # tied -inf pads may be taken in any order (exp(-inf) = 0 in gold)
    torch.testing.assert_close(mine.grad[finite], ref.grad[finite])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_top_values_radix_select_equals_numpys_sort(dtype, threads):
    """The Numba radix select + sort against NumPy's full sort, bit for bit: rows of ordinary
    log-values, wide and narrow spreads (one histogram bucket or many), -inf pads, signed
    zeros, many ties, one distinct value, n = 1 and n = m; the columns point at the values;
    the rows split over one thread or two (each thread's scratch reused row after row)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_top_values(dtype)
    finally:
        torch.set_num_threads(before)


def _check_top_values(dtype) -> None:
    rng = np.random.default_rng(0)
    m = 3000
    a = (rng.standard_normal((9, m)) * 2 - 11).astype(dtype)
    a[1] *= 1e-6                      # a narrow spread: keys differ in low bits only
    a[2, :2500] = -np.inf             # a short shard's pads, below n
    a[3, ::3] = -np.inf
    a[4] = rng.integers(-3, 3, m)     # few distinct values, many ties
    a[5] = -7.25                      # one value
    a[6, :10] = [0.0, -0.0, 1e-40, -1e-40, np.inf, 3.0, -3.0, 5e37, -5e37, 1.0]
    a[7] = np.abs(a[7])               # positive values (probabilities, as sorted_top's callers)
    a[8] = rng.permutation(m).astype(dtype)
    for n in (1, 2, 517, 2999, m):
        want = -np.sort(-a, axis=1)[:, :n]
        values, cols = top_values(a, n, with_columns=True)
        assert values.dtype == a.dtype and values.shape == (9, n)
        np.testing.assert_array_equal(values, want)
        np.testing.assert_array_equal(  # each value is its column's, bit for bit (-0.0, 0.0)
            np.take_along_axis(a, cols, 1).view(np.uint8), values.view(np.uint8))
        assert all(len(set(row)) == n for row in cols.tolist())  # distinct columns
        np.testing.assert_array_equal(top_values(a, n)[0], values)
        out = np.full((9, n), np.nan, dtype)
        top_values(a, n, out=out)
        np.testing.assert_array_equal(out, values)


def _l1_reference(a: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The L1 of the sorted values and its gradient by torch.topk's autograd."""
    ref = a.clone().requires_grad_(True)
    value = (ref.topk(t.shape[1], dim=1).values.exp() - t).abs().sum(-1)
    value.sum().backward()
    return value.detach(), ref.grad


def _l1_case(rows: int, m: int, n: int, runs: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Log values [rows, m] and sorted teacher values [rows, n]: "few" sign runs (the teacher
    a scaled copy of the student's sorted values, crossing them a few times) or "many"."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.log_softmax(torch.randn(rows, m, generator=gen, dtype=torch.float64) * 2, -1)
    top = a.topk(n, dim=1).values.exp()
    if runs == "few":
        wave = 1.0 + 0.5 * torch.sin(torch.linspace(0.3, 6.3, n, dtype=torch.float64))
        t = (top * wave).sort(-1, descending=True).values
    else:
        t = (top * (1 + 0.3 * torch.randn(rows, n, generator=gen, dtype=torch.float64))
             ).abs().sort(-1, descending=True).values
    return a, t


@pytest.mark.parametrize("runs", ["few", "many"])
@pytest.mark.parametrize("n", [1, 37, 200])
def test_sorted_l1_equals_topk_with_its_gradient(runs, n):
    a, t = _l1_case(5, 200, n, runs, seed=n)
    starts = l1._sign_runs(a.topk(n, 1).values, t, a, a.sum(1)).starts.shape[1]
    if n == 200:  # rows with more run starts than the memo keeps, and fewer
        assert (starts <= l1._MEMO_STARTS) == (runs == "few")
    mine = a.clone().requires_grad_(True)
    value = l1.sorted_l1(mine, t)
    value.sum().backward()
    want, grad = _l1_reference(a, t)
    torch.testing.assert_close(value.detach(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, grad, rtol=1e-12, atol=1e-300)
    assert int((mine.grad != 0).sum()) == 5 * n  # the n largest of each row, no other


def test_sorted_l1_backward_reuses_the_forwards_runs_only_for_the_same_values():
    """The loss's pattern: a forward without autograd, then the same rows recomputed under
    autograd for the backward. The memo's runs serve the recompute (no second sort); a
    recompute whose values differ sorts again and still gets the right gradient."""
    a, t = _l1_case(4, 300, 64, "few", seed=3)
    memo, keys = l1.RunMemo(10), torch.tensor([7, 2, 5, 0])
    with torch.no_grad():
        first = l1.sorted_l1(a, t, memo, keys)
    assert bool(torch.isfinite(memo.table[keys, 0]).all())
    calls = []
    real = l1._top_values
    l1._top_values = lambda *args: calls.append(1) or real(*args)
    try:
        mine = a.clone().requires_grad_(True)
        l1.sorted_l1(mine, t, memo, keys).sum().backward()
        assert calls == [] and not bool(torch.isfinite(memo.table[:, 0]).any())  # used once
        with torch.no_grad():
            l1.sorted_l1(a, t, memo, keys)
        assert calls == [1]
        moved = a.clone()
        moved[2, 0] += 1e-3  # one row is not what its runs were found on
        other = moved.clone().requires_grad_(True)
        l1.sorted_l1(other, t, memo, keys).sum().backward()
        assert calls == [1, 1]
    finally:
        l1._top_values = real
    torch.testing.assert_close(first, _l1_reference(a, t)[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad, _l1_reference(a, t)[1], rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(other.grad, _l1_reference(moved, t)[1], rtol=1e-12, atol=1e-300)


def _gold_kernel(vs: int, common: int, n: int, rows: int, seed: int):
    """A GoldKernel (one TP rank, forward KL) on ``vs`` student columns, ``common`` of them
    paired, a payload of ``rows`` chunks keeping ``n`` uncommon probabilities, and a block's
    raw sums (summed logits of 1-3 positions, their log-partitions, counts)."""
    from megatron_xdistill.loss.definitions.payload import PayloadSpec, TeacherPayload
    from megatron_xdistill.loss.kernels.gold import GoldKernel

    gen = torch.Generator().manual_seed(seed)
    common_ids = torch.randperm(vs, generator=gen)[:common]  # pair order, not sorted
    payload = TeacherPayload(
        PayloadSpec("gold", rows, common, n),
        torch.log_softmax(torch.randn(1, rows, common, generator=gen, dtype=torch.float64), -1),
        torch.ones(1, rows, dtype=torch.bool),
        uncommon_probs=(torch.rand(1, rows, n, generator=gen, dtype=torch.float64) * 0.02
                        ).sort(-1, descending=True).values)
    kernel = GoldKernel(payload, common_ids, 0, vs, n, 0.0, None)
    counts = torch.randint(1, 4, (rows,), generator=gen)
    logits = torch.randn(int(counts.sum()), vs, generator=gen, dtype=torch.float64) * 3
    logits[0, :40] = 2.0  # ties among a row's values
    lz = torch.logsumexp(logits, 1)
    seg = torch.repeat_interleave(torch.arange(rows), counts)
    raw = {"x": torch.zeros(rows, vs, dtype=torch.float64).index_add_(0, seg, logits),
           "lz": torch.zeros(rows, dtype=torch.float64).index_add_(0, seg, lz)}
    return kernel, raw, counts


@pytest.mark.parametrize("n", [1, 60, 130])
def test_gold_rows_equal_torchs_kl_and_its_autograd(n):
    """gold_rows' CPU passes (the KL's forward; its gradient written directly) against the
    kernel's torch operations and autograd through them, on the same rows: the common
    columns in pair order, ties, every uncommon column a candidate (n = |U|)."""
    kernel, raw, counts = _gold_kernel(vs=250, common=120, n=n, rows=9, seed=n)
    keys = torch.tensor([3, 0, 8, 1, 2, 7, 6, 5, 4])
    weight = torch.rand(9, dtype=torch.float64) + 0.5
    student_top = ((raw["x"][:, kernel.col_common] - raw["lz"][:, None]) / counts[:, None]
                   ).argmax(1)  # (one TP rank: the common columns are in pair order)
    kernel.payload.logprobs[0, keys[::2], student_top[::2]] = 0.0  # these rows agree
    assert kernel._by_rows(raw["x"])
    kl, agree = kernel.kl(raw, keys, counts)
    got = kernel.raw_grad(raw, keys, counts, weight)
    kernel._by_rows = lambda x: False  # torch's operations, differentiated by autograd
    kernel.runs = None
    leaves = {k: v.clone().requires_grad_(True) for k, v in raw.items()}
    want_kl, want_agree = kernel.kl(leaves, keys, counts)
    (want_kl * weight).sum().backward()
    assert kernel.raw_grad(raw, keys, counts, weight) is None
    torch.testing.assert_close(kl, want_kl.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(agree, want_agree) and bool(agree.any()) and not bool(agree.all())
    torch.testing.assert_close(got["x"], leaves["x"].grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got["lz"], leaves["lz"].grad, rtol=1e-12, atol=1e-15)


def test_fast_exp_is_float32_exact_to_a_few_ulps_and_keeps_the_special_values():
    """cpu_rows.fast_exp against float64 exp over the float32 range: relative error under 5e-7
    (torch's own expf is ~1e-7); exp(-inf) = 0, 0 below the normal range, inf above 88.3, NaN
    stays NaN; float64 rows take math.exp."""
    from numba import njit

    from megatron_xdistill.loss.cpu.rows import FASTMATH, fast_exp

    @njit(fastmath=FASTMATH)
    def exp_all(a, out):
        for i in range(a.shape[0]):
            out[i] = fast_exp(a[i])

    grid = torch.linspace(-100.0, 88.0, 400_001, dtype=torch.float64)
    special = torch.tensor([-math.inf, math.inf, math.nan, 0.0, -0.0, -87.5, 88.5, 1e-8])
    for dtype, rtol in ((torch.float32, 5e-7), (torch.float64, 1e-15)):
        a = torch.cat([grid, special.double()]).to(dtype)
        out = torch.empty_like(a)
        exp_all(a.numpy(), out.numpy())
        want = torch.exp(a.double())
        normal = (a <= 88.3) & (want >= torch.finfo(torch.float32).tiny)
        rel = ((out.double() - want) / want)[normal].abs().max()
        assert float(rel) < rtol, (dtype, float(rel))
        tail = out[-special.numel():]
        assert tail[0] == 0 and tail[1] == math.inf and math.isnan(tail[2])
        assert tail[3] == 1 and tail[4] == 1
        if dtype == torch.float32:
            assert tail[5] == 0 and tail[6] == math.inf  # outside the normal float32 range


def test_fast_log_is_float32_exact_to_a_few_ulps_and_keeps_the_special_values():
    """cpu_rows.fast_log against float64 log over the normal float32 range (every binade, both
    halves of the mantissa): absolute error under 2e-7 near 1 and relative under 3e-7
    elsewhere; log 0 = -inf, log of a negative number NaN, log inf = inf, NaN stays NaN."""
    from numba import njit

    from megatron_xdistill.loss.cpu.rows import FASTMATH, fast_log

    @njit(fastmath=FASTMATH)
    def log_all(a, out):
        for i in range(a.shape[0]):
            out[i] = fast_log(a[i])

    grid = torch.cat([torch.logspace(-37.9, 38.4, 400_001, dtype=torch.float64),
                      torch.linspace(0.5, 2.0, 100_001, dtype=torch.float64)])
    special = torch.tensor([0.0, -1.0, math.inf, math.nan, 1.0, -math.inf])
    for dtype in (torch.float32, torch.float64):
        a = torch.cat([grid, special.double()]).to(dtype)
        out = torch.empty_like(a)
        log_all(a.numpy(), out.numpy())
        want = torch.log(a.double())
        err = (out.double() - want)[: grid.numel()].abs()
        bound = torch.maximum(want[: grid.numel()].abs() * 3e-7, torch.full_like(err, 2e-7))
        if dtype == torch.float64:
            bound = want[: grid.numel()].abs() * 1e-15 + 1e-300
        assert bool((err <= bound).all()), (dtype, float((err / bound).max()))
        tail = out[-special.numel():]
        assert tail[0] == -math.inf and math.isnan(tail[1]) and tail[2] == math.inf
        assert math.isnan(tail[3]) and tail[4] == 0 and math.isnan(tail[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_row_logsumexp_equals_torchs_in_float64(dtype):
    """Rows wide and narrow, one all -inf (-> -inf), one with a NaN (-> NaN), some -inf
    columns; no rows and no columns."""
    from megatron_xdistill.loss.cpu.rows import row_logsumexp

    gen = torch.Generator().manual_seed(0)
    for width in (1, 17, 5000):
        x = (torch.randn(9, width, generator=gen, dtype=torch.float64) * 4).to(dtype)
        x[1] = -math.inf
        x[2, 0] = math.nan
        x[3, : width // 2] = -math.inf
        got = row_logsumexp(x)
        want = torch.logsumexp(x.double(), 1)
        assert got[1] == -math.inf and math.isnan(got[2])
        keep = torch.isfinite(want)
        torch.testing.assert_close(got.double()[keep], want[keep],
                                   rtol=1e-6 if dtype == torch.float32 else 1e-14, atol=0)
    assert row_logsumexp(torch.empty(0, 5, dtype=dtype)).shape == (0,)
    assert bool((row_logsumexp(torch.empty(3, 0, dtype=dtype)) == -math.inf).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("alias", [False, True])
def test_exp_spread_writes_softmax_times_c_plus_the_rows_gradient(dtype, alias):
    """exp(x - lz) c + alpha g[row] against torch (rows -1 or R: no g term; no g at all);
    ``out`` may be ``x`` itself; strided rows (a view of wider logits) are taken."""
    from megatron_xdistill.loss.cpu.rows import exp_spread_

    gen = torch.Generator().manual_seed(1)
    wide = torch.randn(7, 40, generator=gen, dtype=dtype) * 3
    x = wide[:, :33]
    lz = torch.logsumexp(x, 1)
    c = torch.randn(7, generator=gen, dtype=dtype)
    g = torch.randn(3, 33, generator=gen, dtype=dtype)
    seg = torch.tensor([0, 2, -1, 1, 3, 0, 2])
    soft = torch.exp(x - lz[:, None]) * c[:, None]
    want = soft + 0.7 * torch.cat([g, g.new_zeros(1, 33)])[seg.clamp(0, 3).masked_fill(seg < 0, 3)]
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-14,
                                                                       "atol": 1e-14}
    out = x.clone() if alias else torch.empty_like(x)
    exp_spread_(out, out if alias else x, lz, c, seg, g, 0.7)
    torch.testing.assert_close(out, want, **tol)
    plain = torch.empty_like(x)
    exp_spread_(plain, x, lz, c)
    torch.testing.assert_close(plain, soft, **tol)
    with pytest.raises(ValueError, match="unit stride"):
        exp_spread_(plain, x.t(), lz, c)


def test_sorted_l1_memo_keeps_no_row_with_more_runs_than_it_holds():
    a, t = _l1_case(3, 200, 200, "many", seed=5)
    memo, keys = l1.RunMemo(3, capacity=4), torch.arange(3)
    with torch.no_grad():
        l1.sorted_l1(a, t, memo, keys)
    assert not bool(torch.isfinite(memo.table[:, 0]).any())
    mine = a.clone().requires_grad_(True)
    l1.sorted_l1(mine, t, memo, keys).sum().backward()
    torch.testing.assert_close(mine.grad, _l1_reference(a, t)[1], rtol=1e-12, atol=1e-300)


def _group_sums(a: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """Per row, the gradient summed over each set of equal values (in value order)."""
    return [torch.zeros(int(inv.max()) + 1, dtype=grad.dtype).index_add_(0, inv, g)
            for row, g in zip(a, grad) for inv in [torch.unique(row, return_inverse=True)[1]]]


@pytest.mark.parametrize("where", ["threshold", "run start"])
def test_sorted_l1_ties_share_their_ranks_signs(where):
    """Equal values where ranks decide (at the n-th value with more equal ones beyond, or on
    both sides of a change of sign) share the signs of the ranks they hold: the same sum over
    the group as torch.topk's (which gives them to some of the tied elements), the rest alike."""
    a = torch.log(torch.tensor([[0.30, 0.20, 0.20, 0.10, 0.05, 0.15]], dtype=torch.float64))
    if where == "threshold":  # n = 2: 0.30 and one of the two 0.20s, both signs +
        t, tied = torch.tensor([[0.10, 0.10]], dtype=torch.float64), 0.5 * 0.20
    else:  # n = 4 sorted 0.30 0.20 | 0.20 0.15: signs + + then - -, the 0.20s get + and -
        t, tied = torch.tensor([[0.10, 0.10, 0.25, 0.25]], dtype=torch.float64), 0.0
    mine = a.clone().requires_grad_(True)
    value = l1.sorted_l1(mine, t)
    value.sum().backward()
    want, grad = _l1_reference(a, t)
    torch.testing.assert_close(value.detach(), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(mine.grad[0, 1:3], torch.full((2,), tied, dtype=torch.float64))
    for got, ref in zip(_group_sums(a, mine.grad), _group_sums(a, grad)):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-15)
    untied = torch.tensor([True, False, False, True, True, True])
    torch.testing.assert_close(mine.grad[0, untied], grad[0, untied])


@pytest.mark.parametrize("memo", [False, True])
def test_sorted_l1_with_many_ties_has_topks_sum_over_every_group(memo):
    """Coarsely rounded values (as low-precision logits give): the value is the dense one and
    the gradient summed over each set of equal values is torch.topk's, with or without the
    forward's runs kept for the backward."""
    gen = torch.Generator().manual_seed(4)
    a = (torch.log_softmax(torch.randn(6, 400, generator=gen, dtype=torch.float64) * 2, -1)
         * 4).round() / 4
    n = 150
    top = a.topk(n, 1).values.exp()
    wave = 1.0 + 0.5 * torch.sin(torch.linspace(0.3, 9.3, n, dtype=torch.float64))
    t = (top * wave).sort(-1, descending=True).values  # a few runs: the memo keeps them
    runs, keys = (l1.RunMemo(6), torch.arange(6)) if memo else (None, None)
    if memo:
        with torch.no_grad():
            l1.sorted_l1(a, t, runs, keys)
        assert bool(torch.isfinite(runs.table[:, 0]).all()) and float(runs.table[:, 4].sum()) > 0
    mine = a.clone().requires_grad_(True)
    value = l1.sorted_l1(mine, t, runs, keys)
    value.sum().backward()
    want, grad = _l1_reference(a, t)
    assert l1._sign_runs(a.topk(n, 1).values, t, a, a.sum(1)).tie_values.shape[1] > 0
    torch.testing.assert_close(value.detach(), want, rtol=1e-12, atol=0)
    for got, ref in zip(_group_sums(a, mine.grad), _group_sums(a, grad)):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("block_tokens", [1, 3, 7, 50, 10_000])
def test_blocks_end_where_chunks_end_and_hold_their_rows_whole(block_tokens):
    """Blocks cover the positions in order, each at least ``block_tokens`` long (but the
    last), ending where a chunk's run of positions ends; each holds its rows whole."""
    from megatron_xdistill.loss.blocks.chunk_rows import build_chunk_rows

    gen = torch.Generator().manual_seed(block_tokens)
    steps = torch.randint(0, 3, (2, 60), generator=gen)  # chunk ids: runs of 1+ positions
    ids = torch.cumsum(steps, 1) // 2
    dropped = torch.rand(int(ids.max()) + 1, generator=gen) < 0.2  # chunks no position predicts
    ids[dropped[ids]] = -1
    ids[1, 50:] = -1  # padding
    rows = build_chunk_rows(ids, int(ids.max()) + 1, None, None, block_tokens)
    pos_row = rows.pos_row
    start, row = 0, 0
    for blk in rows.blocks:
        assert blk.start == start and blk.row_start == row
        assert blk.end - blk.start >= block_tokens or blk.end == 120
        if blk.end < 120:  # not inside a run of one chunk's positions
            assert pos_row[blk.end] < 0 or pos_row[blk.end] != pos_row[blk.end - 1]
        held = pos_row[blk.start: blk.end]
        held = held[held >= 0]
        assert held.unique().tolist() == list(range(blk.row_start, blk.row_end))
        start, row = blk.end, blk.row_end
    assert start == 120 and row == rows.num_rows


@pytest.mark.parametrize("seed", range(4))
def test_each_blocks_rows_held_whole_or_split_are_found_once(seed):
    """The per-block row selections found once per call (concatenated, with offsets) equal a
    per-block search, relative to each block's first row; blocks without rows, or without
    selected rows, get none."""
    from megatron_xdistill.loss.blocks.chunk_rows import Block, _rows_by_block

    gen = torch.Generator().manual_seed(seed)
    num_rows = 40
    cuts = sorted({0, num_rows, *torch.randint(0, num_rows, (6,), generator=gen).tolist()})
    cuts = [0, 0, *cuts[1:]]  # a first block without rows
    blocks = [Block(3 * a, 3 * b, a, b) for a, b in zip(cuts[:-1], cuts[1:])]
    selected = torch.rand(num_rows, generator=gen) < (0.1 if seed == 0 else 0.6)
    flat, off = _rows_by_block(selected, blocks)
    assert len(off) == len(blocks) + 1 and off[0] == 0 and off[-1] == int(selected.sum())
    for i, blk in enumerate(blocks):
        want = torch.nonzero(selected[blk.row_start: blk.row_end], as_tuple=True)[0]
        assert flat[off[i]: off[i + 1]].tolist() == want.tolist()


def test_default_blocks_on_an_accelerator_fill_the_memory_share_and_cpu_keeps_its_rule():
    """Accelerators: the per-block kernels (exact and gold forms) take the largest block whose
    temporaries (``block_buffers`` fp32 [block, V] buffers) stay within BLOCK_MEMORY_SHARE of the
    logits, never smaller than the CPU rule; CPU and the column forms keep 64 MiB / 16 MiB
    blocks and their share of the positions."""
    from megatron_xdistill.loss.blocks.block_size import BLOCK_MEMORY_SHARE, block_positions
    from megatron_xdistill.loss.kernels.gold import GoldKernel
    from megatron_xdistill.loss.kernels.pkl import ColumnsKernel, DenseKernel
    from megatron_xdistill.loss.student.kernel_choice import NoKernel

    n, v = 16384, 49152
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for kernel in (GoldKernel, DenseKernel):
        assert block_positions(kernel, n, v, 4, cpu) == (64 << 20) // (4 * v * 4) == 85
        for itemsize in (4, 2):  # fp32 and bf16 logits
            p = block_positions(kernel, n, v, itemsize, cuda)
            budget = BLOCK_MEMORY_SHARE * n * v * itemsize
            fits = int(budget // (4 * v * kernel.block_buffers))  # largest block in the share
            assert fits * 4 * v * kernel.block_buffers <= budget
            assert budget < (fits + 1) * 4 * v * kernel.block_buffers
            assert p == max(85, fits)
        assert block_positions(kernel, 100, v, 4, cuda) == 8  # the CPU rule's floor
        assert block_positions(kernel, 100, v, 4, cpu) == 8  # (1/128 of them would be 1)
        assert block_positions(kernel, 2048, v, 4, cpu) == 16  # the share above the floor
        assert block_positions(kernel, 100, 10_000_000, 4, cpu) == 1  # within BLOCK_BYTES
    assert block_positions(GoldKernel, n, v, 4, cuda) == 264
    assert block_positions(DenseKernel, n, v, 4, cuda) == 133
    assert block_positions(GoldKernel, n, v, 4, cuda, 512 << 20) == 682  # as asked, a quarter
    for kernel in (ColumnsKernel, NoKernel):
        assert block_positions(kernel, n, v, 4, cuda) == block_positions(kernel, n, v, 4, cpu) \
            == (64 << 20) // (4 * v)


def _exact_case(dtype: torch.dtype, seed: int = 0):
    """Payload log-probs [9, 60] (row 2 with -inf columns, row 4 with a tied maximum), the
    image I of W (40 columns), rows' keys and projected masses u [5, |I|]."""
    gen = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(9, 60, generator=gen, dtype=torch.float64), -1)
    lp[2, ::3] = float("-inf")
    lp[2] = torch.log_softmax(lp[2], -1)
    lp[4, 7] = lp[4, 31] = lp[4].max() + 0.5
    lp[4] = torch.log_softmax(lp[4], -1)
    image = torch.randperm(60, generator=gen)[:40].sort().values
    keys = torch.tensor([4, 0, 2, 8, 2])
    u = torch.rand(5, image.numel(), generator=gen, dtype=torch.float64) * 1e-3
    return lp.to(dtype), image, keys, u.to(dtype)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("step", [1, 2, 32])
def test_exact_rows_teacher_terms_equal_torchs(beta, dtype, step):
    """Per payload row: the divergence's terms outside I (forward KL: sum p log p with
    0 log 0 = 0, minus log(EPS) times the mass outside I; JSD: -beta log(beta) times that
    mass; reverse: none) and the first argmax over V_t; rows not asked for stay 0."""
    from megatron_xdistill.loss.cpu import exact as exact_rows
    from megatron_xdistill.loss.definitions.common import EPS

    lp, image, keys, _ = _exact_case(dtype)
    in_image = torch.zeros(60, dtype=torch.bool)
    in_image[image] = True
    const, argmax = exact_rows.teacher_terms(lp, keys, in_image, beta, step)
    p = lp.double().exp()
    plogp = torch.where(p > 0, p * lp.double(), 0.0).sum(-1)
    outside = (p * (~in_image)).sum(-1)
    want = {0.0: plogp - math.log(EPS) * outside, 1.0: torch.zeros(9, dtype=torch.float64),
            0.5: -0.5 * math.log(0.5) * outside}[beta]
    asked = torch.zeros(9, dtype=torch.bool)
    asked[keys] = True
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(const, torch.where(asked, want, 0.0), rtol=tol, atol=tol)
    assert torch.isfinite(const).all()
    assert argmax.tolist() == torch.where(asked, lp.argmax(-1), 0).tolist()
    assert int(argmax[4]) == 7  # the first of two equal maxima, as torch.argmax


def test_exact_rows_teacher_terms_over_rows_of_several_pieces():
    """Rows longer than the pass's piece (each row is read a piece at a time): the first
    argmax wherever it lies (column 0, a later piece, the partial last piece, a tie between
    pieces: the earlier) and the terms as the float64 sums over the whole row."""
    from megatron_xdistill.loss.cpu import exact as exact_rows
    from megatron_xdistill.loss.definitions.common import EPS

    piece = exact_rows._PIECE
    width = 3 * piece + 100
    gen = torch.Generator().manual_seed(5)
    lp = torch.log_softmax(torch.randn(6, width, generator=gen, dtype=torch.float64), -1)
    for row, cols in enumerate([[0], [piece + 7], [3 * piece + 99], [piece - 1, 2 * piece],
                                [2 * piece + 1, 2 * piece + 5], []]):
        for c in cols:
            lp[row, c] = -0.5
    lp[5, :: 3] = float("-inf")  # 0 log 0 = 0
    in_image = torch.rand(width, generator=gen) < 0.6
    keys = torch.arange(6)
    for dtype in (torch.float32, torch.float64):
        x = lp.to(dtype)
        const, argmax = exact_rows.teacher_terms(x, keys, in_image, 0.0, 4)
        p = x.double().exp()
        want = (torch.where(p > 0, p * x.double(), 0.0).sum(-1)
                - math.log(EPS) * (p * (~in_image)).sum(-1))
        tol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(const, want, rtol=tol, atol=tol)
        assert argmax.tolist() == x.argmax(-1).tolist()
        assert argmax[:5].tolist() == [0, piece + 7, 3 * piece + 99, piece - 1, 2 * piece + 1]


def _image_kl_reference(u, lp, keys, image, const=None):
    """The forward KL of the rows ``keys`` against q = u / sum u on I; ``const`` the rows'
    teacher-only terms (None: from ``lp``, in float64: sum p log p - log(EPS) * mass outside
    I, the KL over all of V_t)."""
    from megatron_xdistill.loss.definitions.common import EPS, TINY

    if const is None:
        p = lp.double().exp()
        outside = torch.ones(lp.shape[1], dtype=torch.bool)
        outside[image] = False
        const = (torch.where(p > 0, p * lp.double(), 0.0).sum(-1)
                 - math.log(EPS) * (p * outside).sum(-1))
    q = u / u.sum(-1, keepdim=True).clamp_min(TINY)
    p = lp.index_select(0, keys)[:, image].exp()
    return const.index_select(0, keys).to(u.dtype) - (p * torch.log(q + EPS)).sum(-1)


def _outside(width: int, image: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.ones(width, dtype=dtype)
    out[image] = 0
    return out


def test_exact_rows_image_kl_over_rows_of_several_pieces():
    """Payload rows longer than the pass's piece: the KL over all of V_t against the float64
    sums, and both argmaxes wherever they lie (a tie between pieces: the earlier, as
    torch.argmax), with pieces that hold no column of I."""
    from megatron_xdistill.loss.cpu import exact as exact_rows

    piece = exact_rows._PIECE
    width = 4 * piece + 100
    gen = torch.Generator().manual_seed(7)
    lp = torch.log_softmax(torch.randn(5, width, generator=gen, dtype=torch.float64), -1)
    lp[1, 3 * piece + 50] = lp[2, piece + 1] = lp[2, 4 * piece + 3] = 0.0
    lp[3, :: 2] = float("-inf")
    keep = torch.rand(width, generator=gen) < 0.5
    keep[piece: 2 * piece] = False  # a piece with no column of I
    image = torch.nonzero(keep, as_tuple=True)[0]
    keys = torch.tensor([0, 1, 2, 3, 4, 2])
    u = torch.rand(6, image.numel(), generator=gen, dtype=torch.float64)
    last = image.numel() - 1
    u[1, last] = u[2, 3] = u[2, last] = 2.0  # u's argmax: the last piece; a tie: the first
    for dtype in (torch.float32, torch.float64):
        x, m = lp.to(dtype), u.to(dtype)
        weight = torch.tensor([0.5, 2.0, 1.0, 3.0, 1.0, 0.25], dtype=dtype)
        kl, at, teacher_at, grad = exact_rows.image_kl(m, x, keys, image,
                                                       _outside(width, image, dtype), weight)
        leaf = m.double().requires_grad_(True)
        want = _image_kl_reference(leaf, x.double(), keys, image)
        tol = 1e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(kl.double(), want.detach(), rtol=tol, atol=tol)
        (grad_want,) = torch.autograd.grad((want * weight.double()).sum(), leaf)
        torch.testing.assert_close(grad.double(), grad_want, rtol=tol,
                                   atol=tol * float(grad_want.abs().max()))
        assert at.tolist() == m.argmax(-1).tolist() and at[2] == 3 and at[1] == last
        assert teacher_at.tolist() == x.argmax(-1)[keys].tolist()
        assert teacher_at[1] == 3 * piece + 50 and teacher_at[2] == piece + 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exact_rows_image_kl_and_its_gradient_equal_autograds(dtype):
    """The forward KL on I per row, the argmax of u, and the direct gradient on u (per-row
    and scalar weights) against the plain torch formula and its autograd; in float64 also a
    row with no projected mass, where the floor TINY holds the sum (no normalisation term)."""
    from megatron_xdistill.loss.cpu import exact as exact_rows

    lp, image, keys, u = _exact_case(dtype)
    if dtype == torch.float64:
        u[3] = 0.0
    kl, at, teacher_at, none = exact_rows.image_kl(u, lp, keys, image,
                                                   _outside(60, image, lp.dtype))
    assert none is None
    leaf = u.clone().requires_grad_(True)
    want = _image_kl_reference(leaf, lp, keys, image)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(kl, want.detach(), rtol=tol, atol=tol)
    assert at.tolist() == u.argmax(-1).tolist()
    assert teacher_at.tolist() == lp.argmax(-1)[keys].tolist() and teacher_at[0] == 7
    for weight in (torch.tensor([0.5, 2.0, 0.0, 1.0, 3.0], dtype=dtype),
                   torch.tensor(1.5, dtype=dtype)):
        (grad_want,) = torch.autograd.grad((want * weight).sum(), leaf, retain_graph=True)
        got = exact_rows.image_kl_grad(u, lp, keys, image, weight)
        kl_too, *_, with_kl = exact_rows.image_kl(u, lp, keys, image,
                                                  _outside(60, image, lp.dtype), weight)
        # the same sums in a loop that also writes the gradient: vectorised in another order
        torch.testing.assert_close(kl_too, kl, rtol=1e-6 if dtype == torch.float32 else 1e-14,
                                   atol=0.0)
        for r in range(u.shape[0]):  # each row to its own scale (the empty row's is ~1e40)
            scale = float(grad_want[r].abs().max())
            torch.testing.assert_close(got[r], grad_want[r], rtol=tol, atol=tol * scale)
            torch.testing.assert_close(with_kl[r], grad_want[r], rtol=tol, atol=tol * scale)


def test_cpu_scratch_buffers_start_on_a_huge_page_and_are_advised_for_huge_pages():
    """A CPU scratch buffer of 2 MiB or more starts on a 2 MiB boundary and its mapping
    carries the huge-page advice (``hg`` in /proc/self/smaps' VmFlags, Linux with THP);
    a smaller one is a plain buffer; both hold what is written to them."""
    from pathlib import Path

    from megatron_xdistill.loss import workspace

    numel = workspace.HUGE_PAGE // 4 * 3 + 5  # 6 MiB and 20 bytes of float32
    buf = workspace.scratch("test_huge", numel, torch.device("cpu"), torch.float32)
    assert buf.numel() == numel and buf.data_ptr() % workspace.HUGE_PAGE == 0
    buf.copy_(torch.arange(numel, dtype=torch.float32))
    assert float(buf[-1]) == numel - 1
    small = workspace.scratch("test_small", 100, torch.device("cpu"), torch.float64)
    assert small.numel() == 100 and small.dtype == torch.float64
    if not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists():
        pytest.skip("no transparent huge pages on this kernel")
    address, flags, inside = buf.data_ptr(), None, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            break
    assert flags is not None and "hg" in flags, flags
