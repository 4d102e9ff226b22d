"""The wgmma forward compiled for sm_90a without a GPU (the compile table does not hold sm_90a jobs yet): every
switch on (the worst case for registers), the mods and packed-sequence builds, both dtypes and head-dim buckets;
none may spill or use a stack, and the products must be HGMMA.

Run: .venv/bin/python -m pytest -q -m ptx tests/numba_flash/cuda/test_wgmma_forward_compile.py
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.ptx


@pytest.mark.parametrize("kernel,dtype,d", [("wgmma_forward", "float16", 128), ("wgmma_forward", "bfloat16", 64),
                                            ("wgmma_forward+mods", "float16", 64),
                                            ("wgmma_forward+varlen", "bfloat16", 128)])
def test_compiles_for_sm_90a_without_spills(kernel, dtype, d):
    pytest.importorskip("cuda.bindings.nvjitlink")
    from numba_flash.cuda.compile_check import assemble, kernel_ptx
    from numba_flash.cuda.compile_check.sass import disassemble, link
    from numba_flash.cuda.device.hopper import ARCH
    from numba_flash.cuda.host.picker import TileOverride, tile_config_for

    cfg = tile_config_for(d, dtype, (9, 0), kernel="wgmma_forward", override=TileOverride())
    ptx = kernel_ptx(kernel, cfg, dtype, ARCH)
    found = assemble(ptx, kernel, cfg, dtype, ARCH)
    assert (found.spill_stores, found.spill_loads, found.stack) == (0, 0, 0), found
    assert found.smem <= 48 * 1024 + 1024, found   # static shared memory, and the 1 KiB sm_90 reserves
    sass = disassemble(link(ptx, ARCH)[0])
    hgmma = [line for line in sass.splitlines() if "HGMMA." in line]
    assert any(f"HGMMA.64x{cfg.block_n}x16.F32" in line for line in hgmma), hgmma[:3]   # Q K^T
    assert any(f"HGMMA.64x{d}x16.F32" in line and "tnspB" in line for line in hgmma), hgmma[:3]   # P V, V N-major
