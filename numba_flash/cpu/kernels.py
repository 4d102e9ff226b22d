"""Tiled FlashAttention-2 forward and backward for the CPU, as ``numba.njit(parallel=True)`` kernels.

How the work is laid out:

* Scores are computed transposed, one (key tile x query tile) block at a time: ``S^T = K Q^T``, shape
  (BLOCK_N, BLOCK_M). The softmax statistics of a query (running max, running sum, the rescale factor) then sit
  along a row of the block, so the online-softmax updates are elementwise vector operations over 64 queries instead
  of horizontal reductions; and every product of the forward and backward reads K, V, Q and dO as they are stored,
  one row per key or query with the head dim contiguous:

      forward   S^T = K Q^T       O += P V            (P read as P^T)
      backward  S^T = K Q^T       dP^T = V dO^T       dV += P^T dO      dK += dS^T Q      dQ += dS K

  Only Q^T and dO^T tiles are built (the forward transposes each query tile once; the backward packs them once per
  call). K, V (and, for the backward, Q and dO) are read in place from a head-major ``(B, H, S, D_pad)`` buffer:
  the caller's own array when it already is one (contiguous "bhsd" with D a multiple of 16), else a copy made once
  per call (``_head_major``). Extra memory is O(B*H*S*D); the S x S matrix is never stored: per thread there is one
  score block and one accumulator tile.
* Every product is ``C (+)= A @ B`` (``_mm``) or ``C (+)= A^T @ B`` (``_mm_at``) with row-major B and C, run by a
  register-blocked outer-product micro-kernel written in LLVM IR (``_mm_block_codegen``): MR rows of C times two
  vectors of columns stay in registers for the whole reduction, each step broadcasting MR values of A, loading two
  vectors of B and issuing 2*MR fused multiply-adds. On CPUs with AVX-512 the block is 8 x 32 in 512-bit vectors,
  elsewhere 4 x 16 in 256-bit vectors (LLVM splits those where vectors are narrower). Python loop nests for these
  shapes compile to dot products with a horizontal sum each, at about half the speed of the 256-bit block and a
  third of the 512-bit one.
* ``exp`` is a polynomial on the bits of the float (``_fast_exp2``) because ``math.exp`` is a scalar libm call that
  LLVM cannot vectorise. Scores stay in natural-log units; ``_fast_exp`` turns score - max into base 2.
* Tiles entirely outside the causal/window band are never visited (loop bounds); only tiles that straddle the
  band's edge are masked.
* Accuracy, float32 against torch's (issue 16; ``tools/accuracy_vs_torch.py``): the backward recomputes P as
  exp(score - row max) / row sum with the statistics of a stats-only forward pass over the forward's own scores,
  not from the float32 lse; head-dim dot products are summed in chunks of ``_DOT_CHUNK``; sums across tiles
  (P V and row sums over key tiles, dK / dV / dQ over query or key tiles) are formed per tile and then added.

The kernels take (B, S, H, D) views with any strides and are compiled once per dtype (float32, float64) with
layout-generic array types (``_entry``), so "bshd", "bhsd" and strided inputs share one cached compilation.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from typing import Any, Callable

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from numba_flash.semantics import clamp_window_bound, effective_softcap

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile
_D_ALIGN = 16  # head dims are padded to a multiple of this in the accumulators (a 512-bit vector of float32)

# No 'nnan'/'ninf': the online softmax relies on -inf and +inf comparing correctly.
_FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

SIMD_ENV = "NUMBA_FLASH_CPU_SIMD"


def _simd_lanes() -> int:
    """float32 lanes of the vectors the micro-kernel is written with: 16 where the CPU numba compiles for has
    AVX-512, else 8. ``NUMBA_FLASH_CPU_SIMD=256`` forces the 256-bit kernel (for testing it on an AVX-512 CPU)."""
    forced = os.environ.get(SIMD_ENV, "").strip()
    if forced in ("256", "avx2"):
        return 8
    if forced in ("512", "avx512"):
        return 16
    features = numba.config.CPU_FEATURES
    if features is None:
        try:
            from llvmlite import binding as llvm

            features = llvm.get_host_cpu_features().flatten()
        except Exception:  # a host llvmlite cannot describe: the narrow kernel runs everywhere
            return 8
    return 16 if "+avx512f" in features.split(",") else 8


_LANES = _simd_lanes()
_MR = 8 if _LANES == 16 else 4  # rows of C per register block: 2 * MR accumulators, 16 of the 32 zmm / 8 of 16 ymm
_NR = 2 * _LANES  # columns of C per register block

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_EXP2_MIN = np.float32(-127.0)  # 2^-127 comes out of _pow2_f32 as exactly 0: masked scores give p = 0, not ~1e-38
_EXP2_MAX = np.float32(127.0)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_E1 = np.float32(_LN2)  # ln(2)^k / k!: 2^f = exp(f ln 2) as a polynomial in f
_E2 = np.float32(_LN2 ** 2 / 2)
_E3 = np.float32(_LN2 ** 3 / 6)
_E4 = np.float32(_LN2 ** 4 / 24)
_E5 = np.float32(_LN2 ** 5 / 120)
_E6 = np.float32(_LN2 ** 6 / 720)
_E7 = np.float32(_LN2 ** 7 / 5040)  # degree 7: degree 6 alone is 1.2e-7 (2 ulp, one-signed) short at |f| = 1/2


# n + 1.5 * 2**23 holds the integer n in its low mantissa bits (for |n| < 2**22): bitcast, minus these bits, is n.
_ROUND_MAGIC = 12582912.0
_MAGIC_BITS_MINUS_BIAS = 0x4B400000 - 127


def _pow2_bits(builder, n, fty, ity):
    """IR: 2**n for float ``n`` (scalar or vector type ``fty``, ints ``ity``) holding an integer in [-127, 127],
    built from the exponent bits; n = -127 gives the bit pattern of +0.0. The integer comes from the bits of
    ``n + 1.5 * 2**23`` rather than from fptosi, whose result for a NaN is poison in LLVM: a NaN n gives some
    defined bit pattern here, and the NaN of the polynomial it multiplies carries on."""
    lanes = getattr(fty, "count", None)

    def const(ty, x):
        return ir.Constant(ty, [x] * lanes if lanes else x)

    t = builder.fadd(n, const(fty, _ROUND_MAGIC))
    bits = builder.sub(builder.bitcast(t, ity), const(ity, _MAGIC_BITS_MINUS_BIAS))
    return builder.bitcast(builder.shl(bits, const(ity, 23)), fty)


@intrinsic
def _pow2_f32(typingctx, n):
    """2**n as float32 for a float32 ``n`` holding an integer in [-127, 127] (see ``_pow2_bits``)."""
    if n != types.float32:
        return None
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        return _pow2_bits(builder, args[0], ir.FloatType(), ir.IntType(32))

    return sig, codegen


def _fast_exp2(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_fast_exp2, inline="always")
def _fast_exp2_impl(x):
    if x == types.float32:
        def impl(x):
            # n = round(x), |f| <= 1/2, and a degree-7 Taylor polynomial of exp(f ln 2) is within ~1 ulp. Pure
            # arithmetic, so loops over it vectorise. -inf (a masked score, or lse = +inf for a row that sees no
            # key) clamps to -127 and comes out as exactly 0. A NaN (a poisoned row's lse) stays NaN, never a
            # probability of 0: max and min return their first argument unless the second compares larger/smaller
            # (Python's semantics, which numba keeps), so x must stay first.
            c = min(max(x, _EXP2_MIN), _EXP2_MAX)
            n = np.floor(c + _HALF)
            f = c - n
            p = _ONE + f * (_E1 + f * (_E2 + f * (_E3 + f * (_E4 + f * (_E5 + f * (_E6 + f * _E7))))))
            return p * _pow2_f32(n)
        return impl
    if x == types.float64:
        def impl(x):
            return math.exp(x * _LN2)
        return impl
    return None


@njit(inline="always", cache=True)
def _capped(x, softcap):
    """(softcap * tanh(x / softcap) in x's dtype, tanh in float64) for a raw score x: the capped score computed in
    float64 and rounded once, where float32 steps (x * (1 / softcap), tanh, * softcap) round three times, the first
    with a systematic error (1 / 50 is not a float32) and numba's float32 tanh off by up to 2 ulp. The forward and
    the backward both call this, so that the backward's recomputed scores are the forward's to the bit."""
    t = math.tanh(np.float64(x) / softcap)
    return type(x)(softcap * t), t


def _fma(a, b, c):  # pragma: no cover - typed by the intrinsic below
    raise NotImplementedError


@intrinsic
def _fma_intrinsic(typingctx, a, b, c):
    """a * b + c with one rounding (llvm.fma), float32 or float64."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None
    sig = a(a, b, c)

    def codegen(context, builder, signature, args):
        ty = context.get_value_type(signature.return_type)
        name = "llvm.fma.f32" if signature.return_type == types.float32 else "llvm.fma.f64"
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty, ty, ty]), name)
        return builder.call(fn, args)

    return sig, codegen


@overload(_fma, inline="always")
def _fma_impl(a, b, c):
    return lambda a, b, c: _fma_intrinsic(a, b, c)


def _fast_exp(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


_LOG2E_F32 = np.float32(_LOG2E)


@overload(_fast_exp, inline="always")
def _fast_exp_impl(x):
    """exp(x) for x <= 0 (or -inf, NaN): ``_fast_exp2(x * log2 e)`` in float32. The kernels apply it to differences
    score - row max only, so that the rounding of log2 e (1.3e-8 relative) scales |score - max|, which is small
    wherever P is not, rather than the score itself: scores kept in base 2 carried that rounding, and the one of
    the base-2 scale, into every score, an error as large as the scores (at softcap 50, 4e-6 in P)."""
    if x == types.float32:
        return lambda x: _fast_exp2(x * _LOG2E_F32)
    if x == types.float64:
        return lambda x: math.exp(x)
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


# ---------------------------------------------------------------------------------------------------------------
# The micro-kernel


def _mm_block_codegen(a_transposed: bool, nvec: int, mr: int = _MR, chunk: int = 0) -> Callable:
    """LLVM IR for C[i:i+MR, j:j+nvec*LANES] (+)= A[i:i+MR, :kdim] @ B[:kdim, j:j+nvec*LANES] on float32 2-D arrays
    whose last axis is unit-stride, A given as is or (``a_transposed``) as A^T, shape (kdim, >= i+MR).

    Written as IR because neither of LLVM's vectorisers finds this shape in a Python loop nest: the MR * nvec
    accumulators stay in registers for the whole k loop, each step broadcasting MR values of A, loading nvec vectors
    of B and issuing MR * nvec multiply-adds, so loads stay below FMAs and no horizontal sum is ever needed.

    With ``chunk`` (the accumulate flag is then ignored: C is written), the reduction runs in chunks of that many
    steps, each from fresh accumulators, and C = chunk 0, then C = C + chunk i in order (see ``_mm_dot``)."""
    lanes = _LANES

    def codegen(context, builder, signature, args):
        cty, aty, bty, ity, jty, kty, accty = signature.args
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, lanes)
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

        def col(h):
            return builder.add(jj, ir.Constant(i64, lanes * h))

        accs = [[cgutils.alloca_once(builder, vty) for _ in range(nvec)] for _ in range(mr)]
        cptr = [[addr(bases[0], builder.add(ii, ir.Constant(i64, r)), rs[0], col(h), vty) for h in range(nvec)]
                for r in range(mr)]
        zero_mask = ir.Constant(ir.VectorType(ir.IntType(32), lanes), None)

        def zero_accs():
            for r in range(mr):
                for h in range(nvec):
                    builder.store(ir.Constant(vty, None), accs[r][h])

        def step(k):
            bv = [builder.load(addr(bases[2], k, rs[2], col(h), vty), align=4) for h in range(nvec)]
            for r in range(mr):
                row = builder.add(ii, ir.Constant(i64, r))
                if a_transposed:
                    av = builder.load(addr(bases[1], k, rs[1], row, f32))
                else:
                    av = builder.load(addr(bases[1], row, rs[1], k, f32))
                bc = builder.shuffle_vector(builder.insert_element(ir.Constant(vty, ir.Undefined), av,
                                                                   ir.Constant(ir.IntType(32), 0)),
                                            ir.Constant(vty, ir.Undefined), zero_mask)
                for h in range(nvec):
                    # 'contract' lets LLVM fuse into an FMA where the target has one (and stay correct where not)
                    prod = builder.fmul(bc, bv[h], flags=("contract",))
                    builder.store(builder.fadd(builder.load(accs[r][h]), prod, flags=("contract",)), accs[r][h])

        def store_accs():
            for r in range(mr):
                for h in range(nvec):
                    builder.store(builder.load(accs[r][h]), cptr[r][h], align=4)

        if chunk:
            zero = ir.Constant(i64, 0)
            with cgutils.for_range_slice(builder, zero, kd, ir.Constant(i64, chunk)) as (k0, _):
                zero_accs()
                k1 = builder.add(k0, ir.Constant(i64, chunk))
                k1 = builder.select(builder.icmp_signed("<", k1, kd), k1, kd)
                with cgutils.for_range_slice(builder, k0, k1, ir.Constant(i64, 1)) as (k, _):
                    step(k)
                with builder.if_else(builder.icmp_signed("==", k0, zero)) as (first, later):
                    with first:
                        store_accs()
                    with later:
                        for r in range(mr):
                            for h in range(nvec):
                                total = builder.fadd(builder.load(cptr[r][h], align=4), builder.load(accs[r][h]))
                                builder.store(total, cptr[r][h], align=4)
            return context.get_dummy_value()
        with builder.if_else(acc_flag) as (then, otherwise):
            with then:
                for r in range(mr):
                    for h in range(nvec):
                        builder.store(builder.load(cptr[r][h], align=4), accs[r][h])
            with otherwise:
                zero_accs()
        with cgutils.for_range(builder, kd) as loop:
            step(loop.index)
        store_accs()
        return context.get_dummy_value()

    return codegen


def _rows_f32(*arrays) -> bool:
    """Whether every array is a 2-D float32 array: what the IR micro-kernels take. They also assume a unit-stride
    last axis, which numba's types cannot state for a strided view; the host code guarantees it."""
    return all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 for x in arrays)


def _block_sig(c, a, b, i, j, kdim, accumulate):
    return types.none(c, a, b, i, j, kdim, accumulate) if _rows_f32(c, a, b) else None


@intrinsic
def _block2(typingctx, c, a, b, i, j, kdim, accumulate):
    """C[i:i+MR, j:j+NR] (+)= A[i:i+MR, :kdim] @ B[:kdim, j:j+NR], float32."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 2))


@intrinsic
def _block1(typingctx, c, a, b, i, j, kdim, accumulate):
    """C[i:i+MR, j:j+LANES] (+)= A[i:i+MR, :kdim] @ B[:kdim, j:j+LANES], float32."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 1))


@intrinsic
def _block2_at(typingctx, c, at, b, i, j, kdim, accumulate):
    """C[i:i+MR, j:j+NR] (+)= AT[:kdim, i:i+MR]^T @ B[:kdim, j:j+NR], float32."""
    sig = _block_sig(c, at, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(True, 2))


@intrinsic
def _block1_at(typingctx, c, at, b, i, j, kdim, accumulate):
    """C[i:i+MR, j:j+LANES] (+)= AT[:kdim, i:i+MR]^T @ B[:kdim, j:j+LANES], float32."""
    sig = _block_sig(c, at, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(True, 1))


# Head-dim products (scores q.k and dP = dO.v) sum their reduction in chunks of this many terms, each chunk a
# fresh chain of multiply-adds, the chunks then added in order: a chain over all of D = 256 erred 2-10x torch's
# vectorised dot products at Sq = 1 and 3 with large scores (softcap 50), and at D = 256.
_DOT_CHUNK = 32

# The 4 x 64 block issues fewer instructions per FMA than 8 x 32 (four broadcasts and four loads for sixteen FMAs
# against eight and two) and measured faster for long reductions: 349 vs 308 GFLOP/s at kdim 128, 295 vs 303 at 64.
_WIDE_BLOCK_MIN_KDIM = 96


@intrinsic
def _block4(typingctx, c, a, b, i, j, kdim, accumulate):
    """C[i:i+4, j:j+4*LANES] (+)= A[i:i+4, :kdim] @ B[:kdim, j:j+4*LANES], float32."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 4, 4))


@intrinsic
def _block2_dot(typingctx, c, a, b, i, j, kdim, accumulate):
    """``_block2`` with the reduction in chunks of ``_DOT_CHUNK`` (C written, never accumulated into)."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 2, chunk=_DOT_CHUNK))


@intrinsic
def _block1_dot(typingctx, c, a, b, i, j, kdim, accumulate):
    """``_block1`` with the reduction in chunks of ``_DOT_CHUNK``."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 1, chunk=_DOT_CHUNK))


@intrinsic
def _block4_dot(typingctx, c, a, b, i, j, kdim, accumulate):
    """``_block4`` with the reduction in chunks of ``_DOT_CHUNK``."""
    sig = _block_sig(c, a, b, i, j, kdim, accumulate)
    return None if sig is None else (sig, _mm_block_codegen(False, 4, 4, chunk=_DOT_CHUNK))


def _mm(c, a, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) a[:, :kdim] @ b[:kdim, :c.shape[1]] for 2-D arrays with unit-stride rows: c (R, N), a (R, >= kdim),
    b (>= kdim, >= N); R % 8 == 0 and N % 16 == 0."""
    raise NotImplementedError


def _mm_at(c, at, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) at[:kdim].T @ b[:kdim, :c.shape[1]] for 2-D arrays with unit-stride rows: c (R, N),
    at (>= kdim, R), b (>= kdim, >= N); R % 8 == 0 and N % 16 == 0. Saves transposing P and dS."""
    raise NotImplementedError


@overload(_mm, inline="never")
def _mm_impl(c, a, b, kdim, accumulate):
    if _rows_f32(c, a, b):
        def impl(c, a, b, kdim, accumulate):
            # Column blocks outermost: the (kdim x NR) panel of B in use stays in L1 while A streams as broadcasts.
            n = c.shape[1]
            if n == 4 * _LANES and _LANES == 16 and kdim >= _WIDE_BLOCK_MIN_KDIM:
                for i in range(0, c.shape[0], 4):
                    _block4(c, a, b, i, 0, kdim, accumulate)
                return
            j = 0
            while j + _NR <= n:
                for i in range(0, c.shape[0], _MR):
                    _block2(c, a, b, i, j, kdim, accumulate)
                j += _NR
            if j < n:  # a last 16 columns (512-bit vectors, D_pad % 32 == 16)
                for i in range(0, c.shape[0], _MR):
                    _block1(c, a, b, i, j, kdim, accumulate)
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


@overload(_mm_at, inline="never")
def _mm_at_impl(c, at, b, kdim, accumulate):
    if _rows_f32(c, at, b):
        def impl(c, at, b, kdim, accumulate):
            n = c.shape[1]
            j = 0
            while j + _NR <= n:
                for i in range(0, c.shape[0], _MR):
                    _block2_at(c, at, b, i, j, kdim, accumulate)
                j += _NR
            if j < n:
                for i in range(0, c.shape[0], _MR):
                    _block1_at(c, at, b, i, j, kdim, accumulate)
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


def _mm_dot(c, a, b, kdim):  # pragma: no cover - typed by the overload below
    """c = a[:, :kdim] @ b[:kdim, :c.shape[1]] as ``_mm``, the reduction in chunks of ``_DOT_CHUNK``: C = chunk 0,
    then C = C + chunk i in order. ``_row_dot_kernel`` sums the same way, so that a row's delta = dO . O equals its
    dP = dO . v to the bit where O = v."""
    raise NotImplementedError


@overload(_mm_dot, inline="never")
def _mm_dot_impl(c, a, b, kdim):
    if _rows_f32(c, a, b):
        def impl(c, a, b, kdim):
            n = c.shape[1]
            if n == 4 * _LANES and _LANES == 16 and kdim >= _WIDE_BLOCK_MIN_KDIM:
                for i in range(0, c.shape[0], 4):
                    _block4_dot(c, a, b, i, 0, kdim, False)
                return
            j = 0
            while j + _NR <= n:
                for i in range(0, c.shape[0], _MR):
                    _block2_dot(c, a, b, i, j, kdim, False)
                j += _NR
            if j < n:
                for i in range(0, c.shape[0], _MR):
                    _block1_dot(c, a, b, i, j, kdim, False)
        return impl

    def impl(c, a, b, kdim):
        c[:] = 0
        for k0 in range(0, kdim, _DOT_CHUNK):
            for i in range(c.shape[0]):
                for j in range(c.shape[1]):
                    part = c[i, j] * 0
                    for k in range(k0, min(kdim, k0 + _DOT_CHUNK)):
                        part += a[i, k] * b[k, j]
                    c[i, j] = part if k0 == 0 else c[i, j] + part
    return impl


# ---------------------------------------------------------------------------------------------------------------
# Column passes of the forward's online softmax
#
# In a transposed score block (keys as rows, queries as columns) the running max and sum of a query are a column
# statistic. Written as plain loops, LLVM vectorises across columns but loads and stores the statistic vectors
# once per key row; these keep them in registers for the whole block (one vector per LANES queries), so each score
# is loaded once per pass. Measured on the (1, 8, 2048, 64) forward: the two loops took 8.4 of 41 ms.


def _column_pass_codegen(kind: str) -> Callable:
    """IR for ``stat (op)= column reduction of st[:nk]`` over float32 arrays: st (>= nk, BLOCK_M) with a
    unit-stride last axis, stat (BLOCK_M,) contiguous.

    kind 'max_strict' / 'max_nan': stat = max(stat, max_c st[c]), except that stat becomes NaN, and stays NaN, for
    a column holding a score that is not finite ('max_strict': a block no mask touched, where every score is
    visible and -inf can only come from the data) or a NaN ('max_nan': a block ``_mask_scores`` has been through,
    where -inf means masked and a visible non-finite score is already NaN). A NaN max poisons the query: its
    exp2s, sum and output become NaN. kind 'exp2': st[c] = 2 ** (st[c] - shift) for every c < nk and
    stat += sum_c st[c], where shift (BLOCK_M,) is the third array and every st[c] - shift <= 0 or NaN (clamped
    at -127, which comes out as exactly 0; a NaN stays NaN)."""
    lanes = _LANES

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        i32 = ir.IntType(32)
        i64 = ir.IntType(64)
        vty = ir.VectorType(f32, lanes)
        ity = ir.VectorType(i32, lanes)
        arrays = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args, args)
                  if isinstance(t, types.Array)]
        st = arrays[0]
        nk = context.cast(builder, args[1], signature.args[1], types.int64)
        rstride = cgutils.unpack_tuple(builder, st.strides, 2)[0]
        i8p = ir.IntType(8).as_pointer()
        base = builder.bitcast(st.data, i8p)

        def splat(x):
            return ir.Constant(vty, [x] * lanes)

        def vec_ptr(arr, chunk):
            p = builder.gep(arr.data, [builder.mul(chunk, ir.Constant(i64, lanes))])
            return builder.bitcast(p, vty.as_pointer())

        def st_ptr(row, chunk):
            off = builder.add(builder.mul(row, rstride), builder.mul(chunk, ir.Constant(i64, 4 * lanes)))
            return builder.bitcast(builder.gep(base, [off]), vty.as_pointer())

        def intrinsic_fn(name, nargs):
            return cgutils.get_or_insert_function(builder.module, ir.FunctionType(vty, [vty] * nargs),
                                                  f"llvm.{name}.v{lanes}f32")

        floor = intrinsic_fn("floor", 1)
        flags = ("contract",)
        nan = splat(float("nan"))

        def exp2_nonpos(x):
            # 2^x as in _fast_exp2: n = round(x), a degree-7 polynomial in f = x - n, 2^n from the exponent bits.
            # The clamp is a compare that a NaN fails (llvm.maxnum would turn a NaN into -127, i.e. p = 0).
            x = builder.select(builder.fcmp_ordered("<", x, splat(float(_EXP2_MIN))), splat(float(_EXP2_MIN)), x)
            n = builder.call(floor, [builder.fadd(x, splat(0.5))])
            f = builder.fsub(x, n)
            poly = splat(float(_E7))
            for coef in (_E6, _E5, _E4, _E3, _E2, _E1, _ONE):
                poly = builder.fadd(builder.fmul(poly, f, flags=flags), splat(float(coef)), flags=flags)
            return builder.fmul(poly, _pow2_bits(builder, n, vty, ity))

        # All BLOCK_M / LANES column chunks in flight at once: independent dependency chains for the max / sum.
        chunks = range(BLOCK_M // lanes)
        stat_p = [vec_ptr(arrays[1], ir.Constant(i64, ch)) for ch in chunks]
        stat = [cgutils.alloca_once_value(builder, builder.load(ptr, align=4)) for ptr in stat_p]
        shift = [builder.load(vec_ptr(arrays[2], ir.Constant(i64, ch)), align=4) for ch in chunks] \
            if kind == "exp2" else None
        # 'max_strict': sum of x * 0 per column, NaN once any x was NaN or +-inf. One multiply-add per vector,
        # looked at once after the loop, where a compare and a select per vector would cost three instructions.
        probe = [cgutils.alloca_once_value(builder, splat(0.0)) for _ in chunks] if kind == "max_strict" else None
        with cgutils.for_range(builder, nk) as loop:
            for ch in chunks:
                p = st_ptr(loop.index, ir.Constant(i64, ch))
                x = builder.load(p, align=4)
                if kind == "exp2":
                    # exp(x - shift) = 2^((x - shift) log2 e): scores are natural-log units (see _fast_exp)
                    prob = exp2_nonpos(builder.fmul(builder.fsub(x, shift[ch]), splat(float(_LOG2E_F32))))
                    builder.store(prob, p, align=4)
                    builder.store(builder.fadd(builder.load(stat[ch]), prob, flags=flags), stat[ch])
                    continue
                old = builder.load(stat[ch])
                # x > old ? x : old is one max instruction; a NaN old stays NaN, so a poisoned query stays so
                new = builder.select(builder.fcmp_ordered(">", x, old), x, old)
                if kind == "max_strict":
                    # no fast-math flags but 'contract': x * 0 must stay NaN for an inf or NaN x
                    zeroed = builder.fmul(x, splat(0.0), flags=flags)
                    builder.store(builder.fadd(builder.load(probe[ch]), zeroed, flags=flags), probe[ch])
                    builder.store(new, stat[ch])
                else:
                    builder.store(builder.select(builder.fcmp_unordered("uno", x, x), nan, new), stat[ch])
        for ch in chunks:
            result = builder.load(stat[ch])
            if kind == "max_strict":
                result = builder.select(builder.fcmp_unordered("uno", builder.load(probe[ch]), splat(0.0)), nan,
                                        result)
            builder.store(result, stat_p[ch], align=4)
        return context.get_dummy_value()

    return codegen


def _column_pass_ok(st, nk, *stats) -> bool:
    return (_rows_f32(st) and isinstance(nk, types.Integer)
            and all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 1 and x.layout == "C"
                    for x in stats))


@intrinsic
def _column_max_strict_f32(typingctx, st, nk, m):
    """m = max(m, max over rows c < nk of st[c]), float32; NaN where a score is not finite."""
    return (types.none(st, nk, m), _column_pass_codegen("max_strict")) if _column_pass_ok(st, nk, m) else None


@intrinsic
def _column_max_nan_f32(typingctx, st, nk, m):
    """m = max(m, max over rows c < nk of st[c]), float32; NaN where a score is NaN (-inf is a masked key)."""
    return (types.none(st, nk, m), _column_pass_codegen("max_nan")) if _column_pass_ok(st, nk, m) else None


@intrinsic
def _column_exp2_sum_f32(typingctx, st, nk, total, shift):
    """st[c] = 2 ** (st[c] - shift) for rows c < nk, and total += the sum of those rows, float32."""
    if not _column_pass_ok(st, nk, total, shift):
        return None
    return types.none(st, nk, total, shift), _column_pass_codegen("exp2")


def _column_max(st, nk, m, strict):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


def _column_exp2_sum(st, nk, total, shift):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_column_max, inline="always")
def _column_max_impl(st, nk, m, strict):
    """The 'max_strict' (``strict``) or 'max_nan' pass of ``_column_pass_codegen``."""
    if _column_pass_ok(st, nk, m):
        def impl(st, nk, m, strict):
            if strict:
                _column_max_strict_f32(st, nk, m)
            else:
                _column_max_nan_f32(st, nk, m)
        return impl

    def impl(st, nk, m, strict):
        nan = _as_dtype_of(m, np.nan)
        inf = _as_dtype_of(m, np.inf)
        for c in range(nk):
            for r in range(st.shape[1]):
                x = st[c, r]
                if x > m[r]:  # false for a NaN m: it stays NaN
                    m[r] = x
                if x != x or (strict and not abs(x) < inf):
                    m[r] = nan
    return impl


@overload(_column_exp2_sum, inline="always")
def _column_exp2_sum_impl(st, nk, total, shift):
    if _column_pass_ok(st, nk, total, shift):
        return lambda st, nk, total, shift: _column_exp2_sum_f32(st, nk, total, shift)

    def impl(st, nk, total, shift):
        for c in range(nk):
            for r in range(st.shape[1]):
                p = _fast_exp(st[c, r] - shift[r])
                st[c, r] = p
                total[r] += p
    return impl


# ---------------------------------------------------------------------------------------------------------------
# Masks


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
    """Fill the per-row key ranges of the query tile starting at ``i0`` and return ``(lo, hi, full_lo, full_hi)``:
    the union ``[lo, hi)`` of the ranges of its rows (empty when no row sees a key), and the keys
    ``[full_lo, full_hi)`` that every real row sees (a key tile inside it needs no mask)."""
    lo = seqlen_k
    hi = 0
    full_lo = 0
    full_hi = seqlen_k
    for r in range(row_lo.shape[0]):
        a, e = _row_key_range(i0 + r, seqlen_q, seqlen_k, left, right)
        row_lo[r] = a
        row_hi[r] = e
        if i0 + r < seqlen_q:
            full_lo = max(full_lo, a)
            full_hi = min(full_hi, e)
        if a < e:
            lo = min(lo, a)
            hi = max(hi, e)
    return lo, hi, full_lo, full_hi


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


@njit(inline="always", cache=True)
def _mask_block(st, j0, nk, row_lo, row_hi, fill):
    """st[c, r] = fill where query r does not see key j0 + c, for the first nk key rows of a (BN, BM) block."""
    for c in range(nk):
        j = j0 + c
        for r in range(st.shape[1]):
            if j < row_lo[r] or j >= row_hi[r]:
                st[c, r] = fill


@njit(inline="always", cache=True)
def _mask_scores(st, j0, nk, row_lo, row_hi):
    """The forward's mask on the first nk key rows of a (BN, BM) block of scores: -inf where query r does not see
    key j0 + c, and NaN where it does but the score is not finite. After it, -inf means "masked" and nothing else,
    so the max pass ('max_nan') can poison a query for a visible -inf (an inf in q or k, or an overflow) instead of
    dropping that key."""
    neg_inf = _as_dtype_of(st, -np.inf)
    inf = _as_dtype_of(st, np.inf)
    nan = _as_dtype_of(st, np.nan)
    for c in range(nk):
        j = j0 + c
        for r in range(st.shape[1]):
            # selects, no branches: the loop vectorises
            x = st[c, r]
            x = x if abs(x) < inf else nan
            st[c, r] = x if (j >= row_lo[r]) & (j < row_hi[r]) else neg_inf


def _rows_finite(rows, n):  # pragma: no cover - typed by the overload below
    """Whether rows[:n] (a 2-D view with unit-stride rows) holds only finite numbers."""
    raise NotImplementedError


@overload(_rows_finite, inline="always")
def _rows_finite_impl(rows, n):
    if _rows_f32(rows):
        return lambda rows, n: _rows_finite_f32(rows, n)

    def impl(rows, n):
        zero = _as_dtype_of(rows, 0.0)
        acc = zero
        for c in range(n):
            for d in range(rows.shape[1]):
                acc += rows[c, d] * zero
        return acc == zero
    return impl


@intrinsic
def _rows_finite_f32(typingctx, rows, n):
    """float32 ``_rows_finite``: a vector sum of x * 0 along each row, which is 0 unless some x is inf or NaN.
    Written as IR because numba types the rows as strided ('A'), and the loop it compiles then runs one element at
    a time: 8192 of them per masked tile at D = 128 cost the causal forward 10%."""
    if not _rows_f32(rows):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, _LANES)
        i64 = ir.IntType(64)
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        nrows = context.cast(builder, args[1], signature.args[1], types.int64)
        width = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        zero_v = ir.Constant(vty, [0.0] * _LANES)
        acc_v = cgutils.alloca_once_value(builder, zero_v)
        acc_s = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
        n_vec = builder.udiv(width, ir.Constant(i64, _LANES))
        # no fast-math flags: x * 0 must stay NaN for an inf or NaN x
        with cgutils.for_range(builder, nrows) as row:
            row_p = builder.gep(base, [builder.mul(row.index, stride)])
            vec_p = builder.bitcast(row_p, vty.as_pointer())
            with cgutils.for_range(builder, n_vec) as col:
                x = builder.load(builder.gep(vec_p, [col.index]), align=4)
                builder.store(builder.fadd(builder.load(acc_v), builder.fmul(x, zero_v)), acc_v)
            flt_p = builder.bitcast(row_p, f32.as_pointer())
            tail = builder.mul(n_vec, ir.Constant(i64, _LANES))
            with cgutils.for_range_slice(builder, tail, width, ir.Constant(i64, 1)) as (col, _):
                x = builder.load(builder.gep(flt_p, [col]))
                builder.store(builder.fadd(builder.load(acc_s), builder.fmul(x, ir.Constant(f32, 0.0))), acc_s)
        total = builder.load(acc_s)
        acc = builder.load(acc_v)
        for lane in range(_LANES):
            total = builder.fadd(total, builder.extract_element(acc, ir.Constant(ir.IntType(32), lane)))
        return builder.fcmp_ordered("==", total, ir.Constant(f32, 0.0))

    return types.boolean(rows, n), codegen


@njit(inline="always", cache=True)
def _visible_product(c_arr, a, b_rows, n, a_transposed, b_is_keys, j0, row_lo, row_hi):
    """c += A @ b_rows[:n] with A = a[:n].T (``a_transposed``) or a[:, :n], counting only the (query, key) pairs a
    query sees, for a block whose mask hides some pairs (A is 0 there) and whose b_rows hold a value that is not
    finite: a plain product adds 0 * nan = nan to every row of c, also to queries that do not see that key.

    b_rows has one row per key j0 + c (``b_is_keys``; c's rows are the queries of row_lo/row_hi) or one per query
    (c's rows are the keys j0 + r). The finite rows go through the same micro-kernel as the fast path, from a copy
    with the non-finite rows zeroed, so that rows of c that see none of those get exactly the result of a run
    without them; the non-finite rows are then added pair by pair where a query sees the key."""
    inf = _as_dtype_of(b_rows, np.inf)
    zero = _as_dtype_of(b_rows, 0.0)
    width = b_rows.shape[1]
    clean = np.empty((n, width), b_rows.dtype)
    bad = np.zeros(n, np.bool_)
    for c in range(n):
        for d in range(width):
            x = b_rows[c, d]
            clean[c, d] = x
            if not abs(x) < inf:
                bad[c] = True
        if bad[c]:
            for d in range(width):
                clean[c, d] = zero
    if a_transposed:
        _mm_at(c_arr, a, clean, n, True)
    else:
        _mm(c_arr, a, clean, n, True)
    for c in range(n):
        if not bad[c]:
            continue
        for r in range(c_arr.shape[0]):
            if b_is_keys:
                seen = row_lo[r] <= j0 + c < row_hi[r]
            else:
                seen = row_lo[c] <= j0 + r < row_hi[c]
            if seen:
                coef = a[c, r] if a_transposed else a[r, c]
                for d in range(width):
                    c_arr[r, d] += coef * b_rows[c, d]


@njit(inline="always", cache=True)
def _load_rows(dst, src, n, head_dim):
    """dst[:n, :head_dim] = src[:n, :head_dim] and zero in dst's rows n..; columns past head_dim keep their
    (zero) contents. src is a 2-D view of a head-major buffer (unit-stride rows)."""
    zero = _as_dtype_of(dst, 0.0)
    _copy_rows(dst, src, n, head_dim)
    for c in range(n, dst.shape[0]):
        for d in range(dst.shape[1]):
            dst[c, d] = zero


# ---------------------------------------------------------------------------------------------------------------
# Forward


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _forward_kernel(q, k, v, out, lse, head_dim, scale, left, right, softcap, row_max, row_inv, stats_only):
    """Online-softmax forward. One prange iteration per (batch, query head, query tile); each writes only its own
    rows of out and lse.

    q, out: (B, Sq, Hq, >= D), any strides; lse: (B, Hq, Sq), any strides;
    k, v: (B, Sk, Hkv, D_pad) views of head-major buffers (``_head_major``), D_pad = D rounded up to 16, zero past D.
    All one float dtype.
    With ``stats_only`` (the backward's first pass) it skips P V and writes neither out nor lse, but each row's
    final max and 1 / sum of exp(score - max) into row_max and row_inv, (B, Hq, n_qt * BLOCK_M) (+inf and 0 for
    padding rows and rows that see no key): the backward then recomputes P = exp(score - max) / sum from the very
    scores of the forward (P = 1 exactly for the max of a row with one key), where exp(score - lse) carried the
    rounding of lse, as large as lse itself.
    """
    batch, seqlen_q, nheads_q = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads_q // nheads_kv
    dp = v.shape[3]
    n_qt = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    # Scores in natural-log units, as torch's: Q carries the scale, and exp(score - max) converts the difference
    # to base 2 (_fast_exp). With softcap, the raw score is divided by the softcap after the product: that keeps
    # an inf in q or k, which tanh would turn into a finite +-1, visible as a non-finite raw score.
    qscale = _as_dtype_of(q, scale)
    neg_inf = _as_dtype_of(q, -np.inf)
    inf = _as_dtype_of(q, np.inf)
    nan = _as_dtype_of(q, np.nan)
    zero = _as_dtype_of(q, 0.0)
    for u in prange(batch * nheads_q * n_qt):
        b = u // (nheads_q * n_qt)
        h = (u // n_qt) % nheads_q
        qt = u % n_qt
        hk = h // group
        i0 = qt * BLOCK_M
        nq = min(BLOCK_M, seqlen_q - i0)
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        span_lo, span_hi, full_lo, full_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
        q_t = np.zeros((head_dim, BLOCK_M), q.dtype)  # scaled Q^T; padding rows stay 0
        for r in range(nq):
            for d in range(head_dim):
                q_t[d, r] = q[b, i0 + r, h, d] * qscale
        k_tail = np.empty((BLOCK_N, head_dim), q.dtype)  # a last, partial key tile, zero-padded
        st = np.empty((BLOCK_N, BLOCK_M), q.dtype)
        acc = np.zeros((BLOCK_M, dp), q.dtype)
        m_run = np.full(BLOCK_M, neg_inf, q.dtype)
        m_use = np.empty(BLOCK_M, q.dtype)
        # Sums across key tiles: each tile's P V and row sums go to a tile buffer first and are then added in, one
        # rounding per tile instead of one per key (the sums in float64): at Sk = 131072 a running sum over every
        # key erred 10x torch's.
        pv = np.empty((BLOCK_M, dp), q.dtype)
        l_run = np.zeros(BLOCK_M, np.float64)
        l_tile = np.empty(BLOCK_M, q.dtype)
        alpha = np.empty(BLOCK_M, q.dtype)
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            nk = min(BLOCK_N, seqlen_k - j0)
            if nk == BLOCK_N:
                _mm_dot(st, k[b, j0:j0 + BLOCK_N, hk], q_t, head_dim)
            else:
                _load_rows(k_tail, k[b, j0:j0 + nk, hk], nk, head_dim)
                _mm_dot(st, k_tail, q_t, head_dim)
            if softcap > 0:
                for c in range(nk):
                    for r in range(BLOCK_M):
                        x = st[c, r]
                        capped = _capped(x, softcap)[0]
                        st[c, r] = capped if abs(x) < inf else nan
            # Every block that no mask touches is all visible: there any non-finite score poisons its query.
            masked = not (full_lo <= j0 and j0 + nk <= full_hi)
            if masked:
                _mask_scores(st, j0, nk, row_lo, row_hi)
            for r in range(BLOCK_M):
                m_use[r] = m_run[r]
            _column_max(st, nk, m_use, not masked)
            for r in range(BLOCK_M):
                m_new = m_use[r]
                # A query that has seen no key yet keeps max -inf; shifting by 0 makes its exp2 0, never NaN.
                # A poisoned query has max NaN: its alpha, sum and accumulator become NaN and stay so.
                if m_new == neg_inf:
                    m_use[r] = zero
                alpha[r] = _fast_exp(m_run[r] - m_use[r])
                m_run[r] = m_new
                l_tile[r] = zero
            _column_exp2_sum(st, nk, l_tile, m_use)
            for r in range(BLOCK_M):
                l_run[r] = l_run[r] * alpha[r] + l_tile[r]
            if not stats_only:
                v_rows = v[b, j0:j0 + nk, hk]
                if masked and not _rows_finite(v_rows, nk):
                    pv[:] = zero
                    _visible_product(pv, st, v_rows, nk, True, True, j0, row_lo, row_hi)
                else:
                    _mm_at(pv, st, v_rows, nk, False)
                for r in range(BLOCK_M):
                    a = alpha[r]
                    for d in range(dp):
                        acc[r, d] = acc[r, d] * a + pv[r, d]
        if stats_only or row_max.shape[2] > 1:
            # the row max and 1 / sum, with +inf and 0 for a row that sees no key (P = 0 there); a forward keeps
            # them too when given arrays for them (the backward reuses them, see _stash_stats)
            for r in range(BLOCK_M):
                seen = l_run[r] != 0
                row_max[b, h, i0 + r] = m_run[r] if seen else inf
                row_inv[b, h, i0 + r] = 1.0 / l_run[r] if seen else 0.0
        if not stats_only:
            for r in range(nq):
                if row_lo[r] >= row_hi[r]:
                    # Sees no key: 0 and lse = +inf, whatever its q holds (it reads nothing).
                    for d in range(head_dim):
                        out[b, i0 + r, h, d] = zero
                    lse[b, h, i0 + r] = inf
                elif l_run[r] > 0 and m_run[r] == m_run[r]:
                    inv = _as_dtype_of(acc, 1.0 / l_run[r])
                    for d in range(head_dim):
                        o = acc[r, d] * inv
                        out[b, i0 + r, h, d] = o if abs(o) < inf else nan
                    lse[b, h, i0 + r] = np.float64(m_run[r]) + math.log(l_run[r])  # in float64, rounded once
                else:  # poisoned by a score that is not finite
                    for d in range(head_dim):
                        out[b, i0 + r, h, d] = nan
                    lse[b, h, i0 + r] = nan


# ---------------------------------------------------------------------------------------------------------------
# Backward
#
# The key-tile pass (dK, dV, and dQ when fused) walks query tiles inside a key tile, so it computes S = Q K^T with
# queries as rows: it needs K^T and V^T of its key tile only, built once per tile, and reads Q and dO rows in place.
# The query-tile pass (dQ alone) walks key tiles inside a query tile, so it computes S^T = K Q^T like the forward,
# building Q^T and dO^T once per query tile and reading K and V rows in place. Either way every transposed copy
# is made once per call, in parallel, and no O(S^2) array exists.


@njit(inline="always", fastmath=_FASTMATH, cache=True)
def _softcap_scores(s, nrows, ncols, softcap, dcap, scale):
    """s[:nrows, :ncols] = softcap * tanh(s / softcap), the forward's capped scores computed the forward's way
    (``_capped``); dcap = scale * (1 - tanh^2), d score / d q.k. A loop of its own: fused into the exponent's
    subtraction (a multiply-add), the capped score would not be the one the forward took the max of."""
    inf = _as_dtype_of(s, np.inf)
    nan = _as_dtype_of(s, np.nan)
    for r in range(nrows):
        for c in range(ncols):
            x = s[r, c]
            capped, t = _capped(x, softcap)
            s[r, c] = capped if abs(x) < inf else nan
            dcap[r, c] = _as_dtype_of(dcap, scale * (1.0 - t * t))


@njit(inline="always", fastmath=_FASTMATH, cache=True)
def _gradient_terms(score, dp, row_max, inv_l, delta, dscore):
    """(P, dS) for one score (as the forward computed it) and dp = dO.v, given the row's max and 1 / sum of the
    forward's last pass (``_forward_kernel`` with ``stats_only``) and delta = dO . O: P is exp(score - max) / sum,
    dS the gradient with respect to q.k, ``P * (dP - delta) * dscore`` (dscore: scale, times 1 - tanh^2 with
    softcap). A poisoned row has max NaN, which makes P and dS NaN; a row that sees no key has max +inf and
    1 / sum = 0, which make P = 0."""
    prob = _fast_exp(score - row_max) * inv_l
    return prob, prob * (dp - delta) * dscore


@njit(inline="always", fastmath=_FASTMATH, cache=True)
def _probs_and_dscores_rows(s, dps, dcap, row_max, row_inv, delta, i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                            scale, softcap):
    """A (BM, BN) block with queries as rows: s holds the scores (Q pre-scaled as in the forward) on entry and P on
    exit, dps holds dO.v on entry and dS on exit. row_max, row_inv (the forward's row max and 1 / sum, see
    ``_gradient_terms``) and delta are indexed by query. Masked entries and key columns past nk become 0 in both.
    dcap: scratch (BM, BN) for softcap's derivative."""
    zero = _as_dtype_of(s, 0.0)
    sc = _as_dtype_of(s, scale)
    if softcap > 0:
        _softcap_scores(s, s.shape[0], s.shape[1], softcap, dcap, scale)
        for r in range(s.shape[0]):
            mr = row_max[i0 + r]
            il = row_inv[i0 + r]
            dl = delta[i0 + r]
            for c in range(s.shape[1]):
                s[r, c], dps[r, c] = _gradient_terms(s[r, c], dps[r, c], mr, il, dl, dcap[r, c])
    else:
        for r in range(s.shape[0]):
            mr = row_max[i0 + r]
            il = row_inv[i0 + r]
            dl = delta[i0 + r]
            for c in range(s.shape[1]):
                s[r, c], dps[r, c] = _gradient_terms(s[r, c], dps[r, c], mr, il, dl, sc)
    if not (full_lo <= j0 and j0 + nk <= full_hi):
        for r in range(s.shape[0]):
            lo = row_lo[r] - j0
            hi = row_hi[r] - j0
            for c in range(s.shape[1]):
                if c < lo or c >= hi:
                    s[r, c] = zero
                    dps[r, c] = zero
    elif nk < s.shape[1]:
        for r in range(s.shape[0]):
            for c in range(nk, s.shape[1]):
                s[r, c] = zero
                dps[r, c] = zero


@njit(inline="always", fastmath=_FASTMATH, cache=True)
def _probs_and_dscores_cols(st, dpt, dcap, row_max, row_inv, delta, i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                            scale, softcap):
    """The same on a transposed (BN, BM) block, keys as rows: st holds k.q and becomes P^T, dpt holds v.dO and
    becomes dS^T; row_max, row_inv and delta are indexed by column. Key rows past nk and masked entries become 0."""
    zero = _as_dtype_of(st, 0.0)
    sc = _as_dtype_of(st, scale)
    if softcap > 0:
        _softcap_scores(st, nk, st.shape[1], softcap, dcap, scale)
        for c in range(nk):
            for r in range(st.shape[1]):
                st[c, r], dpt[c, r] = _gradient_terms(st[c, r], dpt[c, r], row_max[i0 + r], row_inv[i0 + r],
                                                      delta[i0 + r], dcap[c, r])
    else:
        for c in range(nk):
            for r in range(st.shape[1]):
                st[c, r], dpt[c, r] = _gradient_terms(st[c, r], dpt[c, r], row_max[i0 + r], row_inv[i0 + r],
                                                      delta[i0 + r], sc)
    if not (full_lo <= j0 and j0 + nk <= full_hi):
        _mask_block(st, j0, nk, row_lo, row_hi, zero)
        _mask_block(dpt, j0, nk, row_lo, row_hi, zero)
    for c in range(nk, st.shape[0]):
        for r in range(st.shape[1]):
            st[c, r] = zero
            dpt[c, r] = zero


@njit(inline="always", cache=True)
def _tile_product_add(acc, tile, a, b_rows, n, a_transposed, b_is_keys, masked, j0, row_lo, row_hi):
    """acc += A @ b_rows[:n] (A = a[:n].T with ``a_transposed``, else a[:, :n]), the product formed in ``tile`` first
    and then added: a gradient summed over a long sequence then takes one rounding per tile, not one per row of the
    sequence (dK and dV at Sq = 20000 erred 10x torch's). A masked block whose b_rows hold a non-finite value goes
    through ``_visible_product``."""
    zero = _as_dtype_of(acc, 0.0)
    if masked and not _rows_finite(b_rows, n):
        tile[:] = zero
        _visible_product(tile, a, b_rows, n, a_transposed, b_is_keys, j0, row_lo, row_hi)
    elif a_transposed:
        _mm_at(tile, a, b_rows, n, False)
    else:
        _mm(tile, a, b_rows, n, False)
    for r in range(acc.shape[0]):
        for d in range(acc.shape[1]):
            acc[r, d] += tile[r, d]


@njit(inline="always", cache=True)
def _load_transposed(dst, src, n, head_dim):
    """dst[:head_dim, :n] = src[:n, :head_dim].T and zero in dst's columns n..; dst (D, BN), src a 2-D view."""
    zero = _as_dtype_of(dst, 0.0)
    for c in range(n):
        for d in range(head_dim):
            dst[d, c] = src[c, d]
    for d in range(head_dim):
        for c in range(n, dst.shape[1]):
            dst[d, c] = zero


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _backward_kv_kernel(q, qs, k, v, dout, row_max, row_inv, delta, dq_acc, dk, dv, head_dim, scale, left, right,
                        softcap, kt_per_unit, fuse_dq):
    """dK and dV (and, with ``fuse_dq``, dQ into ``dq_acc``).

    q, qs, dout: (B, Sq, Hq, D_pad) and k, v: (B, Sk, Hkv, D_pad), views of head-major buffers (``_head_major``);
    qs is q times the forward's score scale (``_score_scale``), so that the scores are the forward's to the bit;
    row_max, row_inv, delta: (B, Hq, n_qt * BLOCK_M), the forward's row max and 1 / sum (+inf and 0 in
    the padding and for rows that see no key) and rowsum(dO * O);
    dq_acc: (B, Hq, n_qt * BLOCK_M, D_pad), zeroed, accumulated into when ``fuse_dq``; dk, dv: (B, Sk, Hkv, >= D),
    any strides, written.
    One prange iteration per (batch, kv head, run of ``kt_per_unit`` key tiles): it sums dK/dV for its key tiles
    over every query head of the group and every query tile that sees them and writes only those rows of dk, dv.
    dQ rows collect contributions from all key tiles, so they may be accumulated here only when one iteration owns
    all key tiles of its (batch, kv head): then it is the only writer of its group's dQ, and the scores need not
    be recomputed in a second pass.
    """
    batch, seqlen_q, nheads_q = q.shape[0], q.shape[1], q.shape[2]
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads_q // nheads_kv
    dp = q.shape[3]
    n_kt = (seqlen_k + BLOCK_N - 1) // BLOCK_N
    n_chunks = (n_kt + kt_per_unit - 1) // kt_per_unit
    for u in prange(batch * nheads_kv * n_chunks):
        b = u // (nheads_kv * n_chunks)
        hk = (u // n_chunks) % nheads_kv
        chunk = u % n_chunks
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        k_t = np.empty((head_dim, BLOCK_N), q.dtype)
        v_t = np.empty((head_dim, BLOCK_N), q.dtype)
        q_tail = np.empty((BLOCK_M, dp), q.dtype)   # a last, partial query tile, zero-padded
        do_tail = np.empty((BLOCK_M, dp), q.dtype)
        s = np.empty((BLOCK_M, BLOCK_N), q.dtype)
        dps = np.empty((BLOCK_M, BLOCK_N), q.dtype)
        dcap = np.empty((BLOCK_M, BLOCK_N) if softcap > 0 else (1, 1), q.dtype)
        dk_acc = np.empty((BLOCK_N, dp), q.dtype)
        dv_acc = np.empty((BLOCK_N, dp), q.dtype)
        kv_tile = np.empty((BLOCK_N, dp), q.dtype)
        q_tile = np.empty((BLOCK_M, dp), q.dtype)
        for kt in range(chunk * kt_per_unit, min(n_kt, (chunk + 1) * kt_per_unit)):
            j0 = kt * BLOCK_N
            nk = min(BLOCK_N, seqlen_k - j0)
            k_rows = k[b, j0:j0 + nk, hk]
            _load_transposed(k_t, k_rows, nk, head_dim)
            _load_transposed(v_t, v[b, j0:j0 + nk, hk], nk, head_dim)
            dk_acc[:] = 0
            dv_acc[:] = 0
            qt_first, qt_end = _query_tiles_seeing(j0, j0 + nk, seqlen_q, seqlen_k, left, right)
            for h in range(hk * group, (hk + 1) * group):
                for qt in range(qt_first, qt_end):
                    i0 = qt * BLOCK_M
                    nq = min(BLOCK_M, seqlen_q - i0)
                    _, _, full_lo, full_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
                    q_rows = q[b, i0:i0 + nq, h]
                    qs_rows = qs[b, i0:i0 + nq, h]
                    do_rows = dout[b, i0:i0 + nq, h]
                    if nq == BLOCK_M:
                        _mm_dot(s, qs_rows, k_t, head_dim)
                        _mm_dot(dps, do_rows, v_t, head_dim)
                    else:  # the products read whole tiles of their A operand: pad the partial one
                        _load_rows(q_tail, qs_rows, nq, dp)
                        _load_rows(do_tail, do_rows, nq, dp)
                        _mm_dot(s, q_tail, k_t, head_dim)
                        _mm_dot(dps, do_tail, v_t, head_dim)
                    _probs_and_dscores_rows(s, dps, dcap, row_max[b, h], row_inv[b, h], delta[b, h], i0, j0, nk,
                                            row_lo, row_hi, full_lo, full_hi, scale, softcap)
                    # P and dS are 0 where a query does not see a key; a non-finite row of Q, dO or K must not
                    # reach those pairs through 0 * nan (see _visible_product). Only masked blocks have such pairs.
                    masked = not (full_lo <= j0 and j0 + nk <= full_hi)
                    _tile_product_add(dv_acc, kv_tile, s, do_rows, nq, True, False, masked, j0, row_lo, row_hi)
                    _tile_product_add(dk_acc, kv_tile, dps, q_rows, nq, True, False, masked, j0, row_lo, row_hi)
                    if fuse_dq:
                        _tile_product_add(dq_acc[b, h, i0:i0 + BLOCK_M], q_tile, dps, k_rows, nk, False, True,
                                          masked, j0, row_lo, row_hi)
            _store_rows(dk[b, j0:j0 + nk, hk], dk_acc, nk, head_dim)
            _store_rows(dv[b, j0:j0 + nk, hk], dv_acc, nk, head_dim)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _backward_dq_kernel(qs, k, v, dout, row_max, row_inv, delta, dq, head_dim, scale, left, right, softcap):
    """dQ, one prange iteration per (batch, query head, query tile): it recomputes P and dS for the key tiles its
    rows see and is the only writer of its dq rows. qs, k, v, dout, row_max, row_inv, delta as in
    ``_backward_kv_kernel``;
    dq: (B, Sq, Hq, >= D), any strides, written."""
    batch, seqlen_q, nheads_q = qs.shape[0], qs.shape[1], qs.shape[2]
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads_q // nheads_kv
    dp = qs.shape[3]
    n_qt = (seqlen_q + BLOCK_M - 1) // BLOCK_M
    for u in prange(batch * nheads_q * n_qt):
        b = u // (nheads_q * n_qt)
        h = (u // n_qt) % nheads_q
        qt = u % n_qt
        hk = h // group
        i0 = qt * BLOCK_M
        nq = min(BLOCK_M, seqlen_q - i0)
        row_lo = np.empty(BLOCK_M, np.int64)
        row_hi = np.empty(BLOCK_M, np.int64)
        span_lo, span_hi, full_lo, full_hi = _tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
        q_t = np.empty((head_dim, BLOCK_M), qs.dtype)
        do_t = np.empty((head_dim, BLOCK_M), qs.dtype)
        _load_transposed(q_t, qs[b, i0:i0 + nq, h], nq, head_dim)
        _load_transposed(do_t, dout[b, i0:i0 + nq, h], nq, head_dim)
        k_tail = np.zeros((BLOCK_N, dp), qs.dtype)
        v_tail = np.zeros((BLOCK_N, dp), qs.dtype)
        st = np.empty((BLOCK_N, BLOCK_M), qs.dtype)
        dpt = np.empty((BLOCK_N, BLOCK_M), qs.dtype)
        dcap = np.empty((BLOCK_N, BLOCK_M) if softcap > 0 else (1, 1), qs.dtype)
        acc = np.zeros((BLOCK_M, dp), qs.dtype)
        tile = np.empty((BLOCK_M, dp), qs.dtype)
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            nk = min(BLOCK_N, seqlen_k - j0)
            if nk == BLOCK_N:
                kr = k[b, j0:j0 + BLOCK_N, hk]
                vr = v[b, j0:j0 + BLOCK_N, hk]
            else:  # a last, partial key tile: the products read whole tiles, so pad it with zero rows
                _load_rows(k_tail, k[b, j0:j0 + nk, hk], nk, head_dim)
                _load_rows(v_tail, v[b, j0:j0 + nk, hk], nk, head_dim)
                kr = k_tail[:, :]
                vr = v_tail[:, :]
            _mm_dot(st, kr, q_t, head_dim)
            _mm_dot(dpt, vr, do_t, head_dim)
            _probs_and_dscores_cols(st, dpt, dcap, row_max[b, h], row_inv[b, h], delta[b, h], i0, j0, nk, row_lo,
                                    row_hi, full_lo, full_hi, scale, softcap)
            _tile_product_add(acc, tile, dpt, kr, nk, True, True, not (full_lo <= j0 and j0 + nk <= full_hi), j0,
                              row_lo, row_hi)
        _store_rows(dq[b, i0:i0 + nq, h], acc, nq, head_dim)


# ---------------------------------------------------------------------------------------------------------------
# Packing


def _copy_rows(dst, src, n, width):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_copy_rows, inline="always")
def _copy_rows_impl(dst, src, n, width):
    if _rows_f32(dst, src):
        return lambda dst, src, n, width: _copy_rows_f32(dst, src, n, width)

    def impl(dst, src, n, width):
        for r in range(n):
            for d in range(width):
                dst[r, d] = src[r, d]
    return impl


def _rows_codegen(nan_nonfinite: bool) -> Callable:
    """IR for dst[:n, :width] = src[:n, :width] on float32 2-D arrays with unit-stride rows, a vector at a time;
    with ``nan_nonfinite``, every value that is not finite is stored as NaN (the contract reports non-finite
    results as NaN)."""

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, _LANES)
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        dst_a, src_a = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:2], args[:2]))
        rows = context.cast(builder, args[2], signature.args[2], types.int64)
        width = context.cast(builder, args[3], signature.args[3], types.int64)
        d_stride = cgutils.unpack_tuple(builder, dst_a.strides, 2)[0]
        s_stride = cgutils.unpack_tuple(builder, src_a.strides, 2)[0]
        d_base = builder.bitcast(dst_a.data, i8p)
        s_base = builder.bitcast(src_a.data, i8p)
        n_vec = builder.udiv(width, ir.Constant(i64, _LANES))

        def value(x, ty, lanes):
            if not nan_nonfinite:
                return x
            fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty]),
                                                  f"llvm.fabs.v{lanes}f32" if lanes else "llvm.fabs.f32")
            inf = ir.Constant(ty, [float("inf")] * lanes if lanes else float("inf"))
            nan = ir.Constant(ty, [float("nan")] * lanes if lanes else float("nan"))
            return builder.select(builder.fcmp_ordered("<", builder.call(fabs, [x]), inf), x, nan)

        with cgutils.for_range(builder, rows) as row:
            d_row = builder.gep(d_base, [builder.mul(row.index, d_stride)])
            s_row = builder.gep(s_base, [builder.mul(row.index, s_stride)])
            d_vec, s_vec = (builder.bitcast(p, vty.as_pointer()) for p in (d_row, s_row))
            with cgutils.for_range(builder, n_vec) as col:
                x = value(builder.load(builder.gep(s_vec, [col.index]), align=4), vty, _LANES)
                builder.store(x, builder.gep(d_vec, [col.index]), align=4)
            d_flt, s_flt = (builder.bitcast(p, f32.as_pointer()) for p in (d_row, s_row))
            tail = builder.mul(n_vec, ir.Constant(i64, _LANES))
            with cgutils.for_range_slice(builder, tail, width, ir.Constant(i64, 1)) as (col, _):
                x = value(builder.load(builder.gep(s_flt, [col])), f32, None)
                builder.store(x, builder.gep(d_flt, [col]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _copy_rows_f32(typingctx, dst, src, n, width):
    """dst[:n, :width] = src[:n, :width] for float32 2-D arrays with unit-stride rows, a vector at a time."""
    if not _rows_f32(dst, src):
        return None
    return types.none(dst, src, n, width), _rows_codegen(False)


@intrinsic
def _store_rows_f32(typingctx, dst, src, n, width):
    """The same, storing every non-finite value as NaN."""
    if not _rows_f32(dst, src):
        return None
    return types.none(dst, src, n, width), _rows_codegen(True)


def _store_rows(dst, src, n, width):  # pragma: no cover - typed by the overload below
    """dst[:n, :width] = src[:n, :width], every non-finite value stored as NaN; dst and src 2-D, src with
    unit-stride rows, dst any strides (vectorised where its rows are unit-stride, which the backend's are)."""
    raise NotImplementedError


@njit(cache=True)  # a call, not inlined: only strided outputs take it (and inlining it tripped numba's SSA check)
def _store_rows_loop(dst, src, n, width):
    inf = _as_dtype_of(dst, np.inf)
    nan = _as_dtype_of(dst, np.nan)
    for r in range(n):
        for d in range(width):
            g = src[r, d]
            dst[r, d] = g if abs(g) < inf else nan


@overload(_store_rows, inline="always")
def _store_rows_impl(dst, src, n, width):
    if _rows_f32(dst, src):
        def impl(dst, src, n, width):
            if dst.strides[1] == 4:
                _store_rows_f32(dst, src, n, width)
            else:
                _store_rows_loop(dst, src, n, width)
        return impl
    return lambda dst, src, n, width: _store_rows_loop(dst, src, n, width)


@njit(parallel=True, cache=True)
def _pack_kernel(src, dst, head_dim, unit_stride):
    """dst[b, h, s, :D] = src[b, s, h, :D] and zero in dst's columns D.., in parallel over runs of 256 rows.
    src (B, S, H, D) any strides (``unit_stride``: its last axis is); dst (B, H, S, D_pad) C-contiguous."""
    batch, seqlen, nheads = src.shape[0], src.shape[1], src.shape[2]
    n_runs = (seqlen + 255) // 256
    zero = _as_dtype_of(dst, 0.0)
    for u in prange(batch * nheads * n_runs):
        b = u // (nheads * n_runs)
        h = (u // n_runs) % nheads
        s0 = (u % n_runs) * 256
        n = min(256, seqlen - s0)
        d_rows = dst[b, h, s0:s0 + n]
        s_rows = src[b, s0:s0 + n, h]
        if unit_stride:  # else the IR copy (float32) would read the wrong elements
            _copy_rows(d_rows, s_rows, n, head_dim)
        else:
            for r in range(n):
                for d in range(head_dim):
                    d_rows[r, d] = s_rows[r, d]
        for r in range(n):
            for d in range(head_dim, dst.shape[3]):
                d_rows[r, d] = zero


@njit(parallel=True, cache=True)
def _pack_scaled_kernel(src, dst, head_dim, factor):
    """dst[b, h, s, :D] = src[b, s, h, :D] * factor (one rounding, as the forward scales Q) and zero in dst's columns
    D..; src (B, S, H, D) any strides, dst (B, H, S, D_pad) C-contiguous."""
    batch, seqlen, nheads = src.shape[0], src.shape[1], src.shape[2]
    n_runs = (seqlen + 255) // 256
    zero = _as_dtype_of(dst, 0.0)
    f = _as_dtype_of(dst, factor)
    for u in prange(batch * nheads * n_runs):
        b = u // (nheads * n_runs)
        h = (u // n_runs) % nheads
        s0 = (u % n_runs) * 256
        n = min(256, seqlen - s0)
        for r in range(n):
            for d in range(head_dim):
                dst[b, h, s0 + r, d] = src[b, s0 + r, h, d] * f
            for d in range(head_dim, dst.shape[3]):
                dst[b, h, s0 + r, d] = zero


@njit(parallel=True, cache=True)
def _row_dot_kernel(a, b, res):
    """res[b, h, s] = a[b, s, h, :] . b[b, s, h, :] summed as ``_mm_dot`` sums (chains of fused multiply-adds from
    0, in order of d, in chunks of ``_DOT_CHUNK`` added in order): delta = dO . O then cancels dP = dO . v exactly
    where a row sees one key (O = v), so dS = P (dP - delta) is exactly 0 there, as torch's is.
    a, b (B, S, H, D) any strides; res (B, H, >= S)."""
    batch, seqlen, nheads, width = a.shape
    for u in prange(batch * nheads):
        bi = u // nheads
        h = u % nheads
        for s in range(seqlen):
            total = _as_dtype_of(res, 0.0)
            for k0 in range(0, width, _DOT_CHUNK):
                acc = _as_dtype_of(res, 0.0)
                for d in range(k0, min(width, k0 + _DOT_CHUNK)):
                    acc = _fma(a[bi, s, h, d], b[bi, s, h, d], acc)
                total = acc if k0 == 0 else total + acc
            res[bi, h, s] = total


@njit(parallel=True, cache=True)
def _store_dq_kernel(dq_acc, dq, head_dim):
    """dq[b, s, h, :D] = dq_acc[b, h, s, :D] for the fused backward, NaN where not finite (the contract reports
    every non-finite result as NaN). dq_acc (B, H, >= S, D_pad) C-contiguous; dq (B, S, H, >= D) any strides."""
    batch, seqlen, nheads = dq.shape[0], dq.shape[1], dq.shape[2]
    for u in prange(batch * nheads):
        b = u // nheads
        h = u % nheads
        _store_rows(dq[b, :, h], dq_acc[b, h], seqlen, head_dim)


# ---------------------------------------------------------------------------------------------------------------
# Host side


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


_entries: dict[tuple[Any, Any], Any] = {}
_entries_lock = threading.Lock()


def _entry(kernel: Any, dtype: np.dtype) -> Any:
    """The compiled ``kernel`` for ``dtype``. The caller's arrays are typed layout-generic ('A'), so that
    C-contiguous, transposed and strided views share one compilation (numba would otherwise compile, and cache, one
    per layout combination); the buffers this module allocates are typed C-contiguous, which lets LLVM vectorise the
    loops that read them (lse, delta). The first call of a process loads the kernel from numba's on-disk cache."""
    fn = _entries.get((kernel, dtype))
    if fn is None:
        key = (kernel.py_func.__name__, np.dtype(dtype).name)
        nb = numba.from_dtype(np.dtype(dtype))
        user = {n: types.Array(nb, n, "A") for n in (3, 4)}
        own = {n: types.Array(nb, n, "C") for n in (3, 4, 5)}
        i64, f64, boolean = types.int64, types.float64, types.boolean
        sigs = {
            "_forward_kernel": (user[4], user[4], user[4], user[4], user[3], i64, f64, i64, i64, f64, own[3], own[3],
                                boolean),
            "_backward_kv_kernel": (user[4], user[4], user[4], user[4], user[4], own[3], own[3], own[3], own[4],
                                    user[4], user[4], i64, f64, i64, i64, f64, i64, boolean),
            "_backward_dq_kernel": (user[4], user[4], user[4], user[4], own[3], own[3], own[3], user[4], i64, f64, i64,
                                    i64, f64),
            "_pack_kernel": (user[4], own[4], i64, boolean),
            "_pack_scaled_kernel": (user[4], own[4], i64, f64),
            "_row_dot_kernel": (user[4], user[4], own[3]),
            "_store_dq_kernel": (own[4], user[4], i64),
        }
        with _entries_lock:
            fn = _entries.get((kernel, dtype))
            if fn is None:
                fn = _entries[(kernel, dtype)] = kernel.compile(sigs[key[0]])
    return fn


# Scratch buffers (packed K/V/Q/dO, dQ accumulators, lse/delta rows) are reused between calls on a thread.
# Fresh multi-MiB numpy buffers are madvised for huge pages, and faulting them in stalled on memory compaction here:
# the (1, 32, 512, 128) forward took a median of 35.9 ms with fresh buffers and 23.0 ms with reused ones (min of
# both ~22.5 ms). Buffers above the cap are not kept: their cost is small next to the O(S^2) work they serve.
# Each calling thread keeps its own until it exits or calls clear_workspace(): up to 2 x the cap after a forward
# (K, V) and 5 x the cap after a backward (Q, K, V, dO, dQ), plus the small lse/delta rows.
WORKSPACE_ENV = "NUMBA_FLASH_CPU_SCRATCH_MIB"


def _workspace_cap_from_env() -> int:
    text = os.environ.get(WORKSPACE_ENV, "").strip()
    try:
        return max(0, int(float(text) * 2**20)) if text else 64 << 20
    except ValueError:
        raise ValueError(f"{WORKSPACE_ENV}: expected a number of MiB, got {text!r}") from None


WORKSPACE_MAX_BYTES = _workspace_cap_from_env()
_workspace = threading.local()


def _scratch(slot: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` for use inside one call, backed by this thread's buffer
    for ``slot`` (grown as needed) when it fits ``WORKSPACE_MAX_BYTES``."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffers = _workspace.__dict__.setdefault("buffers", {})
    if slot in buffers and buffers[slot].nbytes > WORKSPACE_MAX_BYTES:  # kept under a larger cap set since
        del buffers[slot]
    if nbytes > WORKSPACE_MAX_BYTES:
        return np.empty(shape, dtype)
    buf = buffers.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[slot] = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def clear_workspace() -> None:
    """Free the scratch buffers this thread keeps between calls (at most ``WORKSPACE_MAX_BYTES`` each)."""
    _workspace.__dict__.pop("buffers", None)


def set_workspace_limit(nbytes: int) -> int:
    """Keep scratch buffers of at most ``nbytes`` each between calls (0: keep none); returns the previous limit.
    This thread's larger buffers are freed now, other threads' on their next call. The default is 64 MiB, or
    ``NUMBA_FLASH_CPU_SCRATCH_MIB`` when set at import."""
    global WORKSPACE_MAX_BYTES
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    previous, WORKSPACE_MAX_BYTES = WORKSPACE_MAX_BYTES, int(nbytes)
    buffers = _workspace.__dict__.get("buffers", {})
    for slot in [s for s, b in buffers.items() if b.nbytes > WORKSPACE_MAX_BYTES]:
        del buffers[slot]
    return previous


def workspace_bytes() -> int:
    """Bytes of scratch this thread keeps between calls."""
    return sum(b.nbytes for b in _workspace.__dict__.get("buffers", {}).values())


def _head_major(x: np.ndarray, head_dim: int, slot: str) -> np.ndarray:
    """A (B, S, H, D_pad) view of a C-contiguous (B, H, S, D_pad) buffer holding ``x`` (zero-padded to D_pad = D
    rounded up to 16): ``x`` itself when it already is one (a contiguous "bhsd" array, or "bshd" with H = 1), else a
    copy, in this thread's scratch buffer ``slot``.

    The kernels read K, V, Q and dO rows in place as micro-kernel operands. Head-major rows make a tile one
    contiguous block; in "bshd" a tile's rows sit H * D * 4 bytes apart, a power of two for the usual sizes, which
    maps them onto a few L1 sets and made the products about 1.4x slower in a microbenchmark (2 cores, D = 64,
    H = 8). The copy is O(B * H * S * D) against O(S^2) work: about 0.4 ms per 8 MiB here, on two threads."""
    t = x.transpose(0, 2, 1, 3)
    if t.flags.c_contiguous and head_dim % _D_ALIGN == 0:
        return x
    batch, seqlen, nheads, _ = x.shape
    buf = _scratch(slot, (batch, nheads, seqlen, _padded(head_dim, _D_ALIGN)), x.dtype)
    _entry(_pack_kernel, x.dtype)(x, buf, head_dim, x.strides[3] == x.itemsize)
    return buf.transpose(0, 2, 1, 3)


def _kernel_options(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, softcap: float,
                    dtype: np.dtype) -> tuple[int, int, float]:
    """Window bounds and softcap as the kernels take them: bounds capped at Sq + Sk (the same mask, and int64
    arithmetic that cannot overflow), the softcap as ``semantics.effective_softcap`` defines it for ``dtype``.
    ``validate_forward`` has done both for calls through a backend; this covers direct calls."""
    left, right = (clamp_window_bound(int(w), seqlen_q, seqlen_k) for w in (window_left, window_right))
    return left, right, effective_softcap(float(softcap), np.dtype(dtype).name)


def _score_scale(scale: float, softcap: float) -> float:
    """The factor the forward multiplies Q by (``qscale`` in ``_forward_kernel``)."""
    return float(scale)


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
        lse: (B, Hq, Sq), any strides; written with the natural-log sum of exp(score) over visible keys, +inf for a
            row that sees no key (its output row is 0).
        All arrays float32, or all float64; accumulation is in that dtype.
        scale: multiplies q.k; window_left / window_right: -1 = unbounded (causal is right = 0);
        softcap: 0 = off, else scores become softcap * tanh(score / softcap).
    """
    dtype = _check_dtypes(q, k, v, out, lse)
    head_dim = q.shape[3]
    left, right, softcap = _kernel_options(q.shape[1], k.shape[1], window_left, window_right, softcap, dtype)
    stats_shape = (q.shape[0], q.shape[2], _padded(q.shape[1], BLOCK_M))
    row_max, row_inv = np.empty(stats_shape, dtype), np.empty(stats_shape, dtype)
    _entry(_forward_kernel, dtype)(q, _head_major(k, head_dim, "k"), _head_major(v, head_dim, "v"), out, lse, head_dim,
                                   float(scale), left, right, softcap, row_max, row_inv, False)
    _stash_stats(lse, row_max, row_inv)


# The forward's row statistics, by the lse they produced, for the backward that follows (see _stashed_stats).
STASH_MAX_BYTES = 64 << 20
_stash: "OrderedDict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]" = OrderedDict()
_stash_lock = threading.Lock()
stats_passes = 0  # backward calls that had to recompute the statistics (for tests)


def _stash_key(lse: np.ndarray) -> tuple:
    return (lse.__array_interface__["data"][0], lse.shape, lse.strides, lse.dtype.str)


def _stash_stats(lse: np.ndarray, row_max: np.ndarray, row_inv: np.ndarray) -> None:
    """Keep a forward's row max and 1 / sum (B, Hq, Sq_pad) with a copy of the lse (B, Hq, Sq) they gave, the most
    recent first, within ``STASH_MAX_BYTES``."""
    entry = (np.array(lse, copy=True), row_max, row_inv)
    size = sum(a.nbytes for a in entry)
    if size > STASH_MAX_BYTES:
        return
    with _stash_lock:
        _stash[_stash_key(lse)] = entry
        _stash.move_to_end(_stash_key(lse), last=False)
        while sum(a.nbytes for e in _stash.values() for a in e) > STASH_MAX_BYTES:
            _stash.popitem(last=True)


def _stashed_stats(lse: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Copies of the row statistics of the forward that wrote ``lse``, if it is bit for bit what that forward
    wrote; else None. Safe whatever the caller did in between: statistics whose lse equals the given one bit for bit
    give P = exp(score - max) / sum = exp(score - lse) up to lse's own rounding, so at worst they are what
    recomputing P from lse would give, never another call's softmax."""
    with _stash_lock:
        entry = _stash.get(_stash_key(lse))
    if entry is None:
        return None
    kept, row_max, row_inv = entry
    bits = np.uint64 if kept.dtype.itemsize == 8 else np.uint32   # the key holds lse's shape and dtype
    if not np.array_equal(kept.view(bits), np.ascontiguousarray(lse).view(bits)):
        return None
    return row_max.copy(), row_inv.copy()


def _defer_to_caller_lse(lse: np.ndarray, row_max: np.ndarray, row_inv: np.ndarray) -> None:
    """Where the caller's lse (B, Hq, Sq) is not these keys' own, make P = exp(score - lse) instead of the
    recomputed statistics, in place on row_max and row_inv (B, Hq, Sq).

    The caller's lse says which softmax the gradient is of. Normally it is the forward's own over these keys, and
    the recomputed max and sum give that P with one rounding. Ring attention and split-KV training pass the lse of a
    softmax over more keys than this call holds (one block's share of the gradient); its P is exp(score - lse).
    A row takes the caller's lse when it differs from the local one by more than rounding (8 ulp), is NaN (a row
    poisoned elsewhere), or is +inf while the row sees keys here."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        given = lse.astype(np.float64)
        local = row_max.astype(np.float64) - np.log(row_inv.astype(np.float64))
        tolerance = 8 * np.finfo(lse.dtype).eps * np.maximum(1.0, np.abs(given))
        other = ~(np.abs(local - given) <= tolerance) & ~(np.isposinf(given) & np.isposinf(local))
    if other.any():
        row_max[other] = given[other]
        row_inv[other] = 1.0


def flash_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                   lse: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, scale: float,
                   window_left: int, window_right: int, softcap: float) -> None:
    """Gradients of ``sum(out * dout)`` with respect to q, k and v, written into dq, dk, dv.

    Arguments:
        dout, q, out: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); any strides, not modified.
        lse: (B, Hq, Sq), as written by ``flash_forward`` (+inf for rows that see no key), or the lse of a softmax
            over more keys than k holds (ring attention). Where it is these keys' own, the kernels use each row's
            max and sum recomputed from q and k (``_forward_kernel`` with ``stats_only``), which gives P with one
            rounding; elsewhere P = exp(score - lse) (``_defer_to_caller_lse``).
        dq: (B, Sq, Hq, D); dk, dv: (B, Sk, Hkv, D); any strides, contents ignored and overwritten. With GQA the
            gradients of a kv head are summed over the query heads of its group.
        All arrays float32, or all float64. scale, window_left, window_right, softcap as in ``flash_forward``.
    """
    dtype = _check_dtypes(dout, q, k, v, out, lse, dq, dk, dv)
    batch, seqlen_q, nheads_q, head_dim = q.shape
    nheads_kv = k.shape[2]
    window_left, window_right, softcap = _kernel_options(seqlen_q, k.shape[1], window_left, window_right, softcap,
                                                         dtype)
    sq_pad = _padded(seqlen_q, BLOCK_M)
    # delta_i = dO_i . O_i, the row term of the softmax gradient, summed the way dP = dO . v is (_row_dot_kernel).
    delta = _scratch("delta", (batch, nheads_q, sq_pad), dtype)
    delta[:, :, seqlen_q:] = 0
    _entry(_row_dot_kernel, dtype)(dout, out, delta)
    k_in, v_in = _head_major(k, head_dim, "k"), _head_major(v, head_dim, "v")
    # The forward's softmax statistics of every row, recomputed from the forward's own scores: P is then
    # exp(score - max) / sum with the forward's max and sum, not exp(score - lse) with lse rounded to float32
    # (which made P = 1 for one visible key come out 1 - 1e-7, and erred in proportion to |lse|).
    stashed = _stashed_stats(lse)
    if stashed is not None:
        row_max, row_inv = stashed
    else:
        global stats_passes
        stats_passes += 1
        row_max = _scratch("row_max", (batch, nheads_q, sq_pad), dtype)
        row_inv = _scratch("row_inv", (batch, nheads_q, sq_pad), dtype)
        no_lse = np.empty((1, 1, 1), dtype)
        _entry(_forward_kernel, dtype)(q, k_in, v_in, q, no_lse, head_dim, float(scale), window_left, window_right,
                                       softcap, row_max, row_inv, True)
    _defer_to_caller_lse(lse, row_max[:, :, :seqlen_q], row_inv[:, :, :seqlen_q])
    q_in, do_in = _head_major(q, head_dim, "q"), _head_major(dout, head_dim, "dout")
    qs = _scratch("qs", (batch, nheads_q, seqlen_q, q_in.shape[3]), dtype)
    _entry(_pack_scaled_kernel, dtype)(q, qs, head_dim, _score_scale(scale, softcap))
    qs_in = qs.transpose(0, 2, 1, 3)
    # Fusing dQ into the key-tile pass saves recomputing P and dS, but it needs one iteration per (batch, kv head)
    # to own all key tiles; do it only when there are enough of those to keep every thread busy.
    fuse_dq = batch * nheads_kv >= 2 * numba.get_num_threads()
    n_kt = -(-k.shape[1] // BLOCK_N)
    dq_acc = _scratch("dq", (batch, nheads_q, sq_pad, q_in.shape[3]) if fuse_dq else (1, 1, 1, 1), dtype)
    dq_acc.fill(0)
    _entry(_backward_kv_kernel, dtype)(q_in, qs_in, k_in, v_in, do_in, row_max, row_inv, delta, dq_acc, dk, dv,
                                       head_dim, float(scale), window_left, window_right, softcap,
                                       n_kt if fuse_dq else 1, fuse_dq)
    if fuse_dq:
        _entry(_store_dq_kernel, dtype)(dq_acc, dq, head_dim)
    else:
        _entry(_backward_dq_kernel, dtype)(qs_in, k_in, v_in, do_in, row_max, row_inv, delta, dq, head_dim,
                                           float(scale), window_left, window_right, softcap)
