"""Helpers of the simulator tests of the checker and the warp and Hopper primitives (test_simcheck.py,
test_warp_sim.py, test_hopper_wgmma_sim.py, test_hopper_barriers_sim.py): a launch with a deadline, random 16-bit matrices, and the PTX ISA's layouts written independently of
``numba_flash/cuda/device/hopper_sim.py``: the canonical shared-memory layouts as CuTe layouts (shape : stride, in
16-bit elements) evaluated by a generic function, the swizzle applied to the byte address, and wgmma's float32 D
fragment per register."""

from __future__ import annotations

import threading

import numpy as np
import pytest

T = 8   # 16-bit elements per 128-bit unit


def run_in_time(call, deadline, what):
    """Run ``call()`` on a helper thread with a deadline, so a hang fails the test (naming ``what``); re-raise what
    it raised."""
    outcome = {}

    def go():
        try:
            call()
        except BaseException as exc:   # handed to the test's thread
            outcome["exc"] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(deadline)
    if t.is_alive():
        pytest.fail(f"{what} still running after {deadline} s")
    if "exc" in outcome:
        raise outcome["exc"]


def launch(kernel, threads, *args, deadline=300.0):
    """Launch one block of ``kernel`` with a deadline (``run_in_time``)."""
    run_in_time(lambda: kernel[1, threads](*args), deadline, kernel)


# ---- the ISA's canonical layouts, as CuTe layouts ----

def cute(coord, shape, stride):
    """Offset of a hierarchical coordinate in a CuTe layout (nested tuples of equal structure)."""
    if isinstance(shape, tuple):
        return sum(cute(c, s, d) for c, s, d in zip(coord, shape, stride))
    return coord * stride


def split(x, shape):
    """A flat index into a (possibly nested) CuTe mode, colexicographic (first sub-mode fastest)."""
    if isinstance(shape, tuple):
        out = []
        for s in shape:
            size = int(np.prod(flatten(s)))
            out.append(split(x % size, s))
            x //= size
        return tuple(out)
    return x


def flatten(shape):
    return [v for s in shape for v in flatten(s)] if isinstance(shape, tuple) else [shape]


SWIZZLE = {0: (0, 0), 1: (128, 3), 2: (64, 2), 3: (32, 1)}   # code: (atom row bytes, Swizzle<B,4,3>'s B)


def canonical(k_major, code, mn, lbo, sbo):
    """(shape, stride) in elements of the ISA's canonical layout (16-bit elements, one k16 step)."""
    width, _ = SWIZZLE[code]
    lbo_e, sbo_e = lbo // 2, sbo // 2
    if k_major:
        rows = (8, mn // 8)
        if code == 0:
            return (rows, (T, 2)), ((T, sbo_e), (1, lbo_e))
        return (rows, (T, 2)), ((width // 16 * T, sbo_e), (1, T))
    if code == 0:
        return ((T, 1, mn // T), (8, 2)), ((1, T, sbo_e), (T, lbo_e))
    per = width // 16
    return ((T, per, mn // (T * per)), (8, 2)), ((1, T, lbo_e), (per * T, sbo_e))


def element_address(k_major, code, mn, lbo, sbo, start, i, k):
    """Byte address of operand element (row i of M/N, column k of K)."""
    shape, stride = canonical(k_major, code, mn, lbo, sbo)
    addr = start + 2 * cute((split(i, shape[0]), split(k, shape[1])), shape, stride)
    b = SWIZZLE[code][1]
    mask = (1 << b) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def place(image, mat_bits, k_major, code, lbo, sbo, start, k0=0):
    """Write an operand (mn x 16 bits, K along axis 1) into the shared image, from K column k0 of its tile."""
    mn = mat_bits.shape[0]
    for i in range(mn):
        for k in range(16):
            a = element_address(k_major, code, mn, lbo, sbo, start, i, k)
            image[a // 2] = mat_bits[i, k]


def bits16(x, kind):
    if kind == "f16":
        return np.asarray(x, np.float16).view(np.uint16)
    return (np.asarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def random_values(rng, shape, kind):
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "f16":
        return x.astype(np.float16).astype(np.float64)
    return (x.view(np.uint32) & 0xFFFF0000).view(np.float32).astype(np.float64)


def d_position(lane, j, r):
    """(row, column) of accumulator register 4j + r of warpgroup thread ``lane`` (the ISA's wgmma D table)."""
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    return 16 * w + g + 8 * (r // 2), 8 * j + 2 * t + (r % 2)


def to_registers(d, n):
    regs = np.empty((128, n // 8, 4), np.float32)
    for lane in range(128):
        for j in range(n // 8):
            for r in range(4):
                regs[lane, j, r] = d[d_position(lane, j, r)]
    return regs


def from_registers(regs, n):
    d = np.empty((64, n))
    for lane in range(128):
        for j in range(n // 8):
            for r in range(4):
                d[d_position(lane, j, r)] = regs[lane, j, r]
    return d


def a_register_words(a, kind):
    """(128, 4) A registers of a warpgroup for a 64 x 16 A: warp w holds rows 16w..16w+15 in mma.m16n8k16's A layout
    (the ISA's table: a_i at row g (+8 for i in 2, 3, 6, 7), column 2t + i % 2 (+8 for i >= 4))."""
    bits = bits16(a, kind)
    words = np.empty((128, 4), np.uint32)
    for lane in range(128):
        w, g, t = lane // 32, (lane % 32) // 4, lane % 4
        for reg in range(4):
            halves = []
            for i in (2 * reg, 2 * reg + 1):
                row = 16 * w + g + (8 if i in (2, 3, 6, 7) else 0)
                col = 2 * t + (i % 2) + (8 if i >= 4 else 0)
                halves.append(int(bits[row, col]))
            words[lane, reg] = halves[0] | (halves[1] << 16)
    return words
