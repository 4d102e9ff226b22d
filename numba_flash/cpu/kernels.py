"""Tiled FlashAttention-2 forward and backward for the CPU, as ``numba.njit(parallel=True)`` kernels.

How the work is laid out:

* The host wrappers first copy q, k, v (and dout) into packed ``(B, H, S_pad, D_pad)`` buffers, zero-padded so
  that S_pad is a multiple of the tile size and D_pad a multiple of 8 (one AVX2 vector of float32). This costs
  O(B*H*S*D) memory and time, makes every tile a fixed-size, unit-stride block, and means the big kernels are
  compiled for exactly one array type per dtype whatever the strides of the caller's views.
* The inner products run in two register-blocked micro-kernels: ``_dot_tile`` (``A @ B.T`` for two row-major
  blocks, the shape of ``Q K^T`` and ``dO V^T``) and ``_axpy_tile`` (``C += A @ X``, the shape of ``P V``,
  ``P^T dO``, ``dS^T Q`` and ``dS K``). Their innermost loop runs over the head dimension with unit stride, so
  LLVM turns it into FMA vectors; blocking 4x2 and 4x4 keeps the loads per FMA low enough to run near peak.
* ``exp`` for float32 is a polynomial on the bits of the float (``_fast_exp``) because ``math.exp`` is a scalar
  libm call that LLVM cannot vectorise and would cost as much as the matrix products.
* Tiles entirely outside the causal/window band are never visited (loop bounds); only tiles that straddle the
  band's edge look at per-row key ranges.

Everything runtime-variable (scale, window, softcap, sequence lengths) is a runtime argument, so each kernel is
compiled once per dtype (float32, float64) and cached on disk (``cache=True``).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile
_D_ALIGN = 8  # head dim padded to a multiple of one float32 AVX2 vector

# No 'nnan'/'ninf': the online softmax relies on -inf and +inf comparing correctly.
_FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693145751953125)   # ln 2 split so that n * _LN2_HI is exact for |n| < 2^11
_LN2_LO = np.float32(1.428606765330187e-06)
_EXP_MIN = np.float32(-87.0)  # exp(-87) ~ 1.6e-38 is still a normal float32; below it we flush to ~0 anyway
_EXP_MAX = np.float32(88.0)
_HALF = np.float32(0.5)
_C2 = np.float32(1.0 / 2)
_C3 = np.float32(1.0 / 6)
_C4 = np.float32(1.0 / 24)
_C5 = np.float32(1.0 / 120)
_C6 = np.float32(1.0 / 720)
_ONE = np.float32(1.0)


@intrinsic
def _pow2_f32(typingctx, n):
    """2**n as float32 for a float32 ``n`` holding an integer in [-126, 127], built from the exponent bits."""
    if n != types.float32:
        return None
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.shl(builder.add(builder.fptosi(args[0], i32), ir.Constant(i32, 127)), ir.Constant(i32, 23))
        return builder.bitcast(bits, ir.FloatType())

    return sig, codegen


def _fast_exp(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_fast_exp, inline="always")
def _fast_exp_impl(x):
    if x == types.float32:
        def impl(x):
            # exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2; degree-6 Taylor on r is within ~2 ulp.
            # Pure arithmetic (no libm call), so loops over it vectorise. -inf is clamped to ~1e-38, which the
            # callers only ever multiply by zero or add to sums that are at least 1.
            x = min(max(x, _EXP_MIN), _EXP_MAX)
            n = np.floor(x * _LOG2E + _HALF)
            r = (x - n * _LN2_HI) - n * _LN2_LO
            p = _ONE + r * (_ONE + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * _C6)))))
            return p * _pow2_f32(n)
        return impl
    if x == types.float64:
        def impl(x):
            return math.exp(x)
        return impl
    return None


def _as_dtype_of(a, x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_as_dtype_of, inline="always")
def _as_dtype_of_impl(a, x):
    """``x`` converted to the element type of array ``a``: keeps float32 kernels from drifting to float64 through
    Python-float arguments."""
    dt = a.dtype

    def impl(a, x):
        return dt(x)

    return impl


@njit(fastmath=_FASTMATH, cache=True)
def _dot_tile(a, b, out):
    """out[i, j] = a[i] . b[j] for a (R, Dp), b (C, Dp), out (R, C); R % 4 == 0, C % 2 == 0, rows unit-stride.
    Eight independent dot products share each load of a and b: the loads per FMA stay below one, which is what
    lets the vectorised loop run at FMA throughput rather than load throughput."""
    zero = _as_dtype_of(out, 0.0)
    dp = a.shape[1]
    for i in range(0, a.shape[0], 4):
        for j in range(0, b.shape[0], 2):
            s00 = s01 = s10 = s11 = s20 = s21 = s30 = s31 = zero
            for d in range(dp):
                b0 = b[j, d]
                b1 = b[j + 1, d]
                a0 = a[i, d]
                a1 = a[i + 1, d]
                a2 = a[i + 2, d]
                a3 = a[i + 3, d]
                s00 += a0 * b0
                s01 += a0 * b1
                s10 += a1 * b0
                s11 += a1 * b1
                s20 += a2 * b0
                s21 += a2 * b1
                s30 += a3 * b0
                s31 += a3 * b1
            out[i, j] = s00
            out[i, j + 1] = s01
            out[i + 1, j] = s10
            out[i + 1, j + 1] = s11
            out[i + 2, j] = s20
            out[i + 2, j + 1] = s21
            out[i + 3, j] = s30
            out[i + 3, j + 1] = s31


@njit(fastmath=_FASTMATH, cache=True)
def _axpy_tile(c, coef, x, ncols):
    """c += coef[:, :ncols] @ x[:ncols] for c (R, Dp), coef (R, >= ncols), x (>= ncols, Dp); R % 4 == 0 and
    ncols % 4 == 0. Four rows of c take four rows of x at a time, so each loaded x vector feeds four FMAs and each
    c vector is loaded and stored once per four keys."""
    dp = c.shape[1]
    for i in range(0, c.shape[0], 4):
        for j in range(0, ncols, 4):
            p00 = coef[i, j]
            p01 = coef[i, j + 1]
            p02 = coef[i, j + 2]
            p03 = coef[i, j + 3]
            p10 = coef[i + 1, j]
            p11 = coef[i + 1, j + 1]
            p12 = coef[i + 1, j + 2]
            p13 = coef[i + 1, j + 3]
            p20 = coef[i + 2, j]
            p21 = coef[i + 2, j + 1]
            p22 = coef[i + 2, j + 2]
            p23 = coef[i + 2, j + 3]
            p30 = coef[i + 3, j]
            p31 = coef[i + 3, j + 1]
            p32 = coef[i + 3, j + 2]
            p33 = coef[i + 3, j + 3]
            for d in range(dp):
                x0 = x[j, d]
                x1 = x[j + 1, d]
                x2 = x[j + 2, d]
                x3 = x[j + 3, d]
                c[i, d] += p00 * x0 + p01 * x1 + p02 * x2 + p03 * x3
                c[i + 1, d] += p10 * x0 + p11 * x1 + p12 * x2 + p13 * x3
                c[i + 2, d] += p20 * x0 + p21 * x1 + p22 * x2 + p23 * x3
                c[i + 3, d] += p30 * x0 + p31 * x1 + p32 * x2 + p33 * x3


@njit(inline="always", cache=True)
def _row_key_range(i, seqlen_q, seqlen_k, left, right):
    """Half-open range of keys query row ``i`` sees (numba twin of ``numba_flash.semantics.key_range``); rows past
    the end of the sequence (tile padding) see nothing."""
    if i >= seqlen_q:
        return 0, 0
    centre = i + seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, centre - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
    return lo, max(lo, hi)


@njit(inline="always", cache=True)
def _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi):
    """Fill the per-row key ranges of the query tile starting at ``i0`` and return the union ``[lo, hi)`` over
    its rows (empty when no row sees any key). Both ends of a row's range grow with the row, but a row may see
    nothing, so the union is taken over the rows that see something."""
    lo = seqlen_k
    hi = 0
    for r in range(row_lo.shape[0]):
        a, e = _row_key_range(i0 + r, seqlen_q, seqlen_k, left, right)
        row_lo[r] = a
        row_hi[r] = e
        if a < e:
            lo = min(lo, a)
            hi = max(hi, e)
    return lo, hi


@njit(parallel=True, cache=True)
def _pack(src, dst):
    """dst[b, h, s, d] = src[b, s, h, d], zero in the padding. src (B, S, H, D) any strides; dst (B, H, Sp, Dp)."""
    batch, seqlen, nheads, hd = src.shape
    for u in prange(batch * nheads):
        b = u // nheads
        h = u % nheads
        for s in range(seqlen):
            for d in range(hd):
                dst[b, h, s, d] = src[b, s, h, d]
            for d in range(hd, dst.shape[3]):
                dst[b, h, s, d] = 0
        for s in range(seqlen, dst.shape[2]):
            for d in range(dst.shape[3]):
                dst[b, h, s, d] = 0


@njit(parallel=True, cache=True)
def _unpack(src, dst):
    """dst[b, s, h, d] = src[b, h, s, d] for the unpadded part. src (B, H, Sp, Dp); dst (B, S, H, D) any strides."""
    batch, seqlen, nheads, hd = dst.shape
    for u in prange(batch * nheads):
        b = u // nheads
        h = u % nheads
        for s in range(seqlen):
            for d in range(hd):
                dst[b, s, h, d] = src[b, h, s, d]


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _forward_kernel(qp, kp, vp, op, lse, seqlen_q, seqlen_k, scale, left, right, softcap):
    """Online-softmax forward over packed buffers.

    qp, op: (B, Hq, Sq_pad, Dp); kp, vp: (B, Hkv, Sk_pad, Dp); lse: (B, Hq, Sq) -- all one float dtype.
    One prange iteration per (batch, query head, query tile): each writes its own rows of op and lse only.
    """
    batch, nheads_q, sq_pad, dp = qp.shape
    nheads_kv = kp.shape[1]
    group = nheads_q // nheads_kv
    n_qt = sq_pad // BLOCK_M
    sc = _as_dtype_of(qp, scale)
    cap = _as_dtype_of(qp, softcap)
    inv_cap = _as_dtype_of(qp, 1.0 / softcap if softcap > 0 else 0.0)
    neg_inf = _as_dtype_of(qp, -np.inf)
    zero = _as_dtype_of(qp, 0.0)
    for u in prange(batch * nheads_q * n_qt):
        b = u // (nheads_q * n_qt)
        h = (u // n_qt) % nheads_q
        qt = u % n_qt
        hk = h // group
        i0 = qt * BLOCK_M
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        span_lo, span_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
        # Fold the scale (and 1/softcap) into the query tile once instead of into every score.
        qscale = sc * inv_cap if softcap > 0 else sc
        qs = np.empty((BLOCK_M, dp), qp.dtype)
        for r in range(BLOCK_M):
            for d in range(dp):
                qs[r, d] = qp[b, h, i0 + r, d] * qscale
        s = np.empty((BLOCK_M, BLOCK_N), qp.dtype)
        acc = np.zeros((BLOCK_M, dp), qp.dtype)
        m_run = np.full(BLOCK_M, neg_inf, qp.dtype)
        l_run = np.zeros(BLOCK_M, qp.dtype)
        kv_k = kp[b, hk]
        kv_v = vp[b, hk]
        # Only key tiles that intersect the band of some row of this tile: the rest are skipped, not masked.
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            kb = kv_k[j0:j0 + BLOCK_N]
            _dot_tile(qs, kb, s)
            ncols = min(BLOCK_N, ((span_hi - j0 + 3) // 4) * 4)  # keys past the last visible one: not multiplied
            for r in range(BLOCK_M):
                a = max(row_lo[r] - j0, 0)
                e = min(row_hi[r] - j0, BLOCK_N)
                if a >= e:
                    for c in range(BLOCK_N):
                        s[r, c] = zero
                    continue
                # Loops over the whole tile width (a compile-time trip count) vectorise far better than loops over
                # [a, e); masked keys are set to -inf before the max and to 0 after the exp.
                edge = a > 0 or e < BLOCK_N
                if softcap > 0:
                    for c in range(BLOCK_N):
                        s[r, c] = cap * math.tanh(s[r, c])
                if edge:
                    for c in range(a):
                        s[r, c] = neg_inf
                    for c in range(e, BLOCK_N):
                        s[r, c] = neg_inf
                mx = m_run[r]
                for c in range(BLOCK_N):
                    mx = max(mx, s[r, c])
                for c in range(BLOCK_N):
                    s[r, c] = _fast_exp(s[r, c] - mx)
                if edge:
                    for c in range(a):
                        s[r, c] = zero
                    for c in range(e, BLOCK_N):
                        s[r, c] = zero
                tot = zero
                for c in range(BLOCK_N):
                    tot += s[r, c]
                alpha = _fast_exp(m_run[r] - mx)
                l_run[r] = l_run[r] * alpha + tot
                m_run[r] = mx
                if alpha != 1:
                    for d in range(dp):
                        acc[r, d] *= alpha
            _axpy_tile(acc, s, kv_v[j0:j0 + BLOCK_N], ncols)
        for r in range(min(BLOCK_M, seqlen_q - i0)):
            if l_run[r] > 0:
                inv = 1 / l_run[r]
                for d in range(dp):
                    op[b, h, i0 + r, d] = acc[r, d] * inv
                lse[b, h, i0 + r] = m_run[r] + math.log(l_run[r])
            else:  # the row sees no key: FlashAttention's convention
                for d in range(dp):
                    op[b, h, i0 + r, d] = zero
                lse[b, h, i0 + r] = -neg_inf


@njit(inline="always", fastmath=_FASTMATH, cache=True)
def _probs_and_dscores(s, dpm, lse_row, delta_row, i0, j0, row_lo, row_hi, sc, cap, inv_cap, softcap):
    """Turn raw dot products into probabilities and score gradients for one (query tile, key tile) pair.

    s: (BM, BN) holds q.k on entry and P = exp(score - lse) on exit; dpm: (BM, BN) holds dO.v on entry and
    dS = P * (dP - delta) * dscore/draw * scale on exit (the gradient w.r.t. the raw dot product q.k).
    Entries outside a row's visible keys are set to 0 in both.
    """
    zero = _as_dtype_of(s, 0.0)
    one = _as_dtype_of(s, 1.0)
    for r in range(BLOCK_M):
        a = max(row_lo[r] - j0, 0)
        e = min(row_hi[r] - j0, BLOCK_N)
        if a >= e:
            for c in range(BLOCK_N):
                s[r, c] = zero
                dpm[r, c] = zero
            continue
        lr = lse_row[i0 + r]
        dl = delta_row[i0 + r]
        # Whole-width loops vectorise (see the forward); masked entries are computed, then zeroed.
        if softcap > 0:
            for c in range(BLOCK_N):
                t = math.tanh(s[r, c] * sc * inv_cap)
                p = _fast_exp(cap * t - lr)
                s[r, c] = p
                dpm[r, c] = p * (dpm[r, c] - dl) * (one - t * t) * sc
        else:
            for c in range(BLOCK_N):
                p = _fast_exp(s[r, c] * sc - lr)
                s[r, c] = p
                dpm[r, c] = p * (dpm[r, c] - dl) * sc
        for c in range(a):
            s[r, c] = zero
            dpm[r, c] = zero
        for c in range(e, BLOCK_N):
            s[r, c] = zero
            dpm[r, c] = zero


@njit(inline="always", cache=True)
def _query_tiles_seeing(j0, j1, seqlen_q, seqlen_k, left, right):
    """Query tiles ``[first, end)`` containing a row that may see a key in ``[j0, j1)``: key j is visible to row i
    iff ``j - off - right <= i <= j - off + left`` (off = Sk - Sq), each bound dropped when unbounded."""
    off = seqlen_k - seqlen_q
    i_lo = 0 if right < 0 else max(0, j0 - off - right)
    i_hi = seqlen_q if left < 0 else min(seqlen_q, j1 - 1 - off + left + 1)
    if i_lo >= i_hi:
        return 0, 0
    return i_lo // BLOCK_M, (i_hi + BLOCK_M - 1) // BLOCK_M


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _backward_kv_kernel(qp, kp, vp, dop, lse, delta, dqp, dkp, dvp, seqlen_q, seqlen_k, scale, left, right,
                        softcap, kt_per_unit, fuse_dq):
    """dK and dV (and, with ``fuse_dq``, dQ) over packed buffers.

    qp, dop, dqp: (B, Hq, Sq_pad, Dp); kp, vp, dkp, dvp: (B, Hkv, Sk_pad, Dp); lse, delta: (B, Hq, Sq_pad).
    One prange iteration per (batch, kv head, run of ``kt_per_unit`` key tiles). It sums dK/dV for its key tiles
    over every query head of the group and every query tile that sees them, and writes only those rows of dkp and
    dvp. dQ rows collect contributions from all key tiles, so they may be accumulated here (``fuse_dq``) only when
    one iteration owns all key tiles of its (batch, kv head): then it is also the only writer of its group's dQ,
    no two iterations touch the same memory, and the scores need not be recomputed in a second pass.
    """
    batch, nheads_q, sq_pad, dp = qp.shape
    nheads_kv, sk_pad = kp.shape[1], kp.shape[2]
    group = nheads_q // nheads_kv
    n_kt = sk_pad // BLOCK_N
    n_chunks = (n_kt + kt_per_unit - 1) // kt_per_unit
    sc = _as_dtype_of(qp, scale)
    cap = _as_dtype_of(qp, softcap)
    inv_cap = _as_dtype_of(qp, 1.0 / softcap if softcap > 0 else 0.0)
    for u in prange(batch * nheads_kv * n_chunks):
        b = u // (nheads_kv * n_chunks)
        hk = (u // n_chunks) % nheads_kv
        chunk = u % n_chunks
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        s = np.empty((BLOCK_M, BLOCK_N), qp.dtype)
        dpm = np.empty((BLOCK_M, BLOCK_N), qp.dtype)
        pt = np.empty((BLOCK_N, BLOCK_M), qp.dtype)
        dst = np.empty((BLOCK_N, BLOCK_M), qp.dtype)
        dk_acc = np.empty((BLOCK_N, dp), qp.dtype)
        dv_acc = np.empty((BLOCK_N, dp), qp.dtype)
        for kt in range(chunk * kt_per_unit, min(n_kt, (chunk + 1) * kt_per_unit)):
            j0 = kt * BLOCK_N
            kb = kp[b, hk, j0:j0 + BLOCK_N]
            vb = vp[b, hk, j0:j0 + BLOCK_N]
            dk_acc[:] = 0
            dv_acc[:] = 0
            qt_first, qt_end = _query_tiles_seeing(j0, min(j0 + BLOCK_N, seqlen_k), seqlen_q, seqlen_k, left, right)
            for h in range(hk * group, (hk + 1) * group):
                for qt in range(qt_first, qt_end):
                    i0 = qt * BLOCK_M
                    _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
                    qb = qp[b, h, i0:i0 + BLOCK_M]
                    dob = dop[b, h, i0:i0 + BLOCK_M]
                    _dot_tile(qb, kb, s)
                    _dot_tile(dob, vb, dpm)
                    _probs_and_dscores(s, dpm, lse[b, h], delta[b, h], i0, j0, row_lo, row_hi, sc, cap, inv_cap,
                                       softcap)
                    for r in range(BLOCK_M):
                        for c in range(BLOCK_N):
                            pt[c, r] = s[r, c]
                            dst[c, r] = dpm[r, c]
                    _axpy_tile(dv_acc, pt, dob, BLOCK_M)
                    _axpy_tile(dk_acc, dst, qb, BLOCK_M)
                    if fuse_dq:
                        _axpy_tile(dqp[b, h, i0:i0 + BLOCK_M], dpm, kb, BLOCK_N)
            dkp[b, hk, j0:j0 + BLOCK_N] = dk_acc
            dvp[b, hk, j0:j0 + BLOCK_N] = dv_acc


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _backward_dq_kernel(qp, kp, vp, dop, lse, delta, dqp, seqlen_q, seqlen_k, scale, left, right, softcap):
    """dQ over packed buffers, one prange iteration per (batch, query head, query tile): it recomputes P and dS for
    the key tiles its rows see and is the only writer of its dQ rows. Shapes as in ``_backward_kv_kernel``."""
    batch, nheads_q, sq_pad, dp = qp.shape
    nheads_kv = kp.shape[1]
    group = nheads_q // nheads_kv
    n_qt = sq_pad // BLOCK_M
    sc = _as_dtype_of(qp, scale)
    cap = _as_dtype_of(qp, softcap)
    inv_cap = _as_dtype_of(qp, 1.0 / softcap if softcap > 0 else 0.0)
    for u in prange(batch * nheads_q * n_qt):
        b = u // (nheads_q * n_qt)
        h = (u // n_qt) % nheads_q
        qt = u % n_qt
        hk = h // group
        i0 = qt * BLOCK_M
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        span_lo, span_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
        s = np.empty((BLOCK_M, BLOCK_N), qp.dtype)
        dpm = np.empty((BLOCK_M, BLOCK_N), qp.dtype)
        dq_acc = np.zeros((BLOCK_M, dp), qp.dtype)
        qb = qp[b, h, i0:i0 + BLOCK_M]
        dob = dop[b, h, i0:i0 + BLOCK_M]
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            kb = kp[b, hk, j0:j0 + BLOCK_N]
            _dot_tile(qb, kb, s)
            _dot_tile(dob, vp[b, hk, j0:j0 + BLOCK_N], dpm)
            _probs_and_dscores(s, dpm, lse[b, h], delta[b, h], i0, j0, row_lo, row_hi, sc, cap, inv_cap, softcap)
            _axpy_tile(dq_acc, dpm, kb, BLOCK_N)
        dqp[b, h, i0:i0 + BLOCK_M] = dq_acc


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _heads_major(x: np.ndarray, seq_multiple: int) -> np.ndarray | None:
    """The (B, H, S, D) buffer behind a (B, S, H, D) view when it already has the packed form (C-contiguous, S and
    D already multiples of the padding): the "bhsd" layout with aligned sizes needs no copy at all."""
    t = x.transpose(0, 2, 1, 3)
    if t.flags.c_contiguous and t.shape[2] % seq_multiple == 0 and t.shape[3] % _D_ALIGN == 0:
        return t
    return None


def _packed(x: np.ndarray, seq_multiple: int) -> np.ndarray:
    """(B, S, H, D) view -> (B, H, S_pad, D_pad) C-contiguous zero-padded array of the same dtype: a view of x's
    own buffer when it already has that form (never written to), else a new copy."""
    t = _heads_major(x, seq_multiple)
    if t is not None:
        return t
    batch, seqlen, nheads, hd = x.shape
    out = np.empty((batch, nheads, _padded(seqlen, seq_multiple), _padded(hd, _D_ALIGN)), dtype=x.dtype)
    _pack(x, out)
    return out


def _output_buffer(out: np.ndarray, seq_multiple: int) -> tuple[np.ndarray, bool]:
    """A packed (B, H, S_pad, D_pad) buffer to compute ``out`` in, and whether it must be copied back to ``out``
    afterwards (False when it is ``out``'s own memory)."""
    t = _heads_major(out, seq_multiple)
    if t is not None:
        return t, False
    batch, seqlen, nheads, hd = out.shape
    return np.empty((batch, nheads, _padded(seqlen, seq_multiple), _padded(hd, _D_ALIGN)), out.dtype), True


def _check_dtypes(*arrays: np.ndarray) -> np.dtype:
    dtype = arrays[0].dtype
    if dtype not in (np.float32, np.float64) or any(a.dtype != dtype for a in arrays):
        raise TypeError(f"numba_flash.cpu kernels need all arrays float32 or all float64, got "
                        f"{sorted({str(a.dtype) for a in arrays})}")
    return dtype


def flash_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray, scale: float,
                  window_left: int, window_right: int, softcap: float) -> None:
    """Exact attention forward, written into ``out`` and ``lse``.

    Arguments:
        q: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D) with Hq % Hkv == 0. Any strides; not modified.
        out: (B, Sq, Hq, D), any strides; written with the attention output.
        lse: (B, Hq, Sq) C-contiguous; written with the natural-log sum of exp(score) over visible keys, +inf for
            a row that sees no key (its output row is 0).
        All arrays float32, or all float64; accumulation is in that dtype.
        scale: multiplies q.k; window_left / window_right: -1 = unbounded (causal is right = 0);
        softcap: 0 = off, else scores become softcap * tanh(score / softcap).
    """
    _check_dtypes(q, k, v, out, lse)
    qp = _packed(q, BLOCK_M)
    kp = _packed(k, BLOCK_N)
    vp = _packed(v, BLOCK_N)
    op, copy_back = _output_buffer(out, BLOCK_M)
    _forward_kernel(qp, kp, vp, op, lse, q.shape[1], k.shape[1], float(scale), int(window_left),
                    int(window_right), float(softcap))
    if copy_back:
        _unpack(op, out)


def flash_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                   lse: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, scale: float,
                   window_left: int, window_right: int, softcap: float) -> None:
    """Gradients of ``sum(out * dout)`` with respect to q, k and v, written into dq, dk, dv.

    Arguments:
        dout, q, out: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); any strides, not modified.
        lse: (B, Hq, Sq), as written by ``flash_forward`` (+inf for rows that see no key).
        dq: (B, Sq, Hq, D); dk, dv: (B, Sk, Hkv, D); any strides, contents ignored and overwritten. With GQA the
            gradients of a kv head are summed over the query heads of its group.
        All arrays float32, or all float64. scale, window_left, window_right, softcap as in ``flash_forward``.
    """
    dtype = _check_dtypes(dout, q, k, v, out, lse, dq, dk, dv)
    batch, seqlen_q, nheads_q, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    qp = _packed(q, BLOCK_M)
    dop = _packed(dout, BLOCK_M)
    kp = _packed(k, BLOCK_N)
    vp = _packed(v, BLOCK_N)
    sq_pad = qp.shape[2]
    # delta_i = dO_i . O_i, the row term of the softmax gradient; padded rows get lse = +inf so that P = 0 there.
    delta = np.zeros((batch, nheads_q, sq_pad), dtype)
    delta[:, :, :seqlen_q] = np.einsum("bshd,bshd->bhs", dout, out)
    lse_p = np.full((batch, nheads_q, sq_pad), np.inf, dtype)
    lse_p[:, :, :seqlen_q] = lse
    dkp, dk_back = _output_buffer(dk, BLOCK_N)
    dvp, dv_back = _output_buffer(dv, BLOCK_N)
    n_kt = kp.shape[2] // BLOCK_N
    # Fusing dQ into the key-tile pass saves recomputing P and dS, but it needs one iteration per (batch, kv head)
    # to own all key tiles; do it only when there are enough of those to keep every thread busy.
    fuse_dq = batch * nheads_kv >= 2 * numba.get_num_threads()
    dqp, dq_back = _output_buffer(dq, BLOCK_M)
    if fuse_dq:
        dqp[:] = 0
    _backward_kv_kernel(qp, kp, vp, dop, lse_p, delta, dqp, dkp, dvp, seqlen_q, seqlen_k, float(scale),
                        int(window_left), int(window_right), float(softcap), n_kt if fuse_dq else 1, fuse_dq)
    if not fuse_dq:
        _backward_dq_kernel(qp, kp, vp, dop, lse_p, delta, dqp, seqlen_q, seqlen_k, float(scale),
                            int(window_left), int(window_right), float(softcap))
    for packed, user, back in ((dqp, dq, dq_back), (dkp, dk, dk_back), (dvp, dv, dv_back)):
        if back:
            _unpack(packed, user)
