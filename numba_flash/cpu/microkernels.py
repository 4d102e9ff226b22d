"""The register-blocked matrix products every CPU kernel is built from: ``mm`` (C (+)= A @ B), ``mm_at``
(C (+)= A^T @ B) and ``mm_dot`` (the score block S^T = K Q^T, head-dim sums in chunks of ``DOT_CHUNK``), each an
outer-product micro-kernel written in LLVM IR (``mm_block_codegen``): MR rows of C times two vectors of columns
stay in registers for the whole reduction, each step broadcasting MR values of A, loading two vectors of B and
issuing 2 * MR fused multiply-adds. The fused variants add the tile's product, summed from 0 in registers, into C
as they store it: ``mm_add`` and ``mm_at_add`` (the backward's gradient sums) and ``mm_at_rescale`` (the
forward's O = O * alpha + P^T V), where a product stored to a buffer and added in a second pass took a store, a
reload and a pass per tile for the same bits.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .simd import LANES, MR, MR_TALL, NR

# ---------------------------------------------------------------------------------------------------------------
# The micro-kernel


def mm_block_codegen(a_transposed: bool, nvec: int, mr: int = MR, chunk: int = 0, epilogue: str = "") -> Callable:
    """LLVM IR for C[i:i+MR, j:j+nvec*LANES] (+)= A[i:i+MR, :kdim] @ B[:kdim, j:j+nvec*LANES] on float32 2-D arrays
    whose last axis is unit-stride, A given as is or (``a_transposed``) as A^T, shape (kdim, >= i+MR).

    Written as IR because neither of LLVM's vectorisers finds this shape in a Python loop nest: the MR * nvec
    accumulators stay in registers for the whole k loop, each step broadcasting MR values of A, loading nvec vectors
    of B and issuing MR * nvec multiply-adds, so loads stay below FMAs and no horizontal sum is ever needed.

    With ``chunk`` (the accumulate flag is then ignored: C is written), the reduction runs in chunks of that many
    steps, each from fresh accumulators, and C = chunk 0, then C = C + chunk i in order (see ``mm_dot``).

    ``epilogue`` 'add' (the accumulate flag ignored): C = C + (A @ B), the product summed in registers from 0 and then
    added, one rounding per element, as forming the tile's product in a buffer and adding it in, without the store
    and the reload (the backward's gradient sums, ``mm_at_add``). 'rescale': the last argument is a float32 vector
    ``alpha`` instead of the flag, and C[r] = C[r] * alpha[r] + (A @ B)[r], one fused multiply-add per element (the
    forward's online-softmax update of its accumulator, ``mm_at_rescale``)."""
    lanes = LANES

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
        if epilogue:
            zero_accs()
            with cgutils.for_range(builder, kd) as loop:
                step(loop.index)
            alpha = context.make_array(accty)(context, builder, args[6]) if epilogue == "rescale" else None
            for r in range(mr):
                if alpha is not None:
                    a_r = builder.load(builder.gep(alpha.data, [builder.add(ii, ir.Constant(i64, r))]))
                    a_v = builder.shuffle_vector(builder.insert_element(ir.Constant(vty, ir.Undefined), a_r,
                                                                        ir.Constant(ir.IntType(32), 0)),
                                                 ir.Constant(vty, ir.Undefined), zero_mask)
                for h in range(nvec):
                    old = builder.load(cptr[r][h], align=4)
                    if alpha is not None:
                        old = builder.fmul(old, a_v, flags=("contract",))
                    builder.store(builder.fadd(old, builder.load(accs[r][h]), flags=("contract",)), cptr[r][h],
                                  align=4)
            return context.get_dummy_value()
        acc_flag = context.cast(builder, args[6], accty, types.boolean)
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


def rows_f32(*arrays) -> bool:
    """Whether every array is a 2-D float32 array: what the IR micro-kernels take. They also assume a unit-stride
    last axis, which numba's types cannot state for a strided view; the host code guarantees it."""
    return all(isinstance(x, types.Array) and x.dtype == types.float32 and x.ndim == 2 for x in arrays)


def register_block(a_transposed: bool, nvec: int, mr: int = MR, chunk: int = 0, epilogue: str = "") -> Callable:
    """The intrinsic for one register block, (c, a, b, i, j, kdim, extra) -> None on float32 2-D arrays:
    C[i:i+mr, j:j+nvec*LANES] (+)= A[i:i+mr, :kdim] @ B[:kdim, j:j+nvec*LANES], A given as A^T (shape (kdim, >= i+mr))
    where ``a_transposed``; ``chunk`` and ``epilogue`` as in ``mm_block_codegen``. ``extra`` is the accumulate flag
    (ignored with a chunk or the 'add' epilogue), or alpha, a float32 vector, for 'rescale'."""

    def typer(typingctx, c, a, b, i, j, kdim, extra):
        ok = rows_f32(c, a, b) and (epilogue != "rescale" or (
            isinstance(extra, types.Array) and extra.dtype == types.float32 and extra.ndim == 1))
        if not ok:
            return None
        return (types.none(c, a, b, i, j, kdim, extra),
                mm_block_codegen(a_transposed, nvec, mr, chunk=chunk, epilogue=epilogue))

    # numba names an intrinsic after its function: one name per kind of block
    typer.__name__ = typer.__qualname__ = (f"_block{mr}x{nvec}{'_at' if a_transposed else ''}{'_dot' if chunk else ''}"
                                           f"{'_' + epilogue if epilogue else ''}")
    return intrinsic(typer)


@njit(inline="always", cache=True)
def _tall_rows(rows):
    """How many of ``rows`` (a multiple of MR) the MR_TALL-row blocks take, leaving a multiple of MR to MR-row
    blocks: all of them where MR_TALL is MR; 60 of 64 for 6 and 4."""
    n = rows // MR_TALL * MR_TALL
    while (rows - n) % MR != 0:
        n -= MR_TALL
    return n


# Head-dim products (scores q.k and dP = dO.v) sum their reduction in chunks of this many terms, each chunk a
# fresh chain of multiply-adds, the chunks then added in order: a chain over all of D = 256 erred 2-10x torch's
# vectorised dot products at Sq = 1 and 3 with large scores (softcap 50), and at D = 256.
DOT_CHUNK = 32

# The 4 x 64 block issues fewer instructions per FMA than 8 x 32 (four broadcasts and four loads for sixteen FMAs
# against eight and two) and measured faster for long reductions: 349 vs 308 GFLOP/s at kdim 128, 295 vs 303 at 64.
_WIDE_BLOCK_MIN_KDIM = 96


def mm(c, a, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) a[:, :kdim] @ b[:kdim, :c.shape[1]] for 2-D arrays with unit-stride rows: c (R, N), a (R, >= kdim),
    b (>= kdim, >= N); R % 8 == 0 and N % 16 == 0."""
    raise NotImplementedError


def mm_at(c, at, b, kdim, accumulate):  # pragma: no cover - typed by the overload below
    """c (=|+=) at[:kdim].T @ b[:kdim, :c.shape[1]] for 2-D arrays with unit-stride rows: c (R, N),
    at (>= kdim, R), b (>= kdim, >= N); R % 8 == 0 and N % 16 == 0. Saves transposing P and dS."""
    raise NotImplementedError


@overload(mm, inline="never")
def _mm_impl(c, a, b, kdim, accumulate):
    if rows_f32(c, a, b):
        return lambda c, a, b, kdim, accumulate: _MM_PANELS(c, a, b, kdim, accumulate)

    def impl(c, a, b, kdim, accumulate):
        if not accumulate:
            c[:] = 0
        for i in range(c.shape[0]):
            for k in range(kdim):
                aik = a[i, k]
                for j in range(c.shape[1]):
                    c[i, j] += aik * b[k, j]
    return impl


def _panels(tall_block, block, narrow_block, wide_block=None) -> Callable:
    """The loop of ``mm``, ``mm_at``, ``mm_dot`` and the fused variants over register blocks: column panels
    outermost (the (kdim x NR) panel of B in use stays in L1 while A streams as broadcasts), MR_TALL-row blocks then
    MR-row ones down each, a last LANES-wide panel where the columns leave one; with ``wide_block`` (not A^T) the
    4 x 64 block where it pays (``_WIDE_BLOCK_MIN_KDIM``). ``extra`` goes to every block."""
    wide = wide_block is not None
    wide_block = wide_block if wide else block   # never called then

    @njit(inline="always")
    def panels(c, a, b, kdim, extra):
        n = c.shape[1]
        if wide and n == 4 * LANES and LANES == 16 and kdim >= _WIDE_BLOCK_MIN_KDIM:
            for i in range(0, c.shape[0], 4):
                wide_block(c, a, b, i, 0, kdim, extra)
            return
        tall = _tall_rows(c.shape[0])
        j = 0
        while j + NR <= n:
            for i in range(0, tall, MR_TALL):
                tall_block(c, a, b, i, j, kdim, extra)
            for i in range(tall, c.shape[0], MR):
                block(c, a, b, i, j, kdim, extra)
            j += NR
        if j < n:  # a last 16 columns (512-bit vectors, D_pad % 32 == 16)
            for i in range(0, c.shape[0], MR):
                narrow_block(c, a, b, i, j, kdim, extra)

    return panels


def _block_panels(a_transposed: bool, chunk: int = 0, epilogue: str = "", wide: bool = False) -> Callable:
    """``_panels`` over the blocks of one kind (``_block``): MR_TALL x NR, MR x NR and MR x LANES, and with ``wide``
    the 4 x 64 one."""
    def kind(nvec, mr):
        return register_block(a_transposed, nvec, mr, chunk=chunk, epilogue=epilogue)
    return _panels(kind(2, MR_TALL), kind(2, MR), kind(1, MR), wide_block=kind(4, 4) if wide else None)


_MM_PANELS = _block_panels(False, wide=True)
_AT_PANELS = _block_panels(True)
_DOT_PANELS = _block_panels(False, chunk=DOT_CHUNK, wide=True)
_AT_RESCALE_PANELS = _block_panels(True, epilogue="rescale")
_AT_ADD_PANELS = _block_panels(True, epilogue="add")
_MM_ADD_PANELS = _block_panels(False, epilogue="add", wide=True)


@overload(mm_at, inline="never")
def _mm_at_impl(c, at, b, kdim, accumulate):
    if rows_f32(c, at, b):
        return lambda c, at, b, kdim, accumulate: _AT_PANELS(c, at, b, kdim, accumulate)

    def impl(c, at, b, kdim, accumulate):
        if not accumulate:
            c[:] = 0
        for k in range(kdim):
            for i in range(c.shape[0]):
                aik = at[k, i]
                for j in range(c.shape[1]):
                    c[i, j] += aik * b[k, j]
    return impl


def mm_at_rescale(c, at, b, kdim, alpha):  # pragma: no cover - typed by the overload below
    """c = c * alpha[:, None] + at[:kdim].T @ b[:kdim, :c.shape[1]], shapes as ``mm_at``, alpha (R,) contiguous:
    the forward's accumulator update O = O * alpha + P^T V, the tile's product summed before it is added."""
    raise NotImplementedError


def mm_at_add(c, at, b, kdim):  # pragma: no cover - typed by the overload below
    """c += at[:kdim].T @ b[:kdim, :c.shape[1]], shapes as ``mm_at``, the product summed before it is added (one
    rounding per element and call): the backward's gradient sums over tiles."""
    raise NotImplementedError


def mm_add(c, a, b, kdim):  # pragma: no cover - typed by the overload below
    """c += a[:, :kdim] @ b[:kdim, :c.shape[1]], shapes as ``mm``, the product summed before it is added."""
    raise NotImplementedError


@njit(inline="always")
def _at_then_update(c, at, b, kdim, alpha, rescale):
    """The plain-loop ``mm_at_rescale`` (``rescale``) or ``mm_at_add`` for float64: each row's product summed in
    a row buffer, then added."""
    part = np.empty(c.shape[1], c.dtype)
    for i in range(c.shape[0]):
        part[:] = 0
        for k in range(kdim):
            aki = at[k, i]
            for j in range(c.shape[1]):
                part[j] += aki * b[k, j]
        a = alpha[i] if rescale else 1
        for j in range(c.shape[1]):
            c[i, j] = c[i, j] * a + part[j] if rescale else c[i, j] + part[j]


@overload(mm_at_rescale, inline="never")
def _mm_at_rescale_impl(c, at, b, kdim, alpha):
    if rows_f32(c, at, b) and alpha.dtype == types.float32:
        return lambda c, at, b, kdim, alpha: _AT_RESCALE_PANELS(c, at, b, kdim, alpha)
    return lambda c, at, b, kdim, alpha: _at_then_update(c, at, b, kdim, alpha, True)


@overload(mm_at_add, inline="never")
def _mm_at_add_impl(c, at, b, kdim):
    if rows_f32(c, at, b):
        return lambda c, at, b, kdim: _AT_ADD_PANELS(c, at, b, kdim, False)
    return lambda c, at, b, kdim: _at_then_update(c, at, b, kdim, c[0], False)


@overload(mm_add, inline="never")
def _mm_add_impl(c, a, b, kdim):
    if rows_f32(c, a, b):
        return lambda c, a, b, kdim: _MM_ADD_PANELS(c, a, b, kdim, False)
    return lambda c, a, b, kdim: _at_then_update(c, a.T, b, kdim, c[0], False)


def mm_dot(c, a, b, kdim):  # pragma: no cover - typed by the overload below
    """c = a[:, :kdim] @ b[:kdim, :c.shape[1]] as ``mm``, the reduction in chunks of ``DOT_CHUNK``: C = chunk 0,
    then C = C + chunk i in order. ``row_dot_kernel`` sums the same way, so that a row's delta = dO . O equals its
    dP = dO . v to the bit where O = v."""
    raise NotImplementedError


@overload(mm_dot, inline="never")
def _mm_dot_impl(c, a, b, kdim):
    if rows_f32(c, a, b):
        return lambda c, a, b, kdim: _DOT_PANELS(c, a, b, kdim, False)

    def impl(c, a, b, kdim):
        c[:] = 0
        for k0 in range(0, kdim, DOT_CHUNK):
            for i in range(c.shape[0]):
                for j in range(c.shape[1]):
                    part = c[i, j] * 0
                    for k in range(k0, min(kdim, k0 + DOT_CHUNK)):
                        part += a[i, k] * b[k, j]
                    c[i, j] = part if k0 == 0 else c[i, j] + part
    return impl


# ---------------------------------------------------------------------------------------------------------------
# Transposing a tile in registers


def _transpose_codegen(lanes: int) -> Callable:
    """LLVM IR for dst[dr + a, dc + b] = src[sr + b, sc + a], a, b < lanes, float32 2-D arrays with unit-stride
    rows: ``lanes`` row vectors loaded, transposed by log2(lanes) rounds of two-input shuffles (round s swaps the
    off-diagonal s x s blocks of every 2s x 2s block), stored as ``lanes`` row vectors. A scalar transposing loop
    makes one strided store per element; this makes 2 * lanes vector moves and lanes * log2(lanes) shuffles."""

    def codegen(context, builder, signature, args):
        dty, sty = signature.args[:2]
        f32 = ir.FloatType()
        vty = ir.VectorType(f32, lanes)
        i32, i64 = ir.IntType(32), ir.IntType(64)
        i8p = ir.IntType(8).as_pointer()
        dst, src = (context.make_array(t)(context, builder, v) for t, v in zip((dty, sty), args[:2]))
        idx = [context.cast(builder, v, t, types.int64) for v, t in zip(args[2:], signature.args[2:])]
        sr, sc, dr, dc = idx
        four = ir.Constant(i64, 4)

        def row_ptr(arr, row, col):
            rstride = cgutils.unpack_tuple(builder, arr.strides, 2)[0]
            off = builder.add(builder.mul(row, rstride), builder.mul(col, four))
            return builder.bitcast(builder.gep(builder.bitcast(arr.data, i8p), [off]), vty.as_pointer())

        rows = [builder.load(row_ptr(src, builder.add(sr, ir.Constant(i64, b)), sc), align=4) for b in range(lanes)]
        s = lanes // 2
        while s >= 1:
            lo = ir.Constant(ir.VectorType(i32, lanes), [l if not l & s else lanes + l - s for l in range(lanes)])
            hi = ir.Constant(ir.VectorType(i32, lanes), [l + s if not l & s else lanes + l for l in range(lanes)])
            new = list(rows)
            for i in range(lanes):
                if not i & s:
                    new[i] = builder.shuffle_vector(rows[i], rows[i + s], lo)
                    new[i + s] = builder.shuffle_vector(rows[i], rows[i + s], hi)
            rows = new
            s //= 2
        for a in range(lanes):
            builder.store(rows[a], row_ptr(dst, builder.add(dr, ir.Constant(i64, a)), dc), align=4)
        return context.get_dummy_value()

    return codegen


@intrinsic
def transpose_lanes(typingctx, dst, src, src_row, src_col, dst_row, dst_col):
    """dst[dst_row + a, dst_col + b] = src[src_row + b, src_col + a] for a, b < LANES (16 with AVX-512, else 8);
    float32 2-D arrays whose rows are unit-stride (the caller checks: numba's types cannot say it of a view)."""
    if not rows_f32(dst, src):
        return None
    return types.none(dst, src, src_row, src_col, dst_row, dst_col), _transpose_codegen(LANES)
