"""The warp primitives of ``warp.py`` for the Numba CUDA simulator, with the PTX ISA's fragment layouts.

The simulator runs one Python thread per CUDA thread and knows no warps, shuffles or inline PTX. Here each warp of
a simulated block gets a small exchange: a lane posts its registers (or an address), waits until every lane of its
warp has posted, and computes its own result from what the others posted, exactly as the hardware defines it:

* ``mma_*``: the warp's A, B and C fragments are put together into matrices by the layout tables below, multiplied
  in float64 and rounded once to float32 (the hardware's products are exact, its sum order unspecified);
* ``ldmatrix_*``: each lane reads the rows (or, transposed, the columns) other lanes address, from the kernel's own
  shared array, so the race and bounds checker sees these reads as the lane's own;
* ``cp_async_16``: the copy is queued and made at the ``cp_async_wait_*`` that completes its group, by the issuing
  thread, as late as the hardware may make it: a kernel that reads the tile before waiting reads stale data here
  too, and the checker sees the stores where they may happen;
* ``shfl_xor``: the partner lane's posted value.

The wait is a barrier of the warp's lanes only, not of the block: it does not advance the checker's barrier epoch,
so a missing ``syncthreads()`` between a tile store and another warp's ``ldmatrix`` is still reported as a race.
Two exchange slots alternate, so one wait per call is enough: a lane posts to a slot two calls later only after the
warp's next wait, by which time every lane has read it. All lanes of a warp must call the same primitives in the same
order (the hardware's ``.sync.aligned`` rule); a lane that does not arrive within ``WAIT_TIMEOUT`` seconds fails the
kernel instead of hanging it.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np
from numba import cuda

#: Seconds a lane waits for the rest of its warp before the kernel is failed as divergent.
WAIT_TIMEOUT = 120.0
_POLL = 0.05

# ---- layout tables: which lane, register and half hold each element (PTX ISA, mma.m16n8k16 / m16n8k8) ----


def _a_position(row: int, col: int) -> tuple[int, int, int]:
    """(lane, register, half) of A[row, col], A 16 x 16 with 16-bit elements."""
    return (row % 8) * 4 + (col % 8) // 2, row // 8 + 2 * (col // 8), col % 2


def _b_position(k: int, n: int) -> tuple[int, int, int]:
    """(lane, register, half) of B[k, n], B 16 x 8 with 16-bit elements."""
    return n * 4 + (k % 8) // 2, k // 8, k % 2


def _c_position(row: int, col: int) -> tuple[int, int]:
    """(lane, register) of C[row, col], C 16 x 8 float32."""
    return (row % 8) * 4 + col // 2, 2 * (row // 8) + col % 2


def _a_tf32_position(row: int, col: int) -> tuple[int, int]:
    """(lane, register) of A[row, col], A 16 x 8 tf32 (m16n8k8)."""
    return (row % 8) * 4 + col % 4, row // 8 + 2 * (col // 4)


def _b_tf32_position(k: int, n: int) -> tuple[int, int]:
    """(lane, register) of B[k, n], B 8 x 8 tf32 (m16n8k8)."""
    return n * 4 + k % 4, k // 4


def _flat(table: Any, shape: tuple[int, int], regs: int, halves: int = 1) -> np.ndarray:
    """Positions of a matrix's elements in a (32 lanes, regs, halves) array, flattened."""
    out = np.empty(shape, np.int64)
    for r in range(shape[0]):
        for c in range(shape[1]):
            pos = table(r, c)
            lane, reg, half = pos if len(pos) == 3 else (*pos, 0)
            out[r, c] = (lane * regs + reg) * halves + half
    return out


A_AT = _flat(_a_position, (16, 16), 4, 2)
_B_AT = _flat(_b_position, (16, 8), 2, 2)
_C_AT = _flat(_c_position, (16, 8), 4)
_A_TF32_AT = _flat(_a_tf32_position, (16, 8), 4)
_B_TF32_AT = _flat(_b_tf32_position, (8, 8), 2)
# The C elements each lane owns, (lane, register) -> (row, col).
_C_OWNED = {divmod(int(_C_AT[r, c]), 4): (r, c) for r in range(16) for c in range(8)}

# ---- one exchange per warp (or warpgroup) of a simulated block ----


class LaneGroup:
    """The lanes of one warp (or warpgroup) of one block: two exchange slots and a barrier of these lanes only.
    ``state`` holds what a group-wide primitive keeps between calls (hopper_sim's wgmma reads in flight)."""

    def __init__(self, lanes: int):
        self.lanes = lanes
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0
        self.slots: list[list[Any]] = [[None] * lanes, [None] * lanes]
        self.calls = [0] * lanes
        self.state: dict[Any, Any] = {}

    def exchange(self, lane: int, value: Any, on_complete: Any = None) -> list[Any]:
        """Post ``value`` for ``lane``, wait for the group, and return every lane's posted value. The last lane to
        arrive calls ``on_complete(slot)`` before it releases the others (group-wide bookkeeping, done once)."""
        slot = self.slots[self.calls[lane] & 1]
        self.calls[lane] += 1
        slot[lane] = value
        with self.cond:
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.lanes:
                if on_complete is not None:
                    on_complete(slot)
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return slot
            start = time.monotonic()
            while self.generation == generation:
                self.cond.wait(_POLL)
                if _aborted():
                    raise RuntimeError("warp primitive: the block failed while this lane waited for its warp")
                if time.monotonic() - start > WAIT_TIMEOUT:
                    raise RuntimeError(f"warp primitive: lane {lane} waited {WAIT_TIMEOUT:.0f} s for the other "
                                       "lanes of its warp; every lane must call the same warp primitives in the "
                                       "same order (.sync.aligned)")
        return slot


_warps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_warps_lock = threading.Lock()


def _aborted() -> bool:
    """Whether the simulated block this thread runs in has failed (the simulator's or the checker's flag)."""
    th = threading.current_thread()
    block = getattr(th, "block", None)
    return bool(getattr(th, "abort", False)) or (block is not None and getattr(block, "error", None) is not None)


def lane_and_group(size: int = 32) -> tuple[int, LaneGroup]:
    """This thread's lane in its group of ``size`` consecutive threads (32: its warp; 128: its warpgroup) and the
    group's exchange (made on first use, per launch, block and group size)."""
    from numba.cuda.simulator.kernel import _get_kernel_context

    ctx = _get_kernel_context()
    tid, dim = ctx.threadIdx, ctx.blockDim
    linear = tid.x + dim.x * (tid.y + dim.y * tid.z)
    nthreads = dim.x * dim.y * dim.z
    w = linear // size
    key = (tuple(ctx.blockIdx), size, w)
    with _warps_lock:
        per_launch = _warps.setdefault(ctx, {})
        group = per_launch.get(key)
        if group is None:
            group = per_launch[key] = LaneGroup(min(size, nthreads - size * w))
    return linear % size, group


# ---- bit conversions ----

def _f16_bits(x: Any) -> int:
    with np.errstate(over="ignore"):   # beyond float16's range is inf, as cvt.rn.f16x2.f32 gives
        return int(np.float32(x).astype(np.float16).view(np.uint16))


def _bf16_bits(x: Any) -> int:
    """float32 rounded to bfloat16 (nearest, ties to even; a NaN stays a NaN)."""
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def register_halves(regs: list[Any], kind: str) -> np.ndarray:
    """float64 values of the 16-bit halves of 32-bit registers (low half first), for 'f16' or 'bf16'."""
    words = np.asarray(regs, np.uint32).ravel()
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16).ravel()
    if kind == "f16":
        return halves.view(np.float16).astype(np.float64)
    return (halves.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ---- the primitives ----

def _mma(kind: str, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    lane, warp = lane_and_group()
    posted = warp.exchange(lane, (a0, a1, a2, a3, b0, b1, c0, c1, c2, c3))
    regs = [p[:6] for p in posted[:warp.lanes]]
    if kind == "tf32":
        words = np.asarray(regs, np.uint32)
        a = words[:, :4].view(np.float32).astype(np.float64).ravel()[_A_TF32_AT]
        b = words[:, 4:].view(np.float32).astype(np.float64).ravel()[_B_TF32_AT]
    else:
        a = register_halves([r[:4] for r in regs], kind)[A_AT]
        b = register_halves([r[4:] for r in regs], kind)[_B_AT]
    out = []
    for reg, c in enumerate((c0, c1, c2, c3)):
        row, col = _C_OWNED[(lane, reg)]
        out.append(np.float32(float(np.dot(a[row], b[:, col])) + float(c)))
    return tuple(out)


@cuda.jit(device=True)
def mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma("f16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@cuda.jit(device=True)
def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma("bf16", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


@cuda.jit(device=True)
def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return _mma("tf32", a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)


def _check_row_address(name: str, smem: Any, index: Any) -> None:
    if int(index) % 8:
        raise RuntimeError(f"{name}: element index {int(index)} is not 16-byte aligned (a multiple of 8)")
    if not 0 <= int(index) <= len(smem) - 8:
        raise IndexError(f"{name}: row at element {int(index)} runs past the shared array of {len(smem)}")


def _ldmatrix(name: str, count: int, trans: bool, smem: Any, index: Any) -> tuple:
    lane, warp = lane_and_group()
    _check_row_address(name, smem, index)
    rows = warp.exchange(lane, int(index))
    g, t = lane // 4, lane % 4
    out = []
    for j in range(count):
        if trans:   # column g of matrix j, rows 2t and 2t + 1
            lo, hi = smem[rows[8 * j + 2 * t] + g], smem[rows[8 * j + 2 * t + 1] + g]
        else:       # row g of matrix j, columns 2t and 2t + 1
            lo, hi = smem[rows[8 * j + g] + 2 * t], smem[rows[8 * j + g] + 2 * t + 1]
        out.append(np.uint32(int(lo) | (int(hi) << 16)))
    return tuple(out)


@cuda.jit(device=True)
def ldmatrix_x4(smem, index):
    return _ldmatrix("ldmatrix_x4", 4, False, smem, index)


@cuda.jit(device=True)
def ldmatrix_x4_trans(smem, index):
    return _ldmatrix("ldmatrix_x4_trans", 4, True, smem, index)


@cuda.jit(device=True)
def ldmatrix_x2(smem, index):
    return _ldmatrix("ldmatrix_x2", 2, False, smem, index)


@cuda.jit(device=True)
def ldmatrix_x2_trans(smem, index):
    return _ldmatrix("ldmatrix_x2_trans", 2, True, smem, index)


@cuda.jit(device=True)
def lds_v4(smem, index):
    _check_row_address("lds_v4", smem, index)
    at = int(index)
    return tuple(np.uint32(int(smem[at + 2 * i]) | (int(smem[at + 2 * i + 1]) << 16)) for i in range(4))


@cuda.jit(device=True)
def lds_u32(smem, index):
    at = int(index)
    if at % 2:
        raise RuntimeError(f"lds_u32: element index {at} is not 4-byte aligned (even)")
    return np.uint32(int(smem[at]) | (int(smem[at + 1]) << 16))


@cuda.jit(device=True)
def sts_u32(smem, index, word):
    at = int(index)
    if at % 2:
        raise RuntimeError(f"sts_u32: element index {at} is not 4-byte aligned (even)")
    w = int(word)
    smem[at] = np.uint16(w & 0xFFFF)
    smem[at + 1] = np.uint16(w >> 16)


def _probe(kind: str, acc: Any, word: Any) -> np.uint32:
    """acc + word * 0 on each 16-bit half, in ``kind``'s arithmetic: a half turns NaN for an inf or NaN in word."""
    a, w = register_halves([acc], kind), register_halves([word], kind)
    with np.errstate(invalid="ignore"):   # inf * 0 is the NaN the probe is for
        out = a + w * 0.0
    if kind == "f16":
        bits = out.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        bits = np.array([_bf16_bits(x) for x in out.astype(np.float32)], np.uint32)
    return np.uint32(int(bits[0]) | (int(bits[1]) << 16))


@cuda.jit(device=True)
def probe_f16x2(acc, word):
    return _probe("f16", acc, word)


@cuda.jit(device=True)
def probe_bf16x2(acc, word):
    return _probe("bf16", acc, word)


class _Copies(threading.local):
    """A thread's cp.async copies: the ones not yet committed, then the committed groups, oldest first."""

    def __init__(self):
        self.open: list[tuple] = []
        self.groups: list[list[tuple]] = []


_copies = _Copies()


@cuda.jit(device=True)
def cp_async_16(dst, dst_index, src, src_index, src_bytes):
    _check_row_address("cp_async_16", dst, dst_index)
    nbytes = int(src_bytes)
    if not 0 <= nbytes <= 16 or nbytes % 2:
        raise RuntimeError(f"cp_async_16: src_bytes must be an even count from 0 to 16, got {nbytes}")
    _copies.open.append((dst, int(dst_index), src, tuple(int(i) for i in src_index), nbytes))


def _copy(dst: Any, at: int, src: Any, index: tuple, nbytes: int) -> None:
    """Make one queued copy: 8 elements of 16 bits along src's last axis, zeros past ``nbytes``."""
    head, d0 = index[:-1], index[-1]
    for e in range(8):
        bits = 0
        if 2 * e < nbytes:
            x = src[head + (d0 + e,)]
            bits = int(np.asarray(x).view(np.uint16))
        dst[at + e] = np.uint16(bits)


def _host_array(src: Any) -> np.ndarray:
    """The numpy array behind a simulated device array as kernel code sees it (the simulator's or the checker's
    wrapper)."""
    item = getattr(src, "_item", src)
    return getattr(item, "_ary", item)


class OffsetSource:
    """A chunk at a byte offset of a device array, read like ``src[index]`` by ``_copy``: bounds-checked against the
    array's own elements (an offset between two strided rows, or past the end, raises)."""

    def __init__(self, src: Any, byte_offset: int):
        self.host = _host_array(src)
        self.offset = byte_offset

    def __getitem__(self, index: tuple) -> Any:
        arr, at = self.host, self.offset + 2 * index[-1]
        # The index each axis takes, largest stride first (any order of axes: a transposed view included).
        found, rest = [0] * arr.ndim, at
        for axis in sorted(range(arr.ndim), key=lambda a: -abs(arr.strides[a])):
            if arr.strides[axis] > 0:
                found[axis], rest = divmod(rest, arr.strides[axis])
        exact = sum(i * st for i, st in zip(found, arr.strides)) == at
        if rest or not exact or not all(0 <= i < n for i, n in zip(found, arr.shape)):
            raise IndexError(f"cp_async_16_at: byte offset {at} is not an element of the source array "
                             f"(shape {arr.shape}, strides {arr.strides})")
        return arr[tuple(found)]


@cuda.jit(device=True)
def cp_async_16_at(dst, dst_index, src, byte_offset, src_bytes):
    _check_row_address("cp_async_16_at", dst, dst_index)
    nbytes = int(src_bytes)
    if not 0 <= nbytes <= 16 or nbytes % 2:
        raise RuntimeError(f"cp_async_16_at: src_bytes must be an even count from 0 to 16, got {nbytes}")
    _copies.open.append((dst, int(dst_index), OffsetSource(src, int(byte_offset)), (0,), nbytes))


@cuda.jit(device=True)
def exp2_approx(x):
    """2**x with results below 2**-126 flushed to 0, as ex2.approx.ftz."""
    y = np.float32(np.exp2(np.float32(x)))
    return np.float32(0.0) if abs(y) < np.float32(2.0 ** -126) else y


@cuda.jit(device=True)
def tanh_approx(x):
    """tanh in float32 (the hardware's approximation is within about 2**-11 of it; the simulator is exact)."""
    return np.float32(np.tanh(np.float32(x)))


@cuda.jit(device=True)
def rcp_approx(x):
    """1 / x in float32, results below 2**-126 flushed to 0, as rcp.approx.ftz."""
    with np.errstate(divide="ignore"):
        y = np.float32(1.0) / np.float32(x)
    return np.float32(0.0) if abs(y) < np.float32(2.0 ** -126) else y


@cuda.jit(device=True)
def cp_async_commit():
    _copies.groups.append(_copies.open)
    _copies.open = []


def _complete(keep: int) -> None:
    while len(_copies.groups) > keep:
        for copy in _copies.groups.pop(0):
            _copy(*copy)


@cuda.jit(device=True)
def cp_async_wait_all():
    _complete(0)


@cuda.jit(device=True)
def cp_async_wait_one():
    _complete(1)


@cuda.jit(device=True)
def shfl_xor(x, lane_mask):
    lane, warp = lane_and_group()
    posted = warp.exchange(lane, x)
    return posted[lane ^ int(lane_mask)]


@cuda.jit(device=True)
def pack_f16x2(lo, hi):
    return np.uint32(_f16_bits(lo) | (_f16_bits(hi) << 16))


@cuda.jit(device=True)
def pack_bf16x2(lo, hi):
    return np.uint32(_bf16_bits(lo) | (_bf16_bits(hi) << 16))


@cuda.jit(device=True)
def bits_to_tf32(word):
    """float_to_tf32 of the float32 whose bits are ``word``."""
    return float_to_tf32(np.uint32(word).view(np.float32))


@cuda.jit(device=True)
def float_to_tf32(x):
    """float32 rounded to tf32 (10 mantissa bits, nearest, ties away from zero), as its 32-bit pattern. inf and NaN
    are not rounded, only cut to 10 mantissa bits, as the hardware's cvt.rna.tf32.f32 does (its SASS: no carry
    for them, then the same mask): a NaN whose payload lies only in the low 13 bits becomes inf."""
    u = int(np.float32(x).view(np.uint32))
    if (u & 0x7F800000) == 0x7F800000:
        return np.uint32(u & 0xFFFFE000)
    return np.uint32((u + 0x1000) & 0xFFFFE000)
