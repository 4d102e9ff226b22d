"""The tensor-core forward kernel (float16 and bfloat16, compute capability >= 8.0), FlashAttention-2's shape.

One block per (query tile, query head, batch). Each warp owns ``FRAGMENTS`` fragments of 16 query rows (the tile
config's ``fragments``: ``block_m / (16 * warps)``, 1 or 2) and computes, per key tile, ``S = Q K^T`` and
``O += P V`` with ``mma.sync.m16n8k16`` (float32 accumulation). Each K or V fragment a warp loads from shared
memory feeds the mma of every fragment it owns: with two, two independent mma per ``ldmatrix`` (FlashAttention-2
gives each warp 32 or more rows for that), each fragment keeping its own row statistics (``m_i``, ``l_i``),
accumulators and probabilities; the second fragment's arrays are the first's names with a 1. The online softmax
runs on the accumulator fragments themselves: a lane holds two rows of a fragment (``g`` and ``g + 8``, ``g = lane
// 4``) and two columns per 8-wide tile, so a row's max needs only the 4 lanes of its quad (two ``shfl_xor``), and
its sum stays a per-lane partial until the end. The probabilities never leave registers: the C fragments of two neighbouring
8-key tiles are, element for element, the A fragment of one 16-key step of ``P V`` (warp.py), packed to 16 bits.

K and V tiles are 16-bit in shared memory, swizzled (tc_tiles.py) and filled with ``cp.async``: V's copy runs
while the warp computes the scores, the next K tile's while it computes ``P V``. With D <= 128 the warps keep Q's
fragments in registers for the whole loop and Q's tile shares V's buffer; at D = 256 (at D = 128 with two
fragments) Q stays in shared memory.

Semantics are the float32 kernels' (forward.py): scores in log2 units (``raw * scale * log2(e)``, after the
product, so Q is multiplied exactly by the tensor cores), bottom-right causal/window masks, softcap, ALiBi,
attn_bias, dropout (each lane's keep mask from tc_scores.make_keep_bits), lse, and the contract's non-finite rule:
a visible non-finite score poisons its row; an inf or NaN in V is found when its tile lands (each thread tests the
16-byte chunks it copied, one packed ``x * 0`` per word), zeroed there so that masked pairs' ``0 * inf`` cannot
reach other rows, and after the loop the rows that see such a key get NaN in its columns.

Arrays reach the kernel as (B, S, H, D) uint16 views of the float16 or bfloat16 data (any strides; the
``async_copy`` kernel needs unit stride along D and 16-byte aligned rows: launch.py checks); lse is (B, Hq, Sq)
float32.
"""

from __future__ import annotations

import functools
from typing import Any

from numba import config, cuda, float32, int32, int64, uint16, uint32

from numba_flash.cuda.device import hopper, warp
from numba_flash.cuda.device.block_tiles import make_tile_skip, next_key_tile
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.device.dtypes import load_bf16, load_f16_bits
from numba_flash.cuda.device.masks import bias_head, make_score_mod_hides, make_visible
from numba_flash.cuda.device.sequences import make_locate
from numba_flash.cuda.device.tc_scores import staged_words
from numba_flash.cuda.device.tc_softmax import (finish_rows, make_key_range, make_online_softmax, make_row_start,
                                                make_tile_scores, make_tile_start)
from numba_flash.cuda.device.tc_tiles import (CHUNK, copy_passes, copy_row_step, make_smem_index, make_tile_copy,
                                              make_wgmma_index)
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.kernels.variant import Variant

SMEM_ALIGN = None if config.ENABLE_CUDASIM else 16   # cp.async and ldmatrix move 16-byte aligned chunks
#: wgmma's 128-byte swizzle XORs address bits 4-6 with bits 7-9: its tiles start on 1024-byte boundaries.
WGMMA_ALIGN = None if config.ENABLE_CUDASIM else 1024
#: Exponent bits of a 16-bit float: all set means inf or NaN.
EXPONENT_BITS = {False: 0x7C00, True: 0x7F80}        # float16, bfloat16
QUIET_NAN_BITS = {False: 0x7E00, True: 0x7FC0}


def _checked(cfg: FlashAttentionConfig) -> None:
    why = cfg.problems(1 << 62)
    if why or cfg.spec.role != "forward" or cfg.spec.kind not in ("mma", "wgmma") or cfg.fragments not in (1, 2):
        raise ValueError(f"{cfg}: " + ("; ".join(why) or "not a tensor-core forward config"))


@cuda.jit(device=True, inline="always")
def tile_offset(x, b, row, h):
    """Byte offset of ``x[b, row, h, 0]`` from the data pointer of a (B, S, H, D) array, any strides."""
    return int64(b) * x.strides[0] + int64(row) * x.strides[1] + int64(h) * x.strides[2]


@functools.lru_cache(maxsize=None)
def make_tc_forward_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                           alibi: bool = False, has_bias: bool = False, dropout: bool = False,
                           async_copy: bool = True, mods: CudaMods = NO_MODS, varlen: bool = False) -> Any:
    """The tensor-core forward kernel for one tile config, mask kind and element kind (a ``numba.cuda``
    dispatcher, compiled lazily).

    Launch with grid ``(ceil(Sq / block_m), Hq, B)`` and ``cfg.threads`` threads, arguments as the float32
    kernel's (forward.py) except that q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) and out (B, Sq, Hq,
    Dv) are uint16 bit patterns of float16 (or, with ``bf16``, bfloat16) data; dropout's arguments are read only
    with ``dropout`` (as the float32 kernel's: the row sums and lse are the softmax's, P V takes the kept
    probabilities times 1 / (1 - p)). ``async_copy``: copy tiles with ``cp.async``, which needs unit stride along D
    and rows that start 16-byte aligned (``launch.async_copy_ok``). With ``mods.block_tiles`` the
    key-tile loop skips the tiles the BlockMask's table (``tiles``) calls EMPTY, never copying their keys, and
    stages FULL ones without mask_mod. With ``varlen`` the grid is ``(n_blocks, Hq, 1)`` over the packed
    sequences' block table ``seqs`` (sequences.py), as for the float32 kernel.
    """
    _checked(cfg)
    BLOCK_M, BLOCK_N, HEAD_DIM, NT = cfg.block_m, cfg.block_n, cfg.head_dim_bucket, cfg.threads
    D_STEPS = HEAD_DIM // 16         # k-steps of Q K^T
    N_TILES = BLOCK_N // 8           # 8-key tiles of a warp's scores
    KEY_STEPS = BLOCK_N // 16        # k-steps of P V
    D_TILES = HEAD_DIM // 8          # 8-column tiles of a warp's output
    Q_IN_REGS = cfg.q_in_registers
    # A warp's 16-row fragments: the second one's arrays (named ``...1``) are declared and used only with two.
    FRAGMENTS = cfg.fragments
    TWO_FRAGMENTS = FRAGMENTS == 2
    WARP_ROWS = 16 * FRAGMENTS
    QV_ROWS = max(BLOCK_M, BLOCK_N) if Q_IN_REGS else BLOCK_N
    K_WORDS, V_WORDS = BLOCK_N * HEAD_DIM, QV_ROWS * HEAD_DIM
    Q_WORDS = CHUNK if Q_IN_REGS else BLOCK_M * HEAD_DIM   # Q's own tile only when it stays in shared memory
    Q_PASSES, KV_PASSES = copy_passes(BLOCK_M, HEAD_DIM, NT), copy_passes(BLOCK_N, HEAD_DIM, NT)
    PER_ROW, ROW_STEP = HEAD_DIM // CHUNK, copy_row_step(HEAD_DIM, NT)
    ALIBI = alibi
    EXP, NAN_BITS = EXPONENT_BITS[bf16], QUIET_NAN_BITS[bf16]
    # wgmma (sm_90a): each warpgroup's 64 rows multiply Q K^T and P V with wgmma from shared-memory tiles in
    # tc_tiles.make_wgmma_index's layout (Q stays there); its accumulators are, warp by warp, the mma layout the
    # softmax helpers read, and P goes back as registers in mma's A layout.
    WGMMA = cfg.spec.kind == "wgmma"
    ALIGN = WGMMA_ALIGN if WGMMA else SMEM_ALIGN
    KIND = "bf16" if bf16 else "f16"
    WG_QK = hopper.make_wgmma(BLOCK_N, KIND, False, False) if WGMMA else None
    WG_PV = hopper.make_wgmma(HEAD_DIM, KIND, True, True) if WGMMA else None
    WG_WAIT = hopper.make_wgmma_wait(0)
    FENCE_S, FENCE_O = hopper.make_accumulator_fence(4 * N_TILES), hopper.make_accumulator_fence(4 * D_TILES)
    V_BLOCK_BYTES = 128 * BLOCK_N   # between V's 64-column blocks: the N-major operand's leading byte offset
    MMA_D_STEPS, MMA_KEY_STEPS = (0, 0) if WGMMA else (D_STEPS, KEY_STEPS)   # the mma.sync loops' trip counts
    MMA = warp.mma_bf16 if bf16 else warp.mma_f16
    PACK = warp.pack_bf16x2 if bf16 else warp.pack_f16x2
    PROBE = warp.probe_bf16x2 if bf16 else warp.probe_f16x2
    copy_q = make_tile_copy(BLOCK_M, HEAD_DIM, NT, async_copy, wgmma=WGMMA)
    copy_kv = make_tile_copy(BLOCK_N, HEAD_DIM, NT, async_copy, wgmma=WGMMA)
    smem_index = make_smem_index(HEAD_DIM)
    q_index = make_wgmma_index(BLOCK_M) if WGMMA else smem_index   # Q's tile, and the output staged in it
    kv_index = make_wgmma_index(BLOCK_N) if WGMMA else smem_index
    sees = make_visible(has_left, has_right, has_bias, mods)
    # The mods run outside the score loop (tc_scores.make_mod_stage): mask_mod and bias_mod staged ahead of it,
    # score_mod in a loop of its own after the masks (tc_softmax.make_tile_scores).
    key_range = make_key_range(has_left, has_right, BLOCK_N)
    scores = make_tile_scores(N_TILES, NT, has_left, has_right, softcap, alibi, has_bias, mods)
    softmax = make_online_softmax(N_TILES, D_TILES, dropout)
    start_rows = make_row_start(D_TILES)
    tile_start = make_tile_start(N_TILES, NT, dropout, mods)
    # The second fragment's staged mods sit past the first's: its scores read slot (e, t + SLOT_SHIFT).
    SLOT_SHIFT = staged_words(N_TILES, NT, mods)
    MOD_WORDS = FRAGMENTS * SLOT_SHIFT
    BLOCK_TILES = mods.block_tiles
    tile_skip = make_tile_skip(BLOCK_TILES)
    locate = make_locate(varlen)
    score_mod_hides = make_score_mod_hides(softcap, alibi, has_bias, mods, load_bf16 if bf16 else load_f16_bits)

    # The main loop's products stay written out on its own lines, both fragments', not in helpers: the performance
    # model counts each line's instructions per iteration from the kernel's source (perf_model/counts.py).

    @cuda.jit(device=True, inline="always")
    def stage_out(tile, acc, inv, first_row, g, tq):
        """A fragment's output rows ``first_row + g`` and ``+ 8`` (``acc`` times ``inv``), 16-bit, into ``tile``."""
        for jd in range(D_TILES):
            for half in range(2):
                # x + x * 0: an inf becomes NaN (the contract reports every non-finite result as NaN).
                x0 = acc[jd, 2 * half] * inv[half]
                x1 = acc[jd, 2 * half + 1] * inv[half]
                warp.sts_u32(tile, q_index(first_row + int32(g) + 8 * half, jd) + 2 * tq,
                             PACK(x0 + x0 * float32(0.0), x1 + x1 * float32(0.0)))

    def flash_tc_forward_kernel(q, k, v, out, lse, seqlen_q, seqlen_k, head_dim, group, window_left,
                                window_right, qmult, capmult, slopes, bias, seed_lo, seed_hi, threshold, dscale,
                                batch0, tiles, seqs):
        t = cuda.threadIdx.x
        lane = uint32(t % 32)
        warp_row0 = WARP_ROWS * (t // 32)          # this warp's first row in the tile; its second fragment's + 16
        g, tq = lane >> uint32(2), lane & uint32(3)
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
        row_top = m0 + warp_row0 + int32(g)        # the rows of registers 0, 1; registers 2, 3 hold row_top + 8
        row_top1 = row_top + 16                    # the same, of the second fragment

        k_tile = cuda.shared.array(K_WORDS, uint16, alignment=ALIGN)
        v_tile = cuda.shared.array(V_WORDS, uint16, alignment=ALIGN)
        q_own = cuda.shared.array(Q_WORDS, uint16, alignment=ALIGN)
        q_tile = v_tile if Q_IN_REGS else q_own
        mod_slots = cuda.shared.array(MOD_WORDS, float32)

        q_frag = cuda.local.array((D_STEPS, 4), uint32)
        p_frag = cuda.local.array((KEY_STEPS, 4), uint32)
        s = cuda.local.array((N_TILES, 4), float32)
        acc = cuda.local.array((D_TILES, 4), float32)
        m_i = cuda.local.array(2, float32)         # running max of rows top and top + 8, log2 units
        l_i = cuda.local.array(2, float32)         # this lane's part of their running sums
        start_rows(acc, m_i, l_i)
        q_frag1 = cuda.local.array((D_STEPS, 4), uint32)
        p_frag1 = cuda.local.array((KEY_STEPS, 4), uint32)
        s1 = cuda.local.array((N_TILES, 4), float32)
        acc1 = cuda.local.array((D_TILES, 4), float32)
        m_i1 = cuda.local.array(2, float32)
        l_i1 = cuda.local.array(2, float32)
        if TWO_FRAGMENTS:
            start_rows(acc1, m_i1, l_i1)

        offset, lo, hi, n_start, full_lo, full_hi = key_range(m0, m0 + warp_row0, BLOCK_M, seqlen_q, seqlen_k,
                                                              window_left, window_right)
        full_lo1, full_hi1 = full_lo, full_hi      # the key tiles every row of the second fragment sees whole
        if TWO_FRAGMENTS:
            _, _, _, _, full_lo1, full_hi1 = key_range(m0, m0 + warp_row0 + 16, BLOCK_M, seqlen_q, seqlen_k,
                                                       window_left, window_right)
        lane_col = 2 * int32(tq)                   # this lane's first column in every 8-key tile

        # This thread's share of every tile copy: chunk column c0 of rows r0, r0 + ROW_STEP, ...; byte offsets of
        # (batch, head) in each array, the tile's row added per tile.
        c0 = uint32(t % PER_ROW)
        r0 = uint32(t // PER_ROW)
        d0 = int32(c0 * uint32(CHUNK))
        chunk_bytes = uint32(0)
        if d0 < head_dim:
            chunk_bytes = uint32(2 * min(head_dim - d0, CHUNK))
        head_dim_v = v.shape[3]   # Dv, V's and the output's (both D and Dv within the bucket)
        v_chunk_bytes = uint32(0)
        if d0 < head_dim_v:
            v_chunk_bytes = uint32(2 * min(head_dim_v - d0, CHUNK))

        for c_pass in range(Q_PASSES):
            copy_q(q_tile, q, c_pass, r0, c0, chunk_bytes, q0 + m0, q0 + seqlen_q, tile_offset(q, ab, q0 + m0, h),
                   q.strides[1], ab, h)
        n_first = n_start
        if BLOCK_TILES:   # the first tile that runs: a skipped tile's keys are never copied
            n_first = next_key_tile(tiles, b, h, tile, n_start, hi, BLOCK_N)
        if n_first < hi:
            for c_pass in range(KV_PASSES):
                copy_kv(k_tile, k, c_pass, r0, c0, chunk_bytes, k0 + n_first, k0 + seqlen_k,
                        tile_offset(k, ab, k0 + n_first, hk), k.strides[1], ab, hk)
        warp.cp_async_commit()
        warp.cp_async_wait_all()
        if WGMMA:
            hopper.fence_proxy_async()   # cp.async wrote through the generic proxy; wgmma reads through the async one
        cuda.syncthreads()
        if Q_IN_REGS:
            for kk in range(D_STEPS):
                a0, a1, a2, a3 = warp.ldmatrix_x4(q_tile, smem_index(warp_row0 + 8 * (lm & 1) + lr,
                                                                    2 * kk + (lm >> 1)))
                q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3] = a0, a1, a2, a3
                if TWO_FRAGMENTS:
                    a0, a1, a2, a3 = warp.ldmatrix_x4(q_tile, smem_index(warp_row0 + 16 + 8 * (lm & 1) + lr,
                                                                        2 * kk + (lm >> 1)))
                    q_frag1[kk, 0], q_frag1[kk, 1], q_frag1[kk, 2], q_frag1[kk, 3] = a0, a1, a2, a3
            cuda.syncthreads()                     # V's copies overwrite Q's rows next
        v_nonfinite_seen = False

        for n0 in range(n_start, hi, BLOCK_N):
            # One table entry for the whole block, so every warp skips together, before any barrier of the
            # iteration; no copy is in flight for a skipped tile (the prefetches go to the next tile that runs).
            skip, full_tile = tile_skip(tiles, b, h, tile, n0 // BLOCK_N)
            if skip:   # mask_mod hides every key: K and V never read, so a NaN there cannot poison
                continue
            warp.cp_async_wait_all()               # this K tile; and every warp is past the last tile's P V
            if WGMMA:
                hopper.fence_proxy_async()
            cuda.syncthreads()
            for c_pass in range(KV_PASSES):
                copy_kv(v_tile, v, c_pass, r0, c0, v_chunk_bytes, k0 + n0, k0 + seqlen_k,
                        tile_offset(v, ab, k0 + n0, hk), v.strides[1], ab, hk)
            warp.cp_async_commit()

            kept = tile_start(s, mod_slots, t, b, h, row_top, n0 + lane_col, seqlen_q, seqlen_k, full_tile, seed_lo,
                              seed_hi, threshold, batch0)
            kept1 = kept
            if TWO_FRAGMENTS:
                kept1 = tile_start(s1, mod_slots, t + SLOT_SHIFT, b, h, row_top1, n0 + lane_col, seqlen_q, seqlen_k,
                                   full_tile, seed_lo, seed_hi, threshold, batch0)
            # S = Q K^T: per 16-wide step of the head dim, one ldmatrix gives two 8-key tiles' B fragments, which
            # every fragment's A multiplies. With wgmma, the warpgroup's 64 rows of Q against the whole K tile.
            if WGMMA:
                hopper.wgmma_fence()
                for kk in range(D_STEPS):
                    WG_QK(s, hopper.smem_desc(q_tile, q_index(warp_row0 & ~63, 2 * kk), 16, 1024, 1),
                          hopper.smem_desc(k_tile, kv_index(0, 2 * kk), 16, 1024, 1), 1)
                hopper.wgmma_commit()
                WG_WAIT()
                FENCE_S(s)
            for kk in range(MMA_D_STEPS):
                if Q_IN_REGS:
                    a0, a1, a2, a3 = q_frag[kk, 0], q_frag[kk, 1], q_frag[kk, 2], q_frag[kk, 3]
                    if TWO_FRAGMENTS:
                        e0, e1, e2, e3 = q_frag1[kk, 0], q_frag1[kk, 1], q_frag1[kk, 2], q_frag1[kk, 3]
                else:
                    a0, a1, a2, a3 = warp.ldmatrix_x4(q_tile, smem_index(warp_row0 + 8 * (lm & 1) + lr,
                                                                        2 * kk + (lm >> 1)))
                    if TWO_FRAGMENTS:
                        e0, e1, e2, e3 = warp.ldmatrix_x4(q_tile, smem_index(warp_row0 + 16 + 8 * (lm & 1) + lr,
                                                                            2 * kk + (lm >> 1)))
                for jp in range(N_TILES // 2):
                    b0, b1, b2, b3 = warp.ldmatrix_x4(k_tile, smem_index(16 * jp + 8 * (lm >> 1) + lr,
                                                                        2 * kk + (lm & 1)))
                    j = 2 * jp
                    s[j, 0], s[j, 1], s[j, 2], s[j, 3] = MMA(a0, a1, a2, a3, b0, b1,
                                                             s[j, 0], s[j, 1], s[j, 2], s[j, 3])
                    s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3] = MMA(
                        a0, a1, a2, a3, b2, b3, s[j + 1, 0], s[j + 1, 1], s[j + 1, 2], s[j + 1, 3])
                    if TWO_FRAGMENTS:   # the same B fragments, the second fragment's rows
                        s1[j, 0], s1[j, 1], s1[j, 2], s1[j, 3] = MMA(e0, e1, e2, e3, b0, b1,
                                                                     s1[j, 0], s1[j, 1], s1[j, 2], s1[j, 3])
                        s1[j + 1, 0], s1[j + 1, 1], s1[j + 1, 2], s1[j + 1, 3] = MMA(
                            e0, e1, e2, e3, b2, b3, s1[j + 1, 0], s1[j + 1, 1], s1[j + 1, 2], s1[j + 1, 3])

            scores(s, mod_slots, t, row_top, n0, lane_col, offset, full_lo, full_hi, qmult, capmult, slope, bias_h,
                   b, h, seqlen_q, seqlen_k, window_left, window_right)
            softmax(s, acc, m_i, l_i, kept, dscale)
            # P's C fragments of 8-key tiles 2k and 2k + 1 are the A fragment of 16-key step k.
            for kk in range(KEY_STEPS):
                p_frag[kk, 0] = PACK(s[2 * kk, 0], s[2 * kk, 1])
                p_frag[kk, 1] = PACK(s[2 * kk, 2], s[2 * kk, 3])
                p_frag[kk, 2] = PACK(s[2 * kk + 1, 0], s[2 * kk + 1, 1])
                p_frag[kk, 3] = PACK(s[2 * kk + 1, 2], s[2 * kk + 1, 3])
            if TWO_FRAGMENTS:   # the second fragment's rows: their own statistics, accumulators and mods' slots
                scores(s1, mod_slots, t + SLOT_SHIFT, row_top1, n0, lane_col, offset, full_lo1, full_hi1, qmult,
                       capmult, slope, bias_h, b, h, seqlen_q, seqlen_k, window_left, window_right)
                softmax(s1, acc1, m_i1, l_i1, kept1, dscale)
                for kk in range(KEY_STEPS):
                    p_frag1[kk, 0] = PACK(s1[2 * kk, 0], s1[2 * kk, 1])
                    p_frag1[kk, 1] = PACK(s1[2 * kk, 2], s1[2 * kk, 3])
                    p_frag1[kk, 2] = PACK(s1[2 * kk + 1, 0], s1[2 * kk + 1, 1])
                    p_frag1[kk, 3] = PACK(s1[2 * kk + 1, 2], s1[2 * kk + 1, 3])

            cuda.syncthreads()                     # every warp is done with this K tile: the next one may land
            n_next = n0 + BLOCK_N
            if BLOCK_TILES:
                n_next = next_key_tile(tiles, b, h, tile, n_next, hi, BLOCK_N)
            if n_next < hi:
                for c_pass in range(KV_PASSES):
                    copy_kv(k_tile, k, c_pass, r0, c0, chunk_bytes, k0 + n_next, k0 + seqlen_k,
                            tile_offset(k, ab, k0 + n_next, hk), k.strides[1], ab, hk)
                warp.cp_async_commit()
                warp.cp_async_wait_one()           # V's group, the older one
            else:
                warp.cp_async_wait_all()
            # Each thread tests the V chunks it copied (its own copies are complete for it after the wait); the
            # barrier that publishes the tile also ORs the answer over the block.
            probe = uint32(0)
            for c_pass in range(KV_PASSES):
                r = r0 + uint32(c_pass * ROW_STEP)
                if r < uint32(BLOCK_N):
                    w0, w1, w2, w3 = warp.lds_v4(v_tile, kv_index(r, c0))
                    probe = PROBE(PROBE(PROBE(PROBE(probe, w0), w1), w2), w3)
            if WGMMA:
                hopper.fence_proxy_async()
            probe_nan = ((probe & uint32(0x7FFF)) > uint32(EXP)) | (((probe >> uint32(16)) & uint32(0x7FFF))
                                                                    > uint32(EXP))
            v_nonfinite = cuda.syncthreads_or(int32(probe_nan))
            if v_nonfinite:
                # Rare: V holds an inf or NaN. Zero it here (P V multiplies masked pairs' P = 0 too, and 0 * inf
                # would reach rows that do not see the key); the rows that do see it are made NaN after the loop.
                v_nonfinite_seen = True
                for c_pass in range(KV_PASSES):
                    r = r0 + uint32(c_pass * ROW_STEP)
                    if r < uint32(BLOCK_N):
                        at = kv_index(r, c0)
                        for e in range(CHUNK):
                            if (v_tile[at + uint32(e)] & uint16(EXP)) == uint16(EXP):
                                v_tile[at + uint32(e)] = uint16(0)
                if WGMMA:
                    hopper.fence_proxy_async()
                cuda.syncthreads()

            # O += P V: one transposing ldmatrix gives the B fragments of two 8-column tiles of V, for every
            # fragment's P. With wgmma, P from registers against the whole V tile (N-major), per 16 keys.
            if WGMMA:
                hopper.wgmma_fence()
                for kk in range(KEY_STEPS):
                    WG_PV(acc, p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3],
                          hopper.smem_desc(v_tile, kv_index(16 * kk, 0), V_BLOCK_BYTES, 1024, 1), 1)
                hopper.wgmma_commit()
                WG_WAIT()
                FENCE_O(acc)
            for kk in range(MMA_KEY_STEPS):
                for jdp in range(D_TILES // 2):
                    b0, b1, b2, b3 = warp.ldmatrix_x4_trans(v_tile, smem_index(16 * kk + 8 * (lm & 1) + lr,
                                                                              2 * jdp + (lm >> 1)))
                    jd = 2 * jdp
                    acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3] = MMA(
                        p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], b0, b1,
                        acc[jd, 0], acc[jd, 1], acc[jd, 2], acc[jd, 3])
                    acc[jd + 1, 0], acc[jd + 1, 1], acc[jd + 1, 2], acc[jd + 1, 3] = MMA(
                        p_frag[kk, 0], p_frag[kk, 1], p_frag[kk, 2], p_frag[kk, 3], b2, b3,
                        acc[jd + 1, 0], acc[jd + 1, 1], acc[jd + 1, 2], acc[jd + 1, 3])
                    if TWO_FRAGMENTS:   # the same B fragments, the second fragment's P
                        acc1[jd, 0], acc1[jd, 1], acc1[jd, 2], acc1[jd, 3] = MMA(
                            p_frag1[kk, 0], p_frag1[kk, 1], p_frag1[kk, 2], p_frag1[kk, 3], b0, b1,
                            acc1[jd, 0], acc1[jd, 1], acc1[jd, 2], acc1[jd, 3])
                        acc1[jd + 1, 0], acc1[jd + 1, 1], acc1[jd + 1, 2], acc1[jd + 1, 3] = MMA(
                            p_frag1[kk, 0], p_frag1[kk, 1], p_frag1[kk, 2], p_frag1[kk, 3], b2, b3,
                            acc1[jd + 1, 0], acc1[jd + 1, 1], acc1[jd + 1, 2], acc1[jd + 1, 3])

        # The output goes through shared memory (Q's tile, free now) so that a thread stores whole 16-byte chunks
        # of a row, and so that the accumulators are read once, at constant indices, by a short loop.
        inv = cuda.local.array(2, float32)
        finish_rows(m_i, l_i, inv, lse, ab, h, q0, row_top, tq, seqlen_q)
        inv1 = cuda.local.array(2, float32)
        if TWO_FRAGMENTS:
            finish_rows(m_i1, l_i1, inv1, lse, ab, h, q0, row_top1, tq, seqlen_q)
        cuda.syncthreads()                         # every warp is done reading V's tile, which Q's may share
        stage_out(q_tile, acc, inv, warp_row0, g, tq)
        if TWO_FRAGMENTS:
            stage_out(q_tile, acc1, inv1, warp_row0 + 16, g, tq)
        if v_nonfinite_seen:
            # Each row that sees a key whose V holds an inf or NaN gets NaN in that column (p * inf or p * NaN is
            # not finite whatever p is), read again from global memory: once per block, and only then. Written
            # over the staged output by the lane that staged it.
            for key in range(lo, hi):
                for half in range(2 * FRAGMENTS):   # 8-row halves: fragment half // 2, its rows g or g + 8
                    row = warp_row0 + int32(g) + 8 * half
                    if sees(m0 + row, key, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b, h) and \
                            not score_mod_hides(q, k, b, h, hk, m0 + row, key, head_dim, qmult, capmult, slope,
                                                offset, bias_h, seqlen_q, seqlen_k):
                        for d in range(lane_col, head_dim_v):
                            if (d - lane_col) % 8 < 2 and (v[ab, k0 + key, hk, d] & uint16(EXP)) == uint16(EXP):
                                q_tile[q_index(row, d // 8) + uint32(d % 8)] = uint16(NAN_BITS)
        cuda.syncthreads()
        for c_pass in range(Q_PASSES):
            r = r0 + uint32(c_pass * ROW_STEP)
            row = m0 + int32(r)
            if r < uint32(BLOCK_M) and row < seqlen_q:
                at = q_index(r, c0)
                for e in range(CHUNK):
                    if d0 + e < head_dim_v:
                        out[ab, q0 + row, h, d0 + e] = q_tile[at + uint32(e)]

    return cuda.jit(flash_tc_forward_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py)."""
    return make_tc_forward_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi, v.bias, v.dropout,
                                  v.async_copy, v.mods, **v.factory_switches())
