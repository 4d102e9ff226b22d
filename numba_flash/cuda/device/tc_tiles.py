"""Shared-memory tiles of the tensor-core kernels: 16-bit (rows x D) tiles with swizzled 16-byte chunks, filled by
``cp.async`` (or by plain loads when the inputs' layout does not allow it), and the addresses ``ldmatrix`` reads.

A tile row of D 16-bit elements is D / 8 chunks of 16 bytes. ``ldmatrix`` has each group of 8 lanes read 8 rows of
one chunk column at once; with rows of 128 bytes or a multiple, those 8 chunks would sit in the same 4 of the 32
banks (an 8-way conflict). Chunk ``c`` of row ``r`` is therefore stored at chunk ``c ^ swizzle(r)``, where
``swizzle`` runs through 0..7 over any 8 consecutive rows (over pairs or quads of rows when a row is 64 or 32 bytes,
so that 8 consecutive rows still cover all 32 banks): every ``ldmatrix`` phase and every 8 lanes of a ``cp.async``
row copy touch 8 different 16-byte bank groups, and no byte of padding is spent (the tiles fill exactly 48 KiB
at D = 256).

Helpers are generated per shape with the shape as compile-time constants and are ``inline="always"`` (see
dtypes.py); loops stay on the kernels' lines, where the performance model can count them (perf_model.py).
"""

from __future__ import annotations

import functools
from typing import Any

from numba import cuda, int64, uint16, uint32

from numba_flash.cuda.device import warp

#: 16-bit elements per 16-byte chunk: the unit of cp.async, ldmatrix rows and the swizzle.
CHUNK = 8


def swizzle_params(head_dim_bucket: int) -> tuple[int, int]:
    """(rows that share one 128-byte line, mask of the chunk bits the swizzle flips) for rows of
    ``head_dim_bucket`` 16-bit elements."""
    per_row = head_dim_bucket // CHUNK
    return max(1, CHUNK // per_row), min(per_row, CHUNK) - 1


@functools.lru_cache(maxsize=None)
def make_smem_index(head_dim_bucket: int) -> Any:
    """``smem_index(row, chunk) -> uint32``: the element index where chunk ``chunk`` of row ``row`` of a (rows x
    head_dim_bucket) swizzled tile starts (a multiple of 8)."""
    DB = head_dim_bucket
    ROWS_PER_LINE, MASK = swizzle_params(DB)

    @cuda.jit(device=True, inline="always")
    def smem_index(row, chunk):
        # The swizzle flips only the chunk's low 3 bits: written as (c & ~7) + ((c & 7) ^ s), an address whose
        # chunk is a constant is one of a few per-lane registers plus an immediate, not a register of its own.
        r, c = uint32(row), uint32(chunk)
        s = (r // uint32(ROWS_PER_LINE)) & uint32(MASK)
        return uint32(r * uint32(DB) + uint32(CHUNK) * ((c & uint32(~7 & 0xFFFFFFFF)) + ((c & uint32(7)) ^ s)))

    return smem_index


@functools.lru_cache(maxsize=None)
def make_wgmma_index(rows: int) -> Any:
    """``wgmma_index(row, chunk) -> uint32``: as ``make_smem_index``'s, for a (rows x D) tile that wgmma reads
    through a 128-byte-swizzle descriptor (hopper.py): 64-column blocks of rows x 128 bytes one after another,
    chunk ``c`` of row ``r`` at chunk ``c ^ (r % 8)`` of its block. The same tile serves as a K-major operand (Q,
    and K for ``Q K^T``: 1024 bytes between 8-row groups) and as an N-major one (V for ``P V``: 64-column blocks
    ``rows * 128`` bytes apart). ``rows`` must be a multiple of 8, the tile 1024-byte aligned."""
    BLOCK_WORDS = rows * 64

    @cuda.jit(device=True, inline="always")
    def wgmma_index(row, chunk):
        r, c = uint32(row), uint32(chunk)
        return uint32((c >> uint32(3)) * uint32(BLOCK_WORDS) + r * uint32(64)
                      + uint32(CHUNK) * ((c & uint32(7)) ^ (r & uint32(7))))

    return wgmma_index


def copy_passes(rows: int, head_dim_bucket: int, threads: int) -> int:
    """Passes of ``threads`` threads, one chunk each, over a (rows x head_dim_bucket) tile."""
    return -(-rows * (head_dim_bucket // CHUNK) // threads)


def copy_row_step(head_dim_bucket: int, threads: int) -> int:
    """Rows one pass of a tile copy covers: a thread copies the same chunk column of every ``step``-th row."""
    return threads // (head_dim_bucket // CHUNK)


@functools.lru_cache(maxsize=None)
def make_tile_copy(rows: int, head_dim_bucket: int, threads: int, async_copy: bool, row_slots: int = 0,
                   wgmma: bool = False) -> Any:
    """``copy(dst, src, k, r0, c0, nbytes, row0, seqlen, tile_base, row_stride, b, h)``: pass ``k`` of a copy of
    rows ``row0 ..`` of head ``h`` of batch ``b`` of ``src`` (B, S, H, D), uint16, into the swizzled (rows x
    head_dim_bucket) shared tile ``dst`` (with ``row_slots``, into a row-major tile of that many elements per row,
    unswizzled: the TF32 kernel's padded rows; with ``wgmma``, into ``make_wgmma_index``'s layout). The thread
    copies chunk column ``c0`` of tile row ``r0 + k * step``
    (``copy_row_step``), of which ``nbytes`` are inside the head dim; rows at or past ``seqlen`` become zeros.
    With ``async_copy`` the chunk goes by ``cp.async`` from ``tile_base`` (the byte offset of row ``row0``,
    column 0) plus the row's and column's offsets, completed by ``cp_async_wait_*``; without, element by element
    through ``src[b, row, h, d]``, for layouts ``cp.async`` cannot read. The pass loop is the kernel's, so that the
    performance model can count it."""
    ROWS, ASYNC, ROW_SLOTS = rows, async_copy, row_slots
    STEP = copy_row_step(head_dim_bucket, threads)
    RAGGED = rows % STEP != 0
    smem_index = make_wgmma_index(rows) if wgmma else make_smem_index(head_dim_bucket)

    @cuda.jit(device=True, inline="always")
    def copy(dst, src, k, r0, c0, nbytes, row0, seqlen, tile_base, row_stride, b, h):
        r = r0 + uint32(k * STEP)
        row = row0 + int64(r)
        chunk_bytes = nbytes if row < seqlen else uint32(0)
        if not RAGGED or r < uint32(ROWS):
            at = r * uint32(ROW_SLOTS) + uint32(CHUNK) * c0 if ROW_SLOTS else smem_index(r, c0)
            if ASYNC:
                warp.cp_async_16_at(dst, at, src, tile_base + int64(r) * row_stride + int64(2 * CHUNK) * c0,
                                    chunk_bytes)
            else:
                # Runtime bounds: unrolled, every pass's loads would be in flight at once, for registers the
                # tensor-core kernels do not have (this path serves only layouts cp.async cannot read).
                valid = chunk_bytes // uint32(2)
                for e in range(valid):
                    dst[at + uint32(e)] = src[b, row, h, c0 * uint32(CHUNK) + uint32(e)]
                for e in range(valid, CHUNK):
                    dst[at + uint32(e)] = uint16(0)

    return copy
