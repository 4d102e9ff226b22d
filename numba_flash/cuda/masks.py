"""Device helpers for which (row, key) pairs count, shared by the forward and backward kernels, and for the
contract's non-finite rule (numba_flash/reference.py's docstring states it).

The rule costs the kernels little in the common case and is exact in the rare one:

* a visible score that is not finite (an inf or NaN in q or k, or an overflow) is made NaN before the softmax, so
  the row's max, sum, output and lse all become NaN ("poisoned") instead of an inf being taken for a masked key or
  hidden by ``tanh``;
* a masked pair has P = 0 and dS = 0 exactly (a select, never a product), but a product loop still adds
  ``0 * x``, which is NaN when x is not finite. The forward loads a non-finite V element as 0 and, once per block
  after its main loop, makes NaN the output columns of the rows that see such a key (read again from global
  memory; only when some thread saw one). The backward's tile loads sum ``x * 0`` over what each thread loaded
  (NaN as soon as one element is not finite), the barrier after the load ORs that over the block
  (``syncthreads_or``, no extra barrier), and a tile that holds a non-finite value goes through a product that
  skips the masked pairs. The kernels name that flag ``*_nonfinite``; the performance model counts the branch it
  guards as not taken (but not the cost its mere presence has on the compiled loop: see BENCHMARKS.md);
* every result is stored through ``nan_if_not_finite``: the contract reports every non-finite result as NaN.

The helpers are ``inline="always"`` (see dtypes.py). The performance model attributes their instructions to the
kernel line that calls them; ``make_key_rows_product``'s loops run only on the rare path, which it does not count.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32


@cuda.jit(device=True, inline="always")
def nan_if_not_finite(x):
    """``x`` if it is finite, else NaN (float32)."""
    return x if abs(x) < float32(math.inf) else float32(math.nan)


@cuda.jit(device=True, inline="always")
def nonfinite_probe(x):
    """0 for a finite ``x``, NaN for an inf or a NaN: summed over a tile, NaN iff the tile holds a non-finite value.
    (Without fast-math flags the compiler may not fold ``x * 0`` to 0.)"""
    return x * float32(0.0)


@functools.lru_cache(maxsize=None)
def make_visible(has_left: bool, has_right: bool) -> Any:
    """``visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right) -> bool``: whether query ``row``
    sees key ``col`` (both inside their sequences; bottom-right aligned window with ``offset = seqlen_k -
    seqlen_q``; a side without a bound, ``has_left``/``has_right`` False, is not tested at all)."""
    HAS_LEFT, HAS_RIGHT = has_left, has_right

    @cuda.jit(device=True, inline="always")
    def visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right):
        # '&' on bools, not 'and': numba branches around the right side of an 'and'.
        ok = (row < seqlen_q) & (col < seqlen_k)
        if HAS_LEFT:
            ok = ok & (col >= row + offset - window_left)
        if HAS_RIGHT:
            ok = ok & (col <= row + offset + window_right)
        return ok

    return visible


@functools.lru_cache(maxsize=None)
def make_score(softcap: bool, alibi: bool) -> Any:
    """``score(raw, capmult, slope, row, col, offset) -> (x, dcap)``: the score pipeline after ``Q K^T``, in log2
    units, as every kernel forms it. ``raw`` is the product of the pre-multiplied Q row (``qmult``, see
    launch.py) and a K row; softcap gives ``x = capmult * tanh(raw)`` and its chain factor ``dcap = 1 - tanh^2``
    (1 without softcap); ALiBi then adds ``-slope * |row + offset - col|``, ``slope`` being the head's slope times
    log2(e) and ``offset = seqlen_k - seqlen_q`` (flash-attn's bottom-right distance). ALiBi is a bias: it adds
    nothing to the chain factor. A switch that is off is not compiled at all."""
    SOFTCAP, ALIBI = softcap, alibi

    @cuda.jit(device=True, inline="always")
    def score(raw, capmult, slope, row, col, offset):
        x = raw
        dcap = float32(1.0)
        if SOFTCAP:
            th = math.tanh(raw)
            dcap = float32(1.0) - th * th
            x = capmult * th
        if ALIBI:
            x -= slope * float32(abs(row + offset - col))
        return x, dcap

    return score


@functools.lru_cache(maxsize=None)
def make_key_rows_product(block_m: int, rows: int, cols: int, row_step: int, col_step: int, has_left: bool,
                          has_right: bool) -> Any:
    """``add(acc, a_s, b_s, m0, n0, key0, col0, seqlen_q, seqlen_k, offset, window_left, window_right)``: the dK/dV
    kernel's product ``acc[i, j] += sum_m a_s[m, key_i] * b_s[m, col0 + col_step * j]`` over the tile's
    ``block_m`` query rows (query ``m0 + m``), with ``key_i = key0 + row_step * i`` (key ``n0 + key_i``), taking only
    the pairs where the query sees the key. For a tile ``b_s`` (dO or Q) that holds a non-finite value: the plain
    product would add its ``0 * x`` to keys no query of that row sees. ``acc`` is (rows, cols) float32."""
    BM, ROWS, COLS, ROW_STEP, COL_STEP = block_m, rows, cols, row_step, col_step
    visible = make_visible(has_left, has_right)

    @cuda.jit(device=True, inline="always")
    def add(acc, a_s, b_s, m0, n0, key0, col0, seqlen_q, seqlen_k, offset, window_left, window_right):
        for m in range(BM):
            for i in range(ROWS):
                key = key0 + ROW_STEP * i
                seen = visible(m0 + m, n0 + key, seqlen_q, seqlen_k, offset, window_left, window_right)
                a = a_s[m, key]
                for j in range(COLS):
                    x = acc[i, j] + a * b_s[m, col0 + COL_STEP * j]
                    acc[i, j] = x if seen else acc[i, j]

    return add
