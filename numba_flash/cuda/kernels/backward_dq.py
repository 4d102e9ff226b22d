"""The backward's dQ kernel: one block per (query tile, query head, batch), looping over the key tiles its rows
can see. The layout and the score pipeline are the dK/dV kernel's (backward.py's docstring); here the score block's
columns (keys) are interleaved and its rows in runs, so that dS is stored key-major (dS^T) with one 128-bit store
per run and the product dQ += dS K reads a run of dS^T and a run of K per key. Per key tile the kernel passes 3
barriers: before its loads, after them (which also ORs K's non-finite probe), and after writing dS^T.
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level (not in the factories): see backward.py.
from numba import cuda, float32, int32, uint64

from numba_flash.cuda.device.block_tiles import make_tile_skip
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.kernels.layout import padded_stride
from numba_flash.cuda.device.dtypes import element_io
from numba_flash.cuda.kernels.forward import SMEM_ALIGN
from numba_flash.cuda.device.masks import (bias_head, make_bias_tile, make_dbias_add, make_dropout_tile,
                                           make_score_grads, make_slot_sums, nan_if_not_finite,
                                           row_softmax_terms)
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.device.smem import carve
from numba_flash.cuda.device.tiles import FETCH_VECTOR, checked_grids, make_tile_fetch, product_steps, tile_passes
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                   alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                   mods: CudaMods = NO_MODS, varlen: bool = False, dbias: str = "") -> Any:
    """dQ: one block per (query tile, query head, batch), looping over the key tiles its rows can see.

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments:
      q (B, Sq, Hq, D), dout (B, Sq, Hq, Dv), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): float32 or float16 (int16
      bfloat16 bits with ``bf16``), any strides; D and Dv at most the bucket (Dv is read from v's shape);
      lse, delta (B, Hq, Sq) float32; dq (B, Sq, Hq, D) like q;
      seqlen_q, seqlen_k, head_dim (D), group, window_left, window_right: ints;
      qmult, capmult, scale: float32, slopes and bias float32, the dropout scalars and tiles (as for the dK/dV
      kernel). With ``mods.block_tiles`` the key-tile loop skips the tiles the BlockMask's table calls EMPTY and
      stages FULL ones without mask_mod;
      seqs: int32 (n_blocks, 6), packed sequences' block table, read only with ``varlen`` (as the forward's);
      dbias: float32, C-contiguous, read only with ``dbias``, into which attn_bias's gradient is added:
        ``dbias="pairs"``: each pair's, (B or 1, Hq, Sq, Sk), each element by one thread of one block per launch
        (flash.flash_backward launches once per batch entry, in order, when the bias is shared by the batch);
        ``dbias="per_row"``: each row's sum over its keys, (B, Hq, Sq, 1), the gradient of a bias broadcast over
        the keys: a thread sums its own scores of a row across the key tiles, and at the end the block adds its
        threads' partial sums of each row in a fixed order, so no atomics and the same bits every run;
      batch_base, head_base: int, the call's batch entry and query head of this launch's first (a launch of one
        slice of a larger call, launch_dbias.dq_per_shared_slice; else 0): the indices the user's mods, the
        BlockMask and dropout's mask see are the call's, not the slice's;
      row_stats, stats_on: the forward's row statistics (2, B, Hq, Sq) float32 and whether to read them
        (masks.row_softmax_terms; any 4-dimensional float32 array and 0 otherwise).
    Q is scaled by qmult on load and its scores summed in ``cfg.score_split`` parts, as the forward's are.
    """
    BLOCK_M, BLOCK_N, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    (S_TR, S_TC), (O_TR, O_TC) = checked_grids(cfg, cfg.out_grid)
    SPLIT = cfg.score_split                           # as in the dK/dV kernel
    GT, DK = NT // SPLIT, DB // SPLIT
    S_TM, S_TN = BLOCK_M // S_TR, BLOCK_N // S_TC     # score block: rows in runs, columns interleaved
    O_TM, O_TD = BLOCK_M // O_TR, DB // O_TC          # dQ block: rows and head-dim columns, both in runs
    # The dQ product runs in A_SPLIT groups of AT threads, each over N_PART keys of a tile into its own dQ partial
    # (config.accumulator_split).
    A_SPLIT = cfg.accumulator_split
    AT, N_PART = NT // A_SPLIT, BLOCK_N // A_SPLIT
    S_RM, O_RM, O_RD = min(S_TM, 4), min(O_TM, 4), min(O_TD, 4)
    S_GAP_M, O_GAP_M, O_GAP_D = S_RM * S_TR, O_RM * O_TR, O_RD * O_TC
    # With SPLIT > 1 each thread sums the parts of E scores, runs of R query rows of one key.
    E = BLOCK_M * BLOCK_N // NT
    R = min(E, 4, BLOCK_M)
    RUNS, RUNS_PER_KEY = E // R, BLOCK_M // R
    ROWS = R * RUNS if SPLIT > 1 else S_TM            # query rows whose lse and delta a thread needs
    # dbias="per_row": the threads that hold scores of one row, one partial sum each (a slot of dS^T's buffer)
    ROW_SLOTS = BLOCK_N if SPLIT > 1 else S_TC
    # Flat shared arrays, row-major: Q, dO (BLOCK_M x LD), K, V (BLOCK_N x LD); dS^T, dropout's factors and each
    # part of S^T and dP^T (BLOCK_N x LM).
    LD, LM = padded_stride(DB), padded_stride(BLOCK_M)
    X_WORDS, KV_WORDS, T_WORDS = BLOCK_M * LD, BLOCK_N * LD, BLOCK_N * LM
    PARTS_WORDS = SPLIT * T_WORDS if SPLIT > 1 else 1
    V4, ALIGN = FETCH_VECTOR, SMEM_ALIGN
    D_STEP, N_STEP = product_steps(S_TM * S_TN, DK), product_steps(O_TM * O_TD, N_PART, 1)
    HAS_LEFT, HAS_RIGHT, ALIBI, STAGED, DROPOUT = has_left, has_right, alibi, has_bias or mods.stages_tile, dropout
    Z_WORDS = T_WORDS if dropout else 1
    DYNAMIC = cfg.dynamic_smem
    USED_PARTS = PARTS_WORDS if SPLIT > 1 else 0
    Q_AT, DO_AT, K_AT, V_AT, DS_AT, Z_AT, SP_AT, DP_AT = carve(X_WORDS, X_WORDS, KV_WORDS, KV_WORDS, T_WORDS,
                                                               T_WORDS if dropout else 0, USED_PARTS, USED_PARTS)
    STORE = element_io(bf16)[1]
    grads = make_score_grads(has_left, has_right, softcap, alibi, has_bias, dropout, mods)
    load_bias = make_bias_tile(BLOCK_M, BLOCK_N, NT, True, LM, has_bias, mods)
    tile_skip = make_tile_skip(mods.block_tiles)
    locate = make_locate(varlen)
    assert dbias in ("", "pairs", "per_row"), dbias
    add_dbias, DBIAS_PER_ROW = make_dbias_add(dbias == "pairs"), dbias == "per_row"
    sum_row_slots = make_slot_sums(True, SPLIT, NT, RUNS, RUNS_PER_KEY, R, LM, S_TM, S_RM, S_GAP_M, ROW_SLOTS, BLOCK_M)
    dropout_factors = make_dropout_tile(BLOCK_M, BLOCK_N, NT, LM, True)
    X_PASSES, KV_PASSES = tile_passes(BLOCK_M, DB, NT), tile_passes(BLOCK_N, DB, NT)
    fetch_x = make_tile_fetch(BLOCK_M, DB, NT, bf16, LD, False, True)    # query side: Q, dO
    fetch_kv = make_tile_fetch(BLOCK_N, DB, NT, bf16, LD, False, True)   # key side: K, V

    def flash_dq_kernel(q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, head_dim, group, window_left,
                        window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                        batch0, tiles, seqs, dbias, batch_base, head_base, row_stats, stats_on):
        t = cuda.threadIdx.x
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        m0 = tile * BLOCK_M
        h = cuda.blockIdx.y
        hk = h // group
        head_dim_v = v.shape[3]   # Dv, V's and dO's head dim; Q and K have head_dim (both <= DB)
        slope = float32(0.0)
        if ALIBI:
            slope = slopes[b, h]
        bias_h = bias_head(bias, b, h)
        dbias_h = bias_head(dbias, b, h)
        # The call's batch entry and query head where this launch is a slice of the call (launch_dbias): what the
        # user's mods, the BlockMask's table and dropout's mask take. The arrays, sliced, take b and h.
        cb = b + batch_base
        ch = h + head_base

        if DYNAMIC:   # past 48 KiB: one dynamic buffer (smem.py), carved at compile-time offsets
            smem = cuda.shared.array(0, float32, alignment=ALIGN)
            q_s = smem[Q_AT[0]:Q_AT[1]]
            do_s = smem[DO_AT[0]:DO_AT[1]]
            k_s = smem[K_AT[0]:K_AT[1]]
            v_s = smem[V_AT[0]:V_AT[1]]
            ds_t = smem[DS_AT[0]:DS_AT[1]]
            z_t = smem[Z_AT[0]:Z_AT[1]]
            s_parts = smem[SP_AT[0]:SP_AT[1]]
            dp_parts = smem[DP_AT[0]:DP_AT[1]]
        else:
            q_s = cuda.shared.array(X_WORDS, float32, alignment=ALIGN)
            do_s = cuda.shared.array(X_WORDS, float32, alignment=ALIGN)
            k_s = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)
            v_s = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)
            ds_t = cuda.shared.array(T_WORDS, float32, alignment=ALIGN)   # attn_bias, then dS; key-major
            z_t = cuda.shared.array(Z_WORDS, float32, alignment=ALIGN)    # dropout's factors, key-major
            s_parts = cuda.shared.array(PARTS_WORDS, float32, alignment=ALIGN)
            dp_parts = cuda.shared.array(PARTS_WORDS, float32, alignment=ALIGN)

        acc = cuda.local.array((O_TM, O_TD), float32)
        s = cuda.local.array((S_TM, S_TN), float32)       # scores, then P
        dp = cuda.local.array((S_TM, S_TN), float32)      # dP, then dS
        lse_i = cuda.local.array(ROWS, float32)           # each row's max, log2 units (masks.row_softmax_terms)
        l2_i = cuda.local.array(ROWS, float32)            # and log2 of its sum
        delta_i = cuda.local.array(ROWS, float32)
        s_run = cuda.local.array(R, float32)
        dp_run = cuda.local.array(R, float32)
        qa = cuda.local.array((S_TM, V4), float32)
        kb = cuda.local.array((S_TN, V4), float32)
        a_reg = cuda.local.array(O_TM, float32)
        b_reg = cuda.local.array(O_TD, float32)
        fetched = cuda.local.array(V4, float32)
        row_part = cuda.local.array(ROWS, float32)        # dbias="per_row": this thread's part of each row's sum
        for i in range(O_TM):
            for j in range(O_TD):
                acc[i, j] = float32(0.0)
        for i in range(ROWS):
            row_part[i] = float32(0.0)

        # Q is scaled on load, as the forward's is, so that the scores are the forward's bit for bit.
        for k_pass in range(X_PASSES):
            at, ok = fetch_x(fetched, q, ab, q0 + m0, h, q0 + seqlen_q, head_dim, qmult, t, k_pass)
            if ok:
                for e in range(V4):
                    q_s[at + uint64(e)] = fetched[e]
        for k_pass in range(X_PASSES):
            at, ok = fetch_x(fetched, dout, ab, q0 + m0, h, q0 + seqlen_q, head_dim_v, float32(1.0), t, k_pass)
            if ok:
                for e in range(V4):
                    do_s[at + uint64(e)] = fetched[e]

        # Score block: rows in runs of S_RM, s_tr * S_RM + (i // S_RM) * S_GAP_M + i % S_RM; columns s_tc + S_TC * j;
        # consecutive threads take consecutive columns (keys). dQ block: rows and head-dim columns in runs;
        # consecutive threads take consecutive column runs. Unsigned 64-bit bases, as in the dK/dV kernel.
        # With SPLIT > 1, thread t is thread tg of the group of part ks, whose columns start at ks * DK.
        ks = t // GT
        tg = t - ks * GT
        s_tc = tg % S_TC
        s_tr = tg // S_TC
        ag = t // AT   # the dQ product's group: keys ag * N_PART .. of each tile
        o_tc = (t - ag * AT) % O_TC
        o_tr = (t - ag * AT) // O_TC
        q_row0, k_row0 = uint64(s_tr * S_RM * LD + ks * DK), uint64(s_tc * LD + ks * DK)
        t_at0 = uint64(s_tc * LM + s_tr * S_RM)
        part_at0 = uint64(ks * T_WORDS) + t_at0
        o_row0, o_col0 = uint64(ag * N_PART * LM + o_tr * O_RM), uint64(ag * N_PART * LD + o_tc * O_RD)
        for i in range(ROWS):
            if SPLIT > 1:   # row e of run u: i = u * R + e
                row = m0 + (t + NT * (i // R)) % RUNS_PER_KEY * R + i % R
            else:
                row = m0 + s_tr * S_RM + (i // S_RM) * S_GAP_M + i % S_RM
            if row < seqlen_q:
                lse_i[i], l2_i[i] = row_softmax_terms(lse, row_stats, stats_on, ab, h, q0 + row)
                delta_i[i] = delta[ab, h, q0 + row]
            else:   # P = 0 and dS = 0 past the sequence
                lse_i[i] = float32(math.inf)
                l2_i[i] = float32(0.0)
                delta_i[i] = float32(0.0)

        offset = seqlen_k - seqlen_q
        last_row = min(m0 + BLOCK_M, seqlen_q) - 1
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, m0 + offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, last_row + offset + window_right + 1)
        n_start = (lo // BLOCK_N) * BLOCK_N

        for n0 in range(n_start, hi, BLOCK_N):
            # One table entry for the whole block, so every thread skips together; a skipped tile writes no
            # shared memory, so skipping this iteration's barrier is safe.
            skip, full_tile = tile_skip(tiles, cb, ch, tile, n0 // BLOCK_N)
            if skip:   # mask_mod hides every pair: K and V never read
                continue
            cuda.syncthreads()   # the previous tile's readers of k_s, v_s, ds_t and z_t are done
            probe = float32(0.0)
            for k_pass in range(KV_PASSES):
                at, ok = fetch_kv(fetched, k, ab, k0 + n0, hk, k0 + seqlen_k, head_dim, float32(1.0), t, k_pass)
                if ok:
                    for e in range(V4):
                        k_s[at + uint64(e)] = fetched[e]
                        probe += fetched[e] * float32(0.0)
            for k_pass in range(KV_PASSES):
                at, ok = fetch_kv(fetched, v, ab, k0 + n0, hk, k0 + seqlen_k, head_dim_v, float32(1.0), t, k_pass)
                if ok:
                    for e in range(V4):
                        v_s[at + uint64(e)] = fetched[e]
            if STAGED:   # dS's buffer holds the bias tile until dS overwrites it in place
                load_bias(ds_t, bias_h, cb, ch, m0, n0, seqlen_q, seqlen_k, t, not full_tile)
            if DROPOUT:
                dropout_factors(z_t, seed_lo, seed_hi, threshold, dscale, cb + batch0, ch, m0, n0, t)
            # A K tile with an inf or NaN goes through the product that skips masked pairs.
            k_nonfinite = cuda.syncthreads_or(int32(probe != probe))

            # S = Q K^T and dP = dO V^T for this thread's block (over its part's columns), 4 columns per load.
            for i in range(S_TM):
                for j in range(S_TN):
                    s[i, j] = float32(0.0)
                    dp[i, j] = float32(0.0)
            for d0 in range(0, DK, D_STEP):
                q_d0, k_d0 = q_row0 + uint64(d0), k_row0 + uint64(d0)
                for dd in range(0, D_STEP, V4):
                    for i in range(S_TM):
                        for e in range(V4):
                            qa[i, e] = q_s[q_d0 + uint64(((i // S_RM) * S_GAP_M + i % S_RM) * LD + dd + e)]
                    for j in range(S_TN):
                        for e in range(V4):
                            kb[j, e] = k_s[k_d0 + uint64(j * S_TC * LD + dd + e)]
                    for e in range(V4):
                        for i in range(S_TM):
                            for j in range(S_TN):
                                s[i, j] += qa[i, e] * kb[j, e]
            for d0 in range(0, DK, D_STEP):
                q_d0, k_d0 = q_row0 + uint64(d0), k_row0 + uint64(d0)
                for dd in range(0, D_STEP, V4):
                    for i in range(S_TM):
                        for e in range(V4):
                            qa[i, e] = do_s[q_d0 + uint64(((i // S_RM) * S_GAP_M + i % S_RM) * LD + dd + e)]
                    for j in range(S_TN):
                        for e in range(V4):
                            kb[j, e] = v_s[k_d0 + uint64(j * S_TC * LD + dd + e)]
                    for e in range(V4):
                        for i in range(S_TM):
                            for j in range(S_TN):
                                dp[i, j] += qa[i, e] * kb[j, e]

            if SPLIT > 1:
                # Each part's block into its copy of the tile, then each thread sums the parts of its runs.
                for j in range(S_TN):
                    for i in range(S_TM):
                        at = part_at0 + uint64(j * S_TC * LM + (i // S_RM) * S_GAP_M + i % S_RM)
                        s_parts[at] = s[i, j]
                        dp_parts[at] = dp[i, j]
                cuda.syncthreads()
                for u in range(RUNS):
                    n = (t + NT * u) // RUNS_PER_KEY
                    m = (t + NT * u) % RUNS_PER_KEY * R
                    at = uint64(n * LM + m)
                    for e in range(R):
                        s_run[e] = float32(0.0)
                        dp_run[e] = float32(0.0)
                    for kk in range(SPLIT):
                        for e in range(R):
                            s_run[e] += s_parts[uint64(kk * T_WORDS + e) + at]
                            dp_run[e] += dp_parts[uint64(kk * T_WORDS + e) + at]
                    for e in range(R):
                        z = z_t[at + uint64(e)] if DROPOUT else float32(1.0)
                        bias_value = ds_t[at + uint64(e)] if STAGED else float32(0.0)
                        _, dp_run[e], dx = grads(s_run[e], dp_run[e], m0 + m + e, n0 + n, lse_i[u * R + e],
                                                 l2_i[u * R + e], delta_i[u * R + e], z, bias_value, slope,
                                                 float32(1.0), capmult, offset, seqlen_q, seqlen_k, window_left,
                                                 window_right, cb, ch)
                        add_dbias(dbias_h, m0 + m + e, n0 + n, dx, seqlen_q, seqlen_k)
                        if DBIAS_PER_ROW:
                            row_part[u * R + e] += dx
                    for e in range(R):   # a run is one 128-bit store
                        ds_t[at + uint64(e)] = dp_run[e]
            else:
                for i in range(S_TM):
                    row = m0 + s_tr * S_RM + (i // S_RM) * S_GAP_M + i % S_RM
                    for j in range(S_TN):
                        at = t_at0 + uint64(j * S_TC * LM + (i // S_RM) * S_GAP_M + i % S_RM)
                        z = z_t[at] if DROPOUT else float32(1.0)
                        bias_value = ds_t[at] if STAGED else float32(0.0)
                        _, dp[i, j], dx = grads(s[i, j], dp[i, j], row, n0 + s_tc + S_TC * j, lse_i[i], l2_i[i],
                                                delta_i[i], z, bias_value, slope, float32(1.0), capmult, offset,
                                                seqlen_q, seqlen_k, window_left, window_right, cb, ch)
                        add_dbias(dbias_h, row, n0 + s_tc + S_TC * j, dx, seqlen_q, seqlen_k)
                        if DBIAS_PER_ROW:
                            row_part[i] += dx
                for j in range(S_TN):   # into dS^T key by key: a run of rows is one 128-bit store
                    for i in range(S_TM):
                        ds_t[t_at0 + uint64(j * S_TC * LM + (i // S_RM) * S_GAP_M + i % S_RM)] = dp[i, j]
            cuda.syncthreads()

            # dQ += dS K: one outer product of a column of dS (a row of dS^T) and a row of K per key.
            if k_nonfinite:
                # Rare: 0 * inf would carry a non-finite K element into rows that do not see its key. dS is 0
                # exactly where a pair is skipped: masked pairs, and pairs of rows that do not see such a key (a row
                # that sees one is poisoned, its dS NaN at every key it sees), where skipping adds nothing.
                for n in range(N_PART):
                    for i in range(O_TM):
                        a = ds_t[uint64(n * LM) + o_row0 + uint64((i // O_RM) * O_GAP_M + i % O_RM)]
                        for j in range(O_TD):
                            x = acc[i, j] + a * k_s[uint64(n * LD) + o_col0 + uint64((j // O_RD) * O_GAP_D + j % O_RD)]
                            acc[i, j] = x if a != float32(0.0) else acc[i, j]
            else:
                for nc in range(0, N_PART, N_STEP):
                    t_n0, k_n0 = uint64(nc * LM) + o_row0, uint64(nc * LD) + o_col0
                    for nn in range(N_STEP):
                        for i in range(O_TM):
                            a_reg[i] = ds_t[t_n0 + uint64(nn * LM + (i // O_RM) * O_GAP_M + i % O_RM)]
                        for j in range(O_TD):
                            b_reg[j] = k_s[k_n0 + uint64(nn * LD + (j // O_RD) * O_GAP_D + j % O_RD)]
                        for i in range(O_TM):
                            for j in range(O_TD):
                                acc[i, j] += a_reg[i] * b_reg[j]

        if DBIAS_PER_ROW:   # each thread's partial sums of its rows into dS^T's buffer, then a row's in order
            sum_row_slots(ds_t, row_part, t_at0, t, dbias_h, m0, seqlen_q)
        if A_SPLIT > 1:   # the second group's partial, through the K buffer (BLOCK_M x DB, row-major), to the first
            cuda.syncthreads()
            if ag == 1:
                for i in range(O_TM):
                    for j in range(O_TD):
                        k_s[uint64(((o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM) * DB + o_tc * O_RD
                                    + (j // O_RD) * O_GAP_D + j % O_RD))] = acc[i, j]
            cuda.syncthreads()
            if ag == 0:
                for i in range(O_TM):
                    for j in range(O_TD):
                        acc[i, j] += k_s[uint64(((o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM) * DB + o_tc * O_RD
                                                 + (j // O_RD) * O_GAP_D + j % O_RD))]
        for i in range(O_TM):
            row = m0 + o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM
            if row < seqlen_q and ag == 0:
                for j in range(O_TD):
                    d = o_tc * O_RD + (j // O_RD) * O_GAP_D + j % O_RD
                    if d < head_dim:
                        dq[ab, q0 + row, h, d] = STORE(nan_if_not_finite(acc[i, j] * scale))

    return cuda.jit(flash_dq_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_dq_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout, v.mods,
                          **v.factory_switches())
