"""The tensor-core dK/dV kernel (float16 and bfloat16, compute capability >= 8.0): one block per (key tile, kv
head, batch), looping over the query heads of its GQA group and the query tiles that see its keys, so that dK and dV
are summed over the group in registers, no atomics.

Each warp owns 16 keys and computes everything transposed, keys as rows: ``S^T = K Q^T`` (K's fragments the A
operand, Q's rows the B operand), ``P^T = exp2(s - lse)`` with each query's lse read from shared memory,
``dP^T = V dO^T``, ``dS^T = P^T (dP^T - delta)`` (times softcap's derivative), then ``dV += P^T dO`` and
``dK += dS^T Q``: P^T's and dS^T's C fragments become A fragments in registers, packed to 16 bits, and dO and Q are
read transposed. Scores come from tc_scores.py, as the forward's and the dQ kernel's.

The non-finite rule (masks.py): masked pairs get P = dS = 0 by a select. What a select cannot reach is the two
products multiplying a masked pair's 0 by an inf or NaN of dO (into dV) or of Q (into dK). A Q or dO tile that holds
one (each thread tests the chunks it copied) has it zeroed after the products that need its values and before those
two. For Q that is all: the rows that see the key have NaN in their dS (their lse is NaN). dO's does not reach dS's
NaN through dV, so after the loop the keys seen by a row whose dO holds one get NaN in those columns of dV.

Arrays reach the kernel as (B, S, H, D) uint16 views of the float16 or bfloat16 data (any strides; the
``async_copy`` kernel needs unit stride along D and 16-byte aligned rows); lse and delta are (B, Hq, Sq) float32.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import config, cuda, float32, int32, uint16, uint32, uint64

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.block_tiles import make_tile_skip
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.device.dtypes import load_bf16, load_f16_bits
from numba_flash.cuda.device.masks import LOG2E, bias_head, make_score_mod_hides, make_visible
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.kernels.tc_forward import EXPONENT_BITS, QUIET_NAN_BITS, tile_offset
from numba_flash.cuda.device.tc_scores import hidden_p, is_hidden, make_keep_bits, make_kept_factor, make_score
from numba_flash.cuda.device.tc_tiles import CHUNK, copy_passes, copy_row_step, make_smem_index, make_tile_copy
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

SMEM_ALIGN = None if config.ENABLE_CUDASIM else 16


@functools.lru_cache(maxsize=None)
def make_tc_dkdv_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                        alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                        async_copy: bool = True, mods: CudaMods = NO_MODS, varlen: bool = False) -> Any:
    """The tensor-core dK/dV kernel for one tile config, mask kind and element kind (a ``numba.cuda`` dispatcher).
    ``block_n`` keys (16 per warp) per block, ``block_m`` queries per step of its loop.

    Launch with grid ``(ceil(Sk / block_n), Hkv, B)`` and ``cfg.threads`` threads, arguments as the float32 dK/dV
    kernel's (backward.py) except that q, dout (B, Sq, Hq, D), k, v, dk, dv (B, Sk, Hkv, D) are uint16 bit patterns
    of float16 (or, with ``bf16``, bfloat16) data; dropout's arguments are read only with ``dropout``: the
    forward's keep mask regenerated, dV takes the kept probabilities ``z P`` and dS^T is ``P (z dP - delta)``, ``z``
    = 1 / (1 - p) where kept, 0 where dropped. With ``mods.block_tiles`` the query-tile loop skips the tiles the
    BlockMask's table (``tiles``) calls EMPTY and scores FULL ones without mask_mod."""
    why = cfg.problems(1 << 62)
    if why or (cfg.spec.role, cfg.spec.kind) != ("dkdv", "mma"):
        raise ValueError(f"{cfg}: " + ("; ".join(why) or "not a tensor-core dK/dV config"))
    BLOCK_M, BLOCK_N, HEAD_DIM, NT = cfg.block_m, cfg.block_n, cfg.head_dim_bucket, cfg.threads
    D_STEPS, M_TILES, QUERY_STEPS, D_TILES = HEAD_DIM // 16, BLOCK_M // 8, BLOCK_M // 16, HEAD_DIM // 8
    X_WORDS, KV_WORDS = BLOCK_M * HEAD_DIM, BLOCK_N * HEAD_DIM
    X_PASSES, KV_PASSES = copy_passes(BLOCK_M, HEAD_DIM, NT), copy_passes(BLOCK_N, HEAD_DIM, NT)
    PER_ROW, ROW_STEP = HEAD_DIM // CHUNK, copy_row_step(HEAD_DIM, NT)
    HAS_LEFT, HAS_RIGHT, ALIBI, DROPOUT = has_left, has_right, alibi, dropout
    EXP, NAN_BITS = EXPONENT_BITS[bf16], QUIET_NAN_BITS[bf16]
    ALIGN = SMEM_ALIGN
    MMA = warp.mma_bf16 if bf16 else warp.mma_f16
    PACK = warp.pack_bf16x2 if bf16 else warp.pack_f16x2
    PROBE = warp.probe_bf16x2 if bf16 else warp.probe_f16x2
    copy_x = make_tile_copy(BLOCK_M, HEAD_DIM, NT, async_copy)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, NT, async_copy)
    smem_index = make_smem_index(HEAD_DIM)
    score = make_score(softcap, alibi, has_bias, mods)
    tile_skip = make_tile_skip(mods.block_tiles)
    locate = make_locate(varlen)
    kept_factor = make_kept_factor(dropout)
    keep_bits = make_keep_bits(M_TILES, transposed=True)
    sees = make_visible(has_left, has_right, has_bias, mods)
    score_mod_hides = make_score_mod_hides(softcap, alibi, has_bias, mods, load_bf16 if bf16 else load_f16_bits)

    def flash_tc_dkdv_kernel(q, k, v, dout, lse, delta, dk, dv, seqlen_q, seqlen_k, head_dim, group, window_left,
                             window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                             batch0, tiles, seqs):
        inf = float32(math.inf)
        t = cuda.threadIdx.x
        lane = uint32(t % 32)
        warp_key0 = 16 * (t // 32)                 # this warp's first key in the tile
        g, tq = lane >> uint32(2), lane & uint32(3)
        lm, lr = lane >> uint32(3), lane & uint32(7)
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        n0 = tile * BLOCK_N
        hk = cuda.blockIdx.y
        key_top = n0 + warp_key0 + int32(g)        # the keys of registers 0, 1; registers 2, 3 hold key_top + 8
        lane_col = 2 * int32(tq)                   # this lane's first query in every 8-query tile

        k_tile = cuda.shared.array(KV_WORDS, uint16, alignment=ALIGN)   # K, then dK on the way out
        v_tile = cuda.shared.array(KV_WORDS, uint16, alignment=ALIGN)   # V, then dV
        q_tile = cuda.shared.array(X_WORDS, uint16, alignment=ALIGN)
        do_tile = cuda.shared.array(X_WORDS, uint16, alignment=ALIGN)
        lse_s = cuda.shared.array(BLOCK_M, float32)      # the queries' lse in log2 units (+inf past the sequence)
        delta_s = cuda.shared.array(BLOCK_M, float32)

        s = cuda.local.array((M_TILES, 4), float32)
        dp = cuda.local.array((M_TILES, 4), float32)
        dcap = cuda.local.array((M_TILES, 4), float32)
        p_frag = cuda.local.array((QUERY_STEPS, 4), uint32)
        ds_frag = cuda.local.array((QUERY_STEPS, 4), uint32)
        dk_acc = cuda.local.array((D_TILES, 4), float32)
        dv_acc = cuda.local.array((D_TILES, 4), float32)
        for jd in range(D_TILES):
            for r in range(4):
                dk_acc[jd, r] = float32(0.0)
                dv_acc[jd, r] = float32(0.0)

        # Query rows that can see any key of the tile: row i sees key j iff j - offset - right <= i <= j - offset
        # + left.
        offset = seqlen_k - seqlen_q
        last_key = min(n0 + BLOCK_N, seqlen_k) - 1
        i_lo = 0
        i_hi = seqlen_q
        if HAS_RIGHT:
            i_lo = max(0, n0 - offset - window_right)
        if HAS_LEFT:
            i_hi = min(seqlen_q, last_key - offset + window_left + 1)
        m_start = (i_lo // BLOCK_M) * BLOCK_M
        warp_first = n0 + warp_key0

        c0 = uint32(t % PER_ROW)
        r0 = uint32(t // PER_ROW)
        d0 = int32(c0 * uint32(CHUNK))
        chunk_bytes = uint32(0)
        if d0 < head_dim:
            chunk_bytes = uint32(2 * min(head_dim - d0, CHUNK))
        for c_pass in range(KV_PASSES):
            copy_kv(k_tile, k, c_pass, r0, c0, chunk_bytes, k0 + n0, k0 + seqlen_k, tile_offset(k, ab, k0 + n0, hk),
                    k.strides[1], ab, hk)
            copy_kv(v_tile, v, c_pass, r0, c0, chunk_bytes, k0 + n0, k0 + seqlen_k, tile_offset(v, ab, k0 + n0, hk),
                    v.strides[1], ab, hk)
        warp.cp_async_commit()
        do_nonfinite_seen = False

        for g_head in range(group):
            h = hk * group + g_head
            slope = float32(0.0)
            if ALIBI:
                slope = slopes[b, h]
            bias_h = bias_head(bias, b, h)
            for m0 in range(m_start, i_hi, BLOCK_M):
                # One table entry for the whole block (the transposed look-up: query tile m0, this block's key
                # tile), so every warp skips together; a skipped tile copies nothing, so skipping this
                # iteration's barriers is safe.
                skip, full_tile = tile_skip(tiles, b, h, m0 // BLOCK_M, tile)
                if skip:   # mask_mod hides every pair: Q and dO never read
                    continue
                cuda.syncthreads()               # every warp is done with the last step's Q and dO tiles
                for c_pass in range(X_PASSES):
                    copy_x(q_tile, q, c_pass, r0, c0, chunk_bytes, q0 + m0, q0 + seqlen_q,
                           tile_offset(q, ab, q0 + m0, h), q.strides[1], ab, h)
                    copy_x(do_tile, dout, c_pass, r0, c0, chunk_bytes, q0 + m0, q0 + seqlen_q,
                           tile_offset(dout, ab, q0 + m0, h), dout.strides[1], ab, h)
                warp.cp_async_commit()
                for r in range(t, BLOCK_M, NT):
                    row = m0 + r
                    lse_s[r] = lse[ab, h, q0 + row] * float32(LOG2E) if row < seqlen_q else inf
                    delta_s[r] = delta[ab, h, q0 + row] if row < seqlen_q else float32(0.0)
                warp.cp_async_wait_all()
                # Each thread tests the Q and dO chunks it copied; the barrier that publishes the tiles ORs it.
                probe = uint32(0)
                for c_pass in range(X_PASSES):
                    r = r0 + uint32(c_pass * ROW_STEP)
                    if r < uint32(BLOCK_M):
                        at = smem_index(r, c0)
                        w0, w1, w2, w3 = warp.lds_v4(q_tile, at)
                        probe = PROBE(PROBE(PROBE(PROBE(probe, w0), w1), w2), w3)
                        w0, w1, w2, w3 = warp.lds_v4(do_tile, at)
                        probe = PROBE(PROBE(PROBE(PROBE(probe, w0), w1), w2), w3)
                probe_nan = ((probe & uint32(0x7FFF)) > uint32(EXP)) | (((probe >> uint32(16)) & uint32(0x7FFF))
                                                                        > uint32(EXP))
                x_nonfinite = cuda.syncthreads_or(int32(probe_nan))
                kept = uint64(0)
                if DROPOUT:   # the forward's keep mask, transposed like the scores, ahead of the products
                    kept = keep_bits(seed_lo, seed_hi, threshold, b + batch0, h, key_top, m0 + lane_col)

                # S^T = K Q^T and dP^T = V dO^T: K's and V's rows are the A operands (read per step: keeping both in
                # registers beside two accumulators would spill), Q's and dO's rows the B ones.
                for j in range(M_TILES):
                    for r in range(4):
                        s[j, r] = float32(0.0)
                        dp[j, r] = float32(0.0)
                for kk in range(D_STEPS):
                    a_at = smem_index(warp_key0 + 8 * (lm & 1) + lr, 2 * kk + (lm >> 1))
                    a0, a1, a2, a3 = warp.ldmatrix_x4(k_tile, a_at)
                    e0, e1, e2, e3 = warp.ldmatrix_x4(v_tile, a_at)
                    for jp in range(M_TILES // 2):
                        at = smem_index(16 * jp + 8 * (lm >> 1) + lr, 2 * kk + (lm & 1))
                        j = 2 * jp
                        b0, b1, b2, b3 = warp.ldmatrix_x4(q_tile, at)
                        s[j, 0], s[j, 1], s[j, 2], s[j, 3] = MMA(a0, a1, a2, a3, b0, b1,
                                                                 s[j, 0], s[j, 1], s[j, 2], s[j, 3])
                        s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3] = MMA(
                            a0, a1, a2, a3, b2, b3, s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3])
                        b0, b1, b2, b3 = warp.ldmatrix_x4(do_tile, at)
                        dp[j, 0], dp[j, 1], dp[j, 2], dp[j, 3] = MMA(e0, e1, e2, e3, b0, b1,
                                                                     dp[j, 0], dp[j, 1], dp[j, 2], dp[j, 3])
                        dp[j + 1, 0], dp[j + 1, 1], dp[j + 1, 2], dp[j + 1, 3] = MMA(
                            e0, e1, e2, e3, b2, b3, dp[j + 1, 0], dp[j + 1, 1], dp[j + 1, 2], dp[j + 1, 3])

                # P^T and dS^T; the pair (query row, key) of element (key half, query col) is seen per the band.
                for half in range(2):
                    key = key_top + 8 * half
                    distance0 = float32(m0 + lane_col + offset - key)
                    for j in range(M_TILES):
                        for c in range(2):
                            col = 8 * j + c
                            x, dc = score(s[j, 2 * half + c], qmult, capmult, slope, distance0 + float32(col),
                                          bias_h, m0 + lane_col + col, key, b, h, seqlen_q, seqlen_k, not full_tile)
                            s[j, 2 * half + c] = hidden_p(x, lse_s[lane_col + col])
                            dcap[j, 2 * half + c] = dc
                # Every pair of the step is in the band unless a key of the warp is right of the first row's right
                # bound or left of the last row's left bound.
                tile_edge = False
                if HAS_RIGHT:
                    tile_edge = tile_edge | (warp_first + 15 > m0 + offset + window_right)
                if HAS_LEFT:
                    tile_edge = tile_edge | (warp_first < m0 + BLOCK_M - 1 + offset - window_left)
                if tile_edge:
                    for half in range(2):
                        key = key_top + 8 * half
                        first = -m0 - lane_col          # queries of the band, from the lane's first column
                        last = seqlen_q - 1 - m0 - lane_col
                        if HAS_RIGHT:
                            first = max(first, key - offset - window_right - m0 - lane_col)
                        if HAS_LEFT:
                            last = min(last, key - offset + window_left - m0 - lane_col)
                        for j in range(M_TILES):
                            for c in range(2):
                                col = 8 * j + c
                                seen = (col >= first) & (col <= last)
                                s[j, 2 * half + c] = s[j, 2 * half + c] if seen else float32(-0.0)
                # dV takes the kept probabilities, scaled, as the forward's P V did. Register r of step kk's A
                # fragment packs scores 8 kk + 2 r and the next: C registers 2 (r & 1) and the next of 8-query tile
                # 2 kk + (r >> 1).
                for kk in range(QUERY_STEPS):
                    for r in range(4):
                        j, c = 2 * kk + (r >> 1), 2 * (r & 1)
                        p_frag[kk, r] = PACK(s[j, c] * kept_factor(kept, 8 * kk + 2 * r, dscale),
                                             s[j, c + 1] * kept_factor(kept, 8 * kk + 2 * r + 1, dscale))
                for j in range(M_TILES):
                    for r in range(4):
                        # A hidden pair's P is -0.0 (tc_scores.hidden_p): the select keeps a NaN of dP out of its
                        # dS, a product would not.
                        dp_kept = dp[j, r] * kept_factor(kept, 4 * j + r, dscale)
                        ds = s[j, r] * (dp_kept - delta_s[lane_col + 8 * j + (r & 1)]) * dcap[j, r]
                        s[j, r] = float32(0.0) if is_hidden(s[j, r]) else ds
                for kk in range(QUERY_STEPS):
                    ds_frag[kk, 0] = PACK(s[2 * kk, 0], s[2 * kk, 1])
                    ds_frag[kk, 1] = PACK(s[2 * kk, 2], s[2 * kk, 3])
                    ds_frag[kk, 2] = PACK(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                    ds_frag[kk, 3] = PACK(s[2 * kk + 1, 2], s[2 * kk + 1, 3])

                if x_nonfinite:
                    # Rare: Q or dO holds an inf or NaN. Zero them for the two products below (a masked pair's 0
                    # times inf is NaN); the rows that see them have NaN in their dS already, and dV's columns that
                    # dO's non-finite values reach are made NaN after the loop.
                    cuda.syncthreads()           # every warp's scores are done with the tiles
                    for c_pass in range(X_PASSES):
                        r = r0 + uint32(c_pass * ROW_STEP)
                        if r < uint32(BLOCK_M):
                            at = smem_index(r, c0)
                            for e in range(CHUNK):
                                if (q_tile[at + uint32(e)] & uint16(EXP)) == uint16(EXP):
                                    q_tile[at + uint32(e)] = uint16(0)
                                if (do_tile[at + uint32(e)] & uint16(EXP)) == uint16(EXP):
                                    do_tile[at + uint32(e)] = uint16(0)
                                    do_nonfinite_seen = True
                    do_nonfinite_seen = cuda.syncthreads_or(int32(do_nonfinite_seen)) != 0

                # dV += P^T dO and dK += dS^T Q: one transposing ldmatrix gives two 8-column tiles' B fragments.
                for kk in range(QUERY_STEPS):
                    for jdp in range(D_TILES // 2):
                        at = smem_index(16 * kk + 8 * (lm & 1) + lr, 2 * jdp + (lm >> 1))
                        jd = 2 * jdp
                        b0, b1, b2, b3 = warp.ldmatrix_x4_trans(do_tile, at)
                        dv_acc[jd, 0], dv_acc[jd, 1], dv_acc[jd, 2], dv_acc[jd, 3] = MMA(
                            p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], b0, b1,
                            dv_acc[jd, 0], dv_acc[jd, 1], dv_acc[jd, 2], dv_acc[jd, 3])
                        dv_acc[jd + 1, 0], dv_acc[jd + 1, 1], dv_acc[jd + 1, 2], dv_acc[jd + 1, 3] = MMA(
                            p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], b2, b3,
                            dv_acc[jd + 1, 0], dv_acc[jd + 1, 1], dv_acc[jd + 1, 2], dv_acc[jd + 1, 3])
                        b0, b1, b2, b3 = warp.ldmatrix_x4_trans(q_tile, at)
                        dk_acc[jd, 0], dk_acc[jd, 1], dk_acc[jd, 2], dk_acc[jd, 3] = MMA(
                            ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b0, b1,
                            dk_acc[jd, 0], dk_acc[jd, 1], dk_acc[jd, 2], dk_acc[jd, 3])
                        dk_acc[jd + 1, 0], dk_acc[jd + 1, 1], dk_acc[jd + 1, 2], dk_acc[jd + 1, 3] = MMA(
                            ds_frag[kk, 0], ds_frag[kk, 1], ds_frag[kk, 2], ds_frag[kk, 3], b2, b3,
                            dk_acc[jd + 1, 0], dk_acc[jd + 1, 1], dk_acc[jd + 1, 2], dk_acc[jd + 1, 3])

        # dK = scale * its sum and dV through shared memory (K's and V's tiles, free now), as the forward's output.
        cuda.syncthreads()
        for jd in range(D_TILES):
            for half in range(2):
                row = warp_key0 + int32(g) + 8 * half
                x0, x1 = dk_acc[jd, 2 * half] * scale, dk_acc[jd, 2 * half + 1] * scale
                warp.sts_u32(k_tile, smem_index(row, jd) + 2 * tq,
                             PACK(x0 + x0 * float32(0.0), x1 + x1 * float32(0.0)))
                x0, x1 = dv_acc[jd, 2 * half], dv_acc[jd, 2 * half + 1]
                warp.sts_u32(v_tile, smem_index(row, jd) + 2 * tq,
                             PACK(x0 + x0 * float32(0.0), x1 + x1 * float32(0.0)))
        if do_nonfinite_seen:
            # Each key seen by a row whose dO holds an inf or NaN gets NaN in that column of dV (p * inf or p * NaN
            # is not finite whatever p is), read again from global memory: once per block, and only then. Written
            # over the staged dV by the lane that staged it.
            for g_head in range(group):
                h = hk * group + g_head
                bias_h = bias_head(bias, b, h)
                slope = float32(0.0)
                if ALIBI:
                    slope = slopes[b, h]
                for row in range(i_lo, i_hi):
                    for half in range(2):
                        key_row = warp_key0 + int32(g) + 8 * half
                        if sees(row, n0 + key_row, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b,
                                h) and not score_mod_hides(q, k, b, h, hk, row, n0 + key_row, head_dim, qmult, capmult,
                                                           slope, offset, bias_h, seqlen_q, seqlen_k):
                            for d in range(lane_col, head_dim):
                                if (d - lane_col) % 8 < 2 and (dout[ab, q0 + row, h, d] & uint16(EXP)) == uint16(EXP):
                                    v_tile[smem_index(key_row, d // 8) + uint32(d % 8)] = uint16(NAN_BITS)
        cuda.syncthreads()
        for c_pass in range(KV_PASSES):
            r = r0 + uint32(c_pass * ROW_STEP)
            key = n0 + int32(r)
            if r < uint32(BLOCK_N) and key < seqlen_k:
                at = smem_index(r, c0)
                for e in range(CHUNK):
                    if d0 + e < head_dim:
                        dk[ab, k0 + key, hk, d0 + e] = k_tile[at + uint32(e)]
                        dv[ab, k0 + key, hk, d0 + e] = v_tile[at + uint32(e)]

    return cuda.jit(flash_tc_dkdv_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_tc_dkdv_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout,
                               v.async_copy, v.mods, **v.factory_switches())
