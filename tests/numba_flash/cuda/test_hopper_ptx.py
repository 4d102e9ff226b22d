"""The Hopper primitives' inline PTX (``numba_flash.cuda.device.hopper_ptx``) through the real compiler, without a
GPU: each types in a kernel compiled for sm_90a, lowers to the PTX instruction it names, and ptxas turns them into
Hopper's instructions (HGMMA, the warpgroup arrive/depbar pair, SYNCS for mbarriers, UBLKCP for bulk copies).

Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_hopper_ptx.py
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.ptx
N = 64
NT = N // 8


def _kernel():
    from numba import cuda, float32, uint16, uint64

    from numba_flash.cuda.device import hopper

    wgmma_ss = hopper.make_wgmma(N, "f16", False, False)
    wgmma_rs = hopper.make_wgmma(N, "bf16", True, True)
    wait0, wait1 = hopper.make_wgmma_wait(0), hopper.make_wgmma_wait(1)
    fence = hopper.make_accumulator_fence(N // 2)
    more, fewer = hopper.make_setmaxnreg(240, True), hopper.make_setmaxnreg(40, False)

    def every_primitive(out, src):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(8192, uint16, alignment=1024)
        bars = cuda.shared.array(2, uint64)
        if t == 0:
            hopper.mbarrier_init(bars, 0, 1)
            hopper.mbarrier_init(bars, 1, 128)
            hopper.fence_mbarrier_init()
        cuda.syncthreads()
        if t < 128:
            fewer()
            if t == 0:
                hopper.mbarrier_wait(bars, 1, 1)
                hopper.mbarrier_arrive_expect_tx(bars, 0, 8192)
                hopper.bulk_copy_g2s(smem, 0, src, 0, 8192, bars, 0)
        else:
            more()
            hopper.mbarrier_wait(bars, 0, 0)
            acc = cuda.local.array((NT, 4), float32)
            hopper.wgmma_fence()
            wgmma_ss(acc, hopper.smem_desc(smem, 0, 16, 1024, 1), hopper.smem_desc(smem, 4096, 16, 1024, 1), 0)
            hopper.wgmma_commit()
            wgmma_rs(acc, t, t + 1, t + 2, t + 3, hopper.smem_desc(smem, 4096, 8192, 1024, 1), 1)
            hopper.wgmma_commit()
            wait1()
            wait0()
            fence(acc)
            total = float32(0)
            for j in range(NT):
                for r in range(4):
                    total += acc[j, r]
            out[t] = total
            hopper.fence_proxy_async()
            hopper.mbarrier_arrive(bars, 1)

    return every_primitive


def _compile(arch):
    from numba import cuda, types

    sig = types.void(types.float32[:], types.uint16[:])
    return cuda.compile_ptx(_kernel(), sig, cc=arch)[0]


def test_every_hopper_primitive_becomes_its_instruction():
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba_flash.cuda.compile_check.sass import disassemble, link, parse
    from numba_flash.cuda.device import hopper

    ptx = _compile(hopper.ARCH)
    assert ".target sm_90a" in ptx
    for text in ("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16", "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16",
                 "wgmma.fence.sync.aligned", "wgmma.commit_group.sync.aligned", "wgmma.wait_group.sync.aligned 0",
                 "wgmma.wait_group.sync.aligned 1", "mbarrier.init.shared::cta.b64", "mbarrier.arrive.shared::cta.b64",
                 "mbarrier.arrive.expect_tx.shared::cta.b64", "mbarrier.try_wait.parity.shared::cta.b64",
                 "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", "fence.proxy.async.shared::cta",
                 "fence.mbarrier_init.release.cluster", "setmaxnreg.inc.sync.aligned.u32 240",
                 "setmaxnreg.dec.sync.aligned.u32 40"):
        assert text in ptx, text
    # m64n64: 32 accumulators a thread; the register-A form takes four 32-bit registers, then trans-b = 1.
    ss = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.f16\.f16 \{([^}]*)\}, %rd\d+, %rd\d+, p, "
                   r"1, 1, 0, 0;", ptx)
    rs = re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, \{(%r\d+,){3}%r\d+\}, "
                   r"%rd\d+, p, 1, 1, 1;", ptx)
    assert ss and len(ss.group(1).split(",")) == 32 and rs
    cubin, log = link(ptx, hopper.ARCH)
    sass = disassemble(cubin)
    assert re.search(r"HGMMA\.64x64x16\.F32 ", sass) and re.search(r"HGMMA\.64x64x16\.F32\.BF16 ", sass)
    ops = [i.opcode for f in parse(sass) for i in f.instructions]
    for want in ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE",
                 "SYNCS.EXCH.64", "SYNCS.ARRIVE.TRANS64", "SYNCS.PHASECHK.TRANS64.TRYWAIT", "UBLKCP.S.G",
                 "FENCE.VIEW.ASYNC.S"):
        assert any(op.startswith(want) for op in ops), (want, sorted(set(ops)))
    assert "0 bytes stack frame" in log


def test_plain_sm_90_refuses_wgmma():
    """Why the "a" target: sm_90 without it has no wgmma or setmaxnreg."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba_flash.cuda.compile_check.sass import link

    ptx = _compile((9, 0))
    with pytest.raises(RuntimeError, match="not supported on .target 'sm_90'"):
        link(ptx, (9, 0))


@pytest.mark.parametrize("kind", ["e4m3", "e5m2"])
def test_8_bit_wgmma_becomes_a_k32_qgmma(kind):
    """The 8-bit kinds: k32, no transpose immediates (the ISA reads them K-major only), A from a descriptor or from
    four registers; ptxas assembles both into QGMMA (Hopper's 8-bit-float HGMMA) of K = 32 on those types."""
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba import cuda, float32, types, uint16

    from numba_flash.cuda.compile_check.sass import disassemble, link
    from numba_flash.cuda.device import hopper

    wgmma_ss, wgmma_rs = hopper.make_wgmma(N, kind, False, False), hopper.make_wgmma(N, kind, True, False)
    wait0 = hopper.make_wgmma_wait(0)
    fence = hopper.make_accumulator_fence(N // 2)

    def kernel(out):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(8192, uint16, alignment=1024)
        acc = cuda.local.array((NT, 4), float32)
        hopper.wgmma_fence()
        wgmma_ss(acc, hopper.smem_desc(smem, 0, 16, 1024, 1), hopper.smem_desc(smem, 4096, 16, 1024, 1), 0)
        wgmma_rs(acc, t, t + 1, t + 2, t + 3, hopper.smem_desc(smem, 4096, 16, 1024, 1), 1)
        hopper.wgmma_commit()
        wait0()
        fence(acc)
        out[t] = acc[0, 0] + acc[NT - 1, 3]

    ptx = cuda.compile_ptx(kernel, types.void(types.float32[:]), cc=hopper.ARCH)[0]
    op = rf"wgmma\.mma_async\.sync\.aligned\.m64n64k32\.f32\.{kind}\.{kind}"
    assert re.search(op + r" \{[^}]*\}, %rd\d+, %rd\d+, p, 1, 1;", ptx)
    assert re.search(op + r" \{[^}]*\}, \{(%r\d+,){3}%r\d+\}, %rd\d+, p, 1, 1;", ptx)
    cubin, log = link(ptx, hopper.ARCH)
    qgmma = re.findall(r"QGMMA\.64x64x32\.F32\.(\S+) ", disassemble(cubin))
    assert qgmma == [f"{kind.upper()}.{kind.upper()}"] * 2, qgmma
    assert "0 bytes stack frame" in log
