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

from numba import cuda, float32, uint32, uint64

from .dtypes import element_io
from .masks import nonfinite_probe


@functools.lru_cache(maxsize=None)
def make_tile_load(rows: int, head_dim_bucket: int, threads: int, bf16: bool) -> Any:
    """``load_tile(dst, src, b, row0, h, seqlen, head_dim, mult, t)``: copy rows ``row0 .. row0 + rows - 1`` of
    head ``h`` of batch ``b`` from ``src`` (B, S, H, D), any strides, float32/float16 (int16 bfloat16 bits with
    ``bf16``), into the float32 shared tile ``dst`` (rows, >= head_dim_bucket) scaled by ``mult``; rows at or past
    ``seqlen`` and columns at or past ``head_dim`` become 0, so they add nothing to any product. Returns the sum of
    ``masks.nonfinite_probe`` over what this thread stored: NaN iff one of its elements is not finite. ``t`` is the
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
        probe = float32(0.0)
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
                probe += nonfinite_probe(x)
        return probe

    return load_tile


#: Elements one thread copies per pass of a tile fetch: four neighbours in shared memory, stored with one 128-bit
#: store (tiles are multiples of 4 in both dimensions).
FETCH_VECTOR = 4


def tile_passes(rows: int, head_dim_bucket: int, threads: int) -> int:
    """Passes of a ``make_tile_fetch`` copy of a (rows x head_dim_bucket) tile by ``threads`` threads."""
    return -(-rows * head_dim_bucket // (FETCH_VECTOR * threads))


@functools.lru_cache(maxsize=None)
def make_tile_fetch(rows: int, head_dim_bucket: int, threads: int, bf16: bool, stride: int,
                    transposed: bool) -> Any:
    """``fetch(vals, src, b, row0, h, seqlen, head_dim, mult, t, k) -> (at, ok)``: pass ``k`` of thread ``t`` of a
    copy of rows ``row0 .. row0 + rows - 1`` of head ``h`` of batch ``b`` from ``src`` (B, S, H, D), any strides,
    float32/float16 (int16 bfloat16 bits with ``bf16``), into a flat float32 shared array ``dst``. It fills the
    local array ``vals`` with ``FETCH_VECTOR`` elements scaled by ``mult`` (0 for rows at or past ``seqlen`` and
    columns at or past ``head_dim``: they add nothing to any product) that belong at ``dst[at + e]``; ``ok`` is
    False only past the end of a ragged last pass. The kernel writes the loop and the store::

        for k in range(tile_passes(rows, head_dim_bucket, threads)):
            at, ok = fetch(vals, src, b, row0, h, seqlen, head_dim, mult, t, k)
            if ok:
                for e in range(FETCH_VECTOR):
                    dst[at + uint64(e)] = vals[e]

    The loop and the store are the kernel's: an inlined helper's instructions carry the helper's line numbers, so
    a loop the compiler kept inside a helper would be invisible to the performance model's trip counts, while a
    store on a kernel line anchors them.

    Element (r, d) goes to ``dst[r * stride + d]``, or with ``transposed`` to ``dst[d * stride + r]`` (d-major: a
    thread of a product loop reads consecutive rows of one column in one 128-bit load). A pass copies four
    consecutive columns of one row, or transposed four consecutive rows of one column; consecutive threads take
    consecutive columns, so a warp's global reads of one row are contiguous, and with a stride of 4 times an odd
    number (``config.transposed_stride``) the 8 threads that share a 128-bit store write 8 different 16-byte
    pieces of the banks. Indices are unsigned 32-bit (numba wraps negative signed indices around, a compare and
    select each); ``b``, ``row0``, ``h``, ``seqlen`` and ``head_dim`` must be non-negative."""
    V, DB, NT, STRIDE, TRANSPOSED = FETCH_VECTOR, head_dim_bucket, threads, stride, transposed
    GROUPS = rows * DB // V
    RAGGED = GROUPS % NT != 0          # the last pass has fewer groups than threads
    PER_ROW = DB // V                  # row-major: groups along one row
    LOAD = element_io(bf16)[0]

    @cuda.jit(device=True, inline="always")
    def element(src, b, row, h, d, seqlen, head_dim, mult):
        x = float32(0.0)
        if row < seqlen and d < head_dim:
            x = LOAD(src[b, row, h, d]) * mult
        return x

    @cuda.jit(device=True, inline="always")
    def fetch(vals, src, b, row0, h, seqlen, head_dim, mult, t, k):
        b_u, h_u, seqlen_u, head_dim_u = uint32(b), uint32(h), uint32(seqlen), uint32(head_dim)
        g = uint32(t + k * NT)
        if TRANSPOSED:
            d = uint32(g % uint32(DB))
            r = uint32(uint32(g // uint32(DB)) * uint32(V))
            row = uint32(uint32(row0) + r)
            for e in range(V):
                vals[e] = element(src, b_u, uint32(row + uint32(e)), h_u, d, seqlen_u, head_dim_u, mult)
            at = uint32(d * uint32(STRIDE) + r)
        else:
            d = uint32(uint32(g % uint32(PER_ROW)) * uint32(V))
            r = uint32(g // uint32(PER_ROW))
            row = uint32(uint32(row0) + r)
            for e in range(V):
                vals[e] = element(src, b_u, row, h_u, uint32(d + uint32(e)), seqlen_u, head_dim_u, mult)
            at = uint32(r * uint32(STRIDE) + d)
        return uint64(at), not RAGGED or g < uint32(GROUPS)

    return fetch
