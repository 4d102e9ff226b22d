"""What the CPU kernels inline everywhere: tile sizes, the SIMD width the micro-kernels are written for (512-bit
vectors where the CPU numba compiles for has AVX-512, else 256-bit; ``NUMBA_FLASH_CPU_SIMD`` forces one), and the
scalar arithmetic of the online softmax: ``exp2`` as a polynomial on the float's bits (``fast_exp2``; ``math.exp``
is a libm call LLVM cannot vectorise), fused multiply-add, softcap, and constants in the array's own dtype.
"""

from __future__ import annotations

import math
import os
import warnings

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

BLOCK_M = 64  # query rows per tile
BLOCK_N = 64  # keys per tile
D_ALIGN = 16  # head dims are padded to a multiple of this in the accumulators (a 512-bit vector of float32)

# No 'nnan'/'ninf': the online softmax relies on -inf and +inf comparing correctly.
FASTMATH = {"contract", "reassoc", "nsz", "arcp", "afn"}

SIMD_ENV = "NUMBA_FLASH_CPU_SIMD"


def _simd_lanes() -> int:
    """float32 lanes of the vectors the micro-kernel is written with: 16 where the CPU numba compiles for has
    AVX-512, else 8. ``NUMBA_FLASH_CPU_SIMD=256`` forces the 256-bit kernel (for testing it on an AVX-512 CPU)."""
    forced = os.environ.get(SIMD_ENV, "").strip().lower()
    if forced in ("256", "avx2"):
        return 8
    if forced in ("512", "avx512"):
        return 16
    if forced:   # a typo must not pass for the width asked for
        warnings.warn(f"{SIMD_ENV}={os.environ[SIMD_ENV]!r} is none of 256, avx2, 512, avx512: ignored, the width "
                      "follows the CPU's features", RuntimeWarning, stacklevel=2)
    features = numba.config.CPU_FEATURES
    if features is None:
        try:
            from llvmlite import binding as llvm

            features = llvm.get_host_cpu_features().flatten()
        except Exception:  # a host llvmlite cannot describe: the narrow kernel runs everywhere
            return 8
    return 16 if "+avx512f" in features.split(",") else 8


LANES = _simd_lanes()
MR = 8 if LANES == 16 else 4  # rows of C per register block: 2 * MR accumulators, 16 of the 32 zmm / 8 of 16 ymm
NR = 2 * LANES  # columns of C per register block
# Rows of the tall register block the products run on before a last MR-row one. With 256-bit vectors 4 x 16
# keeps 8 FMA chains in flight, just the 2 ports x 4 cycles of FMA latency, and loads 6 values per 8 FMAs; 6 x 16
# keeps 12 (2 loads per 3 FMAs) in 15 of Haswell's 16 ymm registers (8 rows would spill). 512-bit: MR itself.
MR_TALL = MR if LANES == 16 else 6

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
EXP2_MIN = np.float32(-127.0)  # 2^-127 comes out of _pow2 as exactly 0: masked scores give p = 0, not ~1e-38
_EXP2_MAX = np.float32(127.0)
ONE_F32 = np.float32(1.0)
# 2^f = 1 + f (P1 + f (P2 + ... + f P6)) on |f| <= 1/2 (EXP2_P1 .. EXP2_P6): a degree-6 polynomial fitted to 2^f
# by minimising the largest relative error (``tools/exp2_poly_fit.py``: Lawson's iteration on weighted least squares
# in float64, then rounded to float32), where Taylor's series of exp(f ln 2) needs degree 7 for the same accuracy.
# Evaluated in float32 by Horner's rule with fused multiply-adds it is within 0.94 ulp of 2^f on a 2-million-point
# grid (Taylor's degree 7: 0.86, degree 6: 2.6); test_simd_math holds both builds of exp2 to 1 ulp. P0 = 1, so
# 2^0 = 1.
EXP2_P1 = np.float32(0.6931471824645996)
EXP2_P2 = np.float32(0.24022646248340607)
EXP2_P3 = np.float32(0.05550328642129898)
EXP2_P4 = np.float32(0.009618489071726799)
EXP2_P5 = np.float32(0.0013399930903688073)
EXP2_P6 = np.float32(0.0001534581242594868)


# n + 1.5 * 2**m (m mantissa bits) holds the integer n in its low mantissa bits (for |n| < 2**(m - 1)): bitcast,
# minus these bits, is n. Per width: (m, 1.5 * 2**m, its bits minus the exponent bias).
_POW2_CONSTANTS = {32: (23, 12582912.0, 0x4B400000 - 127), 64: (52, 6755399441055744.0, 0x4338000000000000 - 1023)}


def _pow2_bits(builder, n, fty, ity):
    """IR: 2**n for float ``n`` (scalar or vector type ``fty``, ints ``ity`` of the same width, 32 or 64 bits)
    holding an integer in [-bias, bias] (127 for float32, 1023 for float64), built from the exponent bits; n = -bias
    gives the bit pattern of +0.0. The integer comes from the bits of ``n + 1.5 * 2**m`` rather than from fptosi,
    whose result for a NaN is poison in LLVM: a NaN n gives some defined bit pattern here, and the NaN of the
    polynomial it multiplies carries on."""
    lanes = getattr(fty, "count", None)
    width = (ity.element if lanes else ity).width
    mantissa, magic, magic_bits = _POW2_CONSTANTS[width]

    def const(ty, x):
        return ir.Constant(ty, [x] * lanes if lanes else x)

    t = builder.fadd(n, const(fty, magic))
    bits = builder.sub(builder.bitcast(t, ity), const(ity, magic_bits))
    return builder.bitcast(builder.shl(bits, const(ity, mantissa)), fty)


@intrinsic
def _pow2(typingctx, n):
    """2**n for a float32 or float64 ``n`` holding an integer in [-bias, bias] (127 or 1023; see ``_pow2_bits``)."""
    if n not in (types.float32, types.float64):
        return None
    fty, ity = (ir.FloatType(), ir.IntType(32)) if n == types.float32 else (ir.DoubleType(), ir.IntType(64))

    def codegen(context, builder, signature, args):
        return _pow2_bits(builder, args[0], fty, ity)

    return n(n), codegen


def exp2_split_codegen(builder, x, fty, ity):
    """IR: (f, 2**n) for float32 x (scalar or vector) in [-127, 127]: n = x rounded to the nearest integer (ties to
    even; ``llvm.rint``, one instruction where floor(x + 1/2) took two, and one that fast-math cannot fold away as it
    would (x + 1.5 * 2**23) - 1.5 * 2**23), f = x - n in [-1/2, 1/2], 2**n from the exponent bits."""
    suffix = f"v{fty.count}f32" if isinstance(fty, ir.VectorType) else "f32"
    rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(fty, [fty]), f"llvm.rint.{suffix}")
    n = builder.call(rint, [x])
    return builder.fsub(x, n), _pow2_bits(builder, n, fty, ity)


@intrinsic
def _exp2_split(typingctx, x):
    """(f, 2**n) of ``exp2_split_codegen`` for a float32 x in [-127, 127]: the split the vectorised pass
    (``passes``) and the scalar ``fast_exp2`` share, so that both give the same bits."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        pair = exp2_split_codegen(builder, args[0], ir.FloatType(), ir.IntType(32))
        return context.make_tuple(builder, signature.return_type, pair)

    return types.UniTuple(types.float32, 2)(x), codegen


def fast_exp2(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(fast_exp2, inline="always")
def _fast_exp2_impl(x):
    if x == types.float32:
        def impl(x):
            # n = round(x), |f| <= 1/2, and the degree-6 polynomial above is within 1 ulp of 2^f. Pure
            # arithmetic, so loops over it vectorise. -inf (a masked score, or lse = +inf for a row that sees no
            # key) clamps to -127 and comes out as exactly 0. A NaN (a poisoned row's lse) stays NaN, never a
            # probability of 0: max and min return their first argument unless the second compares larger/smaller
            # (Python's semantics, which numba keeps), so x must stay first.
            c = min(max(x, EXP2_MIN), _EXP2_MAX)
            f, scale = _exp2_split(c)
            p = ONE_F32 + f * (EXP2_P1 + f * (EXP2_P2 + f * (EXP2_P3 + f * (EXP2_P4 + f * (EXP2_P5 + f * EXP2_P6)))))
            return p * scale
        return impl
    if x == types.float64:
        def impl(x):
            return math.exp(x * LN2)
        return impl
    return None


@intrinsic
def _fdiv(typingctx, a, b):
    """a / b for two float64s as one IEEE division, without the zero-divisor test (and ZeroDivisionError) that
    numba's Python error model puts around ``/``: that test keeps LLVM from vectorising the loop around it."""
    if not (a == b == types.float64):
        return None
    sig = types.float64(a, b)

    def codegen(context, builder, signature, args):
        return builder.fdiv(args[0], args[1])

    return sig, codegen


_LN2_HI = 0.6931471803691238     # ln 2 with its last 32 bits zero: n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.9082149292705877e-10
_INV_LN2 = 1.4426950408889634
# exp(r) - 1 = r + r^2 (1/2! + r (1/3! + ... + r / 13!)): the Taylor coefficients, as scalars (numba folds global
# floats into the code; a global tuple is unpickled at run time, which stops the loop around it vectorising)
_T2, _T3, _T4, _T5, _T6, _T7, _T8, _T9, _T10, _T11, _T12, _T13 = (
    1.0 / math.factorial(i) for i in range(2, 14))


@njit(inline="always", cache=True)
def tanh64(y):
    """tanh of a float64 in arithmetic only, so that loops over it vectorise (``math.tanh`` is a scalar libm call:
    with it a forward with softcap took 4.15x the plain one at S=4096, D=64, with this 1.40x).
    tanh |y| = e / (e + 2) with e = expm1(2 |y|) = 2**n (1 + p(r)) - 1, r = 2|y| - n ln 2 in [-ln2/2, ln2/2] and
    p(r) = exp(r) - 1 by its Taylor series to r^13 (truncation below 1e-17 relative); for n = 0 e is p(r) itself,
    so small arguments lose nothing to cancellation. Within a few ulp of libm's tanh; NaN stays NaN, +-inf gives
    +-1."""
    a = min(abs(y), 20.0)   # NaN first: min keeps it; tanh(20) is 1 in float64
    z = a + a
    n = np.floor(z * _INV_LN2 + 0.5)
    r = (z - n * _LN2_HI) - n * _LN2_LO
    p = _T13
    p = p * r + _T12
    p = p * r + _T11
    p = p * r + _T10
    p = p * r + _T9
    p = p * r + _T8
    p = p * r + _T7
    p = p * r + _T6
    p = p * r + _T5
    p = p * r + _T4
    p = p * r + _T3
    p = p * r + _T2
    em1 = r + r * r * p
    scale = _pow2(n)
    e = scale * em1 + (scale - 1.0)
    t = _fdiv(e, e + 2.0)
    return -t if y < 0 else t


def fma(a, b, c):  # pragma: no cover - typed by the intrinsic below
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


@overload(fma, inline="always")
def _fma_impl(a, b, c):
    return lambda a, b, c: _fma_intrinsic(a, b, c)


def fast_exp(x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


LOG2E_F32 = np.float32(LOG2E)


@overload(fast_exp, inline="always")
def _fast_exp_impl(x):
    """exp(x) for x <= 0 (or -inf, NaN): ``fast_exp2(x * log2 e)`` in float32. The kernels apply it to differences
    score - row max only, so that the rounding of log2 e (1.3e-8 relative) scales |score - max|, which is small
    wherever P is not, rather than the score itself: scores kept in base 2 carried that rounding, and the one of
    the base-2 scale, into every score, an error as large as the scores (at softcap 50, 4e-6 in P)."""
    if x == types.float32:
        return lambda x: fast_exp2(x * LOG2E_F32)
    if x == types.float64:
        return lambda x: math.exp(x)
    return None


def as_dtype_of(a, x):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(as_dtype_of, inline="always")
def _as_dtype_of_impl(a, x):
    """``x`` converted to the element type of array ``a``: keeps float32 kernels from drifting to float64 through
    Python-float arguments."""
    dt = a.dtype

    def impl(a, x):
        return dt(x)

    return impl
