"""The forward kernel: one block per (query tile, query head, batch), online softmax over key tiles.

The block keeps its float32 Q tile (pre-multiplied by ``scale * log2(e)`` so that the softmax can use ``exp2``) in
shared memory, streams K and then V of each key tile through one shared buffer, and keeps the output accumulator
in registers: each thread owns a small strided ``rows x cols`` block of the (block_m x D) accumulator and of the
(block_m x block_n) score tile ("register blocking"), so no thread ever holds a whole D = 256 row.

Arrays reach the kernels as (B, S, H, D) views with any strides; ``lse`` is (B, Hq, Sq) float32. bfloat16 arrays
arrive as int16 bit patterns and the kernel built for them widens on load and rounds on store (see dtypes.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level (not in the factories): the simulator swaps the kernel's global `cuda` for its
# fake module, which a closure variable would escape. Only launch.py and compile_check.py import this module.
from numba import cuda, float32, uint32

from .config import FlashAttentionConfig
from .dtypes import element_io
from .tiles import make_tile_load

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def _grids(cfg: FlashAttentionConfig) -> tuple[int, int, int, int]:
    """Thread grid of the score tile and of the output accumulator, checked."""
    why = cfg.problems(1 << 62)
    if why:
        raise ValueError(f"{cfg}: " + "; ".join(why))
    (s_tr, s_tc), (o_tr, o_tc) = cfg.score_grid, cfg.out_grid
    return s_tr, s_tc, o_tr, o_tc


@functools.lru_cache(maxsize=None)
def make_forward_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool,
                        bf16: bool) -> Any:
    """The forward kernel for one tile config, mask kind and element kind (a ``numba.cuda`` dispatcher, compiled
    lazily).

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments:
      q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D): float32 or float16, or with ``bf16`` int16 arrays holding
      bfloat16 bit patterns; any strides;
      out (B, Sq, Hq, D) like q; lse (B, Hq, Sq) float32;
      seqlen_q, seqlen_k, head_dim, group (= Hq // Hkv), window_left, window_right: ints;
      qmult: float32, scale * log2(e), or scale / softcap when softcap is on;
      capmult: float32, softcap * log2(e) (unused without softcap).
    float32 and float16 share one dispatcher (numba specialises it on the array types it is called with); bfloat16
    bits need their own, since an int16 element must be widened, not converted.
    """
    BM, BN, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    S_TR, S_TC, O_TR, O_TC = _grids(cfg)
    S_TM, S_TN = BM // S_TR, BN // S_TC      # score elements per thread
    O_TM, O_TD = BM // O_TR, DB // O_TC      # accumulator elements per thread
    LD, LDP = DB + 1, BN + 1                 # +1: rows start in different banks
    HAS_LEFT, HAS_RIGHT, SOFTCAP = has_left, has_right, softcap
    STORE = element_io(bf16)[1]
    load_q = make_tile_load(BM, DB, NT, bf16)
    load_kv = make_tile_load(BN, DB, NT, bf16)

    def flash_forward_kernel(q, k, v, out, lse, seqlen_q, seqlen_k, head_dim, group, window_left, window_right,
                             qmult, capmult):
        neg_inf = float32(-math.inf)
        t = cuda.threadIdx.x
        m0 = cuda.blockIdx.x * BM
        h = cuda.blockIdx.y
        b = cuda.blockIdx.z
        hk = h // group

        q_s = cuda.shared.array((BM, LD), float32)
        kv_s = cuda.shared.array((BN, LD), float32)
        p_s = cuda.shared.array((BM, LDP), float32)
        row_max = cuda.shared.array(BM, float32)     # running max, log2 domain
        row_sum = cuda.shared.array(BM, float32)     # running sum of exp2(s - row_max)
        row_scale = cuda.shared.array(BM, float32)   # this tile's rescale factor of the accumulator

        acc = cuda.local.array((O_TM, O_TD), float32)
        s = cuda.local.array((S_TM, S_TN), float32)
        a_reg = cuda.local.array(O_TM, float32)
        b_reg = cuda.local.array(O_TD, float32)
        sa_reg = cuda.local.array(S_TM, float32)
        sb_reg = cuda.local.array(S_TN, float32)
        for i in range(O_TM):
            for j in range(O_TD):
                acc[i, j] = float32(0.0)

        # Tile loads (tiles.py): rows past the sequence and columns past head_dim become 0 and add nothing.
        load_q(q_s, q, b, m0, h, seqlen_q, head_dim, qmult, t)
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

        s_tr = t // S_TC
        s_tc = t - s_tr * S_TC
        o_tr = t // O_TC
        o_tc = t - o_tr * O_TC
        # Unsigned copies for the product loops' shared-memory indices: numba wraps negative signed indices
        # around (a compare and select per index), unsigned ones it does not, and ptxas then folds the unrolled
        # loops' constant offsets into the loads (54 -> 38 instructions per 16 FFMA of the score loop at D = 64).
        s_tr_u, s_tc_u, o_tr_u, o_tc_u = uint32(s_tr), uint32(s_tc), uint32(o_tr), uint32(o_tc)
        cuda.syncthreads()

        for n0 in range(n_start, hi, BN):
            load_kv(kv_s, k, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
            cuda.syncthreads()

            # Scores of this thread's (S_TM x S_TN) block: s = q_s . k_s^T over the padded head dim.
            for i in range(S_TM):
                for j in range(S_TN):
                    s[i, j] = float32(0.0)
            for d in range(DB):
                for i in range(S_TM):
                    sa_reg[i] = q_s[s_tr_u + uint32(S_TR * i), uint32(d)]
                for j in range(S_TN):
                    sb_reg[j] = kv_s[s_tc_u + uint32(S_TC * j), uint32(d)]
                for i in range(S_TM):
                    for j in range(S_TN):
                        s[i, j] += sa_reg[i] * sb_reg[j]
            for i in range(S_TM):
                r = s_tr + S_TR * i
                row = m0 + r
                for j in range(S_TN):
                    c = s_tc + S_TC * j
                    col = n0 + c
                    x = s[i, j]
                    if SOFTCAP:
                        x = capmult * math.tanh(x)
                    ok = col < seqlen_k
                    if HAS_LEFT:
                        ok = ok and col >= row + offset - window_left
                    if HAS_RIGHT:
                        ok = ok and col <= row + offset + window_right
                    p_s[r, c] = x if ok else neg_inf
            cuda.syncthreads()

            # Every thread is done with K: the buffer takes V while the row pass runs.
            load_kv(kv_s, v, b, n0, hk, seqlen_k, head_dim, float32(1.0), t)
            for r in range(t, BM, NT):
                m_old = row_max[r]
                m_new = m_old
                for c in range(BN):
                    m_new = max(m_new, p_s[r, c])
                # A row with nothing visible yet keeps max -inf; exp2 against 0 then gives 0, never NaN.
                m_use = m_new if m_new != neg_inf else float32(0.0)
                alpha = math.exp2(m_old - m_use)
                total = float32(0.0)
                for c in range(BN):
                    p = math.exp2(p_s[r, c] - m_use)
                    p_s[r, c] = p
                    total += p
                row_max[r] = m_new
                row_sum[r] = row_sum[r] * alpha + total
                row_scale[r] = alpha
            cuda.syncthreads()

            # acc = acc * alpha + P . V for this thread's (O_TM x O_TD) block.
            for i in range(O_TM):
                alpha = row_scale[o_tr + O_TR * i]
                for j in range(O_TD):
                    acc[i, j] *= alpha
            for n in range(BN):
                for i in range(O_TM):
                    a_reg[i] = p_s[o_tr_u + uint32(O_TR * i), uint32(n)]
                for j in range(O_TD):
                    b_reg[j] = kv_s[uint32(n), o_tc_u + uint32(O_TC * j)]
                for i in range(O_TM):
                    for j in range(O_TD):
                        acc[i, j] += a_reg[i] * b_reg[j]
            cuda.syncthreads()

        for i in range(O_TM):
            r = o_tr + O_TR * i
            row = m0 + r
            if row < seqlen_q:
                total = row_sum[r]
                inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                for j in range(O_TD):
                    d = o_tc + O_TC * j
                    if d < head_dim:
                        out[b, row, h, d] = STORE(acc[i, j] * inv)
        for r in range(t, BM, NT):
            row = m0 + r
            if row < seqlen_q:
                total = row_sum[r]
                if total > float32(0.0):
                    lse[b, h, row] = (row_max[r] + math.log2(total)) * float32(LN2)
                else:
                    lse[b, h, row] = float32(math.inf)

    return cuda.jit(flash_forward_kernel)
