"""The simulator's wgmma (``numba_flash.cuda.device.hopper`` under ``NUMBA_ENABLE_CUDASIM=1``) against numpy's
product: operands read through every canonical shared-memory layout (written again in hopper_sim_cases.py from the
PTX ISA), A from registers, k steps chained through a swizzled tile, results held until their wait, and the
checker's wgmma hazard. Random matrices, fresh each run.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_hopper_wgmma_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hopper_sim_cases import (
    a_register_words,
    bits16,
    chained_wgmma_kernel,
    d_position,
    from_registers,
    launch,
    place,
    random_values,
    to_registers,
)
from numba import cuda, float32, uint16

from numba_flash.cuda import SimulatorCheckError, simcheck
from numba_flash.cuda.device import hopper

pytestmark = pytest.mark.cudasim


@pytest.fixture(autouse=True)
def checker():
    with simcheck.checking():
        yield


# ---- wgmma ----

def make_kernel(n, kind, trans_b, steps=1, a_in_registers=False):
    """``hopper_sim_cases.chained_wgmma_kernel`` with 64 KiB of shared memory."""
    return chained_wgmma_kernel(n, kind, trans_b, steps, a_in_registers)


# (code, lbo, sbo) per operand: dense and padded strides for every swizzle mode.
K_MAJOR_LAYOUTS = [(1, 16, 1024), (1, 16, 2048), (2, 16, 512), (3, 16, 256), (3, 16, 768), (0, 128, 256),
                   (0, 2048, 128)]


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("layout", K_MAJOR_LAYOUTS)
def test_wgmma_k_major_operands_are_read_by_the_isa_layouts(kind, layout, rng):
    code, lbo, sbo = layout
    n = 64 if code != 3 else 24
    a = random_values(rng, (64, 16), kind)
    b = random_values(rng, (16, n), kind)
    c = rng.standard_normal((64, n)).astype(np.float32)
    image = rng.integers(0, 1 << 16, 32768, dtype=np.uint16)   # garbage where no element lies
    a_start, b_start = 0, 16384   # byte addresses: B in the second half
    place(image, bits16(a, kind), True, code, lbo, sbo, a_start)
    place(image, bits16(b.T, kind), True, code, lbo, sbo, b_start)
    params = np.array([[a_start // 2, lbo, sbo, code, b_start // 2, lbo, sbo, code]], np.int64)
    out = np.zeros((128, n // 8, 4), np.float32)
    launch(make_kernel(n, kind, False), 128, image, params, to_registers(c, n), np.zeros((128, 4), np.uint32), out)
    want = a @ b + c
    np.testing.assert_allclose(from_registers(out, n), want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


MN_MAJOR_LAYOUTS = [(1, 8192, 1024, 128), (1, 16384, 2048, 128), (2, 4096, 512, 64), (3, 2048, 256, 32),
                    (0, 1024, 128, 64)]


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("layout", MN_MAJOR_LAYOUTS)
def test_wgmma_n_major_b_is_read_by_the_isa_layouts(kind, layout, rng):
    code, lbo, sbo, n = layout
    a = random_values(rng, (64, 16), kind)
    b = random_values(rng, (16, n), kind)
    c = rng.standard_normal((64, n)).astype(np.float32)
    image = rng.integers(0, 1 << 16, 32768, dtype=np.uint16)
    a_start, b_start = 0, 8192
    place(image, bits16(a, kind), True, 1, 16, 1024, a_start)
    place(image, bits16(b.T, kind), False, code, lbo, sbo, b_start)
    params = np.array([[a_start // 2, 16, 1024, 1, b_start // 2, lbo, sbo, code]], np.int64)
    out = np.zeros((128, n // 8, 4), np.float32)
    launch(make_kernel(n, kind, True), 128, image, params, to_registers(c, n), np.zeros((128, 4), np.uint32), out)
    want = a @ b + c
    np.testing.assert_allclose(from_registers(out, n), want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


def test_wgmma_k_steps_chain_through_a_swizzled_tile(rng):
    """Q K^T's use: a 64 x 64 tile of each operand, 128-byte swizzle, four k16 steps 32 bytes apart, chained into
    one accumulator before a single wait."""
    kind, n = "f16", 96
    a = random_values(rng, (64, 64), kind)
    b = random_values(rng, (64, n), kind)
    image = rng.integers(0, 1 << 16, 32768, dtype=np.uint16)
    a_bits, b_bits = bits16(a, kind), bits16(b.T, kind)
    for s in range(4):   # each step's 16 columns, written where that step's descriptor reads them
        place(image, a_bits[:, 16 * s:16 * s + 16], True, 1, 16, 1024, 32 * s)
        place(image, b_bits[:, 16 * s:16 * s + 16], True, 1, 16, 1024, 16384 + 32 * s)
    params = np.array([[16 * s, 16, 1024, 1, 8192 + 16 * s, 16, 1024, 1] for s in range(4)], np.int64)
    out = np.zeros((128, n // 8, 4), np.float32)
    launch(make_kernel(n, kind, False, steps=4), 128, image, params, np.zeros((128, n // 8, 4), np.float32),
           np.zeros((128, 4), np.uint32), out)
    want = a @ b
    np.testing.assert_allclose(from_registers(out, n), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("trans_b,layout", [(True, (1, 8192, 1024, 128)), (False, (1, 16, 1024, 64)),
                                            (True, (0, 1024, 128, 64))])
def test_wgmma_a_from_registers_is_the_mma_a_layout_per_warp(kind, trans_b, layout, rng):
    code, lbo, sbo, n = layout
    a = random_values(rng, (64, 16), kind)
    b = random_values(rng, (16, n), kind)
    image = rng.integers(0, 1 << 16, 32768, dtype=np.uint16)
    place(image, bits16(b.T, kind), not trans_b, code, lbo, sbo, 4096)
    out = np.full((128, n // 8, 4), np.nan, np.float32)
    params = np.array([[0, 0, 0, 0, 2048, lbo, sbo, code]], np.int64)
    launch(make_kernel(n, kind, trans_b, a_in_registers=True), 128, image, params,
           np.full((128, n // 8, 4), np.nan, np.float32), a_register_words(a, kind), out)
    want = a @ b
    np.testing.assert_allclose(from_registers(out, n), want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


def test_wgmma_results_arrive_at_the_wait_that_retires_their_group(rng):
    """Before the wait the accumulators hold their old values (the hardware's are undefined), and a fence on them
    raises; the second of two committed groups stays in flight through wait_group 1."""
    n, kind = 32, "f16"
    wgmma = hopper.make_wgmma(n, kind, False, False)
    wait0, wait1 = hopper.make_wgmma_wait(0), hopper.make_wgmma_wait(1)
    NT = n // 8

    @cuda.jit
    def kernel(image, early, middle, late):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(8192, uint16)
        for e in range(t, 8192, 128):
            smem[e] = image[e]
        cuda.syncthreads()
        x = cuda.local.array((NT, 4), float32)
        y = cuda.local.array((NT, 4), float32)
        for j in range(NT):
            for r in range(4):
                x[j, r] = 7.0
                y[j, r] = 7.0
        da = hopper.smem_desc(smem, 0, 16, 1024, 1)
        db = hopper.smem_desc(smem, 4096, 16, 1024, 1)
        hopper.wgmma_fence()
        wgmma(x, da, db, 0)
        hopper.wgmma_commit()
        wgmma(y, da, db, 0)
        hopper.wgmma_commit()
        early[t] = x[0, 0] + y[0, 0]
        wait1()
        middle[t] = x[0, 0] + y[0, 0]
        wait0()
        late[t] = x[0, 0] + y[0, 0]

    a, b = random_values(rng, (64, 16), kind), random_values(rng, (16, n), kind)
    image = rng.integers(0, 1 << 16, 8192, dtype=np.uint16)
    place(image, bits16(a, kind), True, 1, 16, 1024, 0)
    place(image, bits16(b.T, kind), True, 1, 16, 1024, 8192)
    early, middle, late = (np.zeros(128, np.float32) for _ in range(3))
    launch(kernel, 128, image, early, middle, late)
    first = np.array([(a @ b)[d_position(lane, 0, 0)] for lane in range(128)], np.float32)
    np.testing.assert_array_equal(early, np.float32(14.0))
    np.testing.assert_allclose(middle, first + np.float32(7.0), rtol=1e-6)
    np.testing.assert_allclose(late, 2 * first, rtol=1e-6)


def make_early_kernel():
    """One 64 x 16 x 16 wgmma, then (``mode``) nothing, a fence on its accumulators, or a write to its B, before the
    wait; a write to B after the wait and a barrier in every case."""
    wgmma = hopper.make_wgmma(16, "f16", False, False)
    wait0 = hopper.make_wgmma_wait(0)
    fence = hopper.make_accumulator_fence(8)

    @cuda.jit
    def kernel(image, mode):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(8192, uint16)
        for e in range(t, 8192, 128):
            smem[e] = image[e]
        cuda.syncthreads()
        acc = cuda.local.array((2, 4), float32)
        hopper.wgmma_fence()
        wgmma(acc, hopper.smem_desc(smem, 0, 16, 1024, 1), hopper.smem_desc(smem, 4096, 16, 1024, 1), 0)
        hopper.wgmma_commit()
        if mode[0] == 1:
            fence(acc)                   # reads the accumulators before the wait
        if mode[0] == 2:
            smem[4096 + t] = uint16(0)   # writes B before the wait
        wait0()
        cuda.syncthreads()
        smem[4096 + t] = uint16(1)       # after it: fine

    return kernel


def test_accumulator_fence_before_the_wait_raises(rng):
    image = bits16(random_values(rng, 8192, "f16"), "f16")
    launch(make_early_kernel(), 128, image, np.zeros(1, np.int64))
    with pytest.raises(Exception, match="has not been retired by wgmma_wait"):
        launch(make_early_kernel(), 128, image, np.ones(1, np.int64))


def test_smem_desc_fields_are_where_the_isa_puts_them():
    @cuda.jit
    def kernel(out, index, lbo, sbo, code):
        smem = cuda.shared.array(16384, uint16)
        out[0] = hopper.smem_desc(smem, index, lbo, sbo, code)

    for index, lbo, sbo, code in [(0, 16, 1024, 1), (8200, 4096, 512, 2), (24, 2048, 128, 0), (16376, 32, 256, 3)]:
        out = np.zeros(1, np.uint64)
        launch(kernel, 1, out, index, lbo, sbo, code)
        bits = int(out[0])
        assert bits & 0x3FFF == (2 * index) >> 4                  # bits 0-13: start address >> 4
        assert (bits >> 16) & 0x3FFF == lbo >> 4                  # bits 16-29
        assert (bits >> 32) & 0x3FFF == sbo >> 4                  # bits 32-45
        assert (bits >> 49) & 0x7 == 0 and bits >> 62 == code    # base offset 0, swizzle in bits 62-63
        assert bits & ((0x3 << 14) | (0x3 << 30) | (0x7 << 46) | (0x3FF << 52)) == 0


def test_a_write_to_shared_memory_a_wgmma_still_reads_is_a_race(rng):
    with pytest.raises(SimulatorCheckError, match="wgmma issued at .* has not completed when this writes it"):
        launch(make_early_kernel(), 128, bits16(random_values(rng, 8192, "f16"), "f16"), np.full(1, 2, np.int64))
