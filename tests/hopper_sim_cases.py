"""Helpers of the simulator tests of the checker and the warp and Hopper primitives (test_simcheck.py,
test_warp_sim.py, test_hopper_wgmma_sim.py, test_hopper_fp8_sim.py, test_hopper_barriers_sim.py): a launch with a
deadline, random 16-bit and 8-bit matrices, and the PTX ISA's layouts written independently of
``numba_flash/cuda/device/hopper_sim.py``: the canonical shared-memory layouts as CuTe layouts (shape : stride, in
16-bit elements) evaluated by a generic function, the swizzle applied to the byte address, and wgmma's float32 D
fragment per register."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from numba import config, cuda, float32, uint16   # module globals: the simulator swaps a kernel's ``cuda``

from numba_flash.cuda.device import hopper

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


def canonical(k_major, code, mn, lbo, sbo, elem_bytes=2):
    """(shape, stride) in elements of the ISA's canonical layout (16-bit elements and one k16 step, or with
    ``elem_bytes`` 1 8-bit elements and one k32 step: K-major only)."""
    width, _ = SWIZZLE[code]
    t = 16 // elem_bytes   # elements per 128-bit unit
    lbo_e, sbo_e = lbo // elem_bytes, sbo // elem_bytes
    if k_major:
        rows = (8, mn // 8)
        if code == 0:
            return (rows, (t, 2)), ((t, sbo_e), (1, lbo_e))
        return (rows, (t, 2)), ((width // 16 * t, sbo_e), (1, t))
    if code == 0:
        return ((T, 1, mn // T), (8, 2)), ((1, T, sbo_e), (T, lbo_e))
    per = width // 16
    return ((T, per, mn // (T * per)), (8, 2)), ((1, T, lbo_e), (per * T, sbo_e))


def element_address(k_major, code, mn, lbo, sbo, start, i, k, elem_bytes=2):
    """Byte address of operand element (row i of M/N, column k of K)."""
    shape, stride = canonical(k_major, code, mn, lbo, sbo, elem_bytes)
    addr = start + elem_bytes * cute((split(i, shape[0]), split(k, shape[1])), shape, stride)
    b = SWIZZLE[code][1]
    mask = (1 << b) - 1
    return addr ^ (((addr >> 7) & mask) << 4)


def place(image, mat_bits, k_major, code, lbo, sbo, start, k0=0):
    """Write an operand (mn x K, K along axis 1: 16 16-bit or 32 8-bit elements, by ``mat_bits``' dtype) into the
    shared image (16-bit elements; 8-bit ones two to an element, the low byte first), from K column k0 of its
    tile."""
    mn, k_count = mat_bits.shape
    elem_bytes = mat_bits.dtype.itemsize
    target = image.view(np.uint8) if elem_bytes == 1 else image
    for i in range(mn):
        for k in range(k_count):
            a = element_address(k_major, code, mn, lbo, sbo, start, i, k, elem_bytes)
            target[a // elem_bytes] = mat_bits[i, k]


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


# ---- 8-bit floats (torch's float8 dtypes decode them, independently of hopper_sim's table) ----

def random_fp8(rng, shape, kind):
    """(bits uint8, float64 values) of random 8-bit floats of ``kind`` ("e4m3", "e5m2"): N(0, 2) rounded by torch,
    so that small, large and subnormal values all occur; no NaN or infinity."""
    torch = pytest.importorskip("torch")
    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[kind]
    x = torch.from_numpy(rng.standard_normal(shape) * 2.0).to(dtype)
    return x.view(torch.uint8).numpy().copy(), x.to(torch.float64).numpy()


def a_register_words_fp8(a_bits):
    """(128, 4) A registers of a warpgroup for a 64 x 32 8-bit A (``a_bits`` uint8): warp w's rows 16w..16w+15 in
    mma.m16n8k32's A layout for 8-bit types (register r of lane (g, t): row g + 8 (r % 2), columns 16 (r // 2) + 4t
    to + 3, lowest byte first)."""
    words = np.empty((128, 4), np.uint32)
    for lane in range(128):
        w, g, t = lane // 32, (lane % 32) // 4, lane % 4
        for reg in range(4):
            row, col = 16 * w + g + 8 * (reg % 2), 16 * (reg // 2) + 4 * t
            words[lane, reg] = sum(int(a_bits[row, col + b]) << (8 * b) for b in range(4))
    return words


# ---- a warpgroup's chain of wgmmas (the simulator's tests, and tools/gpu_hopper_cases.py on a GPU) ----

def chained_wgmma_kernel(n, kind, trans_b=False, steps=1, a_in_registers=False, smem_words=32768):
    """One warpgroup: ``image`` into a 16-bit shared array of ``smem_words`` (1024-byte aligned, as swizzled tiles
    need on the hardware), then ``steps`` wgmmas chained into one accumulator (the descriptors' fields per step in
    ``params``: A's index, lbo, sbo, swizzle code, then B's), committed, waited for and written to ``out``
    (128, n / 8, 4). A from descriptors (the accumulators start as ``c``) or, with ``a_in_registers``, from
    ``a_words`` (128, 4) with scale_d 0 (the accumulators are not read)."""
    wgmma = hopper.make_wgmma(n, kind, a_in_registers, trans_b)
    wait0 = hopper.make_wgmma_wait(0)
    fence = hopper.make_accumulator_fence(n // 2)
    NT, A_REGS, WORDS = n // 8, a_in_registers, smem_words
    ALIGN = None if config.ENABLE_CUDASIM else 1024   # the simulator takes no alignment (its offsets start at 0)

    @cuda.jit
    def kernel(image, params, c, a_words, out):
        t = cuda.threadIdx.x
        smem = cuda.shared.array(WORDS, uint16, alignment=ALIGN)
        for e in range(t, WORDS, 128):
            smem[e] = image[e]
        cuda.syncthreads()
        hopper.fence_proxy_async()
        acc = cuda.local.array((NT, 4), float32)
        for j in range(NT):
            for r in range(4):
                acc[j, r] = c[t, j, r]
        hopper.wgmma_fence()
        for s in range(steps):
            db = hopper.smem_desc(smem, params[s, 4], params[s, 5], params[s, 6], params[s, 7])
            if A_REGS:
                wgmma(acc, a_words[t, 0], a_words[t, 1], a_words[t, 2], a_words[t, 3], db, 0)
            else:
                da = hopper.smem_desc(smem, params[s, 0], params[s, 1], params[s, 2], params[s, 3])
                wgmma(acc, da, db, 1)
        hopper.wgmma_commit()
        wait0()
        fence(acc)
        for j in range(NT):
            for r in range(4):
                out[t, j, r] = acc[j, r]

    return kernel
