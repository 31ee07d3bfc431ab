"""Row-wise passes over the student's logits on a CPU with no [rows, V] softmax buffer.

The CPU counterpart of :mod:`gpu.row_softmax` for kernels that read the logits and the
log-partitions rather than the probabilities (gold / H-KL, CE alone):

* :func:`row_logsumexp`: each row's log-partition, ``max + log sum exp(x - max)``: torch's max
  (vectorised) and one Numba pass of exp and sum that writes nothing of size V. Was torch's
  softmax into a block buffer (max, exp written, a scaling pass) and two more maxima.
* :func:`exp_spread_`: a block's logits gradient ``exp(x - lz) c + alpha g[row]`` in one pass
  from the logits (``out`` may be ``x`` itself: each element is read before it is written).
  Was a softmax into the gradient, then a second pass for the scaling and the rows' part.

Both need an exp the compiler can vectorise (the exact form's rows take a log as well): Numba's ``math.exp`` is a scalar libm call (no
SVML here), ~4x torch's. :func:`fast_exp` on float32 is a range reduction by ln 2 and a
degree-7 polynomial (Cephes' expf coefficients; relative error under 3e-7 over the float32
range up to 88.3, above which it gives inf, against float64 ``exp``), with 2^n put together from its exponent bits, all in
branch-free float32 / int32 arithmetic that LLVM turns into 16-lane AVX-512 code: 0.33 ns an
element against torch's 0.82. :func:`fast_log` is Cephes' logf the same way (the exponent and
mantissa from the bits, a degree-9 polynomial; normal inputs; 0 -> -inf, negative -> NaN).
Float64 keeps ``math.exp`` / ``math.log`` (gradcheck precision).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from megatron_xdistill.loss.cpu.threads import numba_takes, use_torch_threads

#: sums may be reordered (vectorised); no NaN / inf licence (a NaN logit must show in the loss)
FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)       # ln 2 split so that n * _LN2_HI is exact
_LN2_LO = np.float32(-2.12194440e-4)
_FLOOR = np.float32(-87.33654)          # below this, exp(x) < the smallest normal float32: 0
_TINY32 = np.float32(1.1754944e-38)   # the smallest normal float32 (fast_log: none below)
_CEIL = np.float32(88.3)                # above it inf (2^n must stay a normal float32: n <= 127)


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of an integer (an LLVM bitcast)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        value = args[0]
        if value.type.width != 32:
            value = builder.trunc(value, ir.IntType(32))
        return builder.bitcast(value, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _bits_of_float32(typingctx, value):
    """The bit pattern of a float32 as an int32 (an LLVM bitcast)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(value), codegen


@intrinsic
def prefetch(typingctx, array, i, k):
    """Ask the CPU to bring the cache line of ``array[i, k]`` (a 2-D array) into its caches
    (LLVM's prefetch: a read, kept in every level). A hint, so it changes no result: for
    kernels that will read rows at indices known a few steps ahead (W's entries)."""
    if not (isinstance(array, types.Array) and array.ndim == 2
            and isinstance(i, types.Integer) and isinstance(k, types.Integer)):
        return None

    def codegen(context, builder, signature, args):
        array_type = signature.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        where = cgutils.get_item_pointer(context, builder, array_type, view,
                                         [args[1], args[2]], wraparound=False)
        hint = ir.FunctionType(ir.VoidType(), [where.type] + [ir.IntType(32)] * 3)
        call = cgutils.get_or_insert_function(builder.module, hint, "llvm.prefetch.p0")
        read, keep, data = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
        builder.call(call, [where, read, keep, data])
        return context.get_dummy_value()

    return types.void(array, i, k), codegen


def fast_exp(x):  # pragma: no cover - replaced by the overload inside Numba code
    """exp(x) inside Numba kernels: vectorisable for float32, ``math.exp`` for float64."""
    return math.exp(x)


@overload(fast_exp, jit_options={"fastmath": FASTMATH})
def _fast_exp(x):
    if x == types.float32:
        def exp32(x):  # pragma: no cover - numba
            y = min(max(x, _FLOOR), _CEIL)
            k = np.int32(y * _LOG2E + np.float32(127.5))  # floor(y log2 e + 1/2) + 127 > 0
            n = np.float32(k - np.int32(127))
            r = y - n * _LN2_HI - n * _LN2_LO              # |r| <= ln 2 / 2
            p = np.float32(1.9875691500e-4)
            p = p * r + np.float32(1.3981999507e-3)
            p = p * r + np.float32(8.3334519073e-3)
            p = p * r + np.float32(4.1665795894e-2)
            p = p * r + np.float32(1.6666665459e-1)
            p = p * r + np.float32(5.0000001201e-1)
            p = (p * r) * r + r + np.float32(1.0)
            e = p * _float32_from_bits(k << np.int32(23))
            e = e if x >= _FLOOR else np.float32(0.0)       # exp(-inf) = 0 exactly
            e = e if x <= _CEIL else np.float32(math.inf)
            return e if x == x else x                       # NaN stays NaN
        return exp32
    if isinstance(x, types.Float):
        return lambda x: math.exp(x)  # pragma: no cover - numba
    return None


def zero_of(x):  # pragma: no cover - replaced by the overload inside Numba code
    """0 in the type of ``x`` (float32 sums stay float32 and vectorise 16 lanes wide)."""
    return 0.0


def cast_like(value, like):  # pragma: no cover - replaced by the overload inside Numba code
    """``value`` in the type of ``like`` (float32 arithmetic stays float32)."""
    return value


@overload(cast_like)
def _cast_like_type(value, like):
    if like == types.float32:
        return lambda value, like: np.float32(value)  # pragma: no cover - numba
    if isinstance(like, types.Float):
        return lambda value, like: float(value)  # pragma: no cover - numba
    return None


@overload(zero_of)
def _zero_of_type(x):
    if x == types.float32:
        return lambda x: np.float32(0.0)  # pragma: no cover - numba
    if isinstance(x, types.Float):
        return lambda x: 0.0  # pragma: no cover - numba
    return None


def fast_log(x):  # pragma: no cover - replaced by the overload inside Numba code
    """log(x) inside Numba kernels: vectorisable for float32, ``math.log`` for float64."""
    return math.log(x)


_SQRT_HALF = np.float32(0.70710678118654752)


@overload(fast_log, jit_options={"fastmath": FASTMATH})
def _fast_log(x):
    if x == types.float32:
        def log32(x):  # pragma: no cover - numba
            bits = _bits_of_float32(x)
            k = ((bits >> np.int32(23)) & np.int32(255)) - np.int32(126)  # x = m 2^k
            m = _float32_from_bits((bits & np.int32(0x007FFFFF)) | np.int32(0x3F000000))
            low = m < _SQRT_HALF                       # m in [1/2, 1): to [sqrt(1/2), sqrt(2))
            n = np.float32(k - np.int32(1)) if low else np.float32(k)
            f = (m + m if low else m) - np.float32(1.0)
            z = f * f
            p = np.float32(7.0376836292e-2)
            p = p * f - np.float32(1.1514610310e-1)
            p = p * f + np.float32(1.1676998740e-1)
            p = p * f - np.float32(1.2420140846e-1)
            p = p * f + np.float32(1.4249322787e-1)
            p = p * f - np.float32(1.6668057665e-1)
            p = p * f + np.float32(2.0000714765e-1)
            p = p * f - np.float32(2.4999993993e-1)
            p = p * f + np.float32(3.3333331174e-1)
            y = f * z * p + n * _LN2_LO - np.float32(0.5) * z
            y = f + y + n * _LN2_HI
            y = y if x >= _TINY32 else (np.float32(-math.inf) if x == 0 else np.float32(math.nan))
            y = y if x < np.float32(math.inf) else x          # log(inf) = inf
            return y if x == x else x                          # NaN stays NaN
        return log32
    if isinstance(x, types.Float):
        return lambda x: math.log(x)  # pragma: no cover - numba
    return None


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def row_max(row):  # pragma: no cover - numba
    """The largest value of a non-empty 1-d array (NaNs passed over; an all-NaN row: NaN).
    Eight independent running maxima, which LLVM packs into one vector: a single running
    maximum is a chain of dependent compares (0.55 ns an element against 0.14)."""
    n = row.shape[0]
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[0]
    k = n - n % 8
    for j in range(0, k, 8):
        v = row[j]
        m0 = v if v > m0 else m0
        v = row[j + 1]
        m1 = v if v > m1 else m1
        v = row[j + 2]
        m2 = v if v > m2 else m2
        v = row[j + 3]
        m3 = v if v > m3 else m3
        v = row[j + 4]
        m4 = v if v > m4 else m4
        v = row[j + 5]
        m5 = v if v > m5 else m5
        v = row[j + 6]
        m6 = v if v > m6 else m6
        v = row[j + 7]
        m7 = v if v > m7 else m7
    for t in range(k, n):
        v = row[t]
        m0 = v if v > m0 else m0
    m0 = m1 if m1 > m0 else m0
    m2 = m3 if m3 > m2 else m2
    m4 = m5 if m5 > m4 else m4
    m6 = m7 if m7 > m6 else m6
    m0 = m2 if m2 > m0 else m0
    m4 = m6 if m6 > m4 else m4
    return m4 if m4 > m0 else m0


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def first_argmax(row):  # pragma: no cover - numba
    """The first index of the row's largest value, as torch.argmax where the row has no NaN
    (NaNs are passed over: a row with one has a NaN loss). :func:`row_max`, then a scan for
    its first place."""
    best = row_max(row)
    for t in range(row.shape[0]):
        if row[t] == best:
            return t
    return 0


@njit(inline="always", fastmath=FASTMATH)
def logsumexp_row(row, m):  # pragma: no cover - numba
    """m + log(sum_v exp(row[v] - m)), ``m`` the row's maximum (-inf: a row of -inf, an
    empty distribution, gives -inf)."""
    if m == -math.inf:
        return m
    total = zero_of(m)  # in fp32 for fp32 rows: 16 partial sums, as torch's
    for v in range(row.shape[0]):
        total += fast_exp(row[v] - m)
    return m + math.log(total)


@njit(inline="always", fastmath=FASTMATH)
def logsumexp_of(row):  # pragma: no cover - numba
    """The row's log-partition, as :func:`row_logsumexp` (-inf for a row of -inf, NaN for a
    row with a NaN): its maximum, then :func:`logsumexp_row`."""
    return logsumexp_row(row, row_max(row))


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _logsumexp_rows(x, top, out):  # pragma: no cover - numba
    """out[i] = top[i] + log(sum_v exp(x[i, v] - top[i])), ``top`` the rows' maxima."""
    for i in prange(x.shape[0]):
        out[i] = logsumexp_row(x[i], top[i])


def row_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Log-partition of each row of ``x`` [n, V] (CPU float32 / float64), as
    ``torch.logsumexp(x, 1)`` (a row of -inf gives -inf; a NaN gives NaN)."""
    out = x.new_empty(x.shape[0])
    if x.shape[0] == 0:
        return out
    if x.shape[1] == 0:
        return out.fill_(-math.inf)
    top = x.amax(1)
    use_torch_threads()
    _logsumexp_rows(x.detach().numpy(), top.numpy(), out.numpy())
    return out


#: columns a partial sum of :func:`_exp_sums` takes in the rows' dtype (vectorised) before it
#: is added in fp64: one fp32 sum over a 5,000-column row was 6x further from the float64
#: softmax than torch's
EXP_PIECE = 256
#: a piece's fp32 sum of exps above which :func:`_exp_sums` moves its shift up to the piece's
#: maximum (~e^62: every exp and partial stays a finite float32, 1 / sum of a row a normal one;
#: a row whose first piece holds a value within ~62 of its maximum, any row of a trained
#: model's logits but a freak one, keeps that piece's maximum)
_PIECE_LIMIT = 1e27


@njit(inline="always", fastmath=FASTMATH)
def _exp_sum_piece(o, xi, m):  # pragma: no cover - numba
    part = zero_of(m)  # in the rows' dtype: vectorised
    for v in range(o.shape[0]):
        e = fast_exp(xi[v] - m)
        o[v] = e
        part += e
    return part


@njit(inline="always")
def _rescale(o, s):  # pragma: no cover - numba
    for v in range(o.shape[0]):
        o[v] = o[v] * s  # in float64 (s is), one rounding into o's dtype


@njit(inline="always", fastmath=FASTMATH)
def exp_sum_row(o, row, buf, same):  # pragma: no cover - numba
    """o = exp(row - shift) and (shift, the sum of o in fp64 over :data:`EXP_PIECE` pieces), in one
    pass over the row: the shift is its first piece's maximum (the row's, where that piece is
    all -inf), moved up to a later piece's maximum where that piece's sum of exps passes
    :data:`_PIECE_LIMIT` (the pieces before it scaled by exp(old - new) in float64, the piece
    taken again), so no pass of its own for the row's maximum. ``same``: o is row; each
    piece's exps go to ``buf`` (an L1 buffer of :data:`EXP_PIECE`), then over the piece (the row
    is still there if the piece is taken again)."""
    part_len = min(EXP_PIECE, row.shape[0])
    c = row_max(row[:part_len])
    if c == -math.inf:
        c = row_max(row)  # -inf still: a row of -inf, NaN as torch's softmax
    row_total = 0.0
    for v0 in range(0, row.shape[0], EXP_PIECE):
        xc = row[v0: v0 + EXP_PIECE]
        oc = buf[: xc.shape[0]] if same else o[v0: v0 + EXP_PIECE]
        part = _exp_sum_piece(oc, xc, c)
        if part > _PIECE_LIMIT:  # a value > c + ~62 (inf: +inf or overflow; NaN: not)
            top = row_max(xc)
            s = math.exp(float(c) - float(top))
            _rescale(o[:v0], s)
            row_total *= s
            c = top
            part = _exp_sum_piece(oc, xc, c)
        if same:
            xc[:] = oc
        row_total += part
    return c, row_total


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _exp_sums(out, x, shift, total, same):  # pragma: no cover - numba
    """out[i] = exp(x[i] - shift[i]), total[i] = its sum: :func:`exp_sum_row` a row."""
    part_len = min(EXP_PIECE, x.shape[1])
    for i in prange(x.shape[0]):
        buf = np.empty(part_len, x.dtype)
        row = x[i]
        if same:  # one array to LLVM
            shift[i], total[i] = exp_sum_row(row, row, buf, True)
        else:
            shift[i], total[i] = exp_sum_row(out[i], row, buf, False)


def row_exp_(out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax of each row of ``x`` [n, V] left unnormalised: ``out = exp(x - shift)``
    per row, ``shift`` within ~62 of the row's maximum (``out`` is ``x`` itself or does not
    overlap it; CPU float32 / float64, rows of unit stride). Returns (log-partition, 1 / sum
    of the row's exps): the softmax is ``out`` times the latter, which a caller that reads
    the softmax through a per-row factor folds in there (the loss's forward for the exact
    form: one exp pass with the shift taken as it goes and fp64 sums of :data:`EXP_PIECE`-column
    partials; no pass for the row's maximum, no normalising pass, no second row maximum for
    the log-partition: 0.71-0.72 s at 16k positions x 49,152 columns, one thread, in-process,
    against 0.96-0.99 with a row-max pass and 1.27-1.34 for torch's softmax). A row of -inf
    gives NaN probabilities, as torch's softmax."""
    if not (numba_takes(out) and x.dtype == out.dtype and out.shape == x.shape
            and out.stride(-1) == 1 and x.stride(-1) == 1):
        raise ValueError("row_exp_ takes CPU float32 / float64 rows of unit stride, out and x "
                         f"of one shape; got {out.dtype} / {x.dtype}, shapes "
                         f"{tuple(out.shape)} / {tuple(x.shape)}, strides {out.stride()} / "
                         f"{x.stride()}")
    n, x = x.shape[0], x.detach()
    shift = x.new_full((n,), -math.inf)
    total = x.new_zeros(n)
    if n and x.shape[1]:
        use_torch_threads()
        same = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
        _exp_sums(out.detach().numpy(), x.numpy(), shift.numpy(), total.numpy(), same)
    return shift.add_(total.log()), total.reciprocal_()


@njit(inline="always", fastmath=FASTMATH)
def exp_row(o, xi, z, c):  # pragma: no cover - numba
    """o = exp(xi - z) * c (a position's softmax times its coefficient)."""
    for v in range(o.shape[0]):
        o[v] = fast_exp(xi[v] - z) * c


@njit(inline="always", fastmath=FASTMATH)
def exp_row_plus(o, xi, z, c, gr, alpha):  # pragma: no cover - numba
    """o = exp(xi - z) * c + alpha * gr (plus its chunk row's raw gradient)."""
    for v in range(o.shape[0]):
        o[v] = fast_exp(xi[v] - z) * c + alpha * gr[v]


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _exp_spread(out, x, lz, coef, seg, g, alpha):  # pragma: no cover - numba
    rows = g.shape[0]
    for i in prange(out.shape[0]):
        r = seg[i]
        if 0 <= r < rows:
            exp_row_plus(out[i], x[i], lz[i], coef[i], g[r], alpha)
        else:
            exp_row(out[i], x[i], lz[i], coef[i])


@njit(parallel=True, cache=True, nogil=True, fastmath=FASTMATH)
def _exp_spread_over(x, lz, coef, seg, g, alpha):  # pragma: no cover - numba
    """_exp_spread with ``out`` = ``x``: each row one array to LLVM, so it vectorises without
    the runtime overlap check that sends two aliased arrays down its scalar loop (0.89 s
    against 0.15 s a 4,096 x 49,152 pass)."""
    rows = g.shape[0]
    for i in prange(x.shape[0]):
        r, xi = seg[i], x[i]
        if 0 <= r < rows:
            exp_row_plus(xi, xi, lz[i], coef[i], g[r], alpha)
        else:
            exp_row(xi, xi, lz[i], coef[i])


def exp_spread_(out: torch.Tensor, x: torch.Tensor, lz: torch.Tensor, coef: torch.Tensor,
                seg: torch.Tensor | None = None, g: torch.Tensor | None = None,
                alpha: float = 0.0) -> None:
    """``out[i] = exp(x[i] - lz[i]) * coef[i] + alpha * g[seg[i]]`` in place (no ``g`` term
    where ``seg[i]`` is outside [0, R) or ``g`` is None). ``out``, ``x`` [n, V] CPU, same
    float dtype, rows of unit stride; ``out`` is ``x`` (the same view: written over) or does not
    overlap it; ``g`` [R, V]."""
    if not (numba_takes(out) and x.dtype == out.dtype and out.stride(-1) == 1
            and x.stride(-1) == 1):
        raise ValueError("exp_spread_ takes CPU float32 / float64 rows of unit stride, "
                         f"got {out.dtype} / {x.dtype} strides {out.stride()} / {x.stride()}")
    dt = out.dtype
    if g is None:
        g = out.new_zeros(0, out.shape[1])
        seg = torch.full((out.shape[0],), -1, dtype=torch.int64)
    same = (out.data_ptr() == x.data_ptr() and out.shape == x.shape
            and out.stride() == x.stride())
    # alpha in the rows' dtype: no float64 products
    rest = (lz.detach().to(dt).contiguous().numpy(), coef.detach().to(dt).contiguous().numpy(),
            seg.contiguous().numpy(), g.detach().to(dt).contiguous().numpy(),
            out.detach().numpy().dtype.type(alpha))
    use_torch_threads()
    if same:
        _exp_spread_over(out.detach().numpy(), *rest)
    else:
        _exp_spread(out.detach().numpy(), x.detach().numpy(), *rest)


__all__ = ["EXP_PIECE", "FASTMATH", "cast_like", "exp_row", "exp_row_plus", "exp_spread_",
           "exp_sum_row", "fast_exp", "fast_log", "first_argmax", "logsumexp_of", "logsumexp_row",
           "prefetch", "row_exp_", "row_logsumexp", "row_max", "zero_of"]
