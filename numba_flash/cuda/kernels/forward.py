"""The forward kernel: one block per (query tile, query head, batch), online softmax over key tiles.

The block keeps its float32 Q tile (pre-multiplied by ``scale * log2(e)`` so that the softmax can use ``exp2``) in
shared memory, streams K and then V of each key tile through one shared buffer, and keeps the output accumulator
in registers: each thread owns a small ``rows x cols`` block of the (block_m x D) accumulator and of the
(block_m x block_n) score tile ("register blocking"), so no thread ever holds a whole D = 256 row.

Both products are sums of outer products, SGEMM style: each step of the sum reads a thread's rows of one column
of the left operand and its columns of one row of the right one. So Q, K and P are kept transposed (Q^T and K^T
d-major, P^T key-major) and V row-major, and a thread owns its rows and columns in runs of four consecutive ones:
each run is one 128-bit shared load (LDS.128) where a strided block needed four. Runs of neighbouring threads are
neighbours, and a thread's second run (8 x 8 blocks) lies past the other threads' first: the 8 threads that share
a 128-bit access then touch 8 different 16-byte pieces of the banks, no conflict.

Arrays reach the kernels as (B, S, H, D) views with any strides; ``lse`` is (B, Hq, Sq) float32. bfloat16 arrays
arrive as int16 bit patterns and the kernel built for them widens on load and rounds on store (see dtypes.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level (not in the factories): the simulator swaps the kernel's global `cuda` for its
# fake module, which a closure variable would escape. Only launch.py and compile_check.py import this module.
from numba import config, cuda, float32, int32, uint32, uint64

from numba_flash.cuda.device.block_tiles import make_tile_skip
from numba_flash.cuda.host.config import SCORE_PARTS, FlashAttentionConfig
from numba_flash.cuda.kernels.layout import transposed_stride
from numba_flash.cuda.device.dtypes import element_io
from numba_flash.cuda.device.masks import (LN2, bias_head, dropout_factor, make_bias_tile, make_score_mod_hides,
                                           make_visible, nan_if_not_finite)
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.device.smem import carve
from numba_flash.cuda.device.tiles import FETCH_VECTOR, make_tile_fetch, tile_passes
from numba_flash.cuda.device.score_terms import make_pipeline
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

#: Alignment of the shared tiles: 16 bytes lets LLVM merge four consecutive float32 loads into one 128-bit load.
#: The simulator refuses any alignment argument (and needs none).
SMEM_ALIGN = None if config.ENABLE_CUDASIM else 16
#: Multiply-adds per thread in one iteration of each product loop. Its steps (one outer product each) are an inner
#: loop that NVVM unrolls in full up to a size, so every step's shared-memory offsets fold into its loads and
#: numba's 64-bit loop control (about 10 instructions) is paid once per iteration. Measured: it unrolls 2 steps of an
#: 8 x 4 score block (64 multiply-adds) but not 4, and 2 steps of an 8 x 8 accumulator block (128): a score step
#: holds more loads per multiply-add. Past the limit it keeps a loop unrolled by 2, which costs more than a
#: smaller body.
SCORE_BODY_FMAS, PV_BODY_FMAS = 64, 128
#: At most this many steps per iteration (a 2 x 1 score block at D = 256 is not unrolled at 32).
MAX_STEPS = 8


def _grids(cfg: FlashAttentionConfig) -> tuple[int, int, int, int]:
    """Thread grid of the score tile and of the output accumulator, checked."""
    why = cfg.problems(1 << 62)
    if why:
        raise ValueError(f"{cfg}: " + "; ".join(why))
    (s_tr, s_tc), (o_tr, o_tc) = cfg.score_grid, cfg.out_grid
    return s_tr, s_tc, o_tr, o_tc


@functools.lru_cache(maxsize=None)
def make_forward_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool,
                        bf16: bool, alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                        mods: CudaMods = NO_MODS, varlen: bool = False) -> Any:
    """The forward kernel for one tile config, mask kind and element kind (a ``numba.cuda`` dispatcher, compiled
    lazily).

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments:
      q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv): float32 or float16, or with ``bf16`` int16 arrays
      holding bfloat16 bit patterns; any strides; D and Dv at most the config's bucket (Dv is read from v's shape);
      out (B, Sq, Hq, Dv) like q; lse (B, Hq, Sq) float32;
      seqlen_q, seqlen_k, head_dim (D), group (= Hq // Hkv), window_left, window_right: ints;
      qmult: float32, scale * log2(e), or scale / softcap when softcap is on;
      capmult: float32, softcap * log2(e) (unused without softcap);
      slopes (B, Hq) float32: ALiBi slopes times log2(e), read only with ``alibi`` (any (B, Hq) float32 array
      otherwise);
      bias: attn_bias, float32, 4 dimensions each of the full size or 1 (see masks.bias_head), read only with
      ``has_bias`` (any 4-dimensional float32 array otherwise);
      seed_lo, seed_hi, threshold: uint64, dropout's key words and keep threshold; dscale: float32, 1 / (1 - p);
      batch0: int, the batch index of the call's first row in dropout's counter (all read only with ``dropout``);
      tiles: int8 (B or 1, Hq or 1, ceil(Sq / block_m), ceil(Sk / block_n)), the BlockMask re-cut to this
      config's tiles (block_tiles.py), read only with ``mods.block_tiles`` (any 4-dimensional int8 array otherwise);
      seqs: int32 (n_blocks, 6), with ``varlen`` the packed sequences' block table (sequences.py; grid
      ``(n_blocks, Hq, 1)``, q/k/v/out a batch of one, seqlen_q/seqlen_k unused), read only then (any (1, 6) int32
      array otherwise);
      row_stats: float32 (2, B, Hq, Sq) C-contiguous (lse's rows), written only where ``stats_on`` (int) is 1: each
      row's max score (log2 units, scores summed in ``config.SCORE_PARTS`` parts as the backward's are) and log2 of
      its sum of exponentials, for the backward (spec.TAIL_ARGS); any such array otherwise.
    float32 and float16 share one dispatcher (numba specialises it on the array types it is called with); bfloat16
    bits need their own, since an int16 element must be widened, not converted. ``mods``: the user's mods
    (user_mods.py): bias_mod and mask_mod go through the staged bias tile, score_mod applies per score; with
    ``mods.block_tiles`` the key-tile loop skips the tiles the table calls EMPTY and stages FULL ones without mask_mod.
    """
    BM, BN, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    S_TR, S_TC, O_TR, O_TC = _grids(cfg)
    S_TM, S_TN = BM // S_TR, BN // S_TC      # score elements per thread
    O_TM, O_TD = BM // O_TR, DB // O_TC      # accumulator elements per thread
    # Flat shared arrays, row strides in words (multiples of 4: every row starts 16-byte aligned):
    # Q^T (DB x BM, q_t[d * LQ + r]), one buffer holding K^T (DB x BN, kv[d * LK + c]) and then V (BN x DB,
    # kv[n * DB + d]), P^T (BN x BM, p_t[c * BM + r]).
    LQ, LK = transposed_stride(BM), transposed_stride(BN)
    Q_WORDS, KV_WORDS, P_WORDS = DB * LQ, max(DB * LK, BN * DB), BN * BM
    ALIGN = SMEM_ALIGN
    DYNAMIC = cfg.dynamic_smem
    Q_AT, KV_AT, P_AT, MAX_AT, SUM_AT, SCALE_AT = carve(Q_WORDS, KV_WORDS, P_WORDS, BM, BM, BM)
    # The score dot products are summed in PARTS parts of D_PART columns, as the backward kernels sum theirs
    # (config.SCORE_PARTS), so that a row's max is one of the backward's scores bit for bit.
    PARTS = SCORE_PARTS[DB]
    D_PART = DB // PARTS
    D_STEPS = math.gcd(min(DB, MAX_STEPS, max(1, SCORE_BODY_FMAS // (S_TM * S_TN))), D_PART)
    N_STEPS = min(BN, MAX_STEPS, max(1, PV_BODY_FMAS // (O_TM * O_TD)))
    # Runs of consecutive rows (columns) a thread owns, and the distance from one of its runs to the next.
    S_RM, S_RN, O_RM, O_RD = min(S_TM, 4), min(S_TN, 4), min(O_TM, 4), min(O_TD, 4)
    S_GAP_M, S_GAP_N, O_GAP_M, O_GAP_D = S_RM * S_TR, S_RN * S_TC, O_RM * O_TR, O_RD * O_TC
    HAS_LEFT, HAS_RIGHT, ALIBI = has_left, has_right, alibi
    DROPOUT, STAGED = dropout, has_bias or mods.stages_tile
    LOAD, STORE = element_io(bf16)
    visible = make_visible(has_left, has_right)
    sees = make_visible(has_left, has_right, has_bias, mods)   # also reads attn_bias and the mods, for the rare path
    pipeline = make_pipeline(softcap, alibi, STAGED, mods)   # the staged tile holds attn_bias and the mods
    load_bias = make_bias_tile(BM, BN, NT, True, BM, has_bias, mods)
    tile_skip = make_tile_skip(mods.block_tiles)
    locate = make_locate(varlen)
    score_mod_hides = make_score_mod_hides(softcap, alibi, has_bias, mods, LOAD)
    Q_PASSES, KV_PASSES, V4 = tile_passes(BM, DB, NT), tile_passes(BN, DB, NT), FETCH_VECTOR
    fetch_q = make_tile_fetch(BM, DB, NT, bf16, LQ, True)
    fetch_k = make_tile_fetch(BN, DB, NT, bf16, LK, True)
    fetch_v = make_tile_fetch(BN, DB, NT, bf16, DB, False)

    def flash_forward_kernel(q, k, v, out, lse, seqlen_q, seqlen_k, head_dim, group, window_left, window_right,
                             qmult, capmult, slopes, bias, seed_lo, seed_hi, threshold, dscale, batch0, tiles,
                             seqs, row_stats, stats_on):
        neg_inf = float32(-math.inf)
        nan = float32(math.nan)
        t = cuda.threadIdx.x
        # b: the sequence (masks, ALiBi, dropout); the arrays' rows of it start at (ab, q0) and keys at (ab, k0).
        b, ab, tile, q0, k0, seqlen_q, seqlen_k = locate(seqs, seqlen_q, seqlen_k)
        m0 = tile * BM
        h = cuda.blockIdx.y
        hk = h // group
        head_dim_v = v.shape[3]   # Dv, V's and the output's head dim; Q and K have head_dim (both <= DB)
        slope = float32(0.0)
        if ALIBI:
            slope = slopes[b, h]
        bias_h = bias_head(bias, b, h)

        if DYNAMIC:   # past 48 KiB: one dynamic buffer (smem.py), carved at compile-time offsets
            smem = cuda.shared.array(0, float32, alignment=ALIGN)
            q_t = smem[Q_AT[0]:Q_AT[1]]
            kv = smem[KV_AT[0]:KV_AT[1]]
            p_t = smem[P_AT[0]:P_AT[1]]
            row_max = smem[MAX_AT[0]:MAX_AT[1]]
            row_sum = smem[SUM_AT[0]:SUM_AT[1]]
            row_scale = smem[SCALE_AT[0]:SCALE_AT[1]]
        else:
            q_t = cuda.shared.array(Q_WORDS, float32, alignment=ALIGN)
            kv = cuda.shared.array(KV_WORDS, float32, alignment=ALIGN)
            p_t = cuda.shared.array(P_WORDS, float32, alignment=ALIGN)
            row_max = cuda.shared.array(BM, float32)     # running max, log2 domain
            row_sum = cuda.shared.array(BM, float32)     # running sum of exp2(s - row_max)
            row_scale = cuda.shared.array(BM, float32)   # this tile's rescale factor of the accumulator

        acc = cuda.local.array((O_TM, O_TD), float32)
        s = cuda.local.array((S_TM, S_TN), float32)
        s_part = cuda.local.array((S_TM, S_TN), float32)   # one part's sums (PARTS > 1)
        a_reg = cuda.local.array(O_TM, float32)
        b_reg = cuda.local.array(O_TD, float32)
        sa_reg = cuda.local.array(S_TM, float32)
        sb_reg = cuda.local.array(S_TN, float32)
        fetched = cuda.local.array(V4, float32)
        for i in range(O_TM):
            for j in range(O_TD):
                acc[i, j] = float32(0.0)

        # Tile loads (tiles.py): rows past the sequence and columns past head_dim become 0 and add nothing.
        for k_pass in range(Q_PASSES):
            at, ok = fetch_q(fetched, q, ab, q0 + m0, h, q0 + seqlen_q, head_dim, qmult, t, k_pass)
            if ok:
                for e in range(V4):
                    q_t[at + uint64(e)] = fetched[e]
        for r in range(t, BM, NT):
            row_max[r] = neg_inf
            row_sum[r] = float32(0.0)

        # Keys any row of the tile can see; rows' ranges only move right, so the first and last rows bound them.
        offset = seqlen_k - seqlen_q
        last_row = min(m0 + BM, seqlen_q) - 1
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, m0 + offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, last_row + offset + window_right + 1)
        n_start = (lo // BN) * BN

        # Score block of this thread: row i is s_tr * S_RM + (i // S_RM) * S_GAP_M + i % S_RM, column j likewise
        # with s_tc, S_RN and S_GAP_N. Consecutive threads take consecutive row runs.
        s_tc = t // S_TR
        s_tr = t - s_tc * S_TR
        # Accumulator block: rows from o_tr with O_RM and O_GAP_M, head-dim columns from o_tc with O_RD and O_GAP_D.
        o_tr = t // O_TC
        o_tc = t - o_tr * O_TC
        # First row and column of each block, as the base of the product loops' shared-memory indices. Unsigned:
        # numba wraps negative signed indices around (a compare and select per index). 64-bit: a 32-bit sum that is
        # widened afterwards may wrap, so the compiler cannot split off its constant part, and recomputes every
        # address (an IMAD and a LEA per load); a 64-bit sum's constant steps fold into the loads' offsets.
        s_row0, s_col0 = uint64(s_tr * S_RM), uint64(s_tc * S_RN)
        o_row0, o_col0 = uint64(o_tr * O_RM), uint64(o_tc * O_RD)
        p_block = s_col0 * uint64(BM) + s_row0
        v_nonfinite_seen = False
        cuda.syncthreads()

        for n0 in range(n_start, hi, BN):
            # The state is the block's (one table entry), so every thread takes the same branch; the last
            # iteration ended on a barrier, so skipping before this one's loads leaves nothing half done.
            skip, full_tile = tile_skip(tiles, b, h, tile, n0 // BN)
            if skip:   # mask_mod hides every key: never read, so a NaN there cannot poison
                continue
            for k_pass in range(KV_PASSES):
                at, ok = fetch_k(fetched, k, ab, k0 + n0, hk, k0 + seqlen_k, head_dim, float32(1.0), t, k_pass)
                if ok:
                    for e in range(V4):
                        kv[at + uint64(e)] = fetched[e]
            if STAGED:   # P^T is free: its bias tile (mask_mod not evaluated on a FULL tile), overwritten in place
                load_bias(p_t, bias_h, b, h, m0, n0, seqlen_q, seqlen_k, t, not full_tile)
            cuda.syncthreads()

            # Scores of this thread's (S_TM x S_TN) block: s = Q K^T over the padded head dim, one outer product of
            # a column of Q^T and a column of K^T per d, part by part (PARTS).
            for i in range(S_TM):
                for j in range(S_TN):
                    s[i, j] = float32(0.0)
                    s_part[i, j] = float32(0.0)
            for d0 in range(0, DB, D_STEPS):
                if PARTS > 1 and d0 % D_PART == 0:   # a part begins: the last one's sums into s, this one's from 0
                    for i in range(S_TM):
                        for j in range(S_TN):
                            s[i, j] += s_part[i, j]
                            s_part[i, j] = float32(0.0)
                q_d0, k_d0 = uint64(d0 * LQ) + s_row0, uint64(d0 * LK) + s_col0
                for dd in range(D_STEPS):
                    for i in range(S_TM):
                        sa_reg[i] = q_t[q_d0 + uint64(dd * LQ + (i // S_RM) * S_GAP_M + i % S_RM)]
                    for j in range(S_TN):
                        sb_reg[j] = kv[k_d0 + uint64(dd * LK + (j // S_RN) * S_GAP_N + j % S_RN)]
                    for i in range(S_TM):
                        for j in range(S_TN):
                            s_part[i, j] += sa_reg[i] * sb_reg[j]
            for i in range(S_TM):
                for j in range(S_TN):   # one part: the sums as they are (adding them to 0 would cost an add)
                    s[i, j] = s_part[i, j] if PARTS == 1 else s[i, j] + s_part[i, j]
            # Masked scores become -inf; a visible one that is not finite becomes NaN and poisons its row (the raw
            # score decides: tanh would turn an inf into a finite cap).
            for i in range(S_TM):
                row = m0 + s_tr * S_RM + (i // S_RM) * S_GAP_M + i % S_RM
                for j in range(S_TN):
                    col = n0 + s_tc * S_RN + (j // S_RN) * S_GAP_N + j % S_RN
                    raw = s[i, j]
                    bias_value = float32(0.0)
                    if STAGED:
                        bias_value = p_t[p_block + uint64(((j // S_RN) * S_GAP_N + j % S_RN) * BM
                                                          + (i // S_RM) * S_GAP_M + i % S_RM)]
                    ok = visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b, h)
                    # Q was scaled on load: the pipeline's qmult is 1. A -inf bias, mask_mod or score_mod hides
                    # (shown False); a +inf or NaN term poisons (finite False).
                    x, _, _, shown, finite = pipeline(raw, float32(1.0), capmult, slope, float32(row + offset - col),
                                                      bias_value, float32(0.0), False, ok, b, h, row, col,
                                                      seqlen_q - 1, seqlen_k - 1)
                    x = x if finite else nan
                    s[i, j] = x if ok & shown else neg_inf
            # Into P^T column by column: a run of rows is one 128-bit store.
            for j in range(S_TN):
                for i in range(S_TM):
                    p_t[p_block + uint64(((j // S_RN) * S_GAP_N + j % S_RN) * BM
                                         + (i // S_RM) * S_GAP_M + i % S_RM)] = s[i, j]
            cuda.syncthreads()

            # Every thread is done with K: the buffer takes V while the row pass runs.
            # A non-finite value goes in as 0: P V also multiplies the masked pairs' P = 0, and 0 * inf would
            # carry it into rows that do not see its key. The rows that do are made NaN after the loop.
            for k_pass in range(KV_PASSES):
                at, ok = fetch_v(fetched, v, ab, k0 + n0, hk, k0 + seqlen_k, head_dim_v, float32(1.0), t, k_pass)
                if ok:
                    for e in range(V4):
                        x = fetched[e]
                        finite = abs(x) < float32(math.inf)
                        kv[at + uint64(e)] = x if finite else float32(0.0)
                        v_nonfinite_seen |= not finite
            for r in range(t, BM, NT):
                r_u = uint32(r)
                m_old = row_max[r]
                m_new = m_old
                poisoned = m_old != m_old
                for c in range(BN):
                    x = p_t[uint32(c * BM) + r_u]
                    m_new = max(m_new, x)
                    poisoned |= x != x
                # A poisoned row's max is NaN: its exp2s, sum and accumulator become NaN and stay so.
                m_new = nan if poisoned else m_new
                # A row with nothing visible yet keeps max -inf; exp2 against 0 then gives 0, never NaN.
                m_use = m_new if m_new != neg_inf else float32(0.0)
                alpha = math.exp2(m_old - m_use)
                total = float32(0.0)
                for c in range(BN):
                    p = math.exp2(p_t[uint32(c * BM) + r_u] - m_use)
                    total += p
                    if DROPOUT:   # the sum is the softmax's; P V takes the kept probabilities, scaled
                        p *= dropout_factor(seed_lo, seed_hi, threshold, dscale, b + batch0, h, m0 + r, n0 + c)
                    p_t[uint32(c * BM) + r_u] = p
                row_max[r] = m_new
                row_sum[r] = row_sum[r] * alpha + total
                row_scale[r] = alpha
            cuda.syncthreads()

            # acc = acc * alpha + P V for this thread's (O_TM x O_TD) block: one outer product of a column of P^T
            # and a row of V per key.
            for i in range(O_TM):
                alpha = row_scale[o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM]
                for j in range(O_TD):
                    acc[i, j] *= alpha
            for key0 in range(0, BN, N_STEPS):
                p_key0, v_key0 = uint64(key0 * BM) + o_row0, uint64(key0 * DB) + o_col0
                for kk in range(N_STEPS):
                    for i in range(O_TM):
                        a_reg[i] = p_t[p_key0 + uint64(kk * BM + (i // O_RM) * O_GAP_M + i % O_RM)]
                    for j in range(O_TD):
                        b_reg[j] = kv[v_key0 + uint64(kk * DB + (j // O_RD) * O_GAP_D + j % O_RD)]
                    for i in range(O_TM):
                        for j in range(O_TD):
                            acc[i, j] += a_reg[i] * b_reg[j]
            cuda.syncthreads()

        for i in range(O_TM):
            r = o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM
            row = m0 + r
            if row < seqlen_q:
                total = row_sum[r]
                inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                for j in range(O_TD):
                    d = o_tc * O_RD + (j // O_RD) * O_GAP_D + j % O_RD
                    if d < head_dim_v:
                        out[ab, q0 + row, h, d] = STORE(nan_if_not_finite(acc[i, j] * inv))
        if cuda.syncthreads_or(int32(v_nonfinite_seen)):
            # Rare: V held an inf or NaN, loaded as 0. Each row that sees such a key gets NaN in its column (p * inf
            # or p * NaN is not finite whatever p is), read again from global memory: this runs once per block.
            # Written over the output just stored, not into acc: indexing acc from these loops, which the compiler
            # does not unroll once score_mod_hides is inlined, would move it to local memory for the whole kernel.
            for i in range(O_TM):
                row = m0 + o_tr * O_RM + (i // O_RM) * O_GAP_M + i % O_RM
                for key in range(lo, hi):
                    if row < seqlen_q and sees(row, key, seqlen_q, seqlen_k, offset, window_left, window_right,
                                                bias_h, b, h) and not score_mod_hides(
                            q, k, b, h, hk, row, key, head_dim, qmult, capmult, slope, offset, bias_h, seqlen_q,
                            seqlen_k):
                        for j in range(O_TD):
                            d = o_tc * O_RD + (j // O_RD) * O_GAP_D + j % O_RD
                            if d < head_dim_v and not abs(LOAD(v[ab, k0 + key, hk, d])) < float32(math.inf):
                                out[ab, q0 + row, h, d] = STORE(nan)
        for r in range(t, BM, NT):
            row = m0 + r
            if row < seqlen_q:
                total = row_sum[r]
                # float32 under the simulator too, as on a GPU; -inf where no key was seen (Python's log2 raises)
                log2_total = float32(math.log2(total)) if total > float32(0.0) else float32(-math.inf)
                if stats_on:   # the backward takes them where lse is what they give (spec.TAIL_ARGS)
                    row_stats[0, ab, h, q0 + row] = row_max[r]
                    row_stats[1, ab, h, q0 + row] = log2_total
                if total > float32(0.0):
                    lse[ab, h, q0 + row] = (row_max[r] + log2_total) * float32(LN2)
                elif total != total:   # poisoned
                    lse[ab, h, q0 + row] = nan
                else:                  # sees no key
                    lse[ab, h, q0 + row] = float32(math.inf)

    return cuda.jit(flash_forward_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_forward_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout, v.mods,
                               **v.factory_switches())
