"""The warp primitives of ``warp.py`` as Numba intrinsics emitting inline PTX (for real GPUs and the compiler).

Each intrinsic is typed by Numba like a function and lowered to one ``llvmlite.ir.InlineAsm`` call; NVVM passes the
asm text through to PTX and ptxas assembles it (``HMMA``, ``LDSM``, ``LDGSTS``, ``F2FP``). Shapes, fragment layouts
and the rules for calling them are in ``warp.py``'s docstring. Nothing here runs under the simulator (it imports
this module only without ``NUMBA_ENABLE_CUDASIM``).

Shared-memory addresses go to the asm as 32-bit shared-window addresses: the generic pointer of a ``cuda.shared``
array element, cast to address space 3 and to an integer, which NVVM folds into the array's own shared symbol.
"""

from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.cuda.extending import intrinsic

_I32 = ir.IntType(32)
_F32 = ir.FloatType()
_SHARED = 3   # NVPTX address space of shared memory


def _cast_all(context, builder, values, from_types, to_type):
    return [context.cast(builder, v, t, to_type) for v, t in zip(values, from_types)]


def element_pointer(context, builder, array_type, array, indices):
    """Generic pointer to ``array[indices]`` (any layout and strides; no wraparound: indices are non-negative)."""
    ary = context.make_array(array_type)(context, builder, value=array)
    return cgutils.get_item_pointer(context, builder, array_type, ary, indices, wraparound=False)


def shared_address(context, builder, array_type, array, index, index_type):
    """32-bit shared-window address of element ``index`` of a 1-D shared array."""
    idx = context.cast(builder, index, index_type, types.intp)
    ptr = element_pointer(context, builder, array_type, array, [idx])
    shared_ptr = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, _SHARED))
    return builder.ptrtoint(shared_ptr, _I32)


def check_shared_array(name, array, index):
    if not isinstance(array, types.Array) or array.ndim != 1 or array.dtype.bitwidth != 16:
        raise TypingError(f"{name}: expected a 1-D shared array of 16-bit elements, got {array}")
    if not isinstance(index, types.Integer):
        raise TypingError(f"{name}: expected an integer element index, got {index}")


def _asm_tuple(context, builder, sig, fnty, text, constraints, operands, reads_memory=False):
    """Call inline asm returning a struct of registers and repack it as the signature's UniTuple. ``reads_memory``:
    the asm reads shared memory, so it must stay where the program puts it relative to barriers, copies and
    stores (a side effect; LLVM would otherwise hoist or merge it as pure arithmetic)."""
    asm = ir.InlineAsm(fnty, text, constraints, side_effect=reads_memory)
    res = builder.call(asm, operands)
    count = sig.return_type.count
    return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(count)])


def _make_mma(kind):
    """mma.sync.aligned.m16n8k16.row.col.f32.<kind>.<kind>.f32: D = A B + C, A 16x16, B 16x8, C/D 16x8 f32."""
    text = (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        regs, acc = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
        if not all(isinstance(r, types.Integer) for r in regs) or not all(isinstance(c, types.Float) for c in acc):
            raise TypingError(f"mma_{kind}: expected six 32-bit integer registers and four floats")
        sig = types.UniTuple(types.float32, 4)(*regs, *acc)

        def codegen(context, builder, sig, args):
            ints = _cast_all(context, builder, args[:6], sig.args[:6], types.uint32)
            floats = _cast_all(context, builder, args[6:], sig.args[6:], types.float32)
            fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
            return _asm_tuple(context, builder, sig, fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
                              ints + floats)

        return sig, codegen

    return mma


mma_f16 = _make_mma("f16")
mma_bf16 = _make_mma("bf16")


@intrinsic
def mma_tf32(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: A 16x8 (a0 = A[g, t], a1 = A[g+8, t], a2 = A[g, t+4],
    a3 = A[g+8, t+4]), B 8x8 (b0 = B[t, g], b1 = B[t+4, g]), C/D as for m16n8k16; operands are tf32 bit patterns
    (``float_to_tf32``)."""
    regs, acc = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
    if not all(isinstance(r, types.Integer) for r in regs) or not all(isinstance(c, types.Float) for c in acc):
        raise TypingError("mma_tf32: expected six 32-bit integer registers and four floats")
    sig = types.UniTuple(types.float32, 4)(*regs, *acc)
    text = ("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
            "{$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};")

    def codegen(context, builder, sig, args):
        ints = _cast_all(context, builder, args[:6], sig.args[:6], types.uint32)
        floats = _cast_all(context, builder, args[6:], sig.args[6:], types.float32)
        fnty = ir.FunctionType(ir.LiteralStructType([_F32] * 4), [_I32] * 6 + [_F32] * 4)
        return _asm_tuple(context, builder, sig, fnty, text, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", ints + floats)

    return sig, codegen


def _make_ldmatrix(count, trans):
    suffix = ".trans" if trans else ""
    outs = ",".join(f"${i}" for i in range(count))
    text = f"ldmatrix.sync.aligned.m8n8.x{count}{suffix}.shared.b16 {{{outs}}}, [${count}];"
    constraints = ",".join(["=r"] * count) + ",r"
    name = f"ldmatrix_x{count}{'_trans' if trans else ''}"

    @intrinsic
    def ldmatrix(typingctx, smem, index):
        check_shared_array(name, smem, index)
        sig = types.UniTuple(types.uint32, count)(smem, index)

        def codegen(context, builder, sig, args):
            addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            fnty = ir.FunctionType(ir.LiteralStructType([_I32] * count), [_I32])
            return _asm_tuple(context, builder, sig, fnty, text, constraints, [addr], reads_memory=True)

        return sig, codegen

    return ldmatrix


ldmatrix_x4 = _make_ldmatrix(4, False)
ldmatrix_x4_trans = _make_ldmatrix(4, True)
ldmatrix_x2 = _make_ldmatrix(2, False)
ldmatrix_x2_trans = _make_ldmatrix(2, True)


@intrinsic
def cp_async_16(typingctx, dst, dst_index, src, src_index, src_bytes):
    """``cp.async.cg.shared.global``: copy 16 bytes from ``src[src_index]`` (a global array of any rank and strides,
    ``src_index`` a tuple with one integer per axis) to ``dst[dst_index]`` (1-D shared, 16-bit elements), without
    waiting; bytes past ``src_bytes`` (0 to 16) are filled with zeros instead of read. Both addresses must be
    16-byte aligned. Completes at ``cp_async_wait_*`` for this thread, at the barrier after it for the block."""
    check_shared_array("cp_async_16", dst, dst_index)
    if not isinstance(src, types.Array) or not isinstance(src_index, types.BaseTuple) \
            or len(src_index) != src.ndim or not all(isinstance(i, types.Integer) for i in src_index):
        raise TypingError(f"cp_async_16: expected a global array and one integer index per axis, got {src}, "
                          f"{src_index}")
    if not isinstance(src_bytes, types.Integer):
        raise TypingError(f"cp_async_16: expected an integer byte count, got {src_bytes}")
    sig = types.void(dst, dst_index, src, src_index, src_bytes)

    def codegen(context, builder, sig, args):
        dst_ty, dst_index_ty, src_ty, src_index_ty, nbytes_ty = sig.args
        addr = shared_address(context, builder, dst_ty, args[0], args[1], dst_index_ty)
        raw = cgutils.unpack_tuple(builder, args[3], count=len(src_index_ty))
        indices = [context.cast(builder, i, t, types.intp) for i, t in zip(raw, src_index_ty)]
        ptr = element_pointer(context, builder, src_ty, args[2], indices)
        gaddr = builder.ptrtoint(ptr, ir.IntType(64))
        nbytes = context.cast(builder, args[4], nbytes_ty, types.uint32)
        fnty = ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64), _I32])
        asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [addr, gaddr, nbytes])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def lds_v4(typingctx, smem, index):
    """``ld.shared.v4.b32``: the 16 bytes at element ``index`` (a multiple of 8) of a 1-D shared array of 16-bit
    elements, as four 32-bit words (two elements each, the lower-indexed one in the low half)."""
    check_shared_array("lds_v4", smem, index)
    sig = types.UniTuple(types.uint32, 4)(smem, index)

    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        fnty = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I32])
        asm = ir.InlineAsm(fnty, "ld.shared.v4.b32 {$0,$1,$2,$3}, [$4];", "=r,=r,=r,=r,r,~{memory}",
                           side_effect=True)
        res = builder.call(asm, [addr])
        return context.make_tuple(builder, sig.return_type, [builder.extract_value(res, i) for i in range(4)])

    return sig, codegen


@intrinsic
def lds_u32(typingctx, smem, index):
    """``ld.shared.b32``: the 32-bit word at elements ``index`` (even: 4-byte aligned) and ``index + 1`` of a 1-D
    shared array of 16-bit elements, the lower-indexed one in the low half (a float32 kept as two halves)."""
    check_shared_array("lds_u32", smem, index)
    sig = types.uint32(smem, index)

    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32]), "ld.shared.b32 $0, [$1];", "=r,r,~{memory}",
                           side_effect=True)
        return builder.call(asm, [addr])

    return sig, codegen


@intrinsic
def sts_u32(typingctx, smem, index, word):
    """``st.shared.b32``: ``word`` into elements ``index`` (even: 4-byte aligned) and ``index + 1`` of a 1-D shared
    array of 16-bit elements, low half first (two packed float16 or bfloat16 values in one store)."""
    check_shared_array("sts_u32", smem, index)
    if not isinstance(word, types.Integer):
        raise TypingError(f"sts_u32: expected a 32-bit integer word, got {word}")
    sig = types.void(smem, index, word)

    def codegen(context, builder, sig, args):
        addr = shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        value = context.cast(builder, args[2], sig.args[2], types.uint32)
        asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [_I32, _I32]), "st.shared.b32 [$0], $1;",
                           "r,r,~{memory}", side_effect=True)
        builder.call(asm, [addr, value])
        return context.get_dummy_value()

    return sig, codegen


def _make_probe(kind):
    # fma.rn.<kind>x2 acc, word, 0, acc: each half of acc becomes NaN once a half of some word is an inf or a NaN
    # (0 * inf is NaN), and stays a signed zero otherwise: one instruction per word to test a tile for non-finite
    # values.
    text = f"fma.rn.{kind}x2 $0, $1, $2, $3;"

    @intrinsic
    def probe(typingctx, acc, word):
        if not isinstance(acc, types.Integer) or not isinstance(word, types.Integer):
            raise TypingError(f"probe_{kind}x2: expected two 32-bit integer registers, got {acc}, {word}")
        sig = types.uint32(acc, word)

        def codegen(context, builder, sig, args):
            acc_v, word_v = _cast_all(context, builder, args, sig.args, types.uint32)
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32, _I32, _I32]), text, "=r,r,r,r", side_effect=False)
            return builder.call(asm, [word_v, ir.Constant(_I32, 0), acc_v])

        return sig, codegen

    return probe


probe_f16x2 = _make_probe("f16")
probe_bf16x2 = _make_probe("bf16")


@intrinsic
def cp_async_16_at(typingctx, dst, dst_index, src, byte_offset, src_bytes):
    """``cp_async_16`` from ``byte_offset`` bytes past the data pointer of the global array ``src`` (the kernel
    keeps each chunk's offset for the whole loop and adds a tile's base, instead of four index-times-stride
    products per chunk)."""
    check_shared_array("cp_async_16_at", dst, dst_index)
    if not isinstance(src, types.Array) or not isinstance(byte_offset, types.Integer) \
            or not isinstance(src_bytes, types.Integer):
        raise TypingError(f"cp_async_16_at: expected a global array, an integer byte offset and an integer byte "
                          f"count, got {src}, {byte_offset}, {src_bytes}")
    sig = types.void(dst, dst_index, src, byte_offset, src_bytes)

    def codegen(context, builder, sig, args):
        dst_ty, dst_index_ty, src_ty, offset_ty, nbytes_ty = sig.args
        addr = shared_address(context, builder, dst_ty, args[0], args[1], dst_index_ty)
        ary = context.make_array(src_ty)(context, builder, value=args[2])
        base = builder.ptrtoint(ary.data, ir.IntType(64))
        gaddr = builder.add(base, context.cast(builder, args[3], offset_ty, types.int64))
        nbytes = context.cast(builder, args[4], nbytes_ty, types.uint32)
        fnty = ir.FunctionType(ir.VoidType(), [_I32, ir.IntType(64), _I32])
        asm = ir.InlineAsm(fnty, "cp.async.cg.shared.global [$0], [$1], 16, $2;", "r,l,r,~{memory}",
                           side_effect=True)
        builder.call(asm, [addr, gaddr, nbytes])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def exp2_approx(typingctx, x):
    """``ex2.approx.ftz.f32``: 2**x from the special-function unit in one instruction (about 2 ulp; results below
    2**-126 flush to 0, which changes no softmax: the row's largest term is 1). libdevice's exp2f wraps the same
    instruction in denormal handling that costs three more per call."""
    if not isinstance(x, types.Float):
        raise TypingError(f"exp2_approx: expected a float, got {x}")
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "ex2.approx.ftz.f32 $0, $1;", "=f,f", side_effect=False)
        return builder.call(asm, [v])

    return sig, codegen


@intrinsic
def tanh_approx(typingctx, x):
    """``tanh.approx.f32``: tanh from the special-function unit in one instruction (sm_75 and newer; relative error
    about 2**-11, the size of a float16 score's own rounding). libdevice's tanhf branches between a polynomial and
    an exp-based formula, and a warp of mixed scores runs both."""
    if not isinstance(x, types.Float):
        raise TypingError(f"tanh_approx: expected a float, got {x}")
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "tanh.approx.f32 $0, $1;", "=f,f", side_effect=False)
        return builder.call(asm, [v])

    return sig, codegen


@intrinsic
def rcp_approx(typingctx, x):
    """``rcp.approx.ftz.f32``: 1 / x from the special-function unit (about 1 ulp). IEEE division calls a slow-path
    subroutine for special operands, and a call saves every live register to the stack: the tensor-core kernels'
    128 accumulators at D = 256."""
    if not isinstance(x, types.Float):
        raise TypingError(f"rcp_approx: expected a float, got {x}")
    sig = types.float32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), "rcp.approx.ftz.f32 $0, $1;", "=f,f", side_effect=False)
        return builder.call(asm, [v])

    return sig, codegen


def _make_void_asm(name, text):
    @intrinsic
    def op(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}", side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    op.__name__ = name
    return op


cp_async_commit = _make_void_asm("cp_async_commit", "cp.async.commit_group;")
cp_async_wait_all = _make_void_asm("cp_async_wait_all", "cp.async.wait_group 0;")
cp_async_wait_one = _make_void_asm("cp_async_wait_one", "cp.async.wait_group 1;")


def _make_pack(kind):
    # cvt.rn.<kind>x2.f32 d, a, b puts a in the upper half and b in the lower one.
    text = f"cvt.rn.{kind}x2.f32 $0, $1, $2;"

    @intrinsic
    def pack(typingctx, lo, hi):
        if not isinstance(lo, types.Float) or not isinstance(hi, types.Float):
            raise TypingError(f"pack_{kind}x2: expected two floats, got {lo}, {hi}")
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo_v, hi_v = _cast_all(context, builder, args, sig.args, types.float32)
            asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32, _F32]), text, "=r,f,f", side_effect=False)
            return builder.call(asm, [hi_v, lo_v])

        return sig, codegen

    return pack


pack_f16x2 = _make_pack("f16")
pack_bf16x2 = _make_pack("bf16")


@intrinsic
def float_to_tf32(typingctx, x):
    """``cvt.rna.tf32.f32``: float32 rounded to tf32 (10 mantissa bits, to nearest, ties away), as its bits."""
    if not isinstance(x, types.Float):
        raise TypingError(f"float_to_tf32: expected a float, got {x}")
    sig = types.uint32(x)

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.float32)
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32]), "cvt.rna.tf32.f32 $0, $1;", "=r,f", side_effect=False)
        return builder.call(asm, [v])

    return sig, codegen


@intrinsic
def bits_to_tf32(typingctx, word):
    """``cvt.rna.tf32.f32`` of the float32 whose bits are ``word``: as ``float_to_tf32``, for data that arrived as
    bits (a tile ``cp.async`` copied)."""
    if not isinstance(word, types.Integer):
        raise TypingError(f"bits_to_tf32: expected a 32-bit integer word, got {word}")
    sig = types.uint32(word)

    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[0], sig.args[0], types.uint32)
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32]),
                           "{ .reg .f32 x; mov.b32 x, $1; cvt.rna.tf32.f32 $0, x; }", "=r,r", side_effect=False)
        return builder.call(asm, [value])

    return sig, codegen


@cuda.jit(device=True, inline="always")
def shfl_xor(x, lane_mask):
    """``x`` of lane ``laneid ^ lane_mask`` (float32, the whole warp)."""
    return cuda.shfl_xor_sync(0xFFFFFFFF, x, lane_mask)
