"""What the tensor-core forward kernels do between the two products: the key range of a query tile, the scores of a
warp's accumulator fragments, the online softmax on them, and each row's lse at the end.

Shared by the float16/bfloat16 kernel (tc_forward.py, ``mma.m16n8k16``) and the TF32 one (tf32_forward.py,
``mma.m16n8k8``): both products leave their C fragments in the same layout, so the scores of an ``N_TILES`` x 8 key
tile sit alike in both. A lane holds rows ``row_top`` (registers 0, 1) and ``row_top + 8`` (2, 3), columns
``lane_col`` and ``lane_col + 1`` of every 8-key tile (``lane_col = 2 * (lane % 4)``), as ``s[j, r]`` of a
(N_TILES, 4) local array. Everything is ``inline="always"``: the loops unroll inside the kernels, so the fragments
keep constant indices and stay in registers.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32, uint64

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.tc_scores import (make_keep_bits, make_kept_factor, make_mod_stage, make_score,
                                               staged_value)
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods, make_score_mod

LN2 = math.log(2.0)


@functools.lru_cache(maxsize=None)
def make_key_range(has_left: bool, has_right: bool, block_n: int) -> Any:
    """``key_range(m0, warp_first, block_m, seqlen_q, seqlen_k, window_left, window_right) -> (offset, lo, hi,
    n_start, full_lo, full_hi)``: for the query tile starting at row ``m0``, the keys ``[lo, hi)`` any of its rows
    sees (rows' ranges only move right, so the first and last rows bound them), the first key tile ``n_start``,
    and the tiles ``[full_lo, full_hi)`` every row of the warp whose first row is ``warp_first`` sees whole (no
    mask there: rows past the sequence compute on zeros and are never stored). ``offset = seqlen_k - seqlen_q``
    (bottom-right aligned masks)."""
    HAS_LEFT, HAS_RIGHT, BLOCK_N = has_left, has_right, block_n

    @cuda.jit(device=True, inline="always")
    def key_range(m0, warp_first, block_m, seqlen_q, seqlen_k, window_left, window_right):
        offset = seqlen_k - seqlen_q
        last_row = min(m0 + block_m, seqlen_q) - 1
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, m0 + offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, last_row + offset + window_right + 1)
        n_start = (lo // BLOCK_N) * BLOCK_N
        full_lo = 0
        full_hi = seqlen_k - seqlen_k % BLOCK_N
        if HAS_LEFT:
            full_lo = warp_first + 15 + offset - window_left
        if HAS_RIGHT:
            full_hi = min(full_hi, warp_first + offset + window_right + 1)
        return offset, lo, hi, n_start, full_lo, full_hi

    return key_range


@functools.lru_cache(maxsize=None)
def make_row_start(d_tiles: int) -> Any:
    """``start(acc, m_i, l_i)``: before the first key tile, the output accumulators ``acc`` (D_TILES, 4) at 0, the
    running maxima ``m_i`` (2,) at -inf (no key seen yet) and the lane's parts of the running sums ``l_i`` (2,) at
    0."""
    D_TILES = d_tiles

    @cuda.jit(device=True, inline="always")
    def start(acc, m_i, l_i):
        for jd in range(D_TILES):
            for r in range(4):
                acc[jd, r] = float32(0.0)
        for half in range(2):
            m_i[half] = float32(-math.inf)
            l_i[half] = float32(0.0)

    return start


@functools.lru_cache(maxsize=None)
def make_tile_start(n_tiles: int, threads: int, dropout: bool, mods: CudaMods = NO_MODS) -> Any:
    """``tile_start(s, mod_slots, t, b, h, row_top, col0, seqlen_q, seqlen_k, full_tile, seed_lo, seed_hi,
    threshold, batch0) -> kept``: ahead of a key tile's products, thread ``t`` stages its scores' mask_mod and
    bias_mod values (tc_scores.make_mod_stage; on a FULL tile, ``full_tile``, mask_mod shows every key and is not
    evaluated), draws dropout's keep mask (tc_scores.make_keep_bits: ahead of the products, while only the mask's
    register is live beside the accumulators; 0 without dropout) and zeroes the scores ``s`` (N_TILES, 4). ``col0``
    is the lane's first key of the tile."""
    N_TILES, INDEX_MODS, DROPOUT = n_tiles, mods.stages_tile, dropout
    stage_mods = make_mod_stage(n_tiles, threads, mods)
    keep_bits = make_keep_bits(n_tiles)

    @cuda.jit(device=True, inline="always")
    def tile_start(s, mod_slots, t, b, h, row_top, col0, seqlen_q, seqlen_k, full_tile, seed_lo, seed_hi,
                   threshold, batch0):
        if INDEX_MODS:
            stage_mods(mod_slots, t, b, h, row_top, col0, seqlen_q, seqlen_k, not full_tile)
        kept = uint64(0)
        if DROPOUT:
            kept = keep_bits(seed_lo, seed_hi, threshold, b + batch0, h, row_top, col0)
        for j in range(N_TILES):
            for r in range(4):
                s[j, r] = float32(0.0)
        return kept

    return tile_start


@functools.lru_cache(maxsize=None)
def make_tile_scores(n_tiles: int, threads: int, has_left: bool, has_right: bool, softcap: bool, alibi: bool,
                     has_bias: bool, mods: CudaMods = NO_MODS) -> Any:
    """``scores(s, mod_slots, t, row_top, n0, lane_col, offset, full_lo, full_hi, qmult, capmult, slope, bias_h, b,
    h, seqlen_q, seqlen_k, window_left, window_right)``: the raw products ``s`` (N_TILES, 4) of key tile ``n0``
    become scores in log2 units, in place (tc_scores.make_score: a visible one whose raw product is not finite is
    NaN, which the row's sum carries to its output and lse; a -inf bias hides its pair); mask_mod and bias_mod come
    from thread ``t``'s slots of ``mod_slots`` (tc_scores.make_mod_stage); keys past the sequence or outside a row's
    band become -inf on a tile outside ``[full_lo, full_hi)``; then score_mod on the visible finite scores."""
    N_TILES, HAS_LEFT, HAS_RIGHT, NT = n_tiles, has_left, has_right, threads
    INDEX_MODS, SCORE_MOD = mods.stages_tile, mods.score_mod is not None
    score = make_score(softcap, alibi, has_bias)
    score_mod = make_score_mod(mods)

    @cuda.jit(device=True, inline="always")
    def scores(s, mod_slots, t, row_top, n0, lane_col, offset, full_lo, full_hi, qmult, capmult, slope, bias_h, b, h,
               seqlen_q, seqlen_k, window_left, window_right):
        neg_inf = float32(-math.inf)
        for half in range(2):
            row = row_top + 8 * half
            distance0 = float32(row + offset - lane_col - n0)   # ALiBi's, at the lane's first column
            for j in range(N_TILES):
                for c in range(2):
                    col = 8 * j + c
                    x, _ = score(s[j, 2 * half + c], qmult, capmult, slope, distance0 - float32(col), bias_h,
                                 row, n0 + lane_col + col, b, h, seqlen_q, seqlen_k, True)
                    if INDEX_MODS:
                        x = staged_value(x, mod_slots[(4 * j + 2 * half + c) * NT + t])
                    s[j, 2 * half + c] = x
        if (n0 < full_lo) | (n0 + 8 * N_TILES > full_hi):
            # Keys past the sequence or outside a row's band: -inf, whatever they computed. Bounds relative to
            # the lane's first column of the tile, so that each element's column is a constant.
            for half in range(2):
                row = row_top + 8 * half
                first = -n0 - lane_col
                last = seqlen_k - 1 - n0 - lane_col
                if HAS_LEFT:
                    first = max(first, row + offset - window_left - n0 - lane_col)
                if HAS_RIGHT:
                    last = min(last, row + offset + window_right - n0 - lane_col)
                for j in range(N_TILES):
                    for c in range(2):
                        col = 8 * j + c          # past the lane's first column: a constant
                        seen = (col >= first) & (col <= last)
                        s[j, 2 * half + c] = s[j, 2 * half + c] if seen else neg_inf
        if SCORE_MOD:   # on the visible finite scores (the masked ones are -inf by now)
            for half in range(2):
                row = row_top + 8 * half
                for j in range(N_TILES):
                    for c in range(2):
                        col = n0 + lane_col + 8 * j + c
                        s[j, 2 * half + c], _ = score_mod(s[j, 2 * half + c], (row < seqlen_q) & (col < seqlen_k),
                                                          b, h, row, col, seqlen_q - 1, seqlen_k - 1)

    return scores


@functools.lru_cache(maxsize=None)
def make_online_softmax(n_tiles: int, d_tiles: int, dropout: bool) -> Any:
    """``softmax(s, acc, m_i, l_i, kept, dscale)``: one key tile's step of the online softmax for the lane's two
    rows. ``s`` (N_TILES, 4) scores in log2 units become ``exp2(s - max)``, times dropout's factor (``kept``, a
    tc_scores.make_keep_bits mask, and ``dscale``; read only with ``dropout``: the sum is the softmax's, P V takes
    the kept probabilities, scaled); ``m_i`` (2,) running maxima, ``l_i`` (2,) this lane's part of the running
    sums, ``acc`` (D_TILES, 4) the output accumulators, rescaled. max ignores NaN; the row's sum does not."""
    N_TILES, D_TILES = n_tiles, d_tiles
    kept_factor = make_kept_factor(dropout)

    @cuda.jit(device=True, inline="always")
    def softmax(s, acc, m_i, l_i, kept, dscale):
        neg_inf = float32(-math.inf)
        # The accumulators are rescaled in a loop of their own: indexed by ``half`` inside this one, they would
        # get a runtime index wherever the compiler keeps the loop rolled, and move to local memory.
        alpha = cuda.local.array(2, float32)
        for half in range(2):
            tile_max = neg_inf
            for j in range(N_TILES):
                for c in range(2):
                    tile_max = max(tile_max, s[j, 2 * half + c])
            tile_max = max(tile_max, warp.shfl_xor(tile_max, 1))
            tile_max = max(tile_max, warp.shfl_xor(tile_max, 2))
            m_new = max(m_i[half], tile_max)
            # A row with nothing visible yet keeps max -inf; exp2 against 0 then gives 0, never NaN.
            m_use = m_new if m_new != neg_inf else float32(0.0)
            alpha[half] = warp.exp2_approx(m_i[half] - m_use)
            total = float32(0.0)
            for j in range(N_TILES):
                for c in range(2):
                    p = warp.exp2_approx(s[j, 2 * half + c] - m_use)
                    total += p
                    s[j, 2 * half + c] = p * kept_factor(kept, 4 * j + 2 * half + c, dscale)
            l_i[half] = l_i[half] * alpha[half] + total
            m_i[half] = m_new
        for jd in range(D_TILES):
            for r in range(4):
                acc[jd, r] *= alpha[r >> 1]

    return softmax


@cuda.jit(device=True, inline="always")
def finish_rows(m_i, l_i, inv, lse, ab, h, q0, row_top, tq, seqlen_q):
    """After the last key tile: ``inv`` (2,) gets 1 / each row's sum (the quad's parts added; 0 for a row that sees
    no key), and the quad's first lane writes the row's lse (natural log): NaN for a poisoned row, +inf for one
    that sees no key. lse is (B, Hq, Sq) float32, the rows of this sequence from ``(ab, q0)``."""
    for half in range(2):
        total = l_i[half]
        total += warp.shfl_xor(total, 1)
        total += warp.shfl_xor(total, 2)
        inv[half] = warp.rcp_approx(total) if total > float32(0.0) else float32(0.0)
        row = row_top + 8 * half
        if tq == 0 and row < seqlen_q:
            if total > float32(0.0):
                lse[ab, h, q0 + row] = (m_i[half] + math.log2(total)) * float32(LN2)
            elif total != total:   # poisoned
                lse[ab, h, q0 + row] = float32(math.nan)
            else:                  # sees no key
                lse[ab, h, q0 + row] = float32(math.inf)
