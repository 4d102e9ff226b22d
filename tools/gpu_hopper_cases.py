"""Hopper's wgmma on the GPU against the simulator's reading of the PTX ISA (``tools/gpu_check.py``'s job
"hopper-lanes"): the kernels of the simulator's lane tests (``tests/hopper_sim_cases.chained_wgmma_kernel``) run on
a compute capability 9.0 device, operands placed by the tests' own layouts, accumulators compared register by
register with numpy's product of the same values. Where the two disagree, the emulation (and every kernel proven on
it) has the ISA wrong.

Each case returns ``ok``, the largest error relative to the product's largest magnitude per layout, and the bound:
float32 accumulation over 16 terms for the 16-bit kinds; for the 8-bit ones a looser one, since Hopper's FP8 tensor
cores are reported to accumulate with fewer mantissa bits than float32 (about 14, DeepSeek-V3's technical report),
which the simulator does not model: the measured error says how many. A layout the emulation got wrong is off by a
magnitude of order one either way. On another device or without CUDA the case is skipped with the reason.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

import numba_flash  # noqa: F401  (imported first: tests/numba_flash, the package's tests, must not shadow it)

sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

#: (trans_b, (code, lbo, sbo) of A, of B, n): K-major operands in each swizzle mode, and an N-major B (16-bit only).
LAYOUTS = {
    "k-major-128B": (False, (1, 16, 1024), (1, 16, 1024), 64),
    "k-major-64B-padded": (False, (2, 16, 512), (2, 16, 768), 32),
    "k-major-none": (False, (0, 128, 256), (0, 2048, 128), 64),
    "n-major-128B": (True, (1, 16, 1024), (1, 8192, 1024), 128),
}
BOUNDS = {"f16": 1e-6, "bf16": 1e-6, "e4m3": 1e-3, "e5m2": 1e-3}


def lanes(ctx: Any, kind: str) -> dict[str, Any]:
    """``kind``: "f16", "bf16", "e4m3" or "e5m2"; each layout with A from shared memory, then A from registers."""
    from numba import cuda

    if ctx.device != "cuda" or not cuda.is_available():
        return {"ok": True, "skipped": "needs a CUDA device"}
    if cuda.get_current_device().compute_capability != (9, 0):
        return {"ok": True, "skipped": f"needs compute capability 9.0, got {cuda.get_current_device().compute_capability}"}
    import hopper_sim_cases as hc

    eight_bit = kind in ("e4m3", "e5m2")
    errors = {}
    for name, (trans_b, (code_a, lbo_a, sbo_a), (code_b, lbo_b, sbo_b), n) in LAYOUTS.items():
        if eight_bit and trans_b:
            continue   # the ISA reads 8-bit operands K-major only
        for a_in_registers in (False, True):
            if eight_bit:
                a_bits, a = hc.random_fp8(ctx.rng, (64, 32), kind)
                bt_bits, bt = hc.random_fp8(ctx.rng, (n, 32), kind)
                words = hc.a_register_words_fp8(a_bits)
            else:
                a, bt = hc.random_values(ctx.rng, (64, 16), kind), hc.random_values(ctx.rng, (n, 16), kind)
                a_bits, bt_bits = hc.bits16(a, kind), hc.bits16(bt, kind)
                words = hc.a_register_words(a, kind)
            image = ctx.rng.integers(0, 1 << 16, 32768, dtype=np.uint16)
            hc.place(image, a_bits, True, code_a, lbo_a, sbo_a, 0)
            hc.place(image, bt_bits, not trans_b, code_b, lbo_b, sbo_b, 32768)
            params = np.array([[0, lbo_a, sbo_a, code_a, 16384, lbo_b, sbo_b, code_b]], np.int64)
            c = np.zeros((64, n), np.float32) if a_in_registers else ctx.rng.standard_normal((64, n)).astype(np.float32)
            out = np.full((128, n // 8, 4), np.nan, np.float32)
            kernel = hc.chained_wgmma_kernel(n, kind, trans_b, a_in_registers=a_in_registers)
            kernel[1, 128](image, params, hc.to_registers(c, n), words, out)
            cuda.synchronize()
            want = a @ bt.T + c
            got = hc.from_registers(out, n)
            scale = max(float(np.abs(want).max()), 1e-30)
            errors[f"{name}{'-rs' if a_in_registers else ''}"] = float(np.abs(got - want).max()) / scale
    fails = [k for k, e in errors.items() if not e <= BOUNDS[kind]]
    return {"errors": errors, "bound": BOUNDS[kind], "ok": not fails, "failed": fails}
