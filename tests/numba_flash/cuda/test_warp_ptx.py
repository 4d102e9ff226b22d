"""The warp primitives' inline PTX (``numba_flash.cuda.device.warp_ptx``) through the real compiler: each one types in a
kernel, lowers to the PTX instruction it names, and ptxas turns it into the tensor-core, ldmatrix, async-copy,
shuffle and packing instructions (SASS) for sm_80 and sm_90, without a GPU.

Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_warp_ptx.py
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ptx


def _kernel():
    from numba import cuda, float32, uint16

    from numba_flash.cuda.device import warp

    def every_primitive(out, q):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(1024, uint16)
        warp.cp_async_16(smem, t * 8, q, (0, t, 0, 0), 16)
        warp.cp_async_commit()
        warp.cp_async_wait_all()
        cuda.syncthreads()
        a0, a1, a2, a3 = warp.ldmatrix_x4(smem, (t % 16) * 16 + (t // 16) * 8)
        b0, b1, b2, b3 = warp.ldmatrix_x4_trans(smem, (t % 16) * 16 + (t // 16) * 8)
        c0, c1 = warp.ldmatrix_x2(smem, t * 8)
        e0, e1 = warp.ldmatrix_x2_trans(smem, t * 8)
        w0, w1, w2, w3 = warp.lds_v4(smem, t * 8)
        e0 = warp.probe_f16x2(e0, w0 ^ w1)
        e1 = warp.probe_bf16x2(e1, w2 ^ w3)
        zero = float32(0.0)
        r = warp.mma_f16(a0, a1, a2, a3, b0, b1, zero, zero, zero, zero)
        r = warp.mma_bf16(a0, a1, c0, c1, b2, b3 ^ e0 ^ e1, r[0], r[1], r[2], r[3])
        x = warp.shfl_xor(r[0], 1)
        tf = warp.float_to_tf32(r[3]) ^ warp.bits_to_tf32(warp.lds_u32(smem, t * 2))
        r = warp.mma_tf32(tf, tf, tf, tf, tf, tf, x, r[1], r[2], r[3])
        out[t, 0] = r[0]
        out[t, 1] = float32(warp.pack_f16x2(x, r[1]))
        out[t, 2] = float32(warp.pack_bf16x2(x, r[2]))
        out[t, 3] = r[3] + warp.exp2_approx(r[0]) * warp.rcp_approx(r[1]) + warp.tanh_approx(r[2])
        warp.sts_u32(smem, t * 2, warp.pack_f16x2(r[2], r[3]))
        warp.cp_async_16_at(smem, 512 + t * 8, q, t * q.strides[1], 16)
        warp.cp_async_commit()
        warp.cp_async_wait_one()

    return every_primitive


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_every_primitive_becomes_its_instruction(cc):
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba import cuda, types

    from numba_flash.cuda.compile_check.sass import disassemble, link, parse

    sig = types.void(types.float32[:, :], types.Array(types.float16, 4, "A"))
    ptx, _ = cuda.compile_ptx(_kernel(), sig, cc=cc)
    for text in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "mma.sync.aligned.m16n8k16.row.col.f32.bf16",
                 "mma.sync.aligned.m16n8k8.row.col.f32.tf32", "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                 "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16", "ldmatrix.sync.aligned.m8n8.x2.shared.b16",
                 "cp.async.cg.shared.global", "cp.async.commit_group", "cp.async.wait_group 0",
                 "cvt.rn.f16x2.f32", "cvt.rn.bf16x2.f32", "cvt.rna.tf32.f32", "shfl.sync.bfly",
                 "ld.shared.v4.b32", "fma.rn.f16x2", "fma.rn.bf16x2", "ex2.approx.ftz.f32", "rcp.approx.ftz.f32",
                 "tanh.approx.f32",
                 "st.shared.b32", "cp.async.wait_group 1", "ld.shared.b32"):
        assert text in ptx, text
    cubin, log = link(ptx, cc)
    ops = [i.opcode for f in parse(disassemble(cubin)) for i in f.instructions]
    for want in ("HMMA.16816.F32", "HMMA.16816.F32.BF16", "HMMA.1688.F32.TF32", "LDSM.16.M88.4", "LDSM.16.MT88.4",
                 "LDSM.16.M88.2", "LDSM.16.MT88.2", "LDGSTS.E.BYPASS.128", "SHFL.BFLY", "LDS.128", "HFMA2"):
        assert want in ops, (want, sorted(set(ops)))
    assert "MUFU.EX2" in ops and "MUFU.RCP" in ops and "MUFU.TANH" in ops and "STS" in ops
    assert not any(op.startswith("CALL") for op in ops)   # no subroutine: a call would save every live register
    assert any(op.startswith("F2FP") and "BF16" in op for op in ops)
    assert any(op.startswith("F2FP") and "BF16" not in op for op in ops)
    assert "0 bytes stack" in log or "stack" not in log


def test_a_misused_primitive_is_a_typing_error():
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba import cuda, float32, types
    from numba.core.errors import TypingError

    from numba_flash.cuda.device import warp

    def bad(out):
        smem = cuda.shared.array(64, float32)   # 32-bit elements: ldmatrix moves 16-bit ones
        r = warp.ldmatrix_x4(smem, 0)
        out[0] = r[0]

    with pytest.raises(TypingError, match="16-bit elements"):
        cuda.compile_ptx(bad, types.void(types.uint32[:]), cc=(8, 0))
