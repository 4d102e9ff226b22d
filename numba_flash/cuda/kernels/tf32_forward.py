"""The TF32 tensor-core forward kernel: float32 inputs, products on ``mma.sync.m16n8k8.tf32`` (compute capability
>= 8.0), for callers who allow TF32 (``precision="tf32"``, as torch's ``allow_tf32``).

TF32 keeps float32's exponent and 10 of its 23 mantissa bits: each operand of both products is rounded to it
(``cvt.rna``, to nearest) and the products are summed in float32. The softmax, its sums and the output stay
float32. Accuracy: as naive attention whose two products run in TF32 (docs/guide/cuda.md, "TF32").

The shape is the float16 kernel's (tc_forward.py): one block per (query tile, query head, batch), each warp owns
16 query rows, ``S = Q K^T`` and ``O += P V`` on the tensor cores, the online softmax on the accumulator fragments
(tc_softmax.py, shared with it: m16n8k8's C fragments have m16n8k16's layout). K and V tiles are copied with
``cp.async`` (V's while the scores are computed, the next K's during ``P V``), as there, into row-major tiles of
16-bit slots, two per float (rows of D floats padded by 4: ``slot_stride``). What differs:

- Rounding: each thread rounds the chunks it copied, in place, once its copy has landed (the barrier that publishes
  the tile follows); the same pass finds an inf or NaN in V, after rounding (float32's largest values round to
  inf), and writes 0 there (so that masked pairs' ``0 * inf``
  cannot reach rows that do not see the key), and after the loop the rows that see such a key get NaN in its
  column, as in the float16 kernel. Q's fragments come from global memory once, rounded, and stay in registers
  (D <= 128: ``config.TF32_MAX_HEAD_DIM``).
- K's B fragments (``b0 = K[g, t]``, ``b1 = K[g, t + 4]`` of an 8 x 8 step) are 32-bit words ``t`` of two 16-byte
  chunks of row ``g``: ``ldmatrix`` without ``.trans`` hands each lane exactly those, for two 8-key tiles at once.
- P needs no shuffle to become the A operand of ``P V``: m16n8k8's A fragment wants columns ``t`` and ``t + 4`` of
  a lane's rows where the C fragment holds ``2t`` and ``2t + 1``. So each 8-key step takes its keys in the order
  (0, 2, 4, 6, 1, 3, 5, 7): P's A fragment is its C fragment as it is, and V's B fragment reads rows ``2t`` and
  ``2t + 1`` (``b0 = V[2t, g]``, ``b1 = V[2t + 1, g]``) for the k-rows ``t`` and ``t + 4``, two 32-bit loads.

Arrays reach the kernel as float32 (B, S, H, D) views and, for ``cp.async``, uint16 views of the same memory
(B, S, H, 2D): unit stride along D and 16-byte aligned rows (``launch.async_copy_ok``); other layouts take the
``async_copy=False`` build, which stages each element with plain loads. lse is (B, Hq, Sq) float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import config, cuda, float32, int32, uint16, uint32

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.block_tiles import make_tile_skip, next_key_tile
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.device.dtypes import element_io
from numba_flash.cuda.device.masks import bias_head, make_score_mod_hides, make_visible
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.kernels.tc_forward import tile_offset
from numba_flash.cuda.device.tc_scores import staged_words
from numba_flash.cuda.device.tc_softmax import (finish_rows, make_key_range, make_online_softmax, make_row_start,
                                                make_tile_scores, make_tile_start)
from numba_flash.cuda.device.tc_tiles import CHUNK, copy_passes, copy_row_step, make_tile_copy
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

SMEM_ALIGN = None if config.ENABLE_CUDASIM else 16   # cp.async and ldmatrix move 16-byte aligned chunks
#: Floats of padding per shared-memory tile row (``slot_stride``).
ROW_PAD = 4
#: A float32's exponent bits: all set means inf or NaN.
EXPONENT_BITS = 0x7F800000


def _checked(cfg: FlashAttentionConfig) -> None:
    why = cfg.problems(1 << 62)
    if why or (cfg.spec.role, cfg.spec.kind) != ("forward", "tf32"):
        raise ValueError(f"{cfg}: " + ("; ".join(why) or "not a TF32 forward config"))


def slot_stride(head_dim_bucket: int) -> int:
    """16-bit slots per tile row: D floats and 4 of padding. A row of 4 (mod 32) words puts the 8 rows an
    ``ldmatrix`` phase reads, and the rows ``2t`` of a V fragment load, in different banks; 16 bytes of padding
    keep every row 16-byte aligned for ``cp.async`` and ``ldmatrix``."""
    return 2 * (head_dim_bucket + ROW_PAD)


@cuda.jit(device=True, inline="always")
def _not_finite(word):
    """Whether the float32 (or TF32) bits ``word`` are an inf or a NaN."""
    return (word & uint32(EXPONENT_BITS)) == uint32(EXPONENT_BITS)


@cuda.jit(device=True, inline="always")
def _rounded_word(w, check):
    """(the TF32 bits of the float32 whose bits are ``w``, whether they are an inf or a NaN: a finite float32 within
    half a TF32 step of the largest one rounds to inf); with ``check`` such a value becomes 0."""
    word = warp.bits_to_tf32(w)
    bad = check and _not_finite(word)
    return (uint32(0) if bad else word), bad


@functools.lru_cache(maxsize=None)
def make_chunk_round(rows: int, head_dim_bucket: int, threads: int, zero_non_finite: bool) -> Any:
    """``round_chunk(tile, k, r0, c0) -> bool``: pass ``k`` of the thread's share of a tile copy (tc_tiles
    make_tile_copy's: chunk column ``c0`` of tile row ``r0 + k * step``), once it has landed, rounded to TF32 in
    place. With ``zero_non_finite`` (V) an inf or NaN becomes 0, and the result says whether there was one (always
    False without: K's non-finite values must reach the scores, which the non-finite rule reads)."""
    ROWS, CHECK, STRIDE = rows, zero_non_finite, slot_stride(head_dim_bucket)
    STEP = copy_row_step(2 * head_dim_bucket, threads)

    @cuda.jit(device=True, inline="always")
    def round_chunk(tile, k, r0, c0):
        bad = False
        r = r0 + uint32(k * STEP)
        if r < uint32(ROWS):
            at = r * uint32(STRIDE) + uint32(CHUNK) * c0
            w0, w1, w2, w3 = warp.lds_v4(tile, at)
            x0, bad0 = _rounded_word(w0, CHECK)
            x1, bad1 = _rounded_word(w1, CHECK)
            x2, bad2 = _rounded_word(w2, CHECK)
            x3, bad3 = _rounded_word(w3, CHECK)
            warp.sts_u32(tile, at, x0)
            warp.sts_u32(tile, at + uint32(2), x1)
            warp.sts_u32(tile, at + uint32(4), x2)
            warp.sts_u32(tile, at + uint32(6), x3)
            bad = bad0 | bad1 | bad2 | bad3
        return bad

    return round_chunk


@functools.lru_cache(maxsize=None)
def make_element_stage(rows: int, head_dim_bucket: int, zero_non_finite: bool) -> Any:
    """``stage(tile, x, ab, row0, hk, rows_end, width, e) -> bool``: the copy without ``cp.async``, one element:
    element ``e`` (row ``e // head_dim_bucket``) of rows ``row0 ...`` of ``x[ab, :, hk, :width]`` (float32, any
    strides) into ``tile``, rounded; nothing for ``e`` past the tile, 0 past ``rows_end`` and ``width``, and with
    ``zero_non_finite`` as ``make_chunk_round``. The kernel loops over its threads' elements on its own lines, so
    that the performance model reads the loop's trip count (perf_counts.py)."""
    DB, WORDS, CHECK, STRIDE = head_dim_bucket, rows * head_dim_bucket, zero_non_finite, slot_stride(head_dim_bucket)

    @cuda.jit(device=True, inline="always")
    def stage(tile, x, ab, row0, hk, rows_end, width, e):
        bad = False
        if e < WORDS:
            r = e // DB
            c = e % DB
            value = float32(0.0)
            if (row0 + r < rows_end) & (c < width):
                value = x[ab, row0 + r, hk, c]
            word = warp.float_to_tf32(value)
            if CHECK and _not_finite(word):   # rounded: a finite float32 near the largest one becomes inf
                bad = True
                word = uint32(0)
            warp.sts_u32(tile, uint32(r * STRIDE + 2 * c), word)
        return bad

    return stage


@functools.lru_cache(maxsize=None)
def make_tf32_forward_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool,
                             alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                             async_copy: bool = True, mods: CudaMods = NO_MODS, varlen: bool = False) -> Any:
    """The TF32 forward kernel for one tile config, mask kind and copy path (a ``numba.cuda`` dispatcher, compiled
    lazily).

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments as the tensor-core
    kernel's (tc_forward.py) with float32 q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) and out
    (B, Sq, Hq, Dv), then, last, uint16 views of k and v (B, Sk, Hkv, 2D) for ``cp.async`` (read only with
    ``async_copy``); every variant of that kernel (window, softcap, ALiBi, attn_bias, dropout, mods, a BlockMask's
    tile table, packed sequences) the same way.
    """
    _checked(cfg)
    BLOCK_M, BLOCK_N, HEAD_DIM, NT = cfg.block_m, cfg.block_n, cfg.head_dim_bucket, cfg.threads
    D_STEPS = HEAD_DIM // 8          # k-steps of Q K^T
    N_TILES = BLOCK_N // 8           # 8-key tiles of a warp's scores, each a k-step of P V
    D_TILES = HEAD_DIM // 8          # 8-column tiles of a warp's output
    STRIDE = slot_stride(HEAD_DIM)   # 16-bit slots of a tile row, two per float
    TILE_SLOTS = BLOCK_N * STRIDE
    KV_PASSES, PER_ROW = copy_passes(BLOCK_N, 2 * HEAD_DIM, NT), 2 * HEAD_DIM // CHUNK
    STAGE_STEPS = -(-BLOCK_N * HEAD_DIM // NT)   # elements a thread stages per tile without cp.async
    ALIBI, ASYNC, BLOCK_TILES = alibi, async_copy, mods.block_tiles
    MOD_WORDS = staged_words(N_TILES, NT, mods)
    ALIGN = SMEM_ALIGN
    copy_kv = make_tile_copy(BLOCK_N, 2 * HEAD_DIM, NT, True, row_slots=STRIDE)
    round_k = make_chunk_round(BLOCK_N, HEAD_DIM, NT, False)
    round_v = make_chunk_round(BLOCK_N, HEAD_DIM, NT, True)
    stage_k = make_element_stage(BLOCK_N, HEAD_DIM, False)
    stage_v = make_element_stage(BLOCK_N, HEAD_DIM, True)
    key_range = make_key_range(has_left, has_right, BLOCK_N)
    scores = make_tile_scores(N_TILES, NT, has_left, has_right, softcap, alibi, has_bias, mods)
    softmax = make_online_softmax(N_TILES, D_TILES, dropout)
    start_rows = make_row_start(D_TILES)
    tile_start = make_tile_start(N_TILES, NT, dropout, mods)
    tile_skip = make_tile_skip(BLOCK_TILES)
    locate = make_locate(varlen)
    sees = make_visible(has_left, has_right, has_bias, mods)
    score_mod_hides = make_score_mod_hides(softcap, alibi, has_bias, mods, element_io(False)[0])

    def flash_tf32_forward_kernel(q, k, v, out, lse, seqlen_q, seqlen_k, head_dim, group, window_left,
                                  window_right, qmult, capmult, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                                  batch0, tiles, seqs, k_bits, v_bits):
        t = cuda.threadIdx.x
        lane = uint32(t % 32)
        warp_row0 = 16 * (t // 32)                 # this warp's first row in the tile
        g, tq = int32(lane >> uint32(2)), int32(lane & uint32(3))
        lm, lr = lane >> uint32(3), lane & uint32(7)   # which 8x8 matrix and row this lane addresses for ldmatrix
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        m0 = tile * BLOCK_M
        h = cuda.blockIdx.y
        hk = int32(uint32(h) // uint32(group))     # 32 bits: a 64-bit division is a subroutine call
        slope = float32(0.0)
        if ALIBI:
            slope = slopes[b, h]
        bias_h = bias_head(bias, b, h)
        row_top = m0 + warp_row0 + g               # the rows of registers 0, 1; registers 2, 3 hold row_top + 8
        head_dim_v = v.shape[3]

        k_tile = cuda.shared.array(TILE_SLOTS, uint16, alignment=ALIGN)
        v_tile = cuda.shared.array(TILE_SLOTS, uint16, alignment=ALIGN)
        mod_slots = cuda.shared.array(MOD_WORDS, float32)

        q_frag = cuda.local.array((D_STEPS, 4), uint32)
        s = cuda.local.array((N_TILES, 4), float32)
        acc = cuda.local.array((D_TILES, 4), float32)
        m_i = cuda.local.array(2, float32)         # running max of rows top and top + 8, log2 units
        l_i = cuda.local.array(2, float32)         # this lane's part of their running sums
        start_rows(acc, m_i, l_i)

        offset, lo, hi, n_start, full_lo, full_hi = key_range(m0, m0 + warp_row0, BLOCK_M, seqlen_q, seqlen_k,
                                                              window_left, window_right)
        lane_col = 2 * tq                          # this lane's first column in every 8-key tile
        # This thread's share of every cp.async tile copy: chunk column c0 of rows r0, r0 + step, ...
        c0 = uint32(t % PER_ROW)
        r0 = uint32(t // PER_ROW)
        d0 = int32(c0 * uint32(CHUNK))             # in 16-bit slots
        chunk_bytes = uint32(0)
        if d0 < 2 * head_dim:
            chunk_bytes = uint32(2 * min(2 * head_dim - d0, CHUNK))
        v_chunk_bytes = uint32(0)
        if d0 < 2 * head_dim_v:
            v_chunk_bytes = uint32(2 * min(2 * head_dim_v - d0, CHUNK))

        n_first = n_start
        if BLOCK_TILES:   # the first tile that runs: a skipped tile's keys are never copied
            n_first = next_key_tile(tiles, b, h, tile, n_start, hi, BLOCK_N)
        if ASYNC and n_first < hi:
            for c_pass in range(KV_PASSES):
                copy_kv(k_tile, k_bits, c_pass, r0, c0, chunk_bytes, k0 + n_first, k0 + seqlen_k,
                        tile_offset(k_bits, ab, k0 + n_first, hk), k_bits.strides[1], ab, hk)
            warp.cp_async_commit()
        # A fragment of step kk: a0 = Q[g, 8kk + t], a1 = Q[g + 8, ...], a2 = Q[g, 8kk + t + 4], a3 = Q[g + 8, ...],
        # loaded while the first K tile is in flight.
        for kk in range(D_STEPS):
            for r in range(4):
                row = row_top + 8 * (r & 1)
                col = 8 * kk + tq + 4 * (r >> 1)
                x = float32(0.0)
                if (row < seqlen_q) & (col < head_dim):
                    x = q[ab, q0 + row, h, col]
                q_frag[kk, r] = warp.float_to_tf32(x)

        v_nonfinite_seen = False
        for n0 in range(n_start, hi, BLOCK_N):
            # One table entry for the whole block, so every warp skips together, before any barrier of the
            # iteration; no copy is in flight for a skipped tile (the prefetches go to the next tile that runs).
            skip, full_tile = tile_skip(tiles, b, h, tile, n0 // BLOCK_N)
            if skip:   # mask_mod hides every key: K and V never read, so a NaN there cannot poison
                continue
            if ASYNC:
                warp.cp_async_wait_all()           # this K tile (the thread's own chunks)
                for c_pass in range(KV_PASSES):
                    round_k(k_tile, c_pass, r0, c0)
                cuda.syncthreads()                 # K published; every warp is past the last tile's P V
                for c_pass in range(KV_PASSES):
                    copy_kv(v_tile, v_bits, c_pass, r0, c0, v_chunk_bytes, k0 + n0, k0 + seqlen_k,
                            tile_offset(v_bits, ab, k0 + n0, hk), v_bits.strides[1], ab, hk)
                warp.cp_async_commit()
            else:
                cuda.syncthreads()                 # every warp is past the last tile's P V
                for i in range(STAGE_STEPS):
                    stage_k(k_tile, k, ab, k0 + n0, hk, k0 + seqlen_k, head_dim, t + NT * i)
                cuda.syncthreads()

            kept = tile_start(s, mod_slots, t, b, h, row_top, n0 + lane_col, seqlen_q, seqlen_k, full_tile, seed_lo,
                              seed_hi, threshold, batch0)
            # S = Q K^T: per 8-wide step of the head dim, one ldmatrix gives two 8-key tiles' B fragments.
            for kk in range(D_STEPS):
                for jp in range(N_TILES // 2):
                    b0, b1, b2, b3 = warp.ldmatrix_x4(k_tile, (16 * jp + 8 * (lm >> 1) + lr) * uint32(STRIDE)
                                                      + uint32(CHUNK) * (2 * kk + (lm & 1)))
                    j = 2 * jp
                    s[j, 0], s[j, 1], s[j, 2], s[j, 3] = warp.mma_tf32(
                        q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b0, b1,
                        s[j, 0], s[j, 1], s[j, 2], s[j, 3])
                    s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3] = warp.mma_tf32(
                        q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b2, b3,
                        s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3])
            scores(s, mod_slots, t, row_top, n0, lane_col, offset, full_lo, full_hi, qmult, capmult, slope, bias_h,
                   b, h, seqlen_q, seqlen_k, window_left, window_right)
            softmax(s, acc, m_i, l_i, kept, dscale)

            cuda.syncthreads()                     # every warp is done with this K tile: the next one may land
            bad = False
            if ASYNC:
                n_next = n0 + BLOCK_N
                if BLOCK_TILES:
                    n_next = next_key_tile(tiles, b, h, tile, n_next, hi, BLOCK_N)
                if n_next < hi:
                    for c_pass in range(KV_PASSES):
                        copy_kv(k_tile, k_bits, c_pass, r0, c0, chunk_bytes, k0 + n_next, k0 + seqlen_k,
                                tile_offset(k_bits, ab, k0 + n_next, hk), k_bits.strides[1], ab, hk)
                    warp.cp_async_commit()
                    warp.cp_async_wait_one()       # V's group, the older one
                else:
                    warp.cp_async_wait_all()
                for c_pass in range(KV_PASSES):
                    bad |= round_v(v_tile, c_pass, r0, c0)
            else:
                for i in range(STAGE_STEPS):
                    bad |= stage_v(v_tile, v, ab, k0 + n0, hk, k0 + seqlen_k, head_dim_v, t + NT * i)
            if cuda.syncthreads_or(int32(bad)):    # also publishes the V tile
                v_nonfinite_seen = True

            # O += P V, keys of step j in the order (0, 2, 4, 6, 1, 3, 5, 7) (see the module's docstring).
            for j in range(N_TILES):
                a0, a1 = warp.float_to_tf32(s[j, 0]), warp.float_to_tf32(s[j, 2])
                a2, a3 = warp.float_to_tf32(s[j, 1]), warp.float_to_tf32(s[j, 3])
                for jd in range(D_TILES):
                    at = uint32((8 * j + lane_col) * STRIDE + 2 * (8 * jd + g))
                    b0 = warp.lds_u32(v_tile, at)
                    b1 = warp.lds_u32(v_tile, at + uint32(STRIDE))
                    acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3] = warp.mma_tf32(
                        a0, a1, a2, a3, b0, b1, acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3])

        inv = cuda.local.array(2, float32)
        finish_rows(m_i, l_i, inv, lse, ab, h, q0, row_top, tq, seqlen_q)
        if v_nonfinite_seen:
            # Rare: each row that sees a key whose V holds an inf or NaN, after rounding to TF32, gets NaN in that
            # column (p * inf or p * NaN is not finite whatever p is), read again from global memory.
            for key in range(lo, hi):
                for half in range(2):
                    row = row_top + 8 * half
                    if sees(row, key, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b, h) and \
                            not score_mod_hides(q, k, b, h, hk, row, key, head_dim, qmult, capmult, slope,
                                                offset, bias_h, seqlen_q, seqlen_k):
                        for jd in range(D_TILES):
                            for c in range(2):
                                d = 8 * jd + lane_col + c
                                if d < head_dim_v and _not_finite(warp.float_to_tf32(v[ab, k0 + key, hk, d])):
                                    acc[jd, 2 * half + c] = float32(math.nan)
        for half in range(2):
            row = row_top + 8 * half
            if row < seqlen_q:
                for jd in range(D_TILES):
                    for c in range(2):
                        d = 8 * jd + lane_col + c
                        if d < head_dim_v:
                            # x + x * 0: an inf becomes NaN (the contract reports every non-finite result as NaN).
                            x = acc[jd, 2 * half + c] * inv[half]
                            out[ab, q0 + row, h, d] = x + x * float32(0.0)

    return cuda.jit(flash_tf32_forward_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_tf32_forward_kernel(cfg, v.has_left, v.has_right, v.softcap, v.alibi, v.bias, v.dropout,
                                    v.async_copy, v.mods, **v.factory_switches())
