"""The simulator's 8-bit-float wgmma (``hopper.make_wgmma(n, "e4m3" | "e5m2", ...)``, m64nNk32) against numpy's
product of the same values: every byte decoded as torch decodes its float8 dtypes, operands read through the
K-major canonical layouts with 8-bit elements (written again in hopper_sim_cases.py from the PTX ISA), k32 steps
chained through a swizzled tile, and A from registers in mma.m16n8k32's 8-bit A layout. Random values, fresh each
run.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_hopper_fp8_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hopper_sim_cases import (
    a_register_words_fp8,
    chained_wgmma_kernel,
    from_registers,
    launch,
    place,
    random_fp8,
    to_registers,
)

from numba_flash.cuda import simcheck
from numba_flash.cuda.device import hopper, hopper_sim

pytestmark = pytest.mark.cudasim
KINDS = ["e4m3", "e5m2"]


@pytest.fixture(autouse=True)
def checker():
    with simcheck.checking():
        yield


@pytest.mark.parametrize("kind", KINDS)
def test_every_byte_decodes_as_torch_decodes_it(kind):
    torch = pytest.importorskip("torch")
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kind]
    want = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float64).numpy()
    got = hopper_sim.element_values(np.arange(256, dtype=np.uint8), kind)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])


def make_kernel(n, kind, steps=1, a_in_registers=False):
    """``hopper_sim_cases.chained_wgmma_kernel`` with 32 KiB of shared memory (8-bit operands: K-major only)."""
    return chained_wgmma_kernel(n, kind, False, steps, a_in_registers, smem_words=16384)


# (code, lbo, sbo): dense and padded strides for every swizzle mode (bytes, as for 16-bit operands).
LAYOUTS = [(1, 16, 1024), (1, 16, 2048), (2, 16, 512), (3, 16, 256), (0, 128, 256), (0, 2048, 128)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_k_major_8_bit_operands_are_read_by_the_isa_layouts(kind, layout, rng):
    code, lbo, sbo = layout
    n = 64 if code != 3 else 24
    a_bits, a = random_fp8(rng, (64, 32), kind)
    b_bits, b = random_fp8(rng, (n, 32), kind)   # B stored K-major: its rows are B's columns
    c = rng.standard_normal((64, n)).astype(np.float32)
    image = rng.integers(0, 1 << 16, 16384, dtype=np.uint16)   # garbage where no element lies
    a_start, b_start = 0, 16384
    place(image, a_bits, True, code, lbo, sbo, a_start)
    place(image, b_bits, True, code, lbo, sbo, b_start)
    params = np.array([[a_start // 2, lbo, sbo, code, b_start // 2, lbo, sbo, code]], np.int64)
    out = np.zeros((128, n // 8, 4), np.float32)
    launch(make_kernel(n, kind), 128, image, params, to_registers(c, n), np.zeros((128, 4), np.uint32), out)
    want = a @ b.T + c
    np.testing.assert_allclose(from_registers(out, n), want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


def test_k32_steps_chain_through_a_swizzled_tile(rng):
    """Q K^T's use in 8 bits: a 64 x 128 tile of each operand (128 bytes a row), 128-byte swizzle, four k32 steps
    32 bytes apart, chained into one accumulator before a single wait."""
    kind, n = "e4m3", 80
    a_bits, a = random_fp8(rng, (64, 128), kind)
    b_bits, b = random_fp8(rng, (n, 128), kind)
    image = rng.integers(0, 1 << 16, 16384, dtype=np.uint16)
    for s in range(4):   # each step's 32 columns, written where that step's descriptor reads them
        place(image, a_bits[:, 32 * s:32 * s + 32], True, 1, 16, 1024, 32 * s)
        place(image, b_bits[:, 32 * s:32 * s + 32], True, 1, 16, 1024, 16384 + 32 * s)
    params = np.array([[16 * s, 16, 1024, 1, 8192 + 16 * s, 16, 1024, 1] for s in range(4)], np.int64)
    out = np.zeros((128, n // 8, 4), np.float32)
    launch(make_kernel(n, kind, steps=4), 128, image, params, np.zeros((128, n // 8, 4), np.float32),
           np.zeros((128, 4), np.uint32), out)
    want = a @ b.T
    np.testing.assert_allclose(from_registers(out, n), want, rtol=1e-6, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("kind", KINDS)
def test_a_from_registers_is_the_8_bit_mma_a_layout_per_warp(kind, rng):
    n = 48
    a_bits, a = random_fp8(rng, (64, 32), kind)
    b_bits, b = random_fp8(rng, (n, 32), kind)
    image = rng.integers(0, 1 << 16, 16384, dtype=np.uint16)
    place(image, b_bits, True, 1, 16, 1024, 4096)
    out = np.full((128, n // 8, 4), np.nan, np.float32)
    params = np.array([[0, 0, 0, 0, 2048, 16, 1024, 1]], np.int64)
    launch(make_kernel(n, kind, a_in_registers=True), 128, image, params,
           np.full((128, n // 8, 4), np.nan, np.float32), a_register_words_fp8(a_bits), out)
    want = a @ b.T
    np.testing.assert_allclose(from_registers(out, n), want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


def test_the_isa_has_no_transposed_or_other_8_bit_wgmma():
    with pytest.raises(ValueError, match="K-major only"):
        hopper.make_wgmma(64, "e4m3", False, True)
    with pytest.raises(ValueError, match="kind one of f16, bf16, e4m3, e5m2"):
        hopper.make_wgmma(64, "e3m4", False, False)
