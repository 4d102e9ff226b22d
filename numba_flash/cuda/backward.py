"""Backward kernels, FlashAttention-2 style: a delta pre-pass, a dK/dV kernel over key tiles, a dQ kernel over
query tiles.

dQ gets its own pass instead of atomics from the dK/dV kernel: float atomics add in whatever order the blocks
finish, so dQ would change in its last bits from run to run, and the contract's backends are deterministic. The
price is recomputing the scores once more (about 1.4x the work of an atomic dQ).

Scores are recomputed in the log2 domain exactly as the forward computed them (Q pre-multiplied by
``scale * log2(e)``, or ``scale / softcap`` with softcap), and ``P = exp2(s - lse * log2(e))``. Masked entries,
padded rows and rows with ``lse = +inf`` (no visible key) get ``P = 0`` and ``dS = 0`` and contribute nothing;
rows the forward poisoned (lse NaN) get NaN wherever they see a key, and a non-finite Q, dO or K tile goes through
a product that skips masked pairs (the non-finite rule: masks.py).

Arrays reach the kernels as (B, S, H, D) views with any strides; lse and delta are (B, Hq, Sq) float32. bfloat16
arrays arrive as int16 bit patterns, for kernels built with ``bf16`` (see dtypes.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level (not in the factories): the simulator swaps the kernel's global `cuda` for its
# fake module, which a closure variable would escape. Only launch.py and compile_check.py import this module.
from numba import cuda, float32, int32, uint32

from .config import FlashAttentionConfig
from .dtypes import element_io
from .masks import (LOG2E, bias_head, make_bias_tile, make_biases, make_dropout_tile, make_key_rows_product,
                    make_visible, nan_if_not_finite)
from .tiles import make_tile_load


@functools.lru_cache(maxsize=None)
def make_delta_kernel(bf16: bool) -> Any:
    """``delta[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d]`` in float32, one thread per row.
    Launch with ``ceil(B * Hq * Sq / 128)`` blocks of 128 threads; arguments dout, out (B, Sq, Hq, D) float32 or
    float16 (int16 bfloat16 bits with ``bf16``), any strides, delta (B, Hq, Sq) float32, then seqlen_q, nheads_q,
    head_dim, total rows (ints)."""
    LOAD = element_io(bf16)[0]

    def flash_delta_kernel(dout, out, delta, seqlen_q, nheads_q, head_dim, rows):
        idx = cuda.grid(1)
        if idx < rows:
            i = idx % seqlen_q
            bh = idx // seqlen_q
            h = bh % nheads_q
            b = bh // nheads_q
            total = float32(0.0)
            for d in range(head_dim):
                total += LOAD(dout[b, i, h, d]) * LOAD(out[b, i, h, d])
            delta[b, h, i] = total

    return cuda.jit(flash_delta_kernel)


def _checked(cfg: FlashAttentionConfig) -> None:
    why = cfg.problems(1 << 62)
    if why:
        raise ValueError(f"{cfg}: " + "; ".join(why))


@cuda.jit(device=True, inline="always")
def row_stats(lse, delta, b, h, row, seqlen_q):
    """(lse in log2 units, delta) of query ``row``; (inf, 0) past the sequence, so that its P and dS are 0."""
    if row < seqlen_q:
        return lse[b, h, row] * float32(LOG2E), delta[b, h, row]
    return float32(math.inf), float32(0.0)


@functools.lru_cache(maxsize=None)
def make_dkdv_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool,
                     bf16: bool, alibi: bool = False, has_bias: bool = False, dropout: bool = False) -> Any:
    """dK and dV: one block per (key tile, kv head, batch). The block loops over the query heads of its GQA group
    and over the query tiles that can see its keys, so dK and dV are summed over the group in registers, no atomics.

    Launch with grid ``(ceil(Sk / block_n), Hkv, B)`` and ``cfg.threads`` threads, arguments:
      q, dout (B, Sq, Hq, D), k, v (B, Sk, Hkv, D): float32 or float16 (int16 bfloat16 bits with ``bf16``), any
      strides;
      lse, delta (B, Hq, Sq) float32; dk, dv (B, Sk, Hkv, D) like k;
      seqlen_q, seqlen_k, head_dim, group, window_left, window_right: ints;
      qmult (as the forward's), capmult (softcap * log2(e)), scale: float32;
      slopes (B, Hq) float32, bias (4 dimensions) float32 and the five dropout scalars, as the forward's.
    """
    _checked(cfg)
    BM, BN, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    S_TR, S_TC = cfg.score_grid
    G_TR, G_TC = cfg.kv_grid
    S_TM, S_TN = BM // S_TR, BN // S_TC
    G_TN, G_TD = BN // G_TR, DB // G_TC      # dK/dV elements per thread: key rows x head-dim columns
    LD, LDP = DB + 1, BN + 1
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, HAS_BIAS = has_left, has_right, softcap, alibi, has_bias
    DROPOUT = dropout
    STORE = element_io(bf16)[1]
    visible = make_visible(has_left, has_right)
    add_biases = make_biases(alibi, has_bias)
    load_bias = make_bias_tile(BM, BN, NT, False, 0)
    load_x = make_tile_load(BM, DB, NT, bf16)     # query-side tiles: Q, dO
    load_kv = make_tile_load(BN, DB, NT, bf16)    # key-side tiles: K, V
    add_visible_products = make_key_rows_product(BM, G_TN, G_TD, G_TR, G_TC, has_left, has_right, has_bias)
    apply_dropout = make_dropout_tile(BM, BN, NT, True)

    def flash_dkdv_kernel(q, k, v, dout, lse, delta, dk, dv, seqlen_q, seqlen_k, head_dim, group, window_left,
                          window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                          batch0):
        t = cuda.threadIdx.x
        n0 = cuda.blockIdx.x * BN
        hk = cuda.blockIdx.y
        b = cuda.blockIdx.z

        k_s = cuda.shared.array((BN, LD), float32)
        v_s = cuda.shared.array((BN, LD), float32)
        x_s = cuda.shared.array((BM, LD), float32)    # scaled Q, then dO, then unscaled Q
        p_s = cuda.shared.array((BM, LDP), float32)
        ds_s = cuda.shared.array((BM, LDP), float32)
        lse_s = cuda.shared.array(BM, float32)        # log2 domain
        delta_s = cuda.shared.array(BM, float32)

        dk_acc = cuda.local.array((G_TN, G_TD), float32)
        dv_acc = cuda.local.array((G_TN, G_TD), float32)
        s = cuda.local.array((S_TM, S_TN), float32)
        dcap = cuda.local.array((S_TM, S_TN), float32)
        dp = cuda.local.array((S_TM, S_TN), float32)
        sa_reg = cuda.local.array(S_TM, float32)
        sb_reg = cuda.local.array(S_TN, float32)
        ga_reg = cuda.local.array(G_TN, float32)
        gb_reg = cuda.local.array(G_TD, float32)
        for i in range(G_TN):
            for j in range(G_TD):
                dk_acc[i, j] = float32(0.0)
                dv_acc[i, j] = float32(0.0)

        load_kv(k_s, k, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
        load_kv(v_s, v, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)

        # Query rows that can see any key of the tile: row i sees key j iff
        # j - offset - right <= i <= j - offset + left.
        offset = seqlen_k - seqlen_q
        last_key = min(n0 + BN, seqlen_k) - 1
        i_lo = 0
        i_hi = seqlen_q
        if HAS_RIGHT:
            i_lo = max(0, n0 - offset - window_right)
        if HAS_LEFT:
            i_hi = min(seqlen_q, last_key - offset + window_left + 1)
        m_start = (i_lo // BM) * BM

        s_tr = t // S_TC
        s_tc = t - s_tr * S_TC
        g_tr = t // G_TC
        g_tc = t - g_tr * G_TC
        # Unsigned copies for the product loops' shared-memory indices (see the forward kernel).
        s_tr_u, s_tc_u, g_tr_u, g_tc_u = uint32(s_tr), uint32(s_tc), uint32(g_tr), uint32(g_tc)

        for g in range(group):
            h = hk * group + g
            slope = float32(0.0)
            if ALIBI:
                slope = slopes[b, h]
            bias_h = bias_head(bias, b, h)
            for m0 in range(m_start, i_hi, BM):
                cuda.syncthreads()   # the previous iteration's readers of x_s, ds_s are done
                load_x(x_s, q, b, m0, h, seqlen_q, head_dim, qmult, t)
                if HAS_BIAS:   # dS's buffer holds the bias tile until dS overwrites it in place
                    load_bias(ds_s, bias_h, m0, n0, seqlen_q, seqlen_k, t)
                # row_stats written out: inside this loop an inlined helper's lines would mislead the perf model
                for r in range(t, BM, NT):
                    row = m0 + r
                    if row < seqlen_q:
                        lse_s[r] = lse[b, h, row] * float32(LOG2E)
                        delta_s[r] = delta[b, h, row]
                    else:
                        lse_s[r] = float32(math.inf)
                        delta_s[r] = float32(0.0)
                cuda.syncthreads()

                # P for this thread's score block, kept in s; the softcap derivative 1 - tanh^2 in dcap.
                for i in range(S_TM):
                    for j in range(S_TN):
                        s[i, j] = float32(0.0)
                for d in range(DB):
                    for i in range(S_TM):
                        sa_reg[i] = x_s[s_tr_u + uint32(S_TR * i), uint32(d)]
                    for j in range(S_TN):
                        sb_reg[j] = k_s[s_tc_u + uint32(S_TC * j), uint32(d)]
                    for i in range(S_TM):
                        for j in range(S_TN):
                            s[i, j] += sa_reg[i] * sb_reg[j]
                # (A poisoned row has lse NaN, so its visible P, and then its dS, are NaN.)
                for i in range(S_TM):
                    r = s_tr + S_TR * i
                    row = m0 + r
                    for j in range(S_TN):
                        c = s_tc + S_TC * j
                        col = n0 + c
                        x = s[i, j]
                        if SOFTCAP:
                            th = math.tanh(x)
                            dcap[i, j] = float32(1.0) - th * th
                            x = capmult * th
                        else:
                            dcap[i, j] = float32(1.0)
                        bias_value = ds_s[r, c] if HAS_BIAS else float32(0.0)
                        x = add_biases(x, slope, row, col, offset, bias_value)
                        ok = visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h)
                        if HAS_BIAS:
                            ok = ok & (bias_value != float32(-math.inf))
                        p = math.exp2(x - lse_s[r]) if ok else float32(0.0)
                        s[i, j] = p
                        p_s[r, c] = p
                cuda.syncthreads()
                if DROPOUT:   # dV takes the kept probabilities, scaled (s keeps P for dS)
                    apply_dropout(p_s, seed_lo, seed_hi, threshold, dscale, b + batch0, h, m0, n0, t)

                do_probe = load_x(x_s, dout, b, m0, h, seqlen_q, head_dim, float32(1.0), t)
                do_nonfinite = cuda.syncthreads_or(int32(do_probe != do_probe))

                # dP = dO . V^T, then dS = P * (dP - delta) (times the softcap derivative).
                for i in range(S_TM):
                    for j in range(S_TN):
                        dp[i, j] = float32(0.0)
                for d in range(DB):
                    for i in range(S_TM):
                        sa_reg[i] = x_s[s_tr_u + uint32(S_TR * i), uint32(d)]
                    for j in range(S_TN):
                        sb_reg[j] = v_s[s_tc_u + uint32(S_TC * j), uint32(d)]
                    for i in range(S_TM):
                        for j in range(S_TN):
                            dp[i, j] += sa_reg[i] * sb_reg[j]
                # dS is 0 for a masked pair by a select: dP there may be NaN (a non-finite V or dO).
                for i in range(S_TM):
                    r = s_tr + S_TR * i
                    for j in range(S_TN):
                        c = s_tc + S_TC * j
                        ok = visible(m0 + r, n0 + c, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h)
                        if HAS_BIAS:
                            ok = ok & (ds_s[r, c] != float32(-math.inf))
                        if DROPOUT:   # dS = P (Z dP / (1 - p) - delta), and p_s holds P Z / (1 - p)
                            ds = (p_s[r, c] * dp[i, j] - s[i, j] * delta_s[r]) * dcap[i, j]
                        else:
                            ds = s[i, j] * (dp[i, j] - delta_s[r]) * dcap[i, j]
                        ds_s[r, c] = ds if ok else float32(0.0)

                # dV += P^T . dO for this thread's (key rows x head-dim columns) block.
                if do_nonfinite:
                    add_visible_products(dv_acc, p_s, x_s, m0, n0, g_tr, g_tc, seqlen_q, seqlen_k, offset,
                                         window_left, window_right, bias_h)
                else:
                    for m in range(BM):
                        for i in range(G_TN):
                            ga_reg[i] = p_s[uint32(m), g_tr_u + uint32(G_TR * i)]
                        for j in range(G_TD):
                            gb_reg[j] = x_s[uint32(m), g_tc_u + uint32(G_TC * j)]
                        for i in range(G_TN):
                            for j in range(G_TD):
                                dv_acc[i, j] += ga_reg[i] * gb_reg[j]
                cuda.syncthreads()

                q_probe = load_x(x_s, q, b, m0, h, seqlen_q, head_dim, float32(1.0), t)
                q_nonfinite = cuda.syncthreads_or(int32(q_probe != q_probe))

                # dK += dS^T . Q (the softmax scale is applied once, at the end).
                if q_nonfinite:
                    add_visible_products(dk_acc, ds_s, x_s, m0, n0, g_tr, g_tc, seqlen_q, seqlen_k, offset,
                                         window_left, window_right, bias_h)
                else:
                    for m in range(BM):
                        for i in range(G_TN):
                            ga_reg[i] = ds_s[uint32(m), g_tr_u + uint32(G_TR * i)]
                        for j in range(G_TD):
                            gb_reg[j] = x_s[uint32(m), g_tc_u + uint32(G_TC * j)]
                        for i in range(G_TN):
                            for j in range(G_TD):
                                dk_acc[i, j] += ga_reg[i] * gb_reg[j]

        for i in range(G_TN):
            key = n0 + g_tr + G_TR * i
            if key < seqlen_k:
                for j in range(G_TD):
                    d = g_tc + G_TC * j
                    if d < head_dim:
                        dk[b, key, hk, d] = STORE(nan_if_not_finite(dk_acc[i, j] * scale))
                        dv[b, key, hk, d] = STORE(nan_if_not_finite(dv_acc[i, j]))

    return cuda.jit(flash_dkdv_kernel)


@functools.lru_cache(maxsize=None)
def make_dq_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                   alibi: bool = False, has_bias: bool = False, dropout: bool = False) -> Any:
    """dQ: one block per (query tile, query head, batch), looping over the key tiles its rows can see.

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments:
      q, dout (B, Sq, Hq, D), k, v (B, Sk, Hkv, D): float32 or float16 (int16 bfloat16 bits with ``bf16``), any
      strides;
      lse, delta (B, Hq, Sq) float32; dq (B, Sq, Hq, D) like q;
      seqlen_q, seqlen_k, head_dim, group, window_left, window_right: ints;
      qmult, capmult, scale: float32, slopes and bias float32, the dropout scalars (as for the dK/dV kernel).
    """
    _checked(cfg)
    BM, BN, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    S_TR, S_TC = cfg.score_grid
    O_TR, O_TC = cfg.out_grid
    S_TM, S_TN = BM // S_TR, BN // S_TC
    O_TM, O_TD = BM // O_TR, DB // O_TC
    LD, LDP = DB + 1, BN + 1
    HAS_LEFT, HAS_RIGHT, SOFTCAP, ALIBI, HAS_BIAS = has_left, has_right, softcap, alibi, has_bias
    DROPOUT = dropout
    STORE = element_io(bf16)[1]
    visible = make_visible(has_left, has_right)
    add_biases = make_biases(alibi, has_bias)
    load_bias = make_bias_tile(BM, BN, NT, False, 0)
    dropout_factors = make_dropout_tile(BM, BN, NT, False)
    load_x = make_tile_load(BM, DB, NT, bf16)     # query-side tiles: Q, dO
    load_kv = make_tile_load(BN, DB, NT, bf16)    # key-side tiles: K, V

    def flash_dq_kernel(q, k, v, dout, lse, delta, dq, seqlen_q, seqlen_k, head_dim, group, window_left,
                        window_right, qmult, capmult, scale, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                        batch0):
        t = cuda.threadIdx.x
        m0 = cuda.blockIdx.x * BM
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // group
        slope = float32(0.0)
        if ALIBI:
            slope = slopes[b, h]
        bias_h = bias_head(bias, b, h)

        q_s = cuda.shared.array((BM, LD), float32)
        do_s = cuda.shared.array((BM, LD), float32)
        kv_s = cuda.shared.array((BN, LD), float32)   # K, then V, then K again
        ds_s = cuda.shared.array((BM, LDP), float32)

        acc = cuda.local.array((O_TM, O_TD), float32)
        p = cuda.local.array((S_TM, S_TN), float32)
        dp = cuda.local.array((S_TM, S_TN), float32)
        row_lse = cuda.local.array(S_TM, float32)
        row_delta = cuda.local.array(S_TM, float32)
        sa_reg = cuda.local.array(S_TM, float32)
        sb_reg = cuda.local.array(S_TN, float32)
        a_reg = cuda.local.array(O_TM, float32)
        b_reg = cuda.local.array(O_TD, float32)
        for i in range(O_TM):
            for j in range(O_TD):
                acc[i, j] = float32(0.0)

        load_x(q_s, q, b, m0, h, seqlen_q, head_dim, qmult, t)
        load_x(do_s, dout, b, m0, h, seqlen_q, head_dim, float32(1.0), t)

        s_tr = t // S_TC
        s_tc = t - s_tr * S_TC
        o_tr = t // O_TC
        o_tc = t - o_tr * O_TC
        # Unsigned copies for the product loops' shared-memory indices (see the forward kernel).
        s_tr_u, s_tc_u, o_tr_u, o_tc_u = uint32(s_tr), uint32(s_tc), uint32(o_tr), uint32(o_tc)
        for i in range(S_TM):
            row_lse[i], row_delta[i] = row_stats(lse, delta, b, h, m0 + s_tr + S_TR * i, seqlen_q)

        offset = seqlen_k - seqlen_q
        last_row = min(m0 + BM, seqlen_q) - 1
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, m0 + offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, last_row + offset + window_right + 1)
        n_start = (lo // BN) * BN

        for n0 in range(n_start, hi, BN):
            cuda.syncthreads()   # previous iteration's readers of kv_s are done (and the Q/dO loads visible)
            load_kv(kv_s, k, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
            if HAS_BIAS:   # dS's buffer holds the bias tile until dS overwrites it in place
                load_bias(ds_s, bias_h, m0, n0, seqlen_q, seqlen_k, t)
            cuda.syncthreads()

            for i in range(S_TM):
                for j in range(S_TN):
                    p[i, j] = float32(0.0)
            for d in range(DB):
                for i in range(S_TM):
                    sa_reg[i] = q_s[s_tr_u + uint32(S_TR * i), uint32(d)]
                for j in range(S_TN):
                    sb_reg[j] = kv_s[s_tc_u + uint32(S_TC * j), uint32(d)]
                for i in range(S_TM):
                    for j in range(S_TN):
                        p[i, j] += sa_reg[i] * sb_reg[j]
            for i in range(S_TM):
                row = m0 + s_tr + S_TR * i
                lse_i = row_lse[i]
                if HAS_BIAS:   # read again per tile (cache hits): registers are short at D = 32 with attn_bias
                    lse_i = row_stats(lse, delta, b, h, row, seqlen_q)[0]
                for j in range(S_TN):
                    col = n0 + s_tc + S_TC * j
                    # P times softcap's chain factor: dS needs nothing else from the scores, and a separate
                    # (S_TM x S_TN) factor would not fit the registers of the D = 32 tiles with ALiBi on.
                    bias_value = float32(0.0)
                    if HAS_BIAS:
                        bias_value = ds_s[s_tr_u + uint32(S_TR * i), s_tc_u + uint32(S_TC * j)]
                    x = p[i, j]
                    dcap = float32(1.0)
                    if SOFTCAP:
                        th = math.tanh(x)
                        dcap = float32(1.0) - th * th
                        x = capmult * th
                    x = add_biases(x, slope, row, col, offset, bias_value)
                    ok = visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h)
                    if HAS_BIAS:
                        ok = ok & (bias_value != float32(-math.inf))
                    # A masked pair's P is -0 with attn_bias: the dS pass tells it by its sign (a visible P, even
                    # one that underflows, is +0, and a NaN is not 0), with no second read of the bias or the mask.
                    p[i, j] = math.exp2(x - lse_i) * dcap if ok else float32(-0.0 if HAS_BIAS else 0.0)
            cuda.syncthreads()

            load_kv(kv_s, v, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
            if DROPOUT:   # the bias tile is read: dS's buffer takes the dropout factors
                dropout_factors(ds_s, seed_lo, seed_hi, threshold, dscale, b + batch0, h, m0, n0, t)
            cuda.syncthreads()

            for i in range(S_TM):
                for j in range(S_TN):
                    dp[i, j] = float32(0.0)
            for d in range(DB):
                for i in range(S_TM):
                    sa_reg[i] = do_s[s_tr_u + uint32(S_TR * i), uint32(d)]
                for j in range(S_TN):
                    sb_reg[j] = kv_s[s_tc_u + uint32(S_TC * j), uint32(d)]
                for i in range(S_TM):
                    for j in range(S_TN):
                        dp[i, j] += sa_reg[i] * sb_reg[j]
            # dS is 0 for a masked pair by a select: dP there may be NaN (a non-finite V or dO).
            for i in range(S_TM):
                r = s_tr + S_TR * i
                delta_i = row_delta[i]
                if HAS_BIAS:
                    delta_i = row_stats(lse, delta, b, h, m0 + r, seqlen_q)[1]
                for j in range(S_TN):
                    c = s_tc + S_TC * j
                    if HAS_BIAS:   # masked (by the bias too) iff P is -0, as the score loop left it
                        ok = (p[i, j] != float32(0.0)) | (math.copysign(float32(1.0), p[i, j]) > float32(0.0))
                    else:
                        ok = visible(m0 + r, n0 + c, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h)
                    dp_kept = dp[i, j]
                    if DROPOUT:   # the factor from the tile, overwritten here by dS
                        dp_kept *= ds_s[r, c]
                    ds_s[r, c] = p[i, j] * (dp_kept - delta_i) if ok else float32(0.0)
            cuda.syncthreads()

            k_probe = load_kv(kv_s, k, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
            k_nonfinite = cuda.syncthreads_or(int32(k_probe != k_probe))

            # dQ += dS . K for this thread's (O_TM x O_TD) block.
            if k_nonfinite:
                # Rare: K holds an inf or NaN, which 0 * x would carry into rows that do not see its key.
                for n in range(BN):
                    for i in range(O_TM):
                        r = o_tr + O_TR * i
                        a = ds_s[r, n]
                        if HAS_BIAS:
                            # A row that sees such a key is poisoned (its score there is not finite), so its dS is
                            # NaN at every key it sees, and dS is 0 exactly at the pairs to skip: the masked ones,
                            # and any with a finite key, where skipping adds nothing. No bias read again (the
                            # registers of the D = 32 tiles have no room for it).
                            seen = a != float32(0.0)
                        else:
                            seen = visible(m0 + r, n0 + n, seqlen_q, seqlen_k, offset, window_left, window_right,
                                           bias_h)
                        for j in range(O_TD):
                            x = acc[i, j] + a * kv_s[n, o_tc + O_TC * j]
                            acc[i, j] = x if seen else acc[i, j]
            else:
                for n in range(BN):
                    for i in range(O_TM):
                        a_reg[i] = ds_s[o_tr_u + uint32(O_TR * i), uint32(n)]
                    for j in range(O_TD):
                        b_reg[j] = kv_s[uint32(n), o_tc_u + uint32(O_TC * j)]
                    for i in range(O_TM):
                        for j in range(O_TD):
                            acc[i, j] += a_reg[i] * b_reg[j]

        for i in range(O_TM):
            row = m0 + o_tr + O_TR * i
            if row < seqlen_q:
                for j in range(O_TD):
                    d = o_tc + O_TC * j
                    if d < head_dim:
                        dq[b, row, h, d] = STORE(nan_if_not_finite(acc[i, j] * scale))

    return cuda.jit(flash_dq_kernel)
