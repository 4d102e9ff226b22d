"""The Hopper primitives of ``hopper.py`` for the Numba CUDA simulator, written from the PTX ISA.

* ``wgmma``: the warpgroup's 128 threads meet in one exchange (``warp_sim.LaneGroup`` of 128); each thread reads A
  (from the shared-memory descriptor, or from the four registers every thread posted) and B through the canonical
  layouts of the ISA ("Shared Memory Matrix Layout": K-major and MN-major, no swizzle and 32-, 64- and 128-byte
  swizzles, applied to the byte address), multiplies in float64 and rounds its accumulators once to float32. The
  results are held back until the ``wgmma_wait`` that retires their commit group, as late as the hardware may
  deliver them: a kernel that reads its accumulators early reads the old values here, and
  ``accumulator_fence`` on accumulators still in flight raises. A chain of wgmmas into one accumulator without a
  wait between them (the usual k loop) sees each other's results, as on the hardware.
* ``mbarrier``: a barrier is its expected arrival count, the arrivals still pending, the transaction bytes still
  expected and its phase, kept per block beside the shared array. A bulk copy is queued on its barrier and lands
  when a thread waits on a barrier whose arrivals are all in: the latest the hardware may land it. Its phase then
  completes when the landed bytes cover the expected ones. ``try_wait.parity(p)`` is true once the phase of
  parity ``p`` has completed, that is while the current phase's parity differs from ``p``.
* The checker (``NUMBA_FLASH_SIMCHECK``) learns the asynchronous hazards through the shared arrays'
  ``begin_async`` / ``end_async``: a read of elements a bulk copy has not landed, a write to elements a wgmma
  still reads, and a copy onto elements in use, are races.

Shared addresses here are byte offsets into the shared array: the swizzle is a function of the address, so a
swizzled tile must start 1024-byte aligned on the hardware (``cuda.shared.array(..., alignment=1024)``) for the two
to agree. The matrix base offset field is not emulated (it must be 0).
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Self

import numpy as np
from numba import cuda

from numba_flash.cuda.device.warp_sim import (
    A_AT,
    OffsetSource,
    lane_and_group,
    register_halves,
)

WARPGROUP = 128
#: Bytes per row of a swizzle atom, by the descriptor's swizzle code (0 none, 1 128-byte, 2 64-byte, 3 32-byte).
SWIZZLE_BYTES = {0: 0, 1: 128, 2: 64, 3: 32}
#: The XOR's width in bits (CuTe's Swizzle<B, 4, 3>: address bits [4, 4 + B) ^= bits [7, 7 + B)).
_SWIZZLE_B = {0: 0, 1: 3, 2: 2, 3: 1}


class SharedDescriptor(int):
    """A wgmma shared-memory descriptor: its 64 bits, and (the simulator's addition) the array they point into."""

    array: Any

    def __new__(cls, bits: int, array: Any) -> Self:
        obj = super().__new__(cls, bits)
        obj.array = array
        return obj


def _raw(array: Any) -> np.ndarray:
    return array.raw() if hasattr(array, "raw") else array


@cuda.jit(device=True)
def smem_desc(smem, index, lbo_bytes, sbo_bytes, swizzle):
    at = 2 * int(index)
    if at % 16:
        raise RuntimeError(f"smem_desc: element {int(index)} is not 16-byte aligned (a multiple of 8)")
    if int(swizzle) not in SWIZZLE_BYTES:
        raise RuntimeError(f"smem_desc: swizzle code {int(swizzle)} is not 0 to 3")

    def encode(x):
        return (int(x) & 0x3FFFF) >> 4

    bits = encode(at) | (encode(lbo_bytes) << 16) | (encode(sbo_bytes) << 32) | (int(swizzle) << 62)
    return SharedDescriptor(bits, smem)


def operand_addresses(desc: int, mn: int, k_major: bool, elem_bytes: int = 2) -> np.ndarray:
    """(mn, K) byte addresses of a wgmma operand's elements (row i of M or N, column k of K; ``elem_bytes`` 2 for
    16-bit kinds, K = 16, or 1 for 8-bit ones, K = 32, K-major only) in shared memory, from its descriptor, by the
    ISA's canonical layouts (a 16-byte chunk holds T = 16 / ``elem_bytes`` elements)."""
    start, lbo = (desc & 0x3FFF) << 4, ((desc >> 16) & 0x3FFF) << 4
    sbo, mode = ((desc >> 32) & 0x3FFF) << 4, (desc >> 62) & 3
    if (desc >> 49) & 7:
        raise RuntimeError("wgmma: a descriptor's matrix base offset is not emulated (it must be 0)")
    width = SWIZZLE_BYTES[mode]
    i, k = np.arange(mn)[:, None], np.arange(32 // elem_bytes)[None, :]
    if k_major:   # ((8, m), (T, 2k)) : ((W or T, SBO), (1, T or LBO))
        row_bytes = width or 16
        chunk_step = 16 if width else lbo
        kb = k * elem_bytes   # the element's byte within the row's 32 bytes of K
        offset = (i % 8) * row_bytes + (i // 8) * sbo + kb % 16 + (kb // 16) * chunk_step
    elif width:   # ((T, W / 16, m), (8, k)) : ((1, T, LBO), (W / 16 * T, SBO))
        per_row = width // 16
        offset = (i % 8) * 2 + ((i // 8) % per_row) * 16 + (i // (8 * per_row)) * lbo + (k % 8) * width \
            + (k // 8) * sbo
    else:         # interleaved: ((T, 1, m), (8, k)) : ((1, T, SBO), (T, LBO))
        offset = (i % 8) * 2 + (i // 8) * sbo + (k % 8) * 16 + (k // 8) * lbo
    address = start + offset
    b = _SWIZZLE_B[mode]
    if b:
        address = address ^ (((address >> 7) & ((1 << b) - 1)) << 4)
    return address


def _fp8_table(exponent_bits: int) -> np.ndarray:
    """float64 value of each of the 256 bytes of an 8-bit float with ``exponent_bits`` (4: e4m3, bias 7, no
    infinity, S.1111.111 NaN, largest 448; 5: e5m2, bias 15, IEEE's infinities and NaNs), from the PTX ISA's
    format description."""
    mantissa_bits = 7 - exponent_bits
    bias = (1 << (exponent_bits - 1)) - 1
    b = np.arange(256)
    sign = np.where(b >> 7, -1.0, 1.0)
    e, m = (b >> mantissa_bits) & ((1 << exponent_bits) - 1), b & ((1 << mantissa_bits) - 1)
    fraction = m / (1 << mantissa_bits)
    value = np.where(e == 0, fraction * 2.0 ** (1 - bias), (1 + fraction) * 2.0 ** (e - bias)) * sign
    top = (1 << exponent_bits) - 1
    if exponent_bits == 4:
        value[(e == top) & (m == (1 << mantissa_bits) - 1)] = np.nan
    else:
        value[(e == top) & (m == 0)] = sign[(e == top) & (m == 0)] * np.inf
        value[(e == top) & (m != 0)] = np.nan
    return value


FP8_VALUES = {"e4m3": _fp8_table(4), "e5m2": _fp8_table(5)}


def element_values(bits: np.ndarray, kind: str) -> np.ndarray:
    """float64 values of wgmma operand elements given as unsigned integers of their width (16 or 8 bits)."""
    if kind in FP8_VALUES:
        return FP8_VALUES[kind][np.asarray(bits, np.uint8)]
    bits = np.asarray(bits, np.uint16)
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _operand(desc: Any, mn: int, k_major: bool, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(float64 values (mn, K), 16-bit element indices) of a descriptor's operand."""
    if not isinstance(desc, SharedDescriptor):
        raise TypeError("wgmma: under the simulator a descriptor must come from smem_desc unchanged (it carries "
                        "its shared array); build one per operand tile instead of adding to its bits")
    raw = _raw(desc.array)
    elem_bytes = 1 if kind in FP8_VALUES else 2
    address = operand_addresses(int(desc), mn, k_major, elem_bytes)
    index = address // 2
    if index.max() >= raw.size:
        raise IndexError(f"wgmma: the operand reaches element {int(index.max())} of a shared array of {raw.size}")
    if elem_bytes == 1:   # byte 2e is the low half of 16-bit element e (little-endian, as on the GPU)
        bits = raw.view(np.uint8)[address]
    else:
        bits = raw[index].view(np.uint16)
    return element_values(bits, kind), index


def _a_from_registers(words: list[int], kind: str) -> np.ndarray:
    """(16, K) float64 A of one warp from its 32 lanes' four registers each, ``mma.m16n8k16``'s A layout for 16-bit
    kinds and ``mma.m16n8k32``'s for 8-bit ones: register r of lane (g, t) holds row g + 8 (r % 2) at bytes
    16 (r // 2) + 4 t to + 3 of the row's 32 bytes of K."""
    if kind not in FP8_VALUES:
        return register_halves(words, kind)[A_AT]
    a = np.empty((16, 32))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for r in range(4):
            word = int(words[4 * lane + r])
            for byte in range(4):
                a[g + 8 * (r % 2), 16 * (r // 2) + 4 * t + byte] = FP8_VALUES[kind][(word >> (8 * byte)) & 0xFF]
    return a


class _Pending(threading.local):
    """A thread's wgmmas: issued since the last commit (``open``), then committed groups, oldest first. Each entry is
    (accumulator array, its new float32 values, the warpgroup-wide issue number)."""

    def __init__(self):
        self.open: list[tuple] = []
        self.groups: list[list[tuple]] = []


_pending = _Pending()


def _latest(acc: np.ndarray, count: int) -> np.ndarray:
    """The accumulators a new wgmma chains onto: the newest pending result for ``acc``, else its contents."""
    for group in [_pending.open] + _pending.groups[::-1]:
        for target, values, _ in reversed(group):
            if target is acc:
                return values
    return np.asarray(acc, np.float32).ravel()[:count].copy()


def _wgmma(n: int, kind: str, rs: bool, trans_b: bool, acc: Any, a: tuple, desc_b: Any, scale_d: Any) -> None:
    lane, group = lane_and_group(WARPGROUP)
    if group.lanes != WARPGROUP:
        raise RuntimeError(f"wgmma: a warpgroup needs {WARPGROUP} threads, this block's last group has {group.lanes}")
    count = n // 2
    acc_raw = _raw(acc)
    if acc_raw.size < count:
        raise IndexError(f"wgmma m64n{n}: the accumulator array holds {acc_raw.size} floats, not {count}")
    b, b_index = _operand(desc_b, n, not trans_b, kind)
    operands = [(desc_b.array, b_index)]
    if not rs:
        a_vals, a_index = _operand(a[0], 64, True, kind)
        operands.append((a[0].array, a_index))
    file, line = _caller()

    def record_reads(slot: list[Any]) -> None:   # once for the warpgroup, by its last lane in
        issued = group.state.get("issued", 0)
        group.state["issued"] = issued + 1
        tracked = [(array, np.unique(index)) for array, index in operands if hasattr(array, "begin_async")]
        for array, index in tracked:
            array.begin_async(index, False, f"a wgmma issued at {file}:{line}")
        group.state[("reads", issued)] = tracked

    posted = group.exchange(lane, tuple(int(r) for r in a) if rs else None, record_reads)
    number = _issue_number(group, lane)
    w, g, t = lane // 32, (lane % 32) // 4, lane % 4
    rows = [16 * w + g, 16 * w + g + 8]
    if rs:   # warp w's 32 lanes hold rows 16w..16w+15 in mma's A layout
        words = [word for i in range(32) for word in posted[32 * w + i]]
        a_rows = _a_from_registers(words, kind)[[g, g + 8]]
    else:
        a_rows = a_vals[rows]
    with np.errstate(all="ignore"):   # an inf or NaN operand gives what the hardware gives, without a warning
        product = a_rows @ b.T        # (2, n): rows g and g + 8 of this warp's slice
    old = _latest(acc_raw, count)
    new = np.empty(count, np.float32)
    for j in range(n // 8):
        for r in range(4):
            col = 8 * j + 2 * t + (r & 1)
            c = float(old[4 * j + r]) if int(scale_d) else 0.0
            with np.errstate(all="ignore"):
                new[4 * j + r] = np.float32(product[r // 2, col] + c)
    _pending.open.append((acc_raw, new, number))


def _issue_number(group: Any, lane: int) -> int:
    """The warpgroup-wide number of the wgmma just issued (every lane issues the same ones in the same order)."""
    mine = group.state.setdefault(("lane_issued", lane), 0)
    group.state[("lane_issued", lane)] = mine + 1
    return mine


def _caller() -> tuple[str, int]:
    import os
    import sys

    f = sys._getframe(2)
    while f.f_back is not None and f.f_code.co_filename == __file__:
        f = f.f_back
    return os.path.basename(f.f_code.co_filename), f.f_lineno


def make_wgmma(n: int, kind: str, a_in_registers: bool, trans_b: bool) -> Any:
    """The simulator's ``wgmma`` for one shape (see hopper_ptx.make_wgmma)."""
    if a_in_registers:
        @cuda.jit(device=True)
        def wgmma(acc, a0, a1, a2, a3, desc_b, scale_d):
            _wgmma(n, kind, True, trans_b, acc, (a0, a1, a2, a3), desc_b, scale_d)
    else:
        @cuda.jit(device=True)
        def wgmma(acc, desc_a, desc_b, scale_d):
            _wgmma(n, kind, False, trans_b, acc, (desc_a,), desc_b, scale_d)
    return wgmma


def make_accumulator_fence(count: int) -> Any:
    @cuda.jit(device=True)
    def fence(acc):
        acc_raw = _raw(acc)
        for group in [_pending.open] + _pending.groups:
            for target, _, _ in group:
                if target is acc_raw:
                    raise RuntimeError("accumulator_fence: a wgmma into these accumulators has not been retired by "
                                       "wgmma_wait (commit it, then wait for it, before reading them)")
    return fence


@cuda.jit(device=True)
def wgmma_fence():
    pass


@cuda.jit(device=True)
def wgmma_commit():
    _pending.groups.append(_pending.open)
    _pending.open = []


def make_wgmma_wait(pending: int) -> Any:
    @cuda.jit(device=True)
    def wait():
        lane, group = lane_and_group(WARPGROUP)
        retired: list[tuple] = []
        while len(_pending.groups) > pending:
            retired.extend(_pending.groups.pop(0))
        numbers = [number for _, _, number in retired]

        def release(slot: list[Any]) -> None:
            for number in numbers:
                for array, index in group.state.pop(("reads", number), []):
                    array.end_async(index, False)

        group.exchange(lane, None, release)
        for acc_raw, values, _ in retired:
            acc_raw.ravel()[:values.size] = values
    return wait


def make_setmaxnreg(count: int, increase: bool) -> Any:
    @cuda.jit(device=True)
    def setmaxnreg():
        pass
    return setmaxnreg


@cuda.jit(device=True)
def fence_proxy_async():
    pass


@cuda.jit(device=True)
def fence_mbarrier_init():
    pass


# ---- mbarriers and bulk copies ----

class _Barrier:
    def __init__(self, count: int):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0
        self.copies: list[tuple] = []


_barriers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_barrier_lock = threading.Lock()


def _barrier(bars: Any, index: Any, create: int | None = None) -> _Barrier:
    from numba.cuda.simulator.kernel import _get_kernel_context

    ctx = _get_kernel_context()
    raw = _raw(bars)
    if not 0 <= int(index) < raw.size:
        raise IndexError(f"mbarrier: index {int(index)} outside an array of {raw.size} barriers")
    key = (tuple(ctx.blockIdx), id(raw), int(index))
    per_launch = _barriers.setdefault(ctx, {})
    if create is not None:
        per_launch[key] = _Barrier(create)
    found = per_launch.get(key)
    if found is None:
        raise RuntimeError(f"mbarrier {int(index)}: used before mbarrier_init")
    return found


@cuda.jit(device=True)
def mbarrier_init(bars, index, count):
    if not 1 <= int(count) < (1 << 20):
        raise RuntimeError(f"mbarrier_init: the count must be 1 to 2**20 - 1, got {int(count)}")
    with _barrier_lock:
        _barrier(bars, index, int(count))


def _settle(b: _Barrier, index: Any) -> None:
    """Land the copies queued on a barrier whose arrivals are all in, and complete its phase once the landed bytes
    cover the expected ones: the latest moment the hardware may have done so (a wait, or the next phase's first
    arrival, needs it)."""
    if b.pending:
        return
    for copy in b.copies:
        _land(*copy)
        b.tx -= copy[3]
    b.copies = []
    if b.tx < 0:
        raise RuntimeError(f"mbarrier {int(index)}: bulk copies landed {-b.tx} bytes more than were expected")
    if b.tx == 0:
        b.phase ^= 1
        b.pending = b.count


def _arrive(bars: Any, index: Any, tx: int) -> None:
    with _barrier_lock:
        b = _barrier(bars, index)
        _settle(b, index)
        if b.pending == 0:
            raise RuntimeError(f"mbarrier {int(index)}: more arrivals than its count ({b.count}) in one phase, or "
                               f"a phase waiting for {b.tx} bytes no bulk copy will bring")
        b.tx += tx
        b.pending -= 1
        if b.pending == 0 and b.tx == 0 and not b.copies:
            _settle(b, index)


@cuda.jit(device=True)
def mbarrier_arrive(bars, index):
    _arrive(bars, index, 0)


@cuda.jit(device=True)
def mbarrier_arrive_expect_tx(bars, index, nbytes):
    _arrive(bars, index, int(nbytes))


@cuda.jit(device=True)
def mbarrier_try_wait_parity(bars, index, parity):
    with _barrier_lock:
        b = _barrier(bars, index)
        _settle(b, index)
        done = b.phase != (int(parity) & 1)
    if not done:
        time.sleep(0)   # a spinning thread lets the others run
    return np.uint32(done)


def _land(dst: Any, at: int, source: OffsetSource, nbytes: int) -> None:
    raw = _raw(dst)
    for e in range(nbytes // 2):
        raw[at + e] = np.asarray(source[(e,)]).view(np.uint16)
    if hasattr(dst, "end_async"):
        dst.end_async(np.arange(at, at + nbytes // 2), True)


@cuda.jit(device=True)
def bulk_copy_g2s(dst, dst_index, src, byte_offset, nbytes, bars, bar_index):
    at, size = int(dst_index), int(nbytes)
    if size <= 0 or size % 16 or (2 * at) % 16 or int(byte_offset) % 16:
        raise RuntimeError(f"bulk_copy_g2s: addresses must be 16-byte aligned and the size a positive multiple of "
                           f"16 (element {at}, byte offset {int(byte_offset)}, {size} bytes)")
    if at + size // 2 > _raw(dst).size:
        raise IndexError(f"bulk_copy_g2s: {size} bytes at element {at} run past a shared array of {_raw(dst).size}")
    if hasattr(dst, "begin_async"):
        file, line = _caller()
        dst.begin_async(np.arange(at, at + size // 2), True, f"a bulk copy issued at {file}:{line}")
    with _barrier_lock:
        _barrier(bars, bar_index).copies.append((dst, at, OffsetSource(src, int(byte_offset)), size))
