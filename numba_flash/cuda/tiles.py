"""Device helpers the kernel factories share: moving a (rows x D) tile from global to shared memory.

Each helper is generated per tile shape and element kind with the shape as compile-time constants, and is
``inline="always"``: numba splices it into the kernel before typing, so ``compile_ptx`` builds without a GPU (see
dtypes.py) and the kernel pays no call.

Index arithmetic is where a naive tile load spends its instructions (about 65 per element in the first kernels, by
the performance model): numba counts ``range`` loops in signed 64 bits and wraps negative signed indices around.
So the helpers loop a compile-time number of times (which the compiler unrolls), compute each thread's row and
column in unsigned 32 bits (a shift and a mask, with the head dim a power of two), and index with unsigned values,
which numba does not wrap.
"""

from __future__ import annotations

import functools
from typing import Any

from numba import cuda, float32, uint32

from .dtypes import element_io


@functools.lru_cache(maxsize=None)
def make_tile_load(rows: int, head_dim_bucket: int, threads: int, bf16: bool) -> Any:
    """``load_tile(dst, src, b, row0, h, seqlen, head_dim, mult, t)``: copy rows ``row0 .. row0 + rows - 1`` of
    head ``h`` of batch ``b`` from ``src`` (B, S, H, D), any strides, float32/float16 (int16 bfloat16 bits with
    ``bf16``), into the float32 shared tile ``dst`` (rows, >= head_dim_bucket) scaled by ``mult``; rows at or past
    ``seqlen`` and columns at or past ``head_dim`` become 0, so they add nothing to any product. ``t`` is the
    thread's index in a block of ``threads`` threads; consecutive threads take consecutive columns (coalesced
    global reads, conflict-free shared writes). ``b``, ``row0``, ``h``, ``seqlen`` and ``head_dim`` must be
    non-negative."""
    ROWS, DB, NT = rows, head_dim_bucket, threads
    TOTAL = ROWS * DB
    PER_THREAD = -(-TOTAL // NT)
    RAGGED = TOTAL % NT != 0          # the last pass has fewer elements than threads
    LOAD = element_io(bf16)[0]

    @cuda.jit(device=True, inline="always")
    def load_tile(dst, src, b, row0, h, seqlen, head_dim, mult, t):
        b_u, h_u, row0_u = uint32(b), uint32(h), uint32(row0)
        seqlen_u, head_dim_u = uint32(seqlen), uint32(head_dim)
        for k in range(PER_THREAD):
            idx = uint32(t + k * NT)
            if not RAGGED or idx < uint32(TOTAL):
                r = uint32(idx // uint32(DB))
                d = uint32(idx % uint32(DB))
                row = uint32(row0_u + r)
                x = float32(0.0)
                if row < seqlen_u and d < head_dim_u:
                    x = LOAD(src[b_u, row, h_u, d]) * mult
                dst[r, d] = x

    return load_tile


def lane_rows(stride: int, rows: int) -> int:
    """Rows that one warp's lanes cover side by side when ``make_flat_tile_load`` writes a tile transposed with
    row stride ``stride``: the lowest set bit of the stride (at most 32 and ``rows``). Lanes ``r + R * c``
    (``R`` rows, ``32 / R`` consecutive head-dim columns) then store to ``r + stride * c``, 32 different banks,
    while each row's lanes still read a run of consecutive elements from global memory (32 bytes of float32 when
    the stride is 4 times an odd number)."""
    return min(stride & -stride, 32, rows)


@functools.lru_cache(maxsize=None)
def make_flat_tile_load(rows: int, head_dim_bucket: int, threads: int, bf16: bool, stride: int,
                        transposed: bool) -> Any:
    """``load_tile(dst, src, b, row0, h, seqlen, head_dim, mult, t)`` as ``make_tile_load``'s, into a flat float32
    shared array: element (r, d) of the tile goes to ``dst[r * stride + d]``, or with ``transposed`` to
    ``dst[d * stride + r]`` (d-major, so that a thread reads consecutive rows of one column in one 128-bit load).

    Row-major, consecutive threads take consecutive columns, as in ``make_tile_load``. Transposed, they walk
    ``lane_rows(stride, rows)`` rows before moving to the next column, which keeps one warp's stores in 32
    different banks (consecutive columns alone would land ``stride`` words apart)."""
    ROWS, DB, NT, STRIDE, TRANSPOSED = rows, head_dim_bucket, threads, stride, transposed
    R = lane_rows(stride, rows) if transposed else 1
    TOTAL = ROWS * DB
    PER_THREAD = -(-TOTAL // NT)
    RAGGED = TOTAL % NT != 0
    LOAD = element_io(bf16)[0]

    @cuda.jit(device=True, inline="always")
    def load_tile(dst, src, b, row0, h, seqlen, head_dim, mult, t):
        b_u, h_u, row0_u = uint32(b), uint32(h), uint32(row0)
        seqlen_u, head_dim_u = uint32(seqlen), uint32(head_dim)
        for k in range(PER_THREAD):
            idx = uint32(t + k * NT)
            if not RAGGED or idx < uint32(TOTAL):
                column_run = uint32(idx // uint32(R))
                d = uint32(column_run % uint32(DB))
                r = uint32(uint32(column_run // uint32(DB)) * uint32(R) + uint32(idx % uint32(R)))
                row = uint32(row0_u + r)
                x = float32(0.0)
                if row < seqlen_u and d < head_dim_u:
                    x = LOAD(src[b_u, row, h_u, d]) * mult
                if TRANSPOSED:
                    dst[uint32(d * uint32(STRIDE) + r)] = x
                else:
                    dst[uint32(r * uint32(STRIDE) + d)] = x

    return load_tile
