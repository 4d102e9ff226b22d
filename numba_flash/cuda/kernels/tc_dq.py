"""The tensor-core dQ kernel (float16 and bfloat16, compute capability >= 8.0): dQ = scale * dS K, one block per
(query tile, query head, batch), looping over the key tiles its rows see.

Each warp owns 16 query rows, as in the forward (tc_forward.py), whose fragment layouts and tiles it shares. Per
key tile it recomputes ``S = Q K^T`` and ``P = exp2(s - lse)`` exactly as the forward computed them (tc_scores.py),
then ``dP = dO V^T`` (dO's fragments are the A operand, V's rows the B operand, like K's), ``dS = P (dP - delta)``
(times softcap's derivative; with dropout ``P (z dP - delta)``, ``z`` the forward's factor regenerated), and
``dQ += dS K``: dS's C fragments become an A fragment in registers, packed to 16 bits, and K is read transposed.
No atomics: dK and dV come from their own kernel (tc_dkdv.py), so dQ is the same bits run to run.

The non-finite rule (masks.py): a masked pair's P and dS are 0 by a select, so a NaN in its S or dP stays there.
What a select cannot reach is ``dQ += dS K`` multiplying a masked pair's dS = 0 by an inf or NaN of K: a K tile that
holds one (each thread tests the chunks it copied, one packed ``x * 0`` per word) has it zeroed after the scores
and before that product. The rows that see such a key lose nothing: the forward poisoned them, so their lse is NaN
and so is every dS of theirs.

Arrays reach the kernel as (B, S, H, D) uint16 views of the float16 or bfloat16 data (any strides; the
``async_copy`` kernel needs unit stride along D and 16-byte aligned rows); lse and delta are (B, Hq, Sq) float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import config, cuda, float32, int32, uint16, uint32, uint64

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.block_tiles import make_tile_skip, next_key_tile
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.device.masks import LOG2E, bias_head
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.kernels.tc_forward import EXPONENT_BITS, tile_offset
from numba_flash.cuda.device.tc_scores import hidden_p, is_hidden, make_keep_bits, make_kept_factor, make_score
from numba_flash.cuda.device.tc_tiles import CHUNK, copy_passes, copy_row_step, make_smem_index, make_tile_copy
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

SMEM_ALIGN = None if config.ENABLE_CUDASIM else 16


@functools.lru_cache(maxsize=None)
def make_tc_dq_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                      alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                      async_copy: bool = True, mods: CudaMods = NO_MODS, varlen: bool = False) -> Any:
    """The tensor-core dQ kernel for one tile config, mask kind and element kind (a ``numba.cuda`` dispatcher).

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments as the float32 dQ
    kernel's (backward.py) except that q, dout (B, Sq, Hq, D), k, v (B, Sk, Hkv, D) and dq (B, Sq, Hq, D) are uint16
    bit patterns of float16 (or, with ``bf16``, bfloat16) data; dropout's arguments are read only with ``dropout``
    (the forward's keep mask regenerated: dS = P (z dP - delta), z = 1 / (1 - p) where kept, 0 where dropped).
    With ``mods.block_tiles`` the key-tile loop skips the tiles the BlockMask's table (``tiles``) calls EMPTY,
    never copying their keys, and scores FULL ones without mask_mod."""
    why = cfg.problems(1 << 62)
    if why or (cfg.spec.role, cfg.spec.kind) != ("dq", "mma"):
        raise ValueError(f"{cfg}: " + ("; ".join(why) or "not a tensor-core dQ config"))
    BLOCK_M, BLOCK_N, HEAD_DIM, NT = cfg.block_m, cfg.block_n, cfg.head_dim_bucket, cfg.threads
    D_STEPS, N_TILES, KEY_STEPS, D_TILES = HEAD_DIM // 16, BLOCK_N // 8, BLOCK_N // 16, HEAD_DIM // 8
    X_WORDS, KV_WORDS = BLOCK_M * HEAD_DIM, BLOCK_N * HEAD_DIM
    X_PASSES, KV_PASSES = copy_passes(BLOCK_M, HEAD_DIM, NT), copy_passes(BLOCK_N, HEAD_DIM, NT)
    PER_ROW, ROW_STEP = HEAD_DIM // CHUNK, copy_row_step(HEAD_DIM, NT)
    HAS_LEFT, HAS_RIGHT, ALIBI, DROPOUT, EXP = has_left, has_right, alibi, dropout, EXPONENT_BITS[bf16]
    ALIGN = SMEM_ALIGN
    MMA = warp.mma_bf16 if bf16 else warp.mma_f16
    PACK = warp.pack_bf16x2 if bf16 else warp.pack_f16x2
    PROBE = warp.probe_bf16x2 if bf16 else warp.probe_f16x2
    copy_x = make_tile_copy(BLOCK_M, HEAD_DIM, NT, async_copy)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, NT, async_copy)
    smem_index = make_smem_index(HEAD_DIM)
    score = make_score(softcap, alibi, has_bias, mods)
    BLOCK_TILES = mods.block_tiles
    tile_skip = make_tile_skip(BLOCK_TILES)
    locate = make_locate(varlen)
    kept_factor = make_kept_factor(dropout)
    keep_bits = make_keep_bits(N_TILES)

    def flash_tc_dq_kernel(q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, head_dim, group, window_left,
                           window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                           batch0, tiles, seqs):
        inf = float32(math.inf)
        t = cuda.threadIdx.x
        lane = uint32(t % 32)
        warp_row0 = 16 * (t // 32)
        g, tq = lane >> uint32(2), lane & uint32(3)
        lm, lr = lane >> uint32(3), lane & uint32(7)
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        m0 = tile * BLOCK_M
        h = cuda.blockIdx.y
        hk = int32(uint32(h) // uint32(group))
        slope = float32(0.0)
        if ALIBI:
            slope = slopes[b, h]
        bias_h = bias_head(bias, b, h)
        row_top = m0 + warp_row0 + int32(g)
        lane_col = 2 * int32(tq)

        k_tile = cuda.shared.array(KV_WORDS, uint16, alignment=ALIGN)
        v_tile = cuda.shared.array(KV_WORDS, uint16, alignment=ALIGN)
        x_tile = cuda.shared.array(X_WORDS, uint16, alignment=ALIGN)   # Q, then dO, then the output

        q_frag = cuda.local.array((D_STEPS, 4), uint32)
        do_frag = cuda.local.array((D_STEPS, 4), uint32)
        ds_frag = cuda.local.array((KEY_STEPS, 4), uint32)
        s = cuda.local.array((N_TILES, 4), float32)
        dp = cuda.local.array((N_TILES, 4), float32)
        dcap = cuda.local.array((N_TILES, 4), float32)
        acc = cuda.local.array((D_TILES, 4), float32)
        lse2 = cuda.local.array(2, float32)       # the rows' lse in log2 units; +inf past the sequence (P = 0)
        delta_i = cuda.local.array(2, float32)
        for jd in range(D_TILES):
            for r in range(4):
                acc[jd, r] = float32(0.0)
        for half in range(2):
            row = row_top + 8 * half
            lse2[half] = inf
            delta_i[half] = float32(0.0)
            if row < seqlen_q:
                lse2[half] = lse[ab, h, q0 + row] * float32(LOG2E)
                delta_i[half] = delta[ab, h, q0 + row]

        offset = seqlen_k - seqlen_q
        last_row = min(m0 + BLOCK_M, seqlen_q) - 1
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, m0 + offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, last_row + offset + window_right + 1)
        n_start = (lo // BLOCK_N) * BLOCK_N
        warp_first = m0 + warp_row0
        full_lo = 0
        full_hi = seqlen_k - seqlen_k % BLOCK_N
        if HAS_LEFT:
            full_lo = warp_first + 15 + offset - window_left
        if HAS_RIGHT:
            full_hi = min(full_hi, warp_first + offset + window_right + 1)

        c0 = uint32(t % PER_ROW)
        r0 = uint32(t // PER_ROW)
        d0 = int32(c0 * uint32(CHUNK))
        chunk_bytes = uint32(0)
        if d0 < head_dim:
            chunk_bytes = uint32(2 * min(head_dim - d0, CHUNK))

        # Q's and then dO's fragments into registers through x_tile; the first K and V tiles meanwhile.
        for c_pass in range(X_PASSES):
            copy_x(x_tile, q, c_pass, r0, c0, chunk_bytes, q0 + m0, q0 + seqlen_q, tile_offset(q, ab, q0 + m0, h),
                   q.strides[1], ab, h)
        warp.cp_async_commit()
        n_first = n_start
        if BLOCK_TILES:   # the first tile that runs: a skipped tile's keys are never copied
            n_first = next_key_tile(tiles, b, h, tile, n_start, hi, BLOCK_N)
        if n_first < hi:
            for c_pass in range(KV_PASSES):
                copy_kv(k_tile, k, c_pass, r0, c0, chunk_bytes, k0 + n_first, k0 + seqlen_k,
                        tile_offset(k, ab, k0 + n_first, hk), k.strides[1], ab, hk)
            warp.cp_async_commit()
            for c_pass in range(KV_PASSES):
                copy_kv(v_tile, v, c_pass, r0, c0, chunk_bytes, k0 + n_first, k0 + seqlen_k,
                        tile_offset(v, ab, k0 + n_first, hk), v.strides[1], ab, hk)
            warp.cp_async_commit()
        warp.cp_async_wait_all()
        cuda.syncthreads()
        for kk in range(D_STEPS):
            a0, a1, a2, a3 = warp.ldmatrix_x4(x_tile, smem_index(warp_row0 + 8 * (lm & 1) + lr, 2 * kk + (lm >> 1)))
            q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = a0, a1, a2, a3
        cuda.syncthreads()
        for c_pass in range(X_PASSES):
            copy_x(x_tile, dout, c_pass, r0, c0, chunk_bytes, q0 + m0, q0 + seqlen_q,
                   tile_offset(dout, ab, q0 + m0, h), dout.strides[1], ab, h)
        warp.cp_async_commit()
        warp.cp_async_wait_all()
        cuda.syncthreads()
        for kk in range(D_STEPS):
            a0, a1, a2, a3 = warp.ldmatrix_x4(x_tile, smem_index(warp_row0 + 8 * (lm & 1) + lr, 2 * kk + (lm >> 1)))
            do_frag[kk, 0], do_frag[kk, 1], do_frag[kk, 2], do_frag[kk, 3] = a0, a1, a2, a3

        for n0 in range(n_start, hi, BLOCK_N):
            # One table entry for the whole block, so every warp skips together, before any barrier of the
            # iteration; no copy is in flight for a skipped tile (the prefetches go to the next tile that runs).
            skip, full_tile = tile_skip(tiles, b, h, tile, n0 // BLOCK_N)
            if skip:   # mask_mod hides every key: K and V never read
                continue
            # K and V of this tile are in (copied at the end of the last iteration, or before the loop); each thread
            # tests the K chunks it copied, and the barrier that publishes the tiles ORs the answer.
            warp.cp_async_wait_all()
            probe = uint32(0)
            for c_pass in range(KV_PASSES):
                r = r0 + uint32(c_pass * ROW_STEP)
                if r < uint32(BLOCK_N):
                    w0, w1, w2, w3 = warp.lds_v4(k_tile, smem_index(r, c0))
                    probe = PROBE(PROBE(PROBE(PROBE(probe, w0), w1), w2), w3)
            probe_nan = ((probe & uint32(0x7FFF)) > uint32(EXP)) | (((probe >> uint32(16)) & uint32(0x7FFF))
                                                                    > uint32(EXP))
            k_nonfinite = cuda.syncthreads_or(int32(probe_nan))
            kept = uint64(0)
            if DROPOUT:   # the forward's keep mask, ahead of the products (tc_scores.make_keep_bits)
                kept = keep_bits(seed_lo, seed_hi, threshold, b + batch0, h, row_top, n0 + lane_col)

            # S = Q K^T and dP = dO V^T, side by side: the same B-fragment pattern on two tiles.
            for j in range(N_TILES):
                for r in range(4):
                    s[j, r] = float32(0.0)
                    dp[j, r] = float32(0.0)
            for kk in range(D_STEPS):
                for jp in range(N_TILES // 2):
                    at = smem_index(16 * jp + 8 * (lm >> 1) + lr, 2 * kk + (lm & 1))
                    j = 2 * jp
                    b0, b1, b2, b3 = warp.ldmatrix_x4(k_tile, at)
                    s[j, 0], s[j, 1], s[j, 2], s[j, 3] = MMA(q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2],
                                                             q_frag[kk, 3], b0, b1, s[j, 0], s[j, 1], s[j, 2],
                                                             s[j, 3])
                    s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3] = MMA(
                        q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3], b2, b3,
                        s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3])
                    b0, b1, b2, b3 = warp.ldmatrix_x4(v_tile, at)
                    dp[j, 0], dp[j, 1], dp[j, 2], dp[j, 3] = MMA(do_frag[kk, 0], do_frag[kk, 1], do_frag[kk, 2],
                                                                 do_frag[kk, 3], b0, b1, dp[j, 0], dp[j, 1],
                                                                 dp[j, 2], dp[j, 3])
                    dp[j + 1, 0], dp[j + 1, 1], dp[j + 1, 2], dp[j + 1, 3] = MMA(
                        do_frag[kk, 0], do_frag[kk, 1], do_frag[kk, 2], do_frag[kk, 3], b2, b3,
                        dp[j + 1, 0], dp[j + 1, 1], dp[j + 1, 2], dp[j + 1, 3])

            # P as the forward made it, and dS = P (dP - delta) dcap; a masked pair gets 0 for both by a select.
            for half in range(2):
                row = row_top + 8 * half
                distance0 = float32(row + offset - lane_col - n0)
                for j in range(N_TILES):
                    for c in range(2):
                        col = 8 * j + c
                        x, dc = score(s[j, 2 * half + c], qmult, capmult, slope, distance0 - float32(col), bias_h,
                                      row, n0 + lane_col + col, b, h, seqlen_q, seqlen_k, not full_tile)
                        s[j, 2 * half + c] = hidden_p(x, lse2[half])
                        dcap[j, 2 * half + c] = dc
            tile_edge = (n0 < full_lo) | (n0 + BLOCK_N > full_hi)
            if tile_edge:
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
                            col = 8 * j + c
                            seen = (col >= first) & (col <= last)
                            s[j, 2 * half + c] = s[j, 2 * half + c] if seen else float32(-0.0)
            for j in range(N_TILES):
                for r in range(4):
                    # A hidden pair's P is -0.0 (tc_scores.hidden_p): the select keeps a NaN of dP out of its dS, a
                    # product would not.
                    dp_kept = dp[j, r] * kept_factor(kept, 4 * j + r, dscale)
                    ds = s[j, r] * (dp_kept - delta_i[r >> 1]) * dcap[j, r]
                    s[j, r] = float32(0.0) if is_hidden(s[j, r]) else ds
            for kk in range(KEY_STEPS):
                ds_frag[kk, 0] = PACK(s[2 * kk, 0], s[2 * kk, 1])
                ds_frag[kk, 1] = PACK(s[2 * kk, 2], s[2 * kk, 3])
                ds_frag[kk, 2] = PACK(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                ds_frag[kk, 3] = PACK(s[2 * kk + 1, 2], s[2 * kk + 1, 3])

            if k_nonfinite:
                # Rare: K holds an inf or NaN. Zero it for dQ's product (a masked pair's dS = 0 times inf is NaN);
                # the rows that see the key are NaN already (their lse is).
                cuda.syncthreads()               # every warp's scores are done with the tile
                for c_pass in range(KV_PASSES):
                    r = r0 + uint32(c_pass * ROW_STEP)
                    if r < uint32(BLOCK_N):
                        at = smem_index(r, c0)
                        for e in range(CHUNK):
                            if (k_tile[at + uint32(e)] & uint16(EXP)) == uint16(EXP):
                                k_tile[at + uint32(e)] = uint16(0)
                cuda.syncthreads()

            # dQ += dS K: one transposing ldmatrix gives K's B fragments for two 8-column tiles of dQ.
            for kk in range(KEY_STEPS):
                for jdp in range(D_TILES // 2):
                    b0, b1, b2, b3 = warp.ldmatrix_x4_trans(k_tile, smem_index(16 * kk + 8 * (lm & 1) + lr,
                                                                              2 * jdp + (lm >> 1)))
                    jd = 2 * jdp
                    acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3] = MMA(
                        ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b0, b1,
                        acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3])
                    acc[jd + 1, 0], acc[jd + 1, 1], acc[jd + 1, 2], acc[jd + 1, 3] = MMA(
                        ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b2, b3,
                        acc[jd + 1, 0], acc[jd + 1, 1], acc[jd + 1, 2], acc[jd + 1, 3])

            cuda.syncthreads()                   # every warp is done with both tiles: the next ones may land
            n_next = n0 + BLOCK_N
            if BLOCK_TILES:
                n_next = next_key_tile(tiles, b, h, tile, n_next, hi, BLOCK_N)
            if n_next < hi:
                for c_pass in range(KV_PASSES):
                    copy_kv(k_tile, k, c_pass, r0, c0, chunk_bytes, k0 + n_next, k0 + seqlen_k,
                            tile_offset(k, ab, k0 + n_next, hk), k.strides[1], ab, hk)
                    copy_kv(v_tile, v, c_pass, r0, c0, chunk_bytes, k0 + n_next, k0 + seqlen_k,
                            tile_offset(v, ab, k0 + n_next, hk), v.strides[1], ab, hk)
                warp.cp_async_commit()

        # dQ = scale * the sum, through shared memory (x_tile) as the forward's output.
        cuda.syncthreads()
        for jd in range(D_TILES):
            for half in range(2):
                x0 = acc[jd, 2 * half] * scale
                x1 = acc[jd, 2 * half + 1] * scale
                warp.sts_u32(x_tile, smem_index(warp_row0 + int32(g) + 8 * half, jd) + 2 * tq,
                             PACK(x0 + x0 * float32(0.0), x1 + x1 * float32(0.0)))
        cuda.syncthreads()
        for c_pass in range(X_PASSES):
            r = r0 + uint32(c_pass * ROW_STEP)
            row = m0 + int32(r)
            if r < uint32(BLOCK_M) and row < seqlen_q:
                at = smem_index(r, c0)
                for e in range(CHUNK):
                    if d0 + e < head_dim:
                        dq[ab, q0 + row, h, d0 + e] = x_tile[at + uint32(e)]

    return cuda.jit(flash_tc_dq_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_tc_dq_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout,
                             v.async_copy, v.mods, **v.factory_switches())
