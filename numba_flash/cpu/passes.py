"""Vector passes over a score block and over tile rows, in LLVM IR for float32 (plain loops for float64): the
online softmax's column max and column sum of exp2 over a (keys x queries) block, the finiteness check of a tile's
rows, and the row copies that load tiles and store results (``store_rows`` turns non-finite values into NaN).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .simd import (BLOCK_M, EXP2_MIN, EXP2_P1, EXP2_P2, EXP2_P3, EXP2_P4, EXP2_P5, EXP2_P6, LANES, LOG2E_F32, ONE_F32,
                   as_dtype_of, exp2_split_codegen, fast_exp)
from .microkernels import rows_f32

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
    visible and -inf can only come from the data) or a NaN ('max_nan': a block ``mask_scores`` has been through,
    where -inf means masked and a visible non-finite score is already NaN). A NaN max poisons the query: its
    exp2s, sum and output become NaN. kind 'exp2': st[c] = 2 ** (st[c] - shift) for every c < nk and
    stat += sum_c st[c], where shift (BLOCK_M,) is the third array and every st[c] - shift <= 0 or NaN (clamped
    at -127, which comes out as exactly 0; a NaN stays NaN)."""
    lanes = LANES

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

        flags = ("contract",)
        nan = splat(float("nan"))

        def exp2_nonpos(x):
            # 2^x as fast_exp2 computes it: n = x rounded to nearest, f = x - n, the degree-6 polynomial in f
            # times 2^n. The clamp is a compare that a NaN fails (llvm.maxnum would turn a NaN into -127, i.e.
            # p = 0).
            x = builder.select(builder.fcmp_ordered("<", x, splat(float(EXP2_MIN))), splat(float(EXP2_MIN)), x)
            f, scale = exp2_split_codegen(builder, x, vty, ity)
            poly = splat(float(EXP2_P6))
            for coef in (EXP2_P5, EXP2_P4, EXP2_P3, EXP2_P2, EXP2_P1, ONE_F32):
                poly = builder.fadd(builder.fmul(poly, f, flags=flags), splat(float(coef)), flags=flags)
            return builder.fmul(poly, scale)

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
                    # exp(x - shift) = 2^((x - shift) log2 e): scores are natural-log units (see fast_exp)
                    prob = exp2_nonpos(builder.fmul(builder.fsub(x, shift[ch]), splat(float(LOG2E_F32))))
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
    return (rows_f32(st) and isinstance(nk, types.Integer)
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


def column_max(st, nk, m, strict):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


def column_exp2_sum(st, nk, total, shift):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(column_max, inline="always")
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
        nan = as_dtype_of(m, np.nan)
        inf = as_dtype_of(m, np.inf)
        for c in range(nk):
            for r in range(st.shape[1]):
                x = st[c, r]
                if x > m[r]:  # false for a NaN m: it stays NaN
                    m[r] = x
                if x != x or (strict and not abs(x) < inf):
                    m[r] = nan
    return impl


@overload(column_exp2_sum, inline="always")
def _column_exp2_sum_impl(st, nk, total, shift):
    if _column_pass_ok(st, nk, total, shift):
        return lambda st, nk, total, shift: _column_exp2_sum_f32(st, nk, total, shift)

    def impl(st, nk, total, shift):
        for c in range(nk):
            for r in range(st.shape[1]):
                p = fast_exp(st[c, r] - shift[r])
                st[c, r] = p
                total[r] += p
    return impl


def rows_finite(rows, n):  # pragma: no cover - typed by the overload below
    """Whether rows[:n] (a 2-D view with unit-stride rows) holds only finite numbers."""
    raise NotImplementedError


@overload(rows_finite, inline="always")
def _rows_finite_impl(rows, n):
    if rows_f32(rows):
        return lambda rows, n: _rows_finite_f32(rows, n)
    return lambda rows, n: _rows_finite_any(rows, n)


@njit(cache=True)  # a call, not inlined: inlined, its loops tripped numba's SSA check (4 warnings per float64 build)
def _rows_finite_any(rows, n):
    """``rows_finite`` for any dtype: x * 0 summed over rows[:n], 0 unless some x is inf or NaN."""
    zero = as_dtype_of(rows, 0.0)
    acc = zero
    for c in range(n):
        for d in range(rows.shape[1]):
            acc += rows[c, d] * zero
    return acc == zero


@intrinsic
def _rows_finite_f32(typingctx, rows, n):
    """float32 ``rows_finite``: a vector sum of x * 0 along each row, which is 0 unless some x is inf or NaN.
    Written as IR because numba types the rows as strided ('A'), and the loop it compiles then runs one element at
    a time: 8192 of them per masked tile at D = 128 cost the causal forward 10%."""
    if not rows_f32(rows):
        return None

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, LANES)
        i64 = ir.IntType(64)
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        nrows = context.cast(builder, args[1], signature.args[1], types.int64)
        width = cgutils.unpack_tuple(builder, arr.shape, 2)[1]
        stride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
        base = builder.bitcast(arr.data, ir.IntType(8).as_pointer())
        zero_v = ir.Constant(vty, [0.0] * LANES)
        acc_v = cgutils.alloca_once_value(builder, zero_v)
        acc_s = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
        n_vec = builder.udiv(width, ir.Constant(i64, LANES))
        # no fast-math flags: x * 0 must stay NaN for an inf or NaN x
        with cgutils.for_range(builder, nrows) as row:
            row_p = builder.gep(base, [builder.mul(row.index, stride)])
            vec_p = builder.bitcast(row_p, vty.as_pointer())
            with cgutils.for_range(builder, n_vec) as col:
                x = builder.load(builder.gep(vec_p, [col.index]), align=4)
                builder.store(builder.fadd(builder.load(acc_v), builder.fmul(x, zero_v)), acc_v)
            flt_p = builder.bitcast(row_p, f32.as_pointer())
            tail = builder.mul(n_vec, ir.Constant(i64, LANES))
            with cgutils.for_range_slice(builder, tail, width, ir.Constant(i64, 1)) as (col, _):
                x = builder.load(builder.gep(flt_p, [col]))
                builder.store(builder.fadd(builder.load(acc_s), builder.fmul(x, ir.Constant(f32, 0.0))), acc_s)
        total = builder.load(acc_s)
        acc = builder.load(acc_v)
        for lane in range(LANES):
            total = builder.fadd(total, builder.extract_element(acc, ir.Constant(ir.IntType(32), lane)))
        return builder.fcmp_ordered("==", total, ir.Constant(f32, 0.0))

    return types.boolean(rows, n), codegen


# ---------------------------------------------------------------------------------------------------------------
# Packing


@njit(inline="always", cache=True)
def load_transposed(dst, src, n, head_dim):
    """dst[:head_dim, :n] = src[:n, :head_dim].T and zero in dst's columns n..; dst (D, BN), src a 2-D view
    (the backward's K^T, V^T, Q^T and dO^T tiles; a partial bias tile of the forward)."""
    zero = as_dtype_of(dst, 0.0)
    for c in range(n):
        for d in range(head_dim):
            dst[d, c] = src[c, d]
    for d in range(head_dim):
        for c in range(n, dst.shape[1]):
            dst[d, c] = zero


def copy_rows(dst, src, n, width):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(copy_rows, inline="always")
def _copy_rows_impl(dst, src, n, width):
    if rows_f32(dst, src):
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
        vty = ir.VectorType(f32, LANES)
        i64 = ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        dst_a, src_a = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:2], args[:2]))
        rows = context.cast(builder, args[2], signature.args[2], types.int64)
        width = context.cast(builder, args[3], signature.args[3], types.int64)
        d_stride = cgutils.unpack_tuple(builder, dst_a.strides, 2)[0]
        s_stride = cgutils.unpack_tuple(builder, src_a.strides, 2)[0]
        d_base = builder.bitcast(dst_a.data, i8p)
        s_base = builder.bitcast(src_a.data, i8p)
        n_vec = builder.udiv(width, ir.Constant(i64, LANES))

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
                x = value(builder.load(builder.gep(s_vec, [col.index]), align=4), vty, LANES)
                builder.store(x, builder.gep(d_vec, [col.index]), align=4)
            d_flt, s_flt = (builder.bitcast(p, f32.as_pointer()) for p in (d_row, s_row))
            tail = builder.mul(n_vec, ir.Constant(i64, LANES))
            with cgutils.for_range_slice(builder, tail, width, ir.Constant(i64, 1)) as (col, _):
                x = value(builder.load(builder.gep(s_flt, [col])), f32, None)
                builder.store(x, builder.gep(d_flt, [col]))
        return context.get_dummy_value()

    return codegen


@intrinsic
def _copy_rows_f32(typingctx, dst, src, n, width):
    """dst[:n, :width] = src[:n, :width] for float32 2-D arrays with unit-stride rows, a vector at a time."""
    if not rows_f32(dst, src):
        return None
    return types.none(dst, src, n, width), _rows_codegen(False)


@intrinsic
def _store_rows_f32(typingctx, dst, src, n, width):
    """The same, storing every non-finite value as NaN."""
    if not rows_f32(dst, src):
        return None
    return types.none(dst, src, n, width), _rows_codegen(True)


def store_rows(dst, src, n, width):  # pragma: no cover - typed by the overload below
    """dst[:n, :width] = src[:n, :width], every non-finite value stored as NaN; dst and src 2-D, src with
    unit-stride rows, dst any strides (vectorised where its rows are unit-stride, which the backend's are)."""
    raise NotImplementedError


@njit(cache=True)  # a call, not inlined: only strided outputs take it (and inlining it tripped numba's SSA check)
def _store_rows_loop(dst, src, n, width):
    inf = as_dtype_of(dst, np.inf)
    nan = as_dtype_of(dst, np.nan)
    for r in range(n):
        for d in range(width):
            g = src[r, d]
            dst[r, d] = g if abs(g) < inf else nan


@overload(store_rows, inline="always")
def _store_rows_impl(dst, src, n, width):
    if rows_f32(dst, src):
        def impl(dst, src, n, width):
            if dst.strides[1] == 4:
                _store_rows_f32(dst, src, n, width)
            else:
                _store_rows_loop(dst, src, n, width)
        return impl
    return lambda dst, src, n, width: _store_rows_loop(dst, src, n, width)
