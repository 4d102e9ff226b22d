"""Paged keys for the float64 reference (``attention_ref_varlen(..., block_table=...)`` and its backward): the
keys a paged call reads, as the packed keys the reference takes, and a packed gradient back on the pages.

Written as plain loops over sequences and positions, straight from the definition (sequence b's key j is
``cache[block_table[b, j // page_size], j % page_size]``), and sharing no code with ``numba_flash.paged_keys``,
the gather every backend runs, so that the tests compare two independent readings of the table.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import as_float64, to_numpy


def _positions(block_table: Any, cu_seqlens_k: Any, page_size: int) -> list[tuple[int, int]]:
    """(block, row) of every packed key, sequence by sequence."""
    table, cu_k = (to_numpy(x).astype(np.int64) for x in (block_table, cu_seqlens_k))
    where = []
    for b in range(len(cu_k) - 1):
        for j in range(int(cu_k[b + 1] - cu_k[b])):
            where.append((int(table[b, j // page_size]), j % page_size))
    return where


def unpage_ref(k: Any, v: Any, block_table: Any, cu_seqlens_k: Any) -> tuple[Any, Any]:
    """The packed keys and values a paged call reads: k (num_blocks, page_size, Hkv, D) and v (num_blocks,
    page_size, Hkv, Dv), any float dtype and array kind; block_table (B, max_blocks) and cu_seqlens_k (B + 1,)
    integers. Returns (total_k, Hkv, D) and (total_k, Hkv, Dv) float64; k and v themselves when block_table is None.
    """
    if block_table is None:
        return k, v
    packed = []
    for cache in (as_float64(k), as_float64(v)):
        where = _positions(block_table, cu_seqlens_k, cache.shape[1])
        rows = np.zeros((len(where),) + cache.shape[2:])
        for t, (block, row) in enumerate(where):
            rows[t] = cache[block, row]
        packed.append(rows)
    return packed[0], packed[1]


def page_grads_ref(dk: np.ndarray, dv: np.ndarray, block_table: Any, cu_seqlens_k: Any, shape_k: tuple[int, ...],
                   shape_v: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The gradients of paged caches shaped ``shape_k`` / ``shape_v`` (num_blocks, page_size, Hkv, D / Dv) from
    dk (total_k, Hkv, D) and dv (total_k, Hkv, Dv), those of the packed keys and values ``unpage_ref`` made: each
    packed key's gradient added at the page row it came from, 0 elsewhere, float64. dk and dv themselves when
    block_table is None."""
    if block_table is None:
        return dk, dv
    paged = []
    for grad, shape in ((dk, shape_k), (dv, shape_v)):
        rows = np.zeros(shape)
        for t, (block, row) in enumerate(_positions(block_table, cu_seqlens_k, shape[1])):
            rows[block, row] += grad[t]
        paged.append(rows)
    return paged[0], paged[1]
