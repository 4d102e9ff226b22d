"""A caller's BlockMask (``numba_flash.mods.block_mask``) re-cut to a CUDA kernel's own tiles, and the device
helpers with which the kernels read it.

The BlockMask's tiles (its block_m x block_n, 64 x 64 by default) are not the kernels' (each kernel's config has
its own BLOCK_M x BLOCK_N, and the dK/dV and dQ kernels differ from the forward). A kernel tile is EMPTY when every
BlockMask tile it overlaps is EMPTY (every key hidden: the kernel skips it), FULL when every one is FULL (every key
visible: the kernel runs it without evaluating mask_mod) and PARTIAL otherwise. Exact where the tiles line up, and
conservative where they do not: a kernel tile that straddles an EMPTY and a FULL BlockMask tile is PARTIAL, and
mask_mod decides each of its pairs.

The kernels take the table as an int8 device array (B or 1, Hq or 1, n_query_tiles, n_key_tiles), a dimension of 1
serving every batch or head as in the BlockMask; kernels built without ``CudaMods.block_tiles`` take a (1, 1, 1, 1)
placeholder that they never read.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda

from numba_flash.errors import AttentionInputError
from numba_flash.mods import EMPTY, FULL, PARTIAL, BlockMask


def _overlaps(seqlen: int, kernel_block: int, mask_block: int) -> tuple[np.ndarray, np.ndarray]:
    """For each kernel tile along one axis, the first and one-past-last BlockMask tile it overlaps (int64 arrays
    of ceil(seqlen / kernel_block))."""
    starts = np.arange(0, seqlen, kernel_block, dtype=np.int64)
    ends = np.minimum(starts + kernel_block, seqlen)          # one past the tile's last index
    return starts // mask_block, (ends - 1) // mask_block + 1


def _box_counts(flags: np.ndarray, lo_q: np.ndarray, hi_q: np.ndarray, lo_k: np.ndarray,
                hi_k: np.ndarray) -> np.ndarray:
    """How many entries of ``flags`` (bool (B, H, nq, nk)) are set in each box [lo_q, hi_q) x [lo_k, hi_k) of the
    last two axes: (B, H, len(lo_q), len(lo_k)), from a summed-area table (four look-ups per box)."""
    nb, nh, nq, nk = flags.shape
    sums = np.zeros((nb, nh, nq + 1, nk + 1), dtype=np.int64)
    sums[:, :, 1:, 1:] = flags.cumsum(axis=2, dtype=np.int64).cumsum(axis=3)
    qh, ql, kh, kl = hi_q[:, None], lo_q[:, None], hi_k[None, :], lo_k[None, :]
    return sums[:, :, qh, kh] - sums[:, :, ql, kh] - sums[:, :, qh, kl] + sums[:, :, ql, kl]


def kernel_tile_states(block_mask: BlockMask, kernel_m: int, kernel_n: int) -> np.ndarray:
    """The BlockMask's states re-cut to tiles of ``kernel_m`` query rows by ``kernel_n`` keys: int8 (B or 1, H or 1,
    ceil(Sq / kernel_m), ceil(Sk / kernel_n)) of EMPTY (every overlapped BlockMask tile EMPTY), FULL (every one
    FULL) or PARTIAL. ``AttentionInputError`` naming block_mask when its states do not match its sizes."""
    states = np.asarray(block_mask.states)
    sq, sk, bm, bn = block_mask.seqlen_q, block_mask.seqlen_k, block_mask.block_m, block_mask.block_n
    want = (-(-sq // bm), -(-sk // bn))
    if states.ndim != 4 or states.shape[2:] != want:
        raise AttentionInputError(f"block_mask: expected states of shape (B, H, {want[0]}, {want[1]}) for (Sq, Sk) = "
                                  f"({sq}, {sk}) and blocks ({bm}, {bn}), got {states.shape}")
    lo_q, hi_q = _overlaps(sq, kernel_m, bm)
    lo_k, hi_k = _overlaps(sk, kernel_n, bn)
    area = (hi_q - lo_q)[:, None] * (hi_k - lo_k)[None, :]
    out = np.full(states.shape[:2] + area.shape, PARTIAL, dtype=np.int8)
    out[_box_counts(states == EMPTY, lo_q, hi_q, lo_k, hi_k) == area] = EMPTY
    out[_box_counts(states == FULL, lo_q, hi_q, lo_k, hi_k) == area] = FULL
    return out


@functools.lru_cache(maxsize=None)
def _no_tiles(device: int) -> Any:
    """A (1, 1, 1, 1) int8 array on GPU ``device``: the ``tiles`` argument of kernels built without block tiles,
    never read (one per GPU, as launch._no_bias)."""
    return cuda.device_array((1, 1, 1, 1), np.int8)


def tiles_arg(block_mask: BlockMask | None, kernel_m: int, kernel_n: int, device: int, stream: Any = 0) -> Any:
    """The kernels' ``tiles`` argument: ``kernel_tile_states`` on the GPU, or without a BlockMask the current GPU's
    placeholder."""
    if block_mask is None:
        return _no_tiles(device)
    return cuda.to_device(np.ascontiguousarray(kernel_tile_states(block_mask, kernel_m, kernel_n)), stream=stream)


@cuda.jit(device=True, inline="always")
def tile_state(tiles, b, h, m_tile, n_tile):
    """The state (EMPTY, PARTIAL or FULL) of query tile ``m_tile`` x key tile ``n_tile`` of batch ``b``, query head
    ``h`` in a ``tiles_arg`` table, broadcast over a B or H of 1. Every thread of a block reads the same entry, so
    a branch on it is uniform: safe around barriers."""
    return tiles[b if tiles.shape[0] > 1 else 0, h if tiles.shape[1] > 1 else 0, m_tile, n_tile]


@functools.lru_cache(maxsize=None)
def make_tile_skip(block_tiles: bool) -> Any:
    """``tile_skip(tiles, b, h, m_tile, n_tile) -> (skip, full)``: whether a kernel skips query tile ``m_tile`` x key
    tile ``n_tile`` (the table calls it EMPTY) and whether it runs it without mask_mod (FULL); without
    ``block_tiles`` (kernels built without a BlockMask) (False, False), the table not read. The branch on ``skip``
    is uniform (``tile_state``), so a kernel may ``continue`` on it before any barrier of its iteration."""
    BLOCK_TILES = block_tiles

    @cuda.jit(device=True, inline="always")
    def tile_skip(tiles, b, h, m_tile, n_tile):
        if not BLOCK_TILES:
            return False, False
        state = tile_state(tiles, b, h, m_tile, n_tile)
        return state == EMPTY, state == FULL

    return tile_skip


@cuda.jit(device=True, inline="always")
def next_key_tile(tiles, b, h, m_tile, n0, hi, block_n):
    """The first key tile start of ``n0, n0 + block_n, ..`` below ``hi`` that the table does not call EMPTY for
    query tile ``m_tile``, else one at or past ``hi``. The tensor-core forward prefetches that tile's keys, so that
    a skipped tile is never copied."""
    while n0 < hi and tile_state(tiles, b, h, m_tile, n0 // block_n) == EMPTY:
        n0 += block_n
    return n0


__all__ = ["kernel_tile_states", "tiles_arg", "tile_state", "make_tile_skip", "next_key_tile", "EMPTY", "PARTIAL",
           "FULL"]
