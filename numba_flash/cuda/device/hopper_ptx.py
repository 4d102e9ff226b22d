"""The Hopper primitives of ``hopper.py`` as Numba intrinsics emitting inline PTX (sm_90a; for the compiler and
real GPUs).

Each intrinsic lowers to one ``llvmlite.ir.InlineAsm`` call, as ``warp_ptx.py``'s do; ptxas assembles them into
``HGMMA``, ``SYNCS`` (mbarriers), ``UBLKCP`` (bulk copies) and ``USETMAXREG``. The instructions whose shape,
kind or count is part of the opcode (wgmma's N, setmaxnreg's register count, wait_group's depth) come from cached
factories: the kernels pass those as compile-time constants. Shapes, layouts and rules are in ``hopper.py``.
"""

from __future__ import annotations

import functools
from typing import Any

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

from numba_flash.cuda.device.warp_ptx import check_shared_array, shared_address

_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_F32 = ir.FloatType()
_VOID = ir.VoidType()


def _check_accumulator(name: str, acc: Any) -> None:
    if not isinstance(acc, types.Array) or acc.dtype != types.float32 or acc.layout != "C":
        raise TypingError(f"{name}: expected a C-contiguous float32 local array of accumulators, got {acc}")


def _accumulator_pointers(context: Any, builder: Any, acc_type: Any, acc: Any, count: int) -> list:
    """Pointers to the first ``count`` floats of a C-contiguous local array (any rank): constant offsets from its
    data pointer, which SROA turns into registers once the kernel's loops are unrolled."""
    ary = context.make_array(acc_type)(context, builder, value=acc)
    return [builder.gep(ary.data, [ir.Constant(_I32, i)]) for i in range(count)]


@intrinsic
def smem_desc(typingctx, smem, index, lbo_bytes, sbo_bytes, swizzle):
    """The 64-bit shared-memory matrix descriptor of a wgmma operand that starts at ``smem[index]``: start address,
    leading and stride byte offsets (each ``(x & 0x3FFFF) >> 4``), base offset 0 and the swizzle code (0 none, 1
    128-byte, 2 64-byte, 3 32-byte)."""
    check_shared_array("smem_desc", smem, index)
    for name, arg in (("lbo_bytes", lbo_bytes), ("sbo_bytes", sbo_bytes), ("swizzle", swizzle)):
        if not isinstance(arg, types.Integer):
            raise TypingError(f"smem_desc: expected an integer {name}, got {arg}")
    sig = types.uint64(smem, index, lbo_bytes, sbo_bytes, swizzle)

    def codegen(context, builder, sig, args):
        addr = builder.zext(shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1]), _I64)
        lbo, sbo, swz = (context.cast(builder, a, t, types.uint64) for a, t in zip(args[2:], sig.args[2:]))

        def encode(x):
            return builder.lshr(builder.and_(x, ir.Constant(_I64, 0x3FFFF)), ir.Constant(_I64, 4))

        desc = encode(addr)
        desc = builder.or_(desc, builder.shl(encode(lbo), ir.Constant(_I64, 16)))
        desc = builder.or_(desc, builder.shl(encode(sbo), ir.Constant(_I64, 32)))
        return builder.or_(desc, builder.shl(builder.and_(swz, ir.Constant(_I64, 3)), ir.Constant(_I64, 62)))

    return sig, codegen


@functools.cache
def make_wgmma(n: int, kind: str, a_in_registers: bool, trans_b: bool) -> Any:
    """``wgmma.mma_async.sync.aligned.m64n<n>k<K>.f32.<kind>.<kind>`` (K = 16 for f16 and bf16, 32 for e4m3 and
    e5m2): the accumulators ``acc`` (``n / 2`` float32 per thread, the first ``n / 2`` elements of a C-contiguous
    local array) become ``A B + acc`` (or ``A B`` where ``scale_d`` is 0). A from a descriptor
    (``wgmma(acc, desc_a, desc_b, scale_d)``, K-major) or from four registers per thread
    (``wgmma(acc, a0, a1, a2, a3, desc_b, scale_d)``); B K-major, or N-major with ``trans_b`` (16-bit kinds: the
    8-bit ones take no transpose immediates)."""
    count = n // 2
    outs = ",".join(f"${i}" for i in range(count))
    a_regs = 4 if a_in_registers else 1
    a_text = "{" + ",".join(f"${count + i}" for i in range(4)) + "}" if a_in_registers else f"${count}"
    b_at, p_at = count + a_regs, count + a_regs + 1
    k = 16 if kind in ("f16", "bf16") else 32
    if k == 32:
        imm = "1, 1"
    else:
        imm = f"1, 1, {int(trans_b)}" if a_in_registers else f"1, 1, 0, {int(trans_b)}"
    text = (f"{{ .reg .pred p; setp.ne.b32 p, ${p_at}, 0; "
            f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{kind}.{kind} {{{outs}}}, {a_text}, ${b_at}, p, {imm}; }}")
    constraints = ",".join(["=f"] * count + (["r"] * 4 if a_in_registers else ["l"]) + ["l", "r"]
                           + [str(i) for i in range(count)])
    a_types = [_I32] * 4 if a_in_registers else [_I64]
    fnty = ir.FunctionType(ir.LiteralStructType([_F32] * count), a_types + [_I64, _I32] + [_F32] * count)
    name = f"wgmma_m64n{n}k{k}_{kind}_{'rs' if a_in_registers else 'ss'}{'_tb' if trans_b else ''}"

    def codegen(context, builder, sig, args):
        acc_type = sig.args[0]
        ptrs = _accumulator_pointers(context, builder, acc_type, args[0], count)
        old = [builder.load(p) for p in ptrs]
        if a_in_registers:
            a = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[1:5], sig.args[1:5])]
        else:
            a = [context.cast(builder, args[1], sig.args[1], types.uint64)]
        b = context.cast(builder, args[-2], sig.args[-2], types.uint64)
        scale = context.cast(builder, args[-1], sig.args[-1], types.uint32)
        asm = ir.InlineAsm(fnty, text, constraints + ",~{memory}", side_effect=True)
        res = builder.call(asm, a + [b, scale] + old)
        for i, p in enumerate(ptrs):
            builder.store(builder.extract_value(res, i), p)
        return context.get_dummy_value()

    if a_in_registers:
        @intrinsic
        def wgmma(typingctx, acc, a0, a1, a2, a3, desc_b, scale_d):
            _check_accumulator(name, acc)
            if not all(isinstance(r, types.Integer) for r in (a0, a1, a2, a3, desc_b, scale_d)):
                raise TypingError(f"{name}: expected four 32-bit A registers, a descriptor and an integer scale_d")
            return types.void(acc, a0, a1, a2, a3, desc_b, scale_d), codegen
    else:
        @intrinsic
        def wgmma(typingctx, acc, desc_a, desc_b, scale_d):
            _check_accumulator(name, acc)
            if not all(isinstance(r, types.Integer) for r in (desc_a, desc_b, scale_d)):
                raise TypingError(f"{name}: expected two 64-bit descriptors and an integer scale_d")
            return types.void(acc, desc_a, desc_b, scale_d), codegen

    wgmma.__name__ = name
    return wgmma


@functools.cache
def make_accumulator_fence(count: int) -> Any:
    """An empty asm that reads and rewrites the first ``count`` accumulators: the compiler may not move their uses
    above it, or their definitions below it (place it after ``wgmma_wait`` and before the next ``wgmma``)."""
    constraints = ",".join(["=f"] * count + [str(i) for i in range(count)])
    fnty = ir.FunctionType(ir.LiteralStructType([_F32] * count), [_F32] * count)

    @intrinsic
    def fence(typingctx, acc):
        _check_accumulator("accumulator_fence", acc)

        def codegen(context, builder, sig, args):
            ptrs = _accumulator_pointers(context, builder, sig.args[0], args[0], count)
            res = builder.call(ir.InlineAsm(fnty, "", constraints, side_effect=True), [builder.load(p) for p in ptrs])
            for i, p in enumerate(ptrs):
                builder.store(builder.extract_value(res, i), p)
            return context.get_dummy_value()

        return types.void(acc), codegen

    return fence


def _void_asm(name: str, text: str) -> Any:
    @intrinsic
    def op(typingctx):
        def codegen(context, builder, sig, args):
            builder.call(ir.InlineAsm(ir.FunctionType(_VOID, []), text, "~{memory}", side_effect=True), [])
            return context.get_dummy_value()

        return types.void(), codegen

    op.__name__ = name
    return op


wgmma_fence = _void_asm("wgmma_fence", "wgmma.fence.sync.aligned;")
wgmma_commit = _void_asm("wgmma_commit", "wgmma.commit_group.sync.aligned;")
fence_proxy_async = _void_asm("fence_proxy_async", "fence.proxy.async.shared::cta;")
fence_mbarrier_init = _void_asm("fence_mbarrier_init", "fence.mbarrier_init.release.cluster;")


@functools.cache
def make_wgmma_wait(pending: int) -> Any:
    """``wgmma.wait_group.sync.aligned <pending>``: wait until at most ``pending`` committed groups are in flight."""
    return _void_asm(f"wgmma_wait{pending}", f"wgmma.wait_group.sync.aligned {pending};")


@functools.cache
def make_setmaxnreg(count: int, increase: bool) -> Any:
    """``setmaxnreg.{inc,dec}.sync.aligned.u32 <count>`` for the calling warpgroup (24 to 256, a multiple of 8)."""
    way = "inc" if increase else "dec"
    return _void_asm(f"setmaxnreg_{way}_{count}", f"setmaxnreg.{way}.sync.aligned.u32 {count};")


def _check_barrier(name: str, bars: Any, index: Any) -> None:
    if not isinstance(bars, types.Array) or bars.ndim != 1 or bars.dtype.bitwidth != 64:
        raise TypingError(f"{name}: expected a 1-D shared array of 64-bit mbarriers, got {bars}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"{name}: expected an integer barrier index, got {index}")


def _barrier_op(name: str, text: str, extra: int, returns: bool = False) -> Any:
    """An mbarrier instruction on ``bars[index]`` with ``extra`` 32-bit operands after the address ($0 the
    result where ``returns``)."""
    constraints = ",".join((["=r"] if returns else []) + ["r"] * (1 + extra)) + ",~{memory}"
    fnty = ir.FunctionType(_I32 if returns else _VOID, [_I32] * (1 + extra))

    def typer(bars, index, *ints):
        _check_barrier(name, bars, index)
        if not all(isinstance(i, types.Integer) for i in ints):
            raise TypingError(f"{name}: expected integer operands, got {ints}")
        return (types.uint32 if returns else types.void)(bars, index, *ints)

    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        ints = [context.cast(builder, a, t, types.uint32) for a, t in zip(args[2:], sig.args[2:])]
        res = builder.call(ir.InlineAsm(fnty, text, constraints, side_effect=True), [addr] + ints)
        return res if returns else context.get_dummy_value()

    if extra == 0:
        @intrinsic
        def op(typingctx, bars, index):
            return typer(bars, index), codegen
    else:
        @intrinsic
        def op(typingctx, bars, index, value):
            return typer(bars, index, value), codegen
    op.__name__ = name
    return op


mbarrier_init = _barrier_op("mbarrier_init", "mbarrier.init.shared::cta.b64 [$0], $1;", 1)
mbarrier_arrive = _barrier_op("mbarrier_arrive", "mbarrier.arrive.shared::cta.b64 _, [$0];", 0)
mbarrier_arrive_expect_tx = _barrier_op(
    "mbarrier_arrive_expect_tx", "mbarrier.arrive.expect_tx.shared::cta.b64 _, [$0], $1;", 1)
mbarrier_try_wait_parity = _barrier_op(
    "mbarrier_try_wait_parity",
    "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [$1], $2; selp.u32 $0, 1, 0, p; }", 1, True)


@intrinsic
def bulk_copy_g2s(typingctx, dst, dst_index, src, byte_offset, nbytes, bars, bar_index):
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes``: ``nbytes`` (a multiple of 16) from
    ``byte_offset`` bytes past the data pointer of the global array ``src`` into ``dst[dst_index]`` (1-D shared,
    16-byte aligned), completing ``nbytes`` of transaction count on ``bars[bar_index]``."""
    check_shared_array("bulk_copy_g2s", dst, dst_index)
    _check_barrier("bulk_copy_g2s", bars, bar_index)
    if not isinstance(src, types.Array) or not isinstance(byte_offset, types.Integer) \
            or not isinstance(nbytes, types.Integer):
        raise TypingError(f"bulk_copy_g2s: expected a global array, an integer byte offset and an integer byte "
                          f"count, got {src}, {byte_offset}, {nbytes}")
    sig = types.void(dst, dst_index, src, byte_offset, nbytes, bars, bar_index)

    def codegen(context, builder, sig, args):
        dst_ty, dst_index_ty, src_ty, offset_ty, nbytes_ty, bars_ty, bar_index_ty = sig.args
        addr = shared_address(context, builder, dst_ty, args[0], args[1], dst_index_ty)
        ary = context.make_array(src_ty)(context, builder, value=args[2])
        gaddr = builder.add(builder.ptrtoint(ary.data, _I64), context.cast(builder, args[3], offset_ty, types.int64))
        size = context.cast(builder, args[4], nbytes_ty, types.uint32)
        bar = shared_address(context, builder, bars_ty, args[5], args[6], bar_index_ty)
        fnty = ir.FunctionType(_VOID, [_I32, _I64, _I32, _I32])
        text = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [$0], [$1], $2, [$3];"
        builder.call(ir.InlineAsm(fnty, text, "r,l,r,r,~{memory}", side_effect=True), [addr, gaddr, size, bar])
        return context.get_dummy_value()

    return sig, codegen

