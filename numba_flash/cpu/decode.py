"""Flash-decoding for the CPU: a few new query rows against a KV cache, with the key range split in parallel.

Decoding is memory-bound: each new token reads the whole cache once and does ~4 flops per byte. So the kernel
is shaped around reading the cache once, in place:

* One work unit per (batch, kv head, split). A unit takes every query row that reads its kv head, all
  ``Hq / Hkv`` query heads of the group times all ``Sq`` rows (``rows = group * Sq``), and streams its part of
  the keys through once, in tiles of ``BLOCK_N`` keys: each key's k and v rows are loaded once from memory and
  used for every row while they sit in L1. Where the keys are long enough and a key's rows of all heads are
  adjacent ("bshd"), a unit takes all kv heads and the splits multiply by Hkv instead (``_heads_per_unit``):
  the same number of units, each reading the cache in address order.
* The caches are never copied or packed. They reach the kernel as flat 1-D views of their memory
  (``_flat_view``) plus element strides, so that one compilation serves contiguous, strided and paged caches, and
  the loops over the head dim read unit-stride memory that LLVM vectorises (numba types a strided 4-D view as
  layout 'A', whose inner loops it compiles one element at a time).
* Each unit keeps the online-softmax state of its rows, Triton's names: ``m_i`` (running max, base 2),
  ``l_i`` (running sum of exp2(score - m_i)), ``acc`` (unnormalised output). Scratch is O(rows x D) per unit.
* Splits (flash-decoding): a batch's visible key span is cut into ``num_splits`` contiguous parts; each unit writes
  its partial (m_i, l_i, acc), and a second parallel pass merges the parts of a row by their log-sum-exps,
  exactly: ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. A part in which a row sees no key has
  ``m = -inf, l = 0`` and weighs nothing. This is ``merge_attention_states`` on (out_s, lse_s), done on the
  unnormalised state so that no division happens before the merge.

Semantics are ``numba_flash.reference.attention_ref``'s, per batch on its own keys (see ``decode_forward``). The
non-finite rule is kept without masks: a row only ever touches the keys it sees (each row's visible keys in a tile
are one contiguous run), so a NaN in a v row it does not see never meets it as ``0 * nan``; a visible score that is
not finite marks the row poisoned (its out and lse become NaN) and the row is skipped from then on.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from numba_flash.cpu.cache_stamp import stamp_kernels
from numba_flash.cpu.score_terms import apply_score_terms
from numba_flash.cpu.simd import FASTMATH, LANES, LN2, LOG2E, as_dtype_of, fast_exp2
from numba_flash.cpu.tiles import row_key_range
from numba_flash.cpu.workspace import kernel_slopes
from numba_flash.kvcache import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits  # noqa: F401 (re-exported)
from numba_flash.semantics import clamp_window_bound, effective_softcap

BLOCK_N = 64  # keys per tile: their k and v rows (64 x D) stay in L1/L2 while every row of the unit uses them

# The per-tile work is three functions compiled on their own, called once per tile of BLOCK_N keys. The two
# products over the head dim are LLVM IR (``_dot_f32``, ``_pv_run_f32``) for float32, as in microkernels.py: written
# as numba loops, LLVM's vectoriser took them or not depending on the code around them (one edit elsewhere in
# the kernel made the P V loop scalar and the call 2x slower; the same loops in a function of their own were
# never vectorised), and reading flat[off + d] made it gather, since numba's negative-index wrap on off + d
# cannot be ruled out. The other paths (float64, a cache whose head dim is strided) run plain loops.


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
def _tile_scores(qs, flat, offs, head_off, step, nk, run_lo, run_hi, s):
    """s[r, c] = qs[r] . (cache row at offs[c] + head_off[r]) for every row r and key c < nk with
    run_lo[r] <= c < run_hi[r]. qs (rows, D) C-contiguous, s (rows, BLOCK_N); the cache row is D elements
    ``step`` apart in ``flat``. Key-major: the key's rows of the unit's kv heads (one contiguous block in a
    "bshd" cache) come from memory once, in address order, and serve every row of the unit from L1."""
    for c in range(nk):
        for r in range(qs.shape[0]):
            if run_lo[r] <= c < run_hi[r]:
                s[r, c] = _row_dot(qs, r, flat, offs[c] + head_off[r], step)


@njit(fastmath=FASTMATH, cache=True)
def _tile_pv(acc, s, flat, offs, head_off, step, run_lo, run_hi):
    """acc[r] += s[r, c] * (cache row at offs[c] + head_off[r]) over the (row, key) pairs of ``_tile_scores``:
    only keys a row sees, so a non-finite v row reaches exactly the rows that see it (through p * nan, also where
    p is 0).
    acc (rows, D) and s (rows, BLOCK_N) C-contiguous. Row-major, unlike the scores: a row's accumulator stays in
    registers over its run of keys, whose v rows (BLOCK_N x D) the first row brought into L1/L2."""
    for r in range(acc.shape[0]):
        if run_lo[r] < run_hi[r]:
            _row_pv(acc, r, s, flat, offs, head_off[r], run_lo[r], run_hi[r], step)


@njit(fastmath=FASTMATH, cache=True)
def _tile_softmax(s, run_lo, run_hi, m_i, l_i, acc, poisoned, softcap, slope2, shift):
    """The online-softmax step of one tile: for each row, over its run [run_lo, run_hi) of scores (base 2),
    apply the softcap, then ALiBi (score -= slope2[r] * |shift[r] - c| for column c: slope2 in base 2, 0 without
    ALiBi, shift[r] = i + Sk - Sq - j0), update m_i and l_i, rescale acc, and turn the scores into
    p = exp2(s - m_i) in place. A row with a score that is not finite is marked poisoned and its run emptied, so
    ``_tile_pv`` skips it."""
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


@njit(inline="always", cache=True)
def _cache_offset(strides, b, pos, hk, cache_rows, key_start, block_table, page_size):
    """Element offset in the flat view of the cache row of batch b's logical key ``pos`` (0-based within its
    keys) for kv head hk. strides: (origin, s0, s1, s2, s3) in elements, see ``_flat_view``."""
    p = key_start[b] + pos
    if page_size > 0:
        return strides[0] + block_table[b, p // page_size] * strides[1] + (p % page_size) * strides[2] \
            + hk * strides[3]
    return strides[0] + cache_rows[b] * strides[1] + p * strides[2] + hk * strides[3]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _decode_kernel(q, k_flat, k_str, v_flat, v_str, cache_rows, key_start, key_end, block_table, page_size,
                   nheads_kv, heads_per_unit, out, lse, part_acc, part_m, part_l, scale, left, right, softcap,
                   num_splits, alibi):
    """Both passes of ``decode_forward``. q (B, Sq, Hq, D), out likewise, lse (B, Hq, Sq): any strides. k_flat,
    v_flat: 1-D views of the caches' memory, k_str/v_str (5,) int64 their origin and element strides.
    A unit is (batch, block of ``heads_per_unit`` kv heads, split): U = B * Hkv / heads_per_unit * num_splits units.
    part_acc (U, rows, D), part_m and part_l (U, rows): the units' partial states.
    Row r of a unit: kv head hk0 + r // (group * Sq), query head that * group + (r // Sq) % group, query row r % Sq.
    alibi: (B, Hq) float64 slopes, or (0, 0) for none.
    """
    batch, seqlen_q, nheads_q, head_dim = q.shape
    group = nheads_q // nheads_kv
    n_blocks = nheads_kv // heads_per_unit
    rows_per_head = group * seqlen_q
    n_rows = heads_per_unit * rows_per_head
    k_step, v_step = k_str[4], v_str[4]
    # Scores in base 2 (log2 e folded into the scale) for exp2. With softcap the raw score keeps the scale alone
    # and is checked for finiteness before tanh, which would turn an inf from q or k into a finite +-1.
    qscale = as_dtype_of(q, scale if softcap > 0 else scale * LOG2E)
    neg_inf = as_dtype_of(q, -np.inf)
    inf = as_dtype_of(q, np.inf)
    nan = as_dtype_of(q, np.nan)
    zero = as_dtype_of(q, 0.0)
    one = as_dtype_of(q, 1.0)
    has_alibi = alibi.shape[0] > 0
    for u in prange(batch * n_blocks * num_splits):
        b = u // (n_blocks * num_splits)
        hk0 = (u // num_splits) % n_blocks * heads_per_unit
        split = u % num_splits
        seqlen_k = max(0, key_end[b] - key_start[b])
        # Row r's visible keys are [row_lo[r], row_hi[r]); k_head/v_head: its kv head's offset from hk0's rows.
        row_lo = np.empty(n_rows, np.int64)
        row_hi = np.empty(n_rows, np.int64)
        span_lo, span_hi = seqlen_k, 0
        for r in range(n_rows):
            lo, hi = row_key_range(r % seqlen_q, seqlen_q, seqlen_k, left, right)
            row_lo[r], row_hi[r] = lo, hi
            if lo < hi:
                span_lo, span_hi = min(span_lo, lo), max(span_hi, hi)
        # Split the keys some row sees, not [0, Sk): a sliding window over a long cache still splits evenly.
        chunk = -(-max(0, span_hi - span_lo) // num_splits)
        j_begin = min(span_hi, span_lo + split * chunk)
        j_end = min(span_hi, j_begin + chunk)
        qs = np.empty((n_rows, head_dim), q.dtype)
        k_head = np.empty(n_rows, np.int64)
        v_head = np.empty(n_rows, np.int64)
        slope2 = np.zeros(n_rows, q.dtype)  # ALiBi slopes in the base-2 score domain
        shift = np.zeros(n_rows, np.int64)
        for r in range(n_rows):
            k_head[r] = r // rows_per_head * k_str[3]
            v_head[r] = r // rows_per_head * v_str[3]
            h = hk0 * group + r // seqlen_q
            if has_alibi:
                slope2[r] = as_dtype_of(q, alibi[b, h] * LOG2E)
            for d in range(head_dim):
                qs[r, d] = q[b, r % seqlen_q, h, d] * qscale
        m_i = np.full(n_rows, neg_inf, q.dtype)
        l_i = np.zeros(n_rows, q.dtype)
        acc = np.zeros((n_rows, head_dim), q.dtype)
        poisoned = np.zeros(n_rows, np.bool_)
        s = np.empty((n_rows, BLOCK_N), q.dtype)
        k_off = np.empty(BLOCK_N, np.int64)
        v_off = np.empty(BLOCK_N, np.int64)
        run_lo = np.empty(n_rows, np.int64)  # row r's visible keys in the tile: [run_lo[r], run_hi[r])
        run_hi = np.empty(n_rows, np.int64)
        for j0 in range(j_begin, j_end, BLOCK_N):
            nk = min(BLOCK_N, j_end - j0)
            for c in range(nk):
                k_off[c] = _cache_offset(k_str, b, j0 + c, hk0, cache_rows, key_start, block_table, page_size)
                v_off[c] = _cache_offset(v_str, b, j0 + c, hk0, cache_rows, key_start, block_table, page_size)
            for r in range(n_rows):
                run_lo[r] = max(j0, row_lo[r]) - j0
                run_hi[r] = run_lo[r] if poisoned[r] else max(run_lo[r], min(j0 + nk, row_hi[r]) - j0)
                if has_alibi:
                    shift[r] = r % seqlen_q + seqlen_k - seqlen_q - j0
            _tile_scores(qs, k_flat, k_off, k_head, k_step, nk, run_lo, run_hi, s)
            _tile_softmax(s, run_lo, run_hi, m_i, l_i, acc, poisoned, softcap, slope2, shift)
            _tile_pv(acc, s, v_flat, v_off, v_head, v_step, run_lo, run_hi)
        for r in range(n_rows):
            part_m[u, r] = nan if poisoned[r] else m_i[r]
            part_l[u, r] = l_i[r]
            for d in range(head_dim):
                part_acc[u, r, d] = acc[r, d]

    # Merge the splits of each row by their log-sum-exps.
    ln2 = as_dtype_of(q, LN2)
    for w in prange(batch * n_blocks * n_rows):
        b = w // (n_blocks * n_rows)
        blk = (w // n_rows) % n_blocks
        r = w % n_rows
        i = r % seqlen_q
        h = blk * heads_per_unit * group + r // seqlen_q
        u0 = (b * n_blocks + blk) * num_splits
        seqlen_k = max(0, key_end[b] - key_start[b])
        lo, hi = row_key_range(i, seqlen_q, seqlen_k, left, right)
        if lo >= hi:  # sees no key: 0 and lse = +inf, whatever its q holds (it reads nothing)
            for d in range(head_dim):
                out[b, i, h, d] = zero
            lse[b, h, i] = inf
            continue
        m_all = neg_inf
        bad = False
        for sp in range(num_splits):
            m = part_m[u0 + sp, r]
            bad |= m != m
            m_all = max(m_all, m)
        if bad:  # poisoned by a visible score that is not finite
            for d in range(head_dim):
                out[b, i, h, d] = nan
            lse[b, h, i] = nan
            continue
        l_all = zero
        for sp in range(num_splits):
            l_all += part_l[u0 + sp, r] * fast_exp2(part_m[u0 + sp, r] - m_all)
        inv = one / l_all
        for d in range(head_dim):
            o = zero
            for sp in range(num_splits):
                o += part_acc[u0 + sp, r, d] * fast_exp2(part_m[u0 + sp, r] - m_all)
            o *= inv
            out[b, i, h, d] = o if abs(o) < inf else nan
        lse[b, h, i] = m_all * ln2 + math.log(l_all)


_compiled: dict[Any, Any] = {}
_compiled_lock = threading.Lock()


def _kernel_for(dtype: np.dtype) -> Any:
    """``_decode_kernel`` compiled for ``dtype``, with layout-generic types for the caller's q, out and lse so
    that every layout shares one compilation (and one on-disk cache entry)."""
    dtype = np.dtype(dtype)
    fn = _compiled.get(dtype)
    if fn is None:
        nb = numba.from_dtype(dtype)
        i64 = types.int64
        ints1, ints2 = types.Array(i64, 1, "C"), types.Array(i64, 2, "C")
        flat = types.Array(nb, 1, "C", readonly=True)
        sig = (types.Array(nb, 4, "A", readonly=True), flat, ints1, flat, ints1, ints1, ints1, ints1, ints2, i64,
               i64, i64, types.Array(nb, 4, "A"), types.Array(nb, 3, "A"), types.Array(nb, 3, "C"),
               types.Array(nb, 2, "C"), types.Array(nb, 2, "C"), types.float64, i64, i64, types.float64, i64,
               types.Array(types.float64, 2, "C", readonly=True))
        with _compiled_lock:
            fn = _compiled.get(dtype)
            if fn is None:
                fn = _compiled[dtype] = _decode_kernel.compile(sig)
    return fn


def _heads_per_unit(nheads_kv: int, max_seqlen_k: int, num_splits: int) -> int:
    """How many kv heads one work unit takes: all Hkv where the keys still split into ``num_splits * Hkv`` parts
    of at least MIN_KEYS_PER_SPLIT, else 1. The kernel then runs ``num_splits * Hkv`` splits of all heads: as
    many units as the caller's (b, kv head, split) ones, but in a "bshd" cache the rows of one key for all heads
    are one contiguous block, so a unit streams through memory in address order instead of reading D of every
    Hkv * D elements. Measured single-threaded at Sk = 32768, Hkv = 8, D = 128: 28.0 ms with one head per unit,
    22.0 ms with all 8. Blocks of 2 or 4 of 8 heads measured slower than either (14-16 ms against 6-9 ms at
    Sk = 8192), so they are not used."""
    if nheads_kv > 1 and max_seqlen_k // (num_splits * nheads_kv) >= MIN_KEYS_PER_SPLIT:
        return nheads_kv
    return 1


def _flat_view(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A read-only 1-D unit-stride view of the memory a 4-D array spans, and (origin, s0, s1, s2, s3) int64 such
    that ``x[i0, i1, i2, i3]`` is ``flat[origin + i0 * s0 + ... + i3 * s3]``. No copy, except for arrays whose
    strides are not whole elements (views into structured arrays), which cannot be indexed that way."""
    if any(st % x.itemsize for st in x.strides):
        x = np.ascontiguousarray(x)
    steps = [st // x.itemsize for st in x.strides]
    origin = sum((n - 1) * -st for n, st in zip(x.shape, steps) if st < 0)
    # The lowest address is x with its negative-stride axes reversed; the view starts there.
    low = x[tuple(slice(None, None, -1) if st < 0 else slice(None) for st in steps)]
    span = 0 if x.size == 0 else 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, steps))
    flat = np.lib.stride_tricks.as_strided(low, shape=(span,), strides=(x.itemsize,), writeable=False)
    return flat, np.array([origin, *steps], np.int64)


def _readonly(x: np.ndarray) -> np.ndarray:
    view = x.view()
    view.flags.writeable = False
    return view


def decode_forward(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cache_rows: np.ndarray,
                   key_start: np.ndarray, key_end: np.ndarray, block_table: np.ndarray, page_size: int,
                   out: np.ndarray, lse: np.ndarray, scale: float, window_left: int, window_right: int,
                   softcap: float, num_splits: int, alibi_slopes: np.ndarray | None = None) -> None:
    """Attention of new query rows against a KV cache (flash-decoding), written into ``out`` and ``lse``.

    Arguments (no validation here beyond dtypes: the public ``with_kvcache`` validates):
        q: (B, Sq, Hq, D), any strides, already rotated. Not modified.
        k_cache, v_cache: any strides, not modified, never copied. Not paged (``page_size == 0``):
            (B_cache, S_cache, Hkv, D), batch b reads cache row ``cache_rows[b]``. Paged (``page_size > 0``):
            (num_blocks, page_size, Hkv, D); batch b's logical key position p lives at
            ``[block_table[b, p // page_size], p % page_size]``. Hq % Hkv == 0; query head h reads kv head
            ``h // (Hq // Hkv)``.
        cache_rows: (B,) int64, ignored when paged. block_table: (B, max_blocks) int64, a (1, 1) dummy when not
            paged.
        key_start, key_end: (B,) int64; batch b's keys are its logical positions [key_start[b], key_end[b]).
            Batch b is dense attention over its Sk_b = key_end[b] - key_start[b] keys, renumbered from 0, with
            the contract's bottom-right alignment: row i sees key j iff
            ``i + Sk_b - Sq - left <= j <= i + Sk_b - Sq + right`` (a bound of -1: unbounded; causal: right = 0)::

                Sq = 2, Sk_b = 5, causal:   row 0:  x x x x .
                                            row 1:  x x x x x
        out: (B, Sq, Hq, D), any strides; written. lse: (B, Hq, Sq), any strides; written with the natural log of
            the sum of exp(score) over the row's keys: +inf (and out 0) for a row that sees none (Sk_b may be 0),
            NaN (and out NaN) for a row that sees a key whose raw score is not finite. A non-finite v row makes
            NaN only the rows that see it.
        q, caches, out and lse: all float32 or all float64 (the compute dtype).
        scale: multiplies q.k. softcap: 0 = off, else score = softcap * tanh(scale * q.k / softcap).
        num_splits: >= 1 parts of each batch's visible keys, run in parallel and merged exactly (see
            ``choose_num_splits``).
        alibi_slopes: None or (B, Hq) float64: adds ``-slope * |i + Sk_b - Sq - j|`` to the scores after softcap.
    """
    dtype = q.dtype
    if dtype not in (np.float32, np.float64) or any(a.dtype != dtype for a in (k_cache, v_cache, out, lse)):
        raise TypeError(f"decode_forward needs q, k_cache, v_cache, out and lse all float32 or all float64, got "
                        f"{sorted({str(a.dtype) for a in (q, k_cache, v_cache, out, lse)})}")
    batch, seqlen_q, nheads_q, head_dim = q.shape
    nheads_kv = k_cache.shape[2]
    num_splits = max(1, int(num_splits))
    ints = [np.array(x, np.int64, order="C", ndmin=1) for x in (cache_rows, key_start, key_end)]
    table = np.array(block_table, np.int64, order="C", ndmin=2)
    longest = int(max(0, (ints[2] - ints[1]).max())) if batch else 0
    left, right = (clamp_window_bound(int(w), seqlen_q, longest) for w in (window_left, window_right))
    softcap = effective_softcap(float(softcap), dtype.name)
    k_flat, k_str = _flat_view(k_cache)
    v_flat, v_str = _flat_view(v_cache)
    # Head blocks pay where a key's rows of consecutive heads are adjacent ("bshd"); in a head-major cache they
    # are Sk * D apart, the same low address bits, and 2 x heads streams thrashed L1 sets (19.6 -> 29.5 ms).
    adjacent = all(st[3] == head_dim and st[4] == 1 for st in (k_str, v_str))
    heads_per_unit = _heads_per_unit(nheads_kv, longest, num_splits) if adjacent else 1
    n_rows = heads_per_unit * (nheads_q // nheads_kv) * seqlen_q
    splits = num_splits * heads_per_unit
    units = batch * nheads_kv * num_splits
    part_acc = np.empty((units, n_rows, head_dim), dtype)
    part_m = np.empty((units, n_rows), dtype)
    part_l = np.empty((units, n_rows), dtype)
    _kernel_for(dtype)(_readonly(q), k_flat, k_str, v_flat, v_str, *ints, table, int(page_size), nheads_kv,
                       heads_per_unit, out, lse, part_acc, part_m, part_l, float(scale), left, right, softcap, splits,
                       _readonly(np.ascontiguousarray(kernel_slopes(alibi_slopes))))


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
