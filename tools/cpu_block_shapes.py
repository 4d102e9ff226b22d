"""Time the CPU micro-kernel's register-block shapes against each other, one core, in one process.

    NUMBA_FLASH_CPU_SIMD=256 NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES=... python tools/cpu_block_shapes.py 128

Each shape (rows x vectors of columns) is built by ``register_block`` with the head-dim chunking of
``mm_dot`` and covers one C of 96 x 12 vectors of columns, which every shape tiles exactly (a C it does not
would be written past its end).
Repeats interleave the shapes. Prints each shape's stack moves in the compiled code (the copies of the arguments
give a baseline; more is a spill) and its max / median GFLOP/s. Set ``NUMBA_CPU_FEATURES`` to the target's
features: with the host's, LLVM may use AVX-512 registers, and a shape that spills on the target does not here.
"""

from __future__ import annotations

import re
import sys
import time

import numpy as np
from numba import njit

from numba_flash.cpu.microkernels import DOT_CHUNK, register_block
from numba_flash.cpu.simd import LANES

SHAPES = [(4, 2), (6, 2), (4, 3), (8, 2), (3, 4)]


def _timed_loop(rows: int, nvec: int):
    """A jitted ``loop(c, a, b, kdim, n)``: n times C = A @ B over the whole of C in rows x nvec-vector blocks."""
    block = register_block(False, nvec, rows, chunk=DOT_CHUNK)   # its accumulate flag is ignored with a chunk
    width = nvec * LANES

    @njit
    def loop(c, a, b, kdim, n):
        for _ in range(n):
            for j in range(0, c.shape[1], width):
                for i in range(0, c.shape[0], rows):
                    block(c, a, b, i, j, kdim, False)
    return loop


def main() -> None:
    kdim = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    rows, cols, calls, repeats = 96, 12 * LANES, 500, 11
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, kdim)).astype(np.float32)
    b = rng.standard_normal((kdim, cols)).astype(np.float32)
    loops = {shape: _timed_loop(*shape) for shape in SHAPES}
    for shape, loop in loops.items():
        loop(np.zeros((rows, cols), np.float32), a, b, kdim, 1)
        asm = next(iter(loop.inspect_asm().values()))
        moves = len(re.findall(r"[yz]mm\d+, -?\d*\(%rsp\)|\(%rsp\), %[yz]mm", asm))
        print(f"{shape[0]} x {shape[1] * LANES}: {moves} stack moves")
    rates = {shape: [] for shape in SHAPES}
    for _ in range(repeats):
        for shape, loop in loops.items():
            c = np.zeros((rows, cols), np.float32)
            t0 = time.perf_counter()
            loop(c, a, b, kdim, calls)
            rates[shape].append(2 * rows * cols * kdim * calls / (time.perf_counter() - t0) / 1e9)
    for (r, nvec), got in rates.items():
        got.sort()
        print(f"{r} x {nvec * LANES}, kdim {kdim}: max {got[-1]:.1f}, median {got[len(got) // 2]:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
