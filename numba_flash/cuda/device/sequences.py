"""Packed sequences in one launch: the table that maps a block to its (sequence, tile), and the device helper with
which every tiled kernel finds its sequence.

A dense launch has grid ``(tiles, heads, B)``: block (x, y, z) is tile x of head y of batch z, and every batch has
the same Sq and Sk. Packed sequences (layout "thd") differ in length, so their tiles are listed instead: row x of
an int32 table ``(n_blocks, 6)`` says which sequence block x works on, which of its tiles, and where the sequence
lies, ``(b, tile, q0, seqlen_q, k0, seqlen_k)``; the grid is ``(n_blocks, heads, 1)``. The kernels then index the
packed arrays, viewed as a batch of one ((1, total, H, D), lse (1, Hq, total_q)), at row ``q0 + i`` (keys ``k0 + j``)
and do everything else (masks, ALiBi, dropout's counters) in the sequence's own coordinates with ``b`` its index,
as the per-sequence launches did. Nothing is padded: the blocks are the sum of the sequences' own tiles.

Which tile a row counts depends on the kernel: the forward and dQ kernels tile the queries (``block_m``), the dK/dV
kernel the keys (``block_n``). Sequences with no rows or no keys get no block: the host writes what the contract
says for them (``backends.varlen``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
from numba import cuda, int32

#: Columns of the table.
SEQ_B, SEQ_TILE, SEQ_Q0, SEQ_LEN_Q, SEQ_K0, SEQ_LEN_K = range(6)


def block_table(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, block: int, along: str) -> np.ndarray:
    """The int32 table (n_blocks, 6) of ``(b, tile, q0, seqlen_q, k0, seqlen_k)``, one row per tile of ``block``
    rows along ``along`` ("q": query tiles, "k": key tiles) of every sequence with at least one row and one key.
    Sequences with the most keys come first (then by index): on a GPU the longest blocks start first, so short
    ones fill the tail instead of waiting behind a long one."""
    cq = np.asarray(cu_seqlens_q, np.int64)
    ck = np.asarray(cu_seqlens_k, np.int64)
    lens_q, lens_k = np.diff(cq), np.diff(ck)
    live = np.flatnonzero((lens_q > 0) & (lens_k > 0))
    live = live[np.lexsort((live, -lens_k[live]))]
    tiles = -(-(lens_q if along == "q" else lens_k)[live] // block)
    seq = np.repeat(live, tiles)
    first = np.repeat(np.cumsum(tiles) - tiles, tiles)
    table = np.empty((len(seq), 6), np.int32)
    table[:, SEQ_B] = seq
    table[:, SEQ_TILE] = np.arange(len(seq)) - first
    table[:, SEQ_Q0], table[:, SEQ_LEN_Q] = cq[seq], lens_q[seq]
    table[:, SEQ_K0], table[:, SEQ_LEN_K] = ck[seq], lens_k[seq]
    return table


@functools.lru_cache(maxsize=None)
def no_sequences(device: int) -> Any:
    """A (1, 6) int32 array on GPU ``device``: the ``seqs`` argument of dense launches, never read (one per GPU, as
    ``launch._no_bias``)."""
    return cuda.device_array((1, 6), np.int32)


@functools.lru_cache(maxsize=None)
def make_locate(varlen: bool) -> Any:
    """``locate(seqs, seqlen_q, seqlen_k) -> (b, ab, tile, q0, k0, seqlen_q, seqlen_k)``: for this block, the
    sequence (batch) index ``b`` that masks, ALiBi and dropout see, the batch index ``ab`` of the arrays, the tile
    index, the first row and key of the sequence in the arrays, and its lengths. Dense: (z, z, x, 0, 0, and the
    call's lengths), so the kernels built without ``varlen`` compute what they always did."""
    if varlen:
        @cuda.jit(device=True, inline="always")
        def locate(seqs, seqlen_q, seqlen_k):
            row = cuda.blockIdx.x
            return (seqs[row, SEQ_B], int32(0), seqs[row, SEQ_TILE], seqs[row, SEQ_Q0], seqs[row, SEQ_K0],
                    seqs[row, SEQ_LEN_Q], seqs[row, SEQ_LEN_K])
    else:
        @cuda.jit(device=True, inline="always")
        def locate(seqs, seqlen_q, seqlen_k):
            return (cuda.blockIdx.z, cuda.blockIdx.z, cuda.blockIdx.x, int32(0), int32(0), seqlen_q, seqlen_k)
    return locate
