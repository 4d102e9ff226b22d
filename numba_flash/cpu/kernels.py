"""Tiled FlashAttention-2 forward and backward for the CPU, as ``numba.njit(parallel=True)`` kernels.

How the work is laid out:

* The host wrappers first copy q, k, v (and dout) into packed ``(B, H, S_pad, D_pad)`` buffers, zero-padded so
  that S_pad is a multiple of the tile size and D_pad a multiple of 16 (two AVX2 vectors of float32). K (and, for
  the backward, V) is also packed tile by tile transposed, ``(B, H, S_pad / BLOCK_N, D_pad, BLOCK_N)``. This
  costs O(B*H*S*D) memory and time (nothing for a C-contiguous "bhsd" q/v/out with aligned sizes), makes every
  tile a fixed-size, unit-stride block, and means the big kernels are compiled for exactly one array type per
  dtype whatever the strides of the caller's views.
* Every matrix product is ``C (+)= A @ B`` (``_mm``) or ``C (+)= A^T @ B`` (``_mm_at``) with B and C row-major,
  run by a 4x16 register-blocked outer-product micro-kernel written directly in LLVM IR (``_mm_block_codegen``):
  eight 8-wide accumulators stay in registers over the whole reduction, each step is four broadcasts, two vector
  loads and eight FMAs, and there are no horizontal sums. ``Q K^T`` and ``dO V^T`` read the transposed K/V
  tiles; ``P^T dO`` and ``dS^T Q`` read P and dS in place through ``_mm_at`` (no transposed copies). The blocks
  are visited column-block-major, so the B panel in use (kdim x 16) stays in L1 while A streams as broadcasts.
  (Plain Python loop nests for these shapes come out as dot products with a horizontal sum each, or not
  vectorised at all, at about half the speed.)
* ``exp`` for float32 is a polynomial on the bits of the float (``_fast_exp``, ``_fast_exp2_nonpos``) because
  ``math.exp`` is a scalar libm call that LLVM cannot vectorise and would cost as much as the matrix products.
  The forward keeps scores in base 2 (log2 e folded into the query scale) so its exp is the cheaper exp2; row
  maxima and sums are vector trees (``_row_max``, ``_row_sum``), since LLVM leaves a max reduction that may see
  -inf as a serial scalar chain.
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
from numba.core import cgutils
from numba.extending import intrinsic, overload

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile
_D_ALIGN = 16  # head dim padded to a multiple of the micro-kernel width (two float32 AVX2 vectors)

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


_EXP2_MIN = np.float32(-126.0)  # 2^-126 is the smallest normal float32
_E1 = np.float32(0.6931471805599453)  # ln(2)^k / k!: 2^f = exp(f ln 2) as a polynomial in f directly
_E2 = np.float32(0.6931471805599453 ** 2 / 2)
_E3 = np.float32(0.6931471805599453 ** 3 / 6)
_E4 = np.float32(0.6931471805599453 ** 4 / 24)
_E5 = np.float32(0.6931471805599453 ** 5 / 120)
_E6 = np.float32(0.6931471805599453 ** 6 / 720)


def _fast_exp2_nonpos(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_fast_exp2_nonpos, inline="always")
def _fast_exp2_nonpos_impl(x):
    if x == types.float32:
        def impl(x):
            # 2^x for x <= 0 (the forward only ever exponentiates score - running max). Working in base 2 (log2(e)
            # folded into the query scale) saves the multiply and the two-step ln 2 range reduction of _fast_exp:
            # n = round(x), |f| <= 1/2, degree-6 Taylor of exp(f ln 2) is within ~2 ulp. -inf clamps to 2^-126.
            x = max(x, _EXP2_MIN)
            n = np.floor(x + _HALF)
            f = x - n
            p = _ONE + f * (_E1 + f * (_E2 + f * (_E3 + f * (_E4 + f * (_E5 + f * _E6)))))
            return p * _pow2_f32(n)
        return impl
    if x == types.float64:
        def impl(x):
            return math.exp(x * 0.6931471805599453)
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


_MR = 4    # rows of C per register block
_NR = 16   # columns of C per register block: two AVX2 vectors of float32


def _mm_block_codegen(a_transposed):
    """LLVM IR for C[i:i+4, j:j+16] (+)= A[i:i+4, :kdim] @ B[:kdim, j:j+16] on float32 arrays whose last axis is
    unit-stride, A given as is or (``a_transposed``) as A^T, shape (kdim, >= i+4).

    Written as IR because neither of LLVM's vectorisers finds this shape in a Python loop nest: the eight 8-wide
    accumulators stay in registers for the whole k loop, each step broadcasting four A values, loading two B
    vectors and issuing eight FMAs, so loads stay below FMAs and no horizontal sum is ever needed."""
    def codegen(context, builder, signature, args):
        cty, aty, bty, ity, jty, kty, accty = signature.args
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        arrs = [context.make_array(t)(context, builder, v) for t, v in zip((cty, aty, bty), args[:3])]
        bases = [builder.bitcast(x.data, i8p) for x in arrs]
        rs = [cgutils.unpack_tuple(builder, x.strides, 2)[0] for x in arrs]
        ii = context.cast(builder, args[3], ity, types.int64)
        jj = context.cast(builder, args[4], jty, types.int64)
        kd = context.cast(builder, args[5], kty, types.int64)
        acc_flag = context.cast(builder, args[6], accty, types.boolean)
        four = ir.Constant(i64, 4)

        def addr(base, row, rstride, col, ty):
            off = builder.add(builder.mul(row, rstride), builder.mul(col, four))
            return builder.bitcast(builder.gep(base, [off]), ty.as_pointer())

        def vload(p):
            return builder.load(p, align=4)

        accs = [[cgutils.alloca_once(builder, v8) for _ in range(2)] for _ in range(_MR)]
        cptr = [[addr(bases[0], builder.add(ii, ir.Constant(i64, r)), rs[0],
                      builder.add(jj, ir.Constant(i64, 8 * h)), v8) for h in range(2)] for r in range(_MR)]
        with builder.if_else(acc_flag) as (then, otherwise):
            with then:
                for r in range(_MR):
                    for h in range(2):
                        builder.store(vload(cptr[r][h]), accs[r][h])
            with otherwise:
                for r in range(_MR):
                    for h in range(2):
                        builder.store(ir.Constant(v8, None), accs[r][h])
        zero_mask = ir.Constant(ir.VectorType(ir.IntType(32), 8), None)
        with cgutils.for_range(builder, kd) as loop:
            k = loop.index
            b0 = vload(addr(bases[2], k, rs[2], jj, v8))
            b1 = vload(addr(bases[2], k, rs[2], builder.add(jj, ir.Constant(i64, 8)), v8))
            for r in range(_MR):
                if a_transposed:
                    av = builder.load(addr(bases[1], k, rs[1], builder.add(ii, ir.Constant(i64, r)), f32))
                else:
                    av = builder.load(addr(bases[1], builder.add(ii, ir.Constant(i64, r)), rs[1], k, f32))
                bc = builder.shuffle_vector(builder.insert_element(ir.Constant(v8, ir.Undefined), av,
                                                                   ir.Constant(ir.IntType(32), 0)),
                                            ir.Constant(v8, ir.Undefined), zero_mask)
                for h, bv in enumerate((b0, b1)):
                    # 'contract' lets LLVM fuse into an FMA where the target has one (and stay correct where it has not)
                    prod = builder.fmul(bc, bv, flags=("contract",))
                    builder.store(builder.fadd(builder.load(accs[r][h]), prod, flags=("contract",)), accs[r][h])
        for r in range(_MR):
            for h in range(2):
                builder.store(builder.load(accs[r][h]), cptr[r][h], align=4)
        return context.get_dummy_value()

    return codegen


def _unit_stride_f32(*arrays) -> bool:
    """Whether every array is a 2-D C-contiguous float32 array: what the IR micro-kernels assume about strides."""
    return all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 and x.layout == "C"
               for x in arrays)


def _mm_block_sig(c, a, b, i, j, kdim, accumulate):
    if not _unit_stride_f32(c, a, b):
        return None
    return types.none(c, a, b, i, j, kdim, accumulate)


@intrinsic
def _mm_block_f32(typingctx, c, a, b, i, j, kdim, accumulate):
    """C[i:i+4, j:j+16] (+)= A[i:i+4, :kdim] @ B[:kdim, j:j+16], float32, rows unit-stride."""
    sig = _mm_block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False))


@intrinsic
def _mm_block_at_f32(typingctx, c, at, b, i, j, kdim, accumulate):
    """C[i:i+4, j:j+16] (+)= AT[:kdim, i:i+4]^T @ B[:kdim, j:j+16], float32, rows unit-stride."""
    sig = _mm_block_sig(c, at, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(True))


def _mm(c, a, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) a[:, :kdim] @ b[:kdim] for 2-D arrays with unit-stride rows: c (R, N), a (R, >= kdim),
    b (>= kdim, N); R % 4 == 0 and N % 16 == 0."""
    raise NotImplementedError


def _mm_at(c, at, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) at[:kdim].T @ b[:kdim] for 2-D arrays with unit-stride rows: c (R, N), at (>= kdim, R),
    b (>= kdim, N); R % 4 == 0 and N % 16 == 0. Saves transposing P and dS in the backward."""
    raise NotImplementedError


@overload(_mm_at, inline="never")
def _mm_at_impl(c, at, b, kdim, accumulate):
    if _unit_stride_f32(c, at, b):
        def impl(c, at, b, kdim, accumulate):
            for j in range(0, c.shape[1], _NR):
                for i in range(0, c.shape[0], _MR):
                    _mm_block_at_f32(c, at, b, i, j, kdim, accumulate)
        return impl

    def impl(c, at, b, kdim, accumulate):
        if not accumulate:
            c[:] = 0
        for k in range(kdim):
            for i in range(c.shape[0]):
                aik = at[k, i]
                for j in range(c.shape[1]):
                    c[i, j] += aik * b[k, j]
    return impl


@overload(_mm, inline="never")
def _mm_impl(c, a, b, kdim, accumulate):
    if _unit_stride_f32(c, a, b):
        def impl(c, a, b, kdim, accumulate):
            for j in range(0, c.shape[1], _NR):
                for i in range(0, c.shape[0], _MR):
                    _mm_block_f32(c, a, b, i, j, kdim, accumulate)
        return impl

    def impl(c, a, b, kdim, accumulate):
        if not accumulate:
            c[:] = 0
        for i in range(c.shape[0]):
            for k in range(kdim):
                aik = a[i, k]
                for j in range(c.shape[1]):
                    c[i, j] += aik * b[k, j]
    return impl


def _row_reduce_codegen(kind):
    def codegen(context, builder, signature, args):
        sty, rty, ity = signature.args
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        i8p = ir.IntType(8).as_pointer()
        arr = context.make_array(sty)(context, builder, args[0])
        rstride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        row = context.cast(builder, args[1], rty, types.int64)
        init = context.cast(builder, args[2], ity, types.float32)
        base = builder.gep(builder.bitcast(arr.data, i8p), [builder.mul(row, rstride)])
        vptr = builder.bitcast(base, v8.as_pointer())
        vals = [builder.load(builder.gep(vptr, [ir.Constant(ir.IntType(64), g)]), align=4)
                for g in range(BLOCK_N // 8)]
        if kind == "max":
            vfn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8, v8]), "llvm.maxnum.v8f32")
            sfn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]), "llvm.maxnum.f32")
            vop = lambda x, y: builder.call(vfn, [x, y])  # noqa: E731
            sop = lambda x, y: builder.call(sfn, [x, y])  # noqa: E731
        else:
            vop = builder.fadd
            sop = builder.fadd
        while len(vals) > 1:  # a tree: independent operations, no serial dependency chain
            vals = [vop(vals[g], vals[g + 1]) for g in range(0, len(vals), 2)]
        lanes = [builder.extract_element(vals[0], ir.Constant(ir.IntType(32), x)) for x in range(8)]
        while len(lanes) > 1:
            lanes = [sop(lanes[g], lanes[g + 1]) for g in range(0, len(lanes), 2)]
        return sop(lanes[0], init)
    return codegen


@intrinsic
def _row_max_f32(typingctx, s, r, init):
    """max(init, max(s[r, :BLOCK_N])) for a float32 2-D array with unit-stride rows. A vector tree: LLVM will not
    vectorise a max reduction without the no-NaN flag, which the -inf masking cannot allow; -inf compares fine here."""
    if not _unit_stride_f32(s):
        return None
    return types.float32(s, r, init), _row_reduce_codegen("max")


@intrinsic
def _row_sum_f32(typingctx, s, r, init):
    """init + sum(s[r, :BLOCK_N]) for a float32 2-D array with unit-stride rows, summed as a vector tree."""
    if not _unit_stride_f32(s):
        return None
    return types.float32(s, r, init), _row_reduce_codegen("sum")


def _row_max(s, r, init):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


def _row_sum(s, r, init):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_row_max, inline="always")
def _row_max_impl(s, r, init):
    if _unit_stride_f32(s):
        return lambda s, r, init: _row_max_f32(s, r, init)

    def impl(s, r, init):
        mx = init
        for c in range(BLOCK_N):
            mx = max(mx, s[r, c])
        return mx
    return impl


@overload(_row_sum, inline="always")
def _row_sum_impl(s, r, init):
    if _unit_stride_f32(s):
        return lambda s, r, init: _row_sum_f32(s, r, init)

    def impl(s, r, init):
        tot = init
        for c in range(BLOCK_N):
            tot += s[r, c]
        return tot
    return impl


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


@njit(parallel=True, cache=True)
def _pack_kt(src, dst):
    """dst[b, h, t, d, c] = src[b, t * BN + c, h, d], zero in the padding. src (B, S, H, D) any strides;
    dst (B, H, n_tiles, Dp, BN)."""
    batch, seqlen, nheads, hd = src.shape
    n_t, dp, bn = dst.shape[2], dst.shape[3], dst.shape[4]
    for u in prange(batch * nheads * n_t):
        b = u // (nheads * n_t)
        h = (u // n_t) % nheads
        t = u % n_t
        blk = dst[b, h, t]
        blk[:] = 0
        for c in range(min(bn, seqlen - t * bn)):
            for d in range(hd):
                blk[d, c] = src[b, t * bn + c, h, d]


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _forward_kernel(qp, ktp, vp, op, lse, seqlen_q, seqlen_k, scale, left, right, softcap):
    """Online-softmax forward over packed buffers.

    qp, op: (B, Hq, Sq_pad, Dp); ktp: (B, Hkv, Sk_pad / BLOCK_N, Dp, BLOCK_N), K transposed tile by tile;
    vp: (B, Hkv, Sk_pad, Dp); lse: (B, Hq, Sq) -- all one float dtype.
    One prange iteration per (batch, query head, query tile): each writes its own rows of op and lse only.
    """
    batch, nheads_q, sq_pad, dp = qp.shape
    nheads_kv = ktp.shape[1]
    group = nheads_q // nheads_kv
    bm = BLOCK_M
    n_qt = sq_pad // bm
    sc = _as_dtype_of(qp, scale)
    cap = _as_dtype_of(qp, softcap)
    inv_cap = _as_dtype_of(qp, 1.0 / softcap if softcap > 0 else 0.0)
    log2e = _as_dtype_of(qp, 1.4426950408889634)
    ln2 = _as_dtype_of(qp, 0.6931471805599453)
    cap2 = _as_dtype_of(qp, softcap * 1.4426950408889634)
    neg_inf = _as_dtype_of(qp, -np.inf)
    zero = _as_dtype_of(qp, 0.0)
    for u in prange(batch * nheads_q * n_qt):
        b = u // (nheads_q * n_qt)
        h = (u // n_qt) % nheads_q
        qt = u % n_qt
        hk = h // group
        i0 = qt * bm
        row_lo = np.empty(bm, np.int64)
        row_hi = np.empty(bm, np.int64)
        span_lo, span_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
        # Scores are kept in base-2 units (times log2 e) so that the softmax needs exp2, which is cheaper.
        qscale = sc * inv_cap if softcap > 0 else sc * log2e
        qs = np.empty((bm, dp), qp.dtype)
        for r in range(bm):
            for d in range(dp):
                qs[r, d] = qp[b, h, i0 + r, d] * qscale
        s = np.empty((bm, BLOCK_N), qp.dtype)
        acc = np.zeros((bm, dp), qp.dtype)
        m_run = np.full(bm, neg_inf, qp.dtype)
        l_run = np.zeros(bm, qp.dtype)
        kv_v = vp[b, hk]
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            _mm(s, qs, ktp[b, hk, kt], dp, False)
            ncols = min(BLOCK_N, ((span_hi - j0 + 3) // 4) * 4)
            for r in range(bm):
                a = max(row_lo[r] - j0, 0)
                e = min(row_hi[r] - j0, BLOCK_N)
                if a >= e:
                    for c in range(BLOCK_N):
                        s[r, c] = zero
                    continue
                edge = a > 0 or e < BLOCK_N
                if softcap > 0:
                    for c in range(BLOCK_N):
                        s[r, c] = cap2 * math.tanh(s[r, c])
                if edge:
                    for c in range(a):
                        s[r, c] = neg_inf
                    for c in range(e, BLOCK_N):
                        s[r, c] = neg_inf
                mx = _row_max(s, r, m_run[r])
                for c in range(BLOCK_N):
                    s[r, c] = _fast_exp2_nonpos(s[r, c] - mx)
                if edge:
                    for c in range(a):
                        s[r, c] = zero
                    for c in range(e, BLOCK_N):
                        s[r, c] = zero
                tot = _row_sum(s, r, zero)
                alpha = _fast_exp2_nonpos(m_run[r] - mx)
                l_run[r] = l_run[r] * alpha + tot
                m_run[r] = mx
                if alpha != 1:
                    for d in range(dp):
                        acc[r, d] *= alpha
            _mm(acc, s, kv_v[j0:j0 + BLOCK_N], ncols, True)
        for r in range(min(bm, seqlen_q - i0)):
            if l_run[r] > 0:
                inv = 1 / l_run[r]
                for d in range(dp):
                    op[b, h, i0 + r, d] = acc[r, d] * inv
                lse[b, h, i0 + r] = m_run[r] * ln2 + math.log(l_run[r])
            else:
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
def _backward_kv_kernel(qp, kp, ktp, vtp, dop, lse, delta, dqp, dkp, dvp, seqlen_q, seqlen_k, scale, left, right,
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
        dk_acc = np.empty((BLOCK_N, dp), qp.dtype)
        dv_acc = np.empty((BLOCK_N, dp), qp.dtype)
        for kt in range(chunk * kt_per_unit, min(n_kt, (chunk + 1) * kt_per_unit)):
            j0 = kt * BLOCK_N
            kb = kp[b, hk, j0:j0 + BLOCK_N]
            ktb = ktp[b, hk, kt]
            vtb = vtp[b, hk, kt]
            dk_acc[:] = 0
            dv_acc[:] = 0
            qt_first, qt_end = _query_tiles_seeing(j0, min(j0 + BLOCK_N, seqlen_k), seqlen_q, seqlen_k, left, right)
            for h in range(hk * group, (hk + 1) * group):
                for qt in range(qt_first, qt_end):
                    i0 = qt * BLOCK_M
                    _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
                    qb = qp[b, h, i0:i0 + BLOCK_M]
                    dob = dop[b, h, i0:i0 + BLOCK_M]
                    _mm(s, qb, ktb, dp, False)
                    _mm(dpm, dob, vtb, dp, False)
                    _probs_and_dscores(s, dpm, lse[b, h], delta[b, h], i0, j0, row_lo, row_hi, sc, cap, inv_cap,
                                       softcap)
                    _mm_at(dv_acc, s, dob, BLOCK_M, True)
                    _mm_at(dk_acc, dpm, qb, BLOCK_M, True)
                    if fuse_dq:
                        _mm(dqp[b, h, i0:i0 + BLOCK_M], dpm, kb, BLOCK_N, True)
            dkp[b, hk, j0:j0 + BLOCK_N] = dk_acc
            dvp[b, hk, j0:j0 + BLOCK_N] = dv_acc


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _backward_dq_kernel(qp, kp, ktp, vtp, dop, lse, delta, dqp, seqlen_q, seqlen_k, scale, left, right, softcap):
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
            _mm(s, qb, ktp[b, hk, kt], dp, False)
            _mm(dpm, dob, vtp[b, hk, kt], dp, False)
            _probs_and_dscores(s, dpm, lse[b, h], delta[b, h], i0, j0, row_lo, row_hi, sc, cap, inv_cap, softcap)
            _mm(dq_acc, dpm, kb, BLOCK_N, True)
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


def _packed_transposed(x: np.ndarray) -> np.ndarray:
    """(B, S, H, D) view -> (B, H, S_pad / BLOCK_N, D_pad, BLOCK_N): each key tile transposed, so that ``Q K^T``
    runs through the same outer-product micro-kernel as ``P V``, zero-padded like ``_packed``."""
    batch, seqlen, nheads, hd = x.shape
    out = np.empty((batch, nheads, _padded(seqlen, BLOCK_N) // BLOCK_N, _padded(hd, _D_ALIGN), BLOCK_N), x.dtype)
    _pack_kt(x, out)
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
    ktp = _packed_transposed(k)
    vp = _packed(v, BLOCK_N)
    op, copy_back = _output_buffer(out, BLOCK_M)
    _forward_kernel(qp, ktp, vp, op, lse, q.shape[1], k.shape[1], float(scale), int(window_left),
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
    ktp = _packed_transposed(k)
    vtp = _packed_transposed(v)
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
    _backward_kv_kernel(qp, kp, ktp, vtp, dop, lse_p, delta, dqp, dkp, dvp, seqlen_q, seqlen_k, float(scale),
                        int(window_left), int(window_right), float(softcap), n_kt if fuse_dq else 1, fuse_dq)
    if not fuse_dq:
        _backward_dq_kernel(qp, kp, ktp, vtp, dop, lse_p, delta, dqp, seqlen_q, seqlen_k, float(scale),
                            int(window_left), int(window_right), float(softcap))
    for packed, user, back in ((dqp, dq, dq_back), (dkp, dk, dk_back), (dvp, dv, dv_back)):
        if back:
            _unpack(packed, user)
