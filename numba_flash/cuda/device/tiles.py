"""Device helpers the kernel factories share: moving a (rows x D) tile from global to shared memory.

Each helper is generated per tile shape and element kind with the shape as compile-time constants, and is
``inline="always"``: numba splices it into the kernel before typing, so ``compile_ptx`` builds without a GPU (see
dtypes.py) and the kernel pays no call.

Index arithmetic is where a naive tile load spends its instructions (about 65 per element in the first kernels, by
the performance model): numba counts ``range`` loops in signed 64 bits and wraps negative signed indices around.
So a fetch is a compile-time number of passes written on the kernel's lines (the performance model counts a loop
by its kernel-line anchors, and refuses a loop that stays inside a helper), each pass computes the thread's row and
column in unsigned 32 bits (a shift and a mask, with the head dim a power of two) and indexes with unsigned values,
which numba does not wrap. The module also sizes the backward's product loops (``product_steps``).
"""

from __future__ import annotations

import functools
from typing import Any

from numba import cuda, float32, uint32, uint64

from numba_flash.cuda.device.dtypes import element_io


#: Elements one thread copies per pass of a tile fetch: four neighbours in shared memory, stored with one 128-bit
#: store (tiles are multiples of 4 in both dimensions).
FETCH_VECTOR = 4


def tile_passes(rows: int, head_dim_bucket: int, threads: int) -> int:
    """Passes of a ``make_tile_fetch`` copy of a (rows x head_dim_bucket) tile by ``threads`` threads."""
    return -(-rows * head_dim_bucket // (FETCH_VECTOR * threads))


@functools.lru_cache(maxsize=None)
def make_tile_fetch(rows: int, head_dim_bucket: int, threads: int, bf16: bool, stride: int,
                    transposed: bool, clamped: bool = False) -> Any:
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
    select each); ``b``, ``row0``, ``h``, ``seqlen`` and ``head_dim`` must be non-negative.

    ``clamped`` (row-major only): every element is loaded, from its row and column clamped into the sequence and
    the head dim (so ``seqlen`` and ``head_dim`` must be at least 1), and a select makes it 0 outside them. Under
    a branch per element, ptxas reloads the column stride from constant memory for each load."""
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
    def fetch_clamped(vals, src, b, row0, h, seqlen, head_dim, mult, t, k):
        b_u, h_u, seqlen_u, head_dim_u = uint32(b), uint32(h), uint32(seqlen), uint32(head_dim)
        g = uint32(t + k * NT)
        d = uint32(uint32(g % uint32(PER_ROW)) * uint32(V))
        r = uint32(g // uint32(PER_ROW))
        row = uint32(uint32(row0) + r)
        inside = row < seqlen_u
        row_c = min(row, uint32(seqlen_u - uint32(1)))
        for e in range(V):
            d_e = uint32(d + uint32(e))
            x = LOAD(src[b_u, row_c, h_u, min(d_e, uint32(head_dim_u - uint32(1)))]) * mult
            vals[e] = x if inside & (d_e < head_dim_u) else float32(0.0)
        return uint64(r * uint32(STRIDE) + d), not RAGGED or g < uint32(GROUPS)

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

    if clamped and transposed:
        raise ValueError("make_tile_fetch: clamped loads are row-major only")
    return fetch_clamped if clamped else fetch


#: Multiply-adds per thread in one iteration of a backward product loop: its steps are an inner loop that NVVM
#: unrolls in full, so the steps' shared-memory offsets fold into their loads and numba's 64-bit loop control is
#: paid once per iteration. Measured (performance model): at 128 NVVM keeps the inner loop of 2 score steps of
#: 64 multiply-adds, or 4 accumulator steps of 32, as a loop (about 12 instructions of control a step, and 23 an
#: outer iteration); at 64 it unrolls them; 32 gains nothing more.
BODY_FMAS = 64


def product_steps(fmas_per_step: int, extent: int, multiple: int = FETCH_VECTOR) -> int:
    """Steps of the summed dimension per iteration of a product loop over ``extent`` steps, a multiple of
    ``multiple`` (the score products read 4 head-dim columns per load) and a divisor of ``extent``."""
    steps = max(multiple, BODY_FMAS // max(1, fmas_per_step) // multiple * multiple)
    while extent % steps:
        steps //= 2
    return max(1, min(steps, extent))


def checked_grids(cfg: Any, acc_grid: tuple[int, int] | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """(score grid, accumulator grid) of a kernel's tile config, or ValueError saying why the config cannot be
    built (its ``problems`` with no shared-memory limit: the caller may be compiling for any device)."""
    why = cfg.problems(1 << 62)
    if why:
        raise ValueError(f"{cfg}: " + "; ".join(why))
    return cfg.score_grid, acc_grid
