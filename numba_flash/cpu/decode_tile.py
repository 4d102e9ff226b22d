"""The per-tile work of the CPU decode kernel (``decode``): a tile's scores, its online-softmax step and its
P V product, each a function compiled on its own and called once per tile of ``decode.BLOCK_N`` keys by every
work unit, with the two products over the head dim they run row by row.

The products are LLVM IR (``_dot_f32``, ``_pv_run_f32``) for float32, as in microkernels.py: written as numba
loops, LLVM's vectoriser took them or not depending on the code around them (one edit elsewhere in the kernel
made the P V loop scalar and the call 2x slower; the same loops in a function of their own were never
vectorised), and reading flat[off + d] made it gather, since numba's negative-index wrap on off + d cannot be
ruled out. The other paths (float64, a cache whose head dim is strided) run plain loops.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from numba_flash.cpu.cache_stamp import stamp_kernels
from numba_flash.cpu.score_terms import apply_score_terms
from numba_flash.cpu.simd import FASTMATH, LANES, LOG2E, as_dtype_of, fast_exp2

_DOT_CHAINS = 4  # independent accumulators in _dot_f32: one FMA chain would wait out its latency at every step
_PV_BLOCK = 8  # vectors of acc held in registers by _pv_run_f32 (8 x 16 = 128 floats with AVX-512)


def _f32_ptr(context, builder, aty, arr, oty, off):
    """IR pointer to element ``off`` of float32 array ``arr`` (of numba type ``aty``)."""
    data = context.make_array(aty)(context, builder, arr).data
    return builder.gep(builder.bitcast(data, ir.FloatType().as_pointer()),
                       [context.cast(builder, off, oty, types.int64)])


def _splat(builder, x, vty):
    undef = ir.Constant(vty, ir.Undefined)
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), vty.count), None)
    return builder.shuffle_vector(builder.insert_element(undef, x, ir.Constant(ir.IntType(32), 0)), undef, zeros)


def _dot_codegen(context, builder, signature, args):
    """IR for sum(a[a_off:a_off + n] * b[b_off:b_off + n]): _DOT_CHAINS vector accumulators over blocks of as
    many vectors, then single vectors, then a scalar tail. Only 'contract' flags: products fuse into FMAs, and no
    NaN or inf is assumed away."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vty = ir.VectorType(f32, LANES)
    a_ty, a_off_ty, b_ty, b_off_ty, n_ty = signature.args
    pa = _f32_ptr(context, builder, a_ty, args[0], a_off_ty, args[1])
    pb = _f32_ptr(context, builder, b_ty, args[2], b_off_ty, args[3])
    n = context.cast(builder, args[4], n_ty, types.int64)
    va, vb = builder.bitcast(pa, vty.as_pointer()), builder.bitcast(pb, vty.as_pointer())
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vty, None)) for _ in range(_DOT_CHAINS)]

    def fma(acc, x, y):
        builder.store(builder.fadd(builder.load(acc), builder.fmul(x, y, flags=("contract",)),
                                   flags=("contract",)), acc)

    n_vec = builder.udiv(n, ir.Constant(i64, LANES))
    n_blk = builder.udiv(n_vec, ir.Constant(i64, _DOT_CHAINS))
    with cgutils.for_range(builder, n_blk) as loop:
        first = builder.mul(loop.index, ir.Constant(i64, _DOT_CHAINS))
        for h in range(_DOT_CHAINS):
            i = builder.add(first, ir.Constant(i64, h))
            fma(accs[h], builder.load(builder.gep(va, [i]), align=4), builder.load(builder.gep(vb, [i]), align=4))
    done = builder.mul(n_blk, ir.Constant(i64, _DOT_CHAINS))
    with cgutils.for_range_slice(builder, done, n_vec, ir.Constant(i64, 1)) as (i, _):
        fma(accs[0], builder.load(builder.gep(va, [i]), align=4), builder.load(builder.gep(vb, [i]), align=4))
    acc_s = cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0))
    with cgutils.for_range_slice(builder, builder.mul(n_vec, ir.Constant(i64, LANES)), n,
                                 ir.Constant(i64, 1)) as (i, _):
        fma(acc_s, builder.load(builder.gep(pa, [i])), builder.load(builder.gep(pb, [i])))
    vec = builder.load(accs[0])
    for h in range(1, _DOT_CHAINS):
        vec = builder.fadd(vec, builder.load(accs[h]))
    # Tree sum of the lanes, halving the vector each step: 4 dependent adds for 16 lanes rather than 16.
    width = LANES
    while width > 1:
        width //= 2
        i32 = ir.IntType(32)
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, width), list(range(width))))
        hi = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.fadd(builder.load(acc_s), builder.extract_element(vec, ir.Constant(ir.IntType(32), 0)))


def _pv_codegen(context, builder, signature, args):
    """IR for acc[acc_off + d] += sum over c in [c_lo, c_hi) of p[p_off + c] * flat[offs[c] + extra + d], d < n. A block
    of up to _PV_BLOCK vectors of acc stays in registers while the run of keys streams past (one broadcast, one
    load and one FMA per vector per key, no load or store of acc), then the next block; a scalar tail last."""
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vty = ir.VectorType(f32, LANES)
    acc_ty, acc_off_ty, p_ty, p_off_ty, flat_ty, offs_ty, extra_ty, lo_ty, hi_ty, n_ty = signature.args
    pacc = _f32_ptr(context, builder, acc_ty, args[0], acc_off_ty, args[1])
    pp = _f32_ptr(context, builder, p_ty, args[2], p_off_ty, args[3])
    pflat = _f32_ptr(context, builder, flat_ty, args[4], types.int64, ir.Constant(i64, 0))
    poffs = builder.bitcast(context.make_array(offs_ty)(context, builder, args[5]).data, i64.as_pointer())
    extra = context.cast(builder, args[6], extra_ty, types.int64)
    c_lo = context.cast(builder, args[7], lo_ty, types.int64)
    c_hi = context.cast(builder, args[8], hi_ty, types.int64)
    n = context.cast(builder, args[9], n_ty, types.int64)

    def block(col, nvec, ty):
        """acc[col : col + nvec vectors (or 1 scalar)] += the run's p-weighted rows, accumulated in registers."""
        width = LANES if ty is vty else 1
        ptrs = [builder.bitcast(builder.gep(pacc, [builder.add(col, ir.Constant(i64, h * width))]),
                                ty.as_pointer()) for h in range(nvec)]
        regs = [cgutils.alloca_once_value(builder, builder.load(x, align=4)) for x in ptrs]
        with cgutils.for_range_slice(builder, c_lo, c_hi, ir.Constant(i64, 1)) as (c, _):
            p = builder.load(builder.gep(pp, [c]))
            pv = _splat(builder, p, vty) if ty is vty else p
            row = builder.gep(pflat, [builder.add(builder.add(builder.load(builder.gep(poffs, [c])), extra), col)])
            for h in range(nvec):
                x = builder.load(builder.bitcast(builder.gep(row, [ir.Constant(i64, h * width)]), ty.as_pointer()),
                                 align=4)
                builder.store(builder.fadd(builder.load(regs[h]), builder.fmul(pv, x, flags=("contract",)),
                                           flags=("contract",)), regs[h])
        for x, reg in zip(ptrs, regs):
            builder.store(builder.load(reg), x, align=4)

    blk = _PV_BLOCK * LANES
    n_blk = builder.udiv(n, ir.Constant(i64, blk))
    with cgutils.for_range(builder, n_blk) as loop:
        block(builder.mul(loop.index, ir.Constant(i64, blk)), _PV_BLOCK, vty)
    n_vec = builder.udiv(n, ir.Constant(i64, LANES))
    with cgutils.for_range_slice(builder, builder.mul(n_blk, ir.Constant(i64, _PV_BLOCK)), n_vec,
                                 ir.Constant(i64, 1)) as (v, _):
        block(builder.mul(v, ir.Constant(i64, LANES)), 1, vty)
    with cgutils.for_range_slice(builder, builder.mul(n_vec, ir.Constant(i64, LANES)), n,
                                 ir.Constant(i64, 1)) as (d, _):
        block(d, 1, f32)
    return context.get_dummy_value()


def _f32_arrays(*arrays) -> bool:
    return all(isinstance(x, types.Array) and x.dtype == types.float32 for x in arrays)


@intrinsic
def _dot_f32(typingctx, a, a_off, b, b_off, n):
    """sum(a.flat[a_off:a_off + n] * b.flat[b_off:b_off + n]) for float32 arrays, unit stride from those offsets."""
    if not _f32_arrays(a, b):
        return None
    return types.float32(a, a_off, b, b_off, n), _dot_codegen


@intrinsic
def _pv_run_f32(typingctx, acc, acc_off, p, p_off, flat, offs, extra, c_lo, c_hi, n):
    """acc.flat[acc_off + d] += sum_{c_lo <= c < c_hi} p.flat[p_off + c] * flat[offs[c] + extra + d], d < n: one
    row's P V over its run of keys. float32 arrays, unit stride from the offsets; offs int64."""
    if not (_f32_arrays(acc, p, flat) and isinstance(offs, types.Array) and offs.dtype == types.int64):
        return None
    return types.none(acc, acc_off, p, p_off, flat, offs, extra, c_lo, c_hi, n), _pv_codegen


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _row_dot_loop(qs, r, flat, off, step):
    total = as_dtype_of(qs, 0.0)
    for d in range(qs.shape[1]):
        total += qs[r, d] * flat[off + d * step]
    return total


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _row_pv_loop(acc, r, s, flat, offs, extra, c_lo, c_hi, step):
    for c in range(c_lo, c_hi):
        p = s[r, c]
        off = offs[c] + extra
        for d in range(acc.shape[1]):
            acc[r, d] += p * flat[off + d * step]


def _row_dot(qs, r, flat, off, step):  # pragma: no cover - typed by the overload below
    """qs[r] . flat[off : off + D * step : step], D = qs.shape[1]; qs C-contiguous."""
    raise NotImplementedError


def _row_pv(acc, r, s, flat, offs, extra, c_lo, c_hi, step):  # pragma: no cover - typed by the overload below
    """acc[r] += sum_{c_lo <= c < c_hi} s[r, c] * flat[o : o + D * step : step], o = offs[c] + extra;
    acc, s C-contiguous."""
    raise NotImplementedError


# The IR paths serve float32 with a unit-stride head dim (every cache numba-flash makes); the overloads pick them
# at compile time, so the float64 build never types them, and at run time on the cache's stride.
@overload(_row_dot, inline="always")
def _row_dot_impl(qs, r, flat, off, step):
    if not _f32_arrays(qs, flat):
        return lambda qs, r, flat, off, step: _row_dot_loop(qs, r, flat, off, step)

    def impl(qs, r, flat, off, step):
        if step == 1:
            return _dot_f32(qs, r * qs.shape[1], flat, off, qs.shape[1])
        return _row_dot_loop(qs, r, flat, off, step)
    return impl


@overload(_row_pv, inline="always")
def _row_pv_impl(acc, r, s, flat, offs, extra, c_lo, c_hi, step):
    if not _f32_arrays(acc, s, flat):
        return lambda acc, r, s, flat, offs, extra, c_lo, c_hi, step: _row_pv_loop(acc, r, s, flat, offs, extra,
                                                                                  c_lo, c_hi, step)

    def impl(acc, r, s, flat, offs, extra, c_lo, c_hi, step):
        if step == 1:
            _pv_run_f32(acc, r * acc.shape[1], s, r * s.shape[1], flat, offs, extra, c_lo, c_hi, acc.shape[1])
        else:
            _row_pv_loop(acc, r, s, flat, offs, extra, c_lo, c_hi, step)
    return impl


@njit(fastmath=FASTMATH, cache=True)
def tile_scores(qs, flat, offs, head_off, step, nk, run_lo, run_hi, s):
    """s[r, c] = qs[r] . (cache row at offs[c] + head_off[r]) for every row r and key c < nk with
    run_lo[r] <= c < run_hi[r]. qs (rows, D) C-contiguous, s (rows, BLOCK_N); the cache row is D elements
    ``step`` apart in ``flat``. Key-major: the key's rows of the unit's kv heads (one contiguous block in a
    "bshd" cache) come from memory once, in address order, and serve every row of the unit from L1."""
    for c in range(nk):
        for r in range(qs.shape[0]):
            if run_lo[r] <= c < run_hi[r]:
                s[r, c] = _row_dot(qs, r, flat, offs[c] + head_off[r], step)


@njit(fastmath=FASTMATH, cache=True)
def tile_pv(acc, s, flat, offs, head_off, step, run_lo, run_hi):
    """acc[r] += s[r, c] * (cache row at offs[c] + head_off[r]) over the (row, key) pairs of ``tile_scores``:
    only keys a row sees, so a non-finite v row reaches exactly the rows that see it (through p * nan, also where
    p is 0).
    acc (rows, D) and s (rows, BLOCK_N) C-contiguous. Row-major, unlike the scores: a row's accumulator stays in
    registers over its run of keys, whose v rows (BLOCK_N x D) the first row brought into L1/L2."""
    for r in range(acc.shape[0]):
        if run_lo[r] < run_hi[r]:
            _row_pv(acc, r, s, flat, offs, head_off[r], run_lo[r], run_hi[r], step)


@njit(fastmath=FASTMATH, cache=True)
def tile_softmax(s, run_lo, run_hi, m_i, l_i, acc, poisoned, softcap, slope2, shift):
    """The online-softmax step of one tile: for each row, over its run [run_lo, run_hi) of scores (base 2),
    apply the softcap, then ALiBi (score -= slope2[r] * |shift[r] - c| for column c: slope2 in base 2, 0 without
    ALiBi, shift[r] = i + Sk - Sq - j0), update m_i and l_i, rescale acc, and turn the scores into
    p = exp2(s - m_i) in place. A row with a score that is not finite is marked poisoned and its run emptied, so
    ``tile_pv`` skips it."""
    inf = as_dtype_of(s, np.inf)
    neg_inf = as_dtype_of(s, -np.inf)
    zero = as_dtype_of(s, 0.0)
    one = as_dtype_of(s, 1.0)
    for r in range(s.shape[0]):
        a, e = run_lo[r], run_hi[r]
        if a >= e:
            continue
        s_r = s[r]
        # Separate simple passes: the exp2 pass vectorises only with no branch in it. Softcap and ALiBi: the
        # pipeline's pass (a score whose raw value is not finite comes out NaN; nothing without either), with the
        # distance at - c as query at, key c.
        apply_score_terms(s[r:r + 1, a:e], 1, e - a, False, softcap, slope2[r], shift[r], a, 0, s, 0.0, False, LOG2E)
        finite = True
        tile_max = neg_inf
        for c in range(a, e):
            x = s_r[c]
            finite &= abs(x) < inf  # kept under fastmath: FASTMATH has no 'nnan'/'ninf'
            tile_max = x if x > tile_max else tile_max
        if not finite:
            poisoned[r] = True
            run_hi[r] = a
            continue
        m_new = max(m_i[r], tile_max)
        alpha = fast_exp2(m_i[r] - m_new)  # exactly 0 while m_i is still -inf
        p_sum = zero
        for c in range(a, e):
            p = fast_exp2(s_r[c] - m_new)
            s_r[c] = p
            p_sum += p
        l_i[r] = l_i[r] * alpha + p_sum
        m_i[r] = m_new
        if alpha != one:
            acc_r = acc[r]
            for d in range(acc.shape[1]):
                acc_r[d] *= alpha


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
