"""Backward kernels, FlashAttention-2 style: a delta pre-pass, a dK/dV kernel over key tiles (here), a dQ kernel over
query tiles (backward_dq.py). dQ gets its own pass, not atomics from the dK/dV kernel: float atomics add in whatever
order the blocks finish, and the contract's backends are deterministic (the price: the scores once more, about 1.4x
the work of an atomic dQ).

Scores are recomputed in the log2 domain as the forward computed them, bit for bit: ``s = (Q * qmult) K^T``
(``qmult`` is ``scale * log2(e)``, or ``scale / softcap`` with softcap), summed in ``config.SCORE_PARTS`` parts,
then ``P = exp2((s - m) - log2(l))`` with the forward's row max ``m`` and sum ``l`` where the call has them
(``masks.row_softmax_terms``), else ``P = exp2(s - lse * log2(e))``. Masked entries, padded rows and rows with
``lse = +inf`` (no visible key) get ``P = 0`` and ``dS = 0``; rows the forward poisoned (lse NaN) get NaN wherever
they see a key, and a non-finite Q, dO or K tile goes through a product that skips masked pairs (masks.py).

Layout. All four products of a tile read 128-bit words of shared memory (LDS.128) with every tile kept row-major,
rows padded to a multiple of 4 words (``config.padded_stride``), so Q and dO are stored once: the score products
(S = Q K^T, dP = dO V^T) sum over the head dim, a thread reading 4 consecutive head-dim columns of each of its rows
of both operands per load; the accumulator products (dV += P^T dO, dK += dS^T Q; dQ += dS K) sum over queries
(keys), a thread owning its key rows and head-dim columns in runs of 4, so a run of P, dS, dO, Q or K is one load.

A thread's score rows are interleaved (row ``s_tr + S_TR * i``) and its score columns in runs: the 8 threads that
share a 128-bit access then read 8 consecutive padded rows of Q (8 different 16-byte pieces of the banks) and one
row of K (a broadcast), and store 8 rows of P. Per query tile the dK/dV kernel passes 3 barriers: before its loads,
after them (which also ORs the tiles' non-finite probes), and after writing P and dS. Arrays come as (B, S, H, D)
views with any strides; lse and delta (B, Hq, Sq) float32; bfloat16 as int16 bits, for ``bf16`` kernels (dtypes.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level (not in the factories): the simulator swaps the kernel's global `cuda` for its
# fake module, which a closure variable would escape. Only launch.py and compile_check.py import this module.
from numba import cuda, float32, int32, uint32, uint64

from numba_flash.cuda.kernels.backward_dq import make_dq_kernel
from numba_flash.cuda.device.block_tiles import make_tile_skip
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.kernels.layout import padded_stride
from numba_flash.cuda.device.dtypes import element_io
from numba_flash.cuda.kernels.forward import SMEM_ALIGN
from numba_flash.cuda.device.masks import (bias_head, make_bias_tile, make_dropout_tile, make_score_grads,
                                           make_score_mod_hides, make_slot_sums, make_visible, nan_if_not_finite,
                                           row_softmax_terms)
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.device.smem import carve
from numba_flash.cuda.device.tiles import FETCH_VECTOR, checked_grids, make_tile_fetch, product_steps, tile_passes
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

__all__ = ["make_delta_kernel", "make_dkdv_kernel", "make_dq_kernel", "make_dbias_sum_kernel", "DELTA_THREADS",
           "DBIAS_SUM_THREADS"]

#: Threads per block of the delta pre-pass (one per row and part of a row).
DELTA_THREADS = 128
#: Threads per block of the dbias sum (one per element of attn_bias's gradient).
DBIAS_SUM_THREADS = 128


@functools.lru_cache(maxsize=None)
def make_dbias_sum_kernel() -> Any:
    """The gradient of a bias broadcast over some of (B, Hq, Sq, Sk) from the per-row or per-key sums the backward
    kernels write (``dbias="per_row"``: (B, Hq, Sq, 1); ``"per_key"``: (B, Hq, 1, Sk)): ``dst`` (4 dimensions,
    each src's size or 1) gets added, at each element, the sum of ``src`` (float32, 4 dimensions) over every axis
    where dst has size 1 and src not, in a fixed order, so the same bits every run, with a compensated (Kahan) sum
    in float32: a sum over all rows of a long sequence stays within a few roundings (no float64, which consumer
    GPUs run at 1/64 of the float32 rate; numba compiles without fast-math, so the compensation stays). One thread per
    element of dst: launch with ``ceil(dst.size / DBIAS_SUM_THREADS)`` blocks of DBIAS_SUM_THREADS threads."""

    def flash_dbias_sum_kernel(src, dst):
        idx = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        nb, nh, ni, nj = dst.shape
        if idx < nb * nh * ni * nj:
            j = idx % nj
            i = idx // nj % ni
            h = idx // (nj * ni) % nh
            b = idx // (nj * ni * nh)
            total = float32(0.0)
            lost = float32(0.0)   # what the running total rounded away, added back with the next term
            for bb in range(src.shape[0] if nb == 1 else 1):
                for hh in range(src.shape[1] if nh == 1 else 1):
                    for ii in range(src.shape[2] if ni == 1 else 1):
                        for jj in range(src.shape[3] if nj == 1 else 1):
                            term = src[b + bb, h + hh, i + ii, j + jj] - lost
                            after = total + term
                            lost = (after - total) - term
                            total = after
            dst[b, h, i, j] += total

    return cuda.jit(flash_dbias_sum_kernel)


@functools.lru_cache(maxsize=None)
def make_delta_kernel(bf16: bool) -> Any:
    """``delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]`` in float32, summed in the order the SIMT
    backward kernels sum dP = dO V^T (``config.SCORE_PARTS``): in ``parts`` parts of ``width`` consecutive columns,
    each part from 0 and the parts added in order (one part as it is). A row whose P is one key's alone has that
    key's V as its output, bit for bit, so delta is that key's dP bit for bit and dS = P (dP - delta) exactly 0,
    as in naive attention. One thread per (row, part), DELTA_THREADS per block, ``DELTA_THREADS // parts`` rows:
    launch with ``ceil(B * Hq * Sq / (DELTA_THREADS // parts))`` blocks; arguments dout, out (B, Sq, Hq, D) float32
    or float16 (int16 bfloat16 bits with ``bf16``), any strides, delta (B, Hq, Sq) float32, then seqlen_q,
    nheads_q, head_dim, total rows, parts (a power of two <= DELTA_THREADS) and width (ints)."""
    LOAD = element_io(bf16)[0]
    NT = DELTA_THREADS

    def flash_delta_kernel(dout, out, delta, seqlen_q, nheads_q, head_dim, rows, parts, width):
        partial = cuda.shared.array(NT, float32)
        t = cuda.threadIdx.x
        r = t // parts
        part = t - r * parts
        idx = cuda.blockIdx.x * (NT // parts) + r
        i = idx % seqlen_q
        bh = idx // seqlen_q
        h = bh % nheads_q
        b = bh // nheads_q
        total = float32(0.0)
        if idx < rows:
            for d in range(part * width, min(part * width + width, head_dim)):
                total += LOAD(dout[b, i, h, d]) * LOAD(out[b, i, h, d])
        partial[t] = total
        cuda.syncthreads()   # every thread reaches it: the row test is inside
        if part == 0 and idx < rows:
            if parts > 1:   # 0 + part 0 + part 1 ..., as the kernels add their parts
                total = float32(0.0)
                for j in range(parts):
                    total += partial[t + j]
            delta[b, h, i] = total

    return cuda.jit(flash_delta_kernel)


@functools.lru_cache(maxsize=None)
def make_dkdv_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool,
                     bf16: bool, alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                     mods: CudaMods = NO_MODS, varlen: bool = False, dbias: str = "") -> Any:
    """dK and dV: one block per (key tile, kv head, batch). The block loops over the query heads of its GQA group
    and over the query tiles that can see its keys, so dK and dV are summed over the group in registers, no atomics.

    Launch with grid ``(ceil(Sk / block_n), Hkv, B)`` and ``cfg.threads`` threads, arguments:
      q (B, Sq, Hq, D), dout (B, Sq, Hq, Dv), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): float32 or float16 (int16
      bfloat16 bits with ``bf16``), any strides; D and Dv at most the bucket (Dv is read from v's shape);
      lse, delta (B, Hq, Sq) float32; dk like k, dv like v;
      seqlen_q, seqlen_k, head_dim (D), group, window_left, window_right: ints;
      qmult (as the forward's), capmult (softcap * log2(e)), scale: float32;
      slopes (B, Hq) float32, bias (4 dimensions) float32, the five dropout scalars and tiles (int8, the
      BlockMask's table re-cut to this config's tiles), as the forward's. With ``mods.block_tiles`` the query-tile
      loop skips the tiles the table calls EMPTY and stages FULL ones without mask_mod;
      seqs: int32 (n_blocks, 6), packed sequences' block table, read only with ``varlen`` (as the forward's);
      dbias: float32 (B, Hq, 1, Sk), C-contiguous, read only with ``dbias="per_key"``: each key's gradient of a bias
      broadcast over the query rows (the sum over the rows of the pairs' gradients) is added into it. A thread
      sums its own scores of a key across the query tiles of a head; after each head the block adds its threads'
      partial sums of each key in a fixed order, so no atomics and the same bits every run;
      row_stats, stats_on: the forward's row statistics (2, B, Hq, Sq) float32 and whether to read them
      (masks.row_softmax_terms; any 4-dimensional float32 array and 0 otherwise).
    Q is scaled by qmult on load and its scores summed in ``cfg.score_split`` parts, as the forward's are.
    """
    BLOCK_M, BLOCK_N, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    assert dbias in ("", "per_key"), dbias
    DBIAS_PER_KEY = dbias == "per_key"
    (S_TR, S_TC), (G_TR, G_TC) = checked_grids(cfg, cfg.kv_grid)
    # The score products run in SPLIT parts of DK head-dim columns, a group of GT threads each (config.score_split).
    SPLIT = cfg.score_split
    GT, DK = NT // SPLIT, DB // SPLIT
    S_TM, S_TN = BLOCK_M // S_TR, BLOCK_N // S_TC     # score block: rows interleaved, columns in runs
    G_TN, G_TD = BLOCK_N // G_TR, DB // G_TC          # dK/dV block: key rows and head-dim columns, both in runs
    assert G_TN <= 32, "the rare path keeps which keys a row sees in 32 bits"
    S_RN, G_RN, G_RD = min(S_TN, 4), min(G_TN, 4), min(G_TD, 4)
    S_GAP_N, G_GAP_N, G_GAP_D = S_RN * S_TC, G_RN * G_TR, G_RD * G_TC
    # With SPLIT > 1 each thread then sums the parts of E scores, runs of R keys of one query row.
    E = BLOCK_M * BLOCK_N // NT
    R = min(E, 4, BLOCK_N)
    RUNS, RUNS_PER_ROW = E // R, BLOCK_N // R
    ROWS = RUNS if SPLIT > 1 else S_TM                # query rows whose delta a thread needs
    # dbias="per_key": the keys a thread holds scores of, and the threads that hold scores of one key (the slots
    # of the sum, rows of dS's buffer)
    KEYS, KEY_SLOTS = (RUNS * R, BLOCK_M) if SPLIT > 1 else (S_TN, S_TR)
    # Flat shared arrays, row-major: Q, dO (BLOCK_M x LD), K, V (BLOCK_N x LD), P, dS and each part of S and dP
    # (BLOCK_M x LP).
    LD, LP = padded_stride(DB), padded_stride(BLOCK_N)
    X_WORDS, KV_WORDS, P_WORDS = BLOCK_M * LD, BLOCK_N * LD, BLOCK_M * LP
    PARTS_WORDS = SPLIT * P_WORDS if SPLIT > 1 else 1
    V4, ALIGN = FETCH_VECTOR, SMEM_ALIGN
    DYNAMIC = cfg.dynamic_smem
    USED_PARTS = PARTS_WORDS if SPLIT > 1 else 0
    RS_WORDS = 2 * BLOCK_M                            # each query row's max and log2 sum
    K_AT, V_AT, Q_AT, DO_AT, P_AT, DS_AT, SP_AT, DP_AT, RS_AT = carve(KV_WORDS, KV_WORDS, X_WORDS, X_WORDS, P_WORDS,
                                                                      P_WORDS, USED_PARTS, USED_PARTS, RS_WORDS)
    D_STEP, M_STEP = product_steps(S_TM * S_TN, DK), product_steps(G_TN * G_TD, BLOCK_M, 1)
    HAS_LEFT, HAS_RIGHT, ALIBI, STAGED, DROPOUT = has_left, has_right, alibi, has_bias or mods.stages_tile, dropout
    LOAD, STORE = element_io(bf16)
    sees = make_visible(has_left, has_right, has_bias, mods)   # also attn_bias and mods, for the rare path
    grads = make_score_grads(has_left, has_right, softcap, alibi, has_bias, dropout, mods)
    score_mod_hides = make_score_mod_hides(softcap, alibi, has_bias, mods, LOAD)   # for the rare path
    load_bias = make_bias_tile(BLOCK_M, BLOCK_N, NT, False, LP, has_bias, mods)
    tile_skip = make_tile_skip(mods.block_tiles)
    locate = make_locate(varlen)
    dropout_factors = make_dropout_tile(BLOCK_M, BLOCK_N, NT, LP)
    sum_key_slots = make_slot_sums(False, SPLIT, NT, RUNS, RUNS_PER_ROW, R, LP, S_TN, S_RN, S_GAP_N, KEY_SLOTS,
                                   BLOCK_N)
    X_PASSES, KV_PASSES = tile_passes(BLOCK_M, DB, NT), tile_passes(BLOCK_N, DB, NT)
    fetch_x = make_tile_fetch(BLOCK_M, DB, NT, bf16, LD, False, True)    # query side: Q, dO
    fetch_kv = make_tile_fetch(BLOCK_N, DB, NT, bf16, LD, False, True)   # key side: K, V

    def flash_dkdv_kernel(q, k, v, dout, lse, delta, dk, dv, seqlen_q, seqlen_k, head_dim, group, window_left,
                          window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                          batch0, tiles, seqs, dbias, row_stats, stats_on):
        t = cuda.threadIdx.x
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        n0 = tile * BLOCK_N
        hk = cuda.blockIdx.y
        head_dim_v = v.shape[3]   # Dv, V's and dO's head dim; Q and K have head_dim (both <= DB)

        if DYNAMIC:   # past 48 KiB: one dynamic buffer (smem.py), carved at compile-time offsets
            smem = cuda.shared.array(0, float32, alignment=ALIGN)
            k_s = smem[K_AT[0]:K_AT[1]]
            v_s = smem[V_AT[0]:V_AT[1]]
            q_s = smem[Q_AT[0]:Q_AT[1]]
            do_s = smem[DO_AT[0]:DO_AT[1]]
            p_s = smem[P_AT[0]:P_AT[1]]
            ds_s = smem[DS_AT[0]:DS_AT[1]]
            s_parts = smem[SP_AT[0]:SP_AT[1]]
            dp_parts = smem[DP_AT[0]:DP_AT[1]]
            row_terms = smem[RS_AT[0]:RS_AT[1]]
        else:
            k_s = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)
            v_s = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)
            q_s = cuda.shared.array(X_WORDS, float32, alignment=ALIGN)
            do_s = cuda.shared.array(X_WORDS, float32, alignment=ALIGN)
            p_s = cuda.shared.array(P_WORDS, float32, alignment=ALIGN)    # dropout's factors, then P times them
            ds_s = cuda.shared.array(P_WORDS, float32, alignment=ALIGN)   # attn_bias, then dS
            s_parts = cuda.shared.array(PARTS_WORDS, float32, alignment=ALIGN)
            dp_parts = cuda.shared.array(PARTS_WORDS, float32, alignment=ALIGN)
            # Each query row's max, then log2 of its sum (masks.row_softmax_terms): read beside every score of the
            # row, from shared memory rather than two registers a row, which spill with every mods on (sm_75, 80).
            row_terms = cuda.shared.array(RS_WORDS, float32)

        dk_acc = cuda.local.array((G_TN, G_TD), float32)
        dv_acc = cuda.local.array((G_TN, G_TD), float32)
        s = cuda.local.array((S_TM, S_TN), float32)       # scores, then P
        dp = cuda.local.array((S_TM, S_TN), float32)      # dP, then dS
        delta_i = cuda.local.array(ROWS, float32)
        s_run = cuda.local.array(R, float32)
        dp_run = cuda.local.array(R, float32)
        qa = cuda.local.array((S_TM, V4), float32)
        kb = cuda.local.array((S_TN, V4), float32)
        ga = cuda.local.array(G_TN, float32)
        gb = cuda.local.array(G_TD, float32)
        fetched = cuda.local.array(V4, float32)
        key_part = cuda.local.array(KEYS, float32)        # dbias="per_key": this thread's part of each key's sum
        for i in range(G_TN):
            for j in range(G_TD):
                dk_acc[i, j] = float32(0.0)
                dv_acc[i, j] = float32(0.0)

        for k_pass in range(KV_PASSES):
            at, ok = fetch_kv(fetched, k, ab, k0 + n0, hk, k0 + seqlen_k, head_dim, float32(1.0), t, k_pass)
            if ok:
                for e in range(V4):
                    k_s[at + uint64(e)] = fetched[e]
        for k_pass in range(KV_PASSES):
            at, ok = fetch_kv(fetched, v, ab, k0 + n0, hk, k0 + seqlen_k, head_dim_v, float32(1.0), t, k_pass)
            if ok:
                for e in range(V4):
                    v_s[at + uint64(e)] = fetched[e]

        # Query rows that can see any key of the tile: row i sees key j iff
        # j - offset - right <= i <= j - offset + left.
        offset = seqlen_k - seqlen_q
        last_key = min(n0 + BLOCK_N, seqlen_k) - 1
        i_lo = 0
        i_hi = seqlen_q
        if HAS_RIGHT:
            i_lo = max(0, n0 - offset - window_right)
        if HAS_LEFT:
            i_hi = min(seqlen_q, last_key - offset + window_left + 1)
        m_start = (i_lo // BLOCK_M) * BLOCK_M

        # Score block: rows s_tr + S_TR * i; columns in runs of S_RN, s_tc * S_RN + (j // S_RN) * S_GAP_N + j % S_RN
        # (a thread's next run lies past every other thread's first); consecutive threads take consecutive rows.
        # dK/dV block: keys and head-dim columns in runs likewise; consecutive threads take consecutive column runs.
        # The bases of the shared-memory indices are unsigned 64-bit (see the forward kernel): the constant parts of
        # the unrolled offsets fold into the loads.
        # With SPLIT > 1, thread t is thread tg of the group of part ks, whose columns start at ks * DK.
        ks = t // GT
        tg = t - ks * GT
        s_tr = tg % S_TR
        s_tc = tg // S_TR
        g_tc = t % G_TC
        g_tr = t // G_TC
        q_row0, k_row0 = uint64(s_tr * LD + ks * DK), uint64(s_tc * S_RN * LD + ks * DK)
        p_at0 = uint64(s_tr * LP + s_tc * S_RN)
        part_at0 = uint64(ks * P_WORDS) + p_at0
        g_key0, g_col0 = uint64(g_tr * G_RN), uint64(g_tc * G_RD)

        for g in range(group):
            h = hk * group + g
            slope = float32(0.0)
            if ALIBI:
                slope = slopes[b, h]
            bias_h = bias_head(bias, b, h)
            for j in range(KEYS):
                key_part[j] = float32(0.0)
            for m0 in range(m_start, i_hi, BLOCK_M):
                # One table entry for the whole block (the tile's transposed look-up: query tile m0, this
                # block's key tile), so every thread skips together; a skipped tile writes no shared memory,
                # so skipping this iteration's barrier is safe.
                skip, full_tile = tile_skip(tiles, b, h, m0 // BLOCK_M, tile)
                if skip:   # mask_mod hides every pair: Q and dO never read
                    continue
                cuda.syncthreads()   # the previous tile's readers of q_s, do_s, p_s and ds_s are done
                # Q is scaled on load, as the forward's is, so that the scores are the forward's bit for bit; dK
                # takes the scaled Q and kscale.
                probe = float32(0.0)
                for k_pass in range(X_PASSES):
                    at, ok = fetch_x(fetched, q, ab, q0 + m0, h, q0 + seqlen_q, head_dim, qmult, t, k_pass)
                    if ok:
                        for e in range(V4):
                            q_s[at + uint64(e)] = fetched[e]
                            probe += fetched[e] * float32(0.0)
                for k_pass in range(X_PASSES):
                    at, ok = fetch_x(fetched, dout, ab, q0 + m0, h, q0 + seqlen_q, head_dim_v, float32(1.0), t,
                                     k_pass)
                    if ok:
                        for e in range(V4):
                            do_s[at + uint64(e)] = fetched[e]
                            probe += fetched[e] * float32(0.0)
                if STAGED:   # dS's buffer holds the bias tile until dS overwrites it in place
                    load_bias(ds_s, bias_h, b, h, m0, n0, seqlen_q, seqlen_k, t, not full_tile)
                if DROPOUT:    # P's buffer holds the factors until P times them overwrites them
                    dropout_factors(p_s, seed_lo, seed_hi, threshold, dscale, b + batch0, h, m0, n0, t)
                for r in range(t, BLOCK_M, NT):
                    m2, l2 = float32(math.inf), float32(0.0)   # P = 0 and dS = 0 past the sequence
                    if m0 + r < seqlen_q:
                        m2, l2 = row_softmax_terms(lse, row_stats, stats_on, ab, h, q0 + m0 + r)
                    row_terms[r] = m2
                    row_terms[BLOCK_M + r] = l2
                for i in range(ROWS):
                    row = m0 + ((t + NT * i) // RUNS_PER_ROW if SPLIT > 1 else s_tr + S_TR * i)
                    delta_i[i] = delta[ab, h, q0 + row] if row < seqlen_q else float32(0.0)
                # A Q or dO tile with an inf or NaN goes through the products that skip masked pairs.
                x_nonfinite = cuda.syncthreads_or(int32(probe != probe))

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
                                qa[i, e] = q_s[q_d0 + uint64(i * S_TR * LD + dd + e)]
                        for j in range(S_TN):
                            for e in range(V4):
                                kb[j, e] = k_s[k_d0 + uint64((j // S_RN) * S_GAP_N + j % S_RN * LD + dd + e)]
                        for e in range(V4):
                            for i in range(S_TM):
                                for j in range(S_TN):
                                    s[i, j] += qa[i, e] * kb[j, e]
                for d0 in range(0, DK, D_STEP):
                    q_d0, k_d0 = q_row0 + uint64(d0), k_row0 + uint64(d0)
                    for dd in range(0, D_STEP, V4):
                        for i in range(S_TM):
                            for e in range(V4):
                                qa[i, e] = do_s[q_d0 + uint64(i * S_TR * LD + dd + e)]
                        for j in range(S_TN):
                            for e in range(V4):
                                kb[j, e] = v_s[k_d0 + uint64((j // S_RN) * S_GAP_N + j % S_RN * LD + dd + e)]
                        for e in range(V4):
                            for i in range(S_TM):
                                for j in range(S_TN):
                                    dp[i, j] += qa[i, e] * kb[j, e]

                if SPLIT > 1:
                    # Each part's block into its copy of the tile, then each thread sums the parts of its runs.
                    for i in range(S_TM):
                        for j in range(S_TN):
                            at = part_at0 + uint64(i * S_TR * LP + (j // S_RN) * S_GAP_N + j % S_RN)
                            s_parts[at] = s[i, j]
                            dp_parts[at] = dp[i, j]
                    cuda.syncthreads()
                    for u in range(RUNS):
                        m = (t + NT * u) // RUNS_PER_ROW
                        n = (t + NT * u) % RUNS_PER_ROW * R
                        at = uint64(m * LP + n)
                        for e in range(R):
                            s_run[e] = float32(0.0)
                            dp_run[e] = float32(0.0)
                        for kk in range(SPLIT):
                            for e in range(R):
                                s_run[e] += s_parts[uint64(kk * P_WORDS + e) + at]
                                dp_run[e] += dp_parts[uint64(kk * P_WORDS + e) + at]
                        m2, l2 = row_terms[m], row_terms[BLOCK_M + m]   # once a run: the stores below may alias
                        for e in range(R):
                            z = p_s[at + uint64(e)] if DROPOUT else float32(1.0)
                            bias_value = ds_s[at + uint64(e)] if STAGED else float32(0.0)
                            s_run[e], dp_run[e], dx = grads(s_run[e], dp_run[e], m0 + m, n0 + n + e, m2, l2,
                                                            delta_i[u], z, bias_value, slope, float32(1.0), capmult,
                                                            offset, seqlen_q, seqlen_k, window_left, window_right,
                                                            b, h)
                            if DBIAS_PER_KEY:
                                key_part[u * R + e] += dx
                        for e in range(R):   # a run is one 128-bit store
                            p_s[at + uint64(e)] = s_run[e]
                            ds_s[at + uint64(e)] = dp_run[e]
                else:
                    for i in range(S_TM):
                        m2, l2 = row_terms[s_tr + S_TR * i], row_terms[BLOCK_M + s_tr + S_TR * i]   # once a row
                        for j in range(S_TN):
                            c = s_tc * S_RN + (j // S_RN) * S_GAP_N + j % S_RN
                            at = p_at0 + uint64(i * S_TR * LP + (j // S_RN) * S_GAP_N + j % S_RN)
                            z = p_s[at] if DROPOUT else float32(1.0)
                            bias_value = ds_s[at] if STAGED else float32(0.0)
                            s[i, j], dp[i, j], dx = grads(s[i, j], dp[i, j], m0 + s_tr + S_TR * i, n0 + c, m2, l2,
                                                          delta_i[i], z, bias_value, slope, float32(1.0), capmult,
                                                          offset, seqlen_q, seqlen_k, window_left, window_right, b, h)
                            if DBIAS_PER_KEY:
                                key_part[j] += dx
                    for i in range(S_TM):   # a run of columns is one 128-bit store
                        for j in range(S_TN):
                            at = p_at0 + uint64(i * S_TR * LP + (j // S_RN) * S_GAP_N + j % S_RN)
                            p_s[at] = s[i, j]
                            ds_s[at] = dp[i, j]
                cuda.syncthreads()

                # dV += P^T dO and dK += dS^T Q (the softmax scale is applied once, at the end): one outer product
                # of a row of P (dS) and a row of dO (Q) per query.
                if x_nonfinite:
                    # Rare: 0 * inf would carry a non-finite Q or dO element into keys its row does not see.
                    for m in range(BLOCK_M):
                        # Which of the thread's keys row m sees, as bits: the accumulators are indexed only from
                        # the loop below, which the compiler unrolls; this one, with score_mod_hides inlined, it
                        # does not, and indexing them from it would move them to local memory.
                        seen_bits = uint32(0)
                        for i in range(G_TN):
                            key = g_tr * G_RN + (i // G_RN) * G_GAP_N + i % G_RN
                            if sees(m0 + m, n0 + key, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h,
                                    b, h) and not score_mod_hides(q, k, b, h, hk, m0 + m, n0 + key, head_dim, qmult,
                                                                  capmult, slope, offset, bias_h, seqlen_q, seqlen_k):
                                seen_bits |= uint32(1) << uint32(i)
                        for i in range(G_TN):
                            key = g_tr * G_RN + (i // G_RN) * G_GAP_N + i % G_RN
                            seen = (seen_bits >> uint32(i)) & uint32(1) != uint32(0)
                            pa = p_s[uint32(m * LP + key)]
                            sa = ds_s[uint32(m * LP + key)]
                            for j in range(G_TD):
                                col = uint32(m * LD + g_tc * G_RD + (j // G_RD) * G_GAP_D + j % G_RD)
                                x = dv_acc[i, j] + pa * do_s[col]
                                y = dk_acc[i, j] + sa * q_s[col]
                                dv_acc[i, j] = x if seen else dv_acc[i, j]
                                dk_acc[i, j] = y if seen else dk_acc[i, j]
                else:
                    for mc in range(0, BLOCK_M, M_STEP):
                        p_m0, x_m0 = uint64(mc * LP) + g_key0, uint64(mc * LD) + g_col0
                        for mm in range(M_STEP):
                            for i in range(G_TN):
                                ga[i] = p_s[p_m0 + uint64(mm * LP + (i // G_RN) * G_GAP_N + i % G_RN)]
                            for j in range(G_TD):
                                gb[j] = do_s[x_m0 + uint64(mm * LD + (j // G_RD) * G_GAP_D + j % G_RD)]
                            for i in range(G_TN):
                                for j in range(G_TD):
                                    dv_acc[i, j] += ga[i] * gb[j]
                    for mc in range(0, BLOCK_M, M_STEP):
                        p_m0, x_m0 = uint64(mc * LP) + g_key0, uint64(mc * LD) + g_col0
                        for mm in range(M_STEP):
                            for i in range(G_TN):
                                ga[i] = ds_s[p_m0 + uint64(mm * LP + (i // G_RN) * G_GAP_N + i % G_RN)]
                            for j in range(G_TD):
                                gb[j] = q_s[x_m0 + uint64(mm * LD + (j // G_RD) * G_GAP_D + j % G_RD)]
                            for i in range(G_TN):
                                for j in range(G_TD):
                                    dk_acc[i, j] += ga[i] * gb[j]

            if DBIAS_PER_KEY:   # each thread's partial sums of its keys into dS's buffer, then a key's in order
                sum_key_slots(ds_s, key_part, p_at0, t, bias_head(dbias, b, h), n0, seqlen_k)

        # dK summed the scaled Q: scale / qmult makes it the softmax scale's (Q is 0 where qmult is, and so is dK)
        kscale = scale / qmult if qmult != float32(0.0) else float32(0.0)
        for i in range(G_TN):
            key = n0 + g_tr * G_RN + (i // G_RN) * G_GAP_N + i % G_RN
            if key < seqlen_k:
                for j in range(G_TD):
                    d = g_tc * G_RD + (j // G_RD) * G_GAP_D + j % G_RD
                    if d < head_dim:
                        dk[ab, k0 + key, hk, d] = STORE(nan_if_not_finite(dk_acc[i, j] * kscale))
                for j in range(G_TD):
                    d = g_tc * G_RD + (j // G_RD) * G_GAP_D + j % G_RD
                    if d < head_dim_v:
                        dv[ab, k0 + key, hk, d] = STORE(nan_if_not_finite(dv_acc[i, j]))

    return cuda.jit(flash_dkdv_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_dkdv_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout, v.mods,
                            **v.factory_switches())
