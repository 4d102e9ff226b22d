"""Split-KV decoding (flash-decoding) with a KV cache: one launch over (batch, kv head, split), then a merge.

A decoding step has few query rows (Sq new tokens, usually 1) and a long cache that every row reads, so the work
is organised around reading the cache once, in place:

* One block per (split of the keys, tile of ``BLOCK_M`` query rows, kv head, batch). Its rows are every query row
  that reads the kv head: the ``group = Hq / Hkv`` query heads times the ``Sq`` rows, head-major (block row r is
  group row ``m0 + r``: query head ``hk * group + (m0 + r) // Sq``, query row ``(m0 + r) % Sq``). Each key tile of
  ``BLOCK_N`` keys is read from global memory once and used by all of them.
* The keys are read where they are: a dense cache ``(B_cache, S_cache, Hkv, D)`` at row ``cache_batch_idx[b]``
  from ``cache_leftpad[b]``, or a paged one ``(num_blocks, page_size, Hkv, D)`` through ``block_table``. Before
  each tile the block looks up where its ``BLOCK_N`` keys live (``key_page``, ``key_slot``), so the loads of the
  tile are plain indexed reads whatever the cache's kind; a key past the split's end is never read.
* Split-KV: the keys that some row of the sequence sees (the window's span, not the whole cache) are cut into
  ``num_splits`` contiguous parts of equal length, one per block. Each block writes float32 partial outputs,
  normalised by their own sum, and their log-sum-exps in base 2; ``make_split_merge_kernel`` weighs the parts by
  those and writes the output in the input's dtype. Partials are float32 whatever the dtype, so every dtype splits.

Online softmax per row, Triton's names: ``m_i`` (running max, base 2), ``l_i`` (running sum of exp2(s - m_i)),
``acc`` (unnormalised output). Each tile is five barrier-separated steps, all with shared memory and block barriers
only (no warp shuffles, so the Numba CUDA simulator runs the kernel as a GPU does):

1. K of the tile into the shared buffer ``kv``;
2. scores ``s = q . k`` of the valid (row, key) pairs into ``p_s``, with softcap, ALiBi and the masks;
3. V into ``kv`` (K is done), and each row's tile max over its ``THREADS / BLOCK_M`` softmax threads (``seg``);
4. every softmax thread of a row derives the same new max, turns its scores into probabilities, keeps its own
   part of ``l_i``; one writes the row's rescale factor;
5. ``acc = acc * alpha + P V``, each thread owning a strided set of (row, d) accumulators of the rows there are.

The accumulators live in shared memory (``acc_s``), not registers: a register array needs compile-time indices, so
every thread would compute all ``BLOCK_M`` rows' products, most of them padding in a step of one token (group x 1
rows); in shared memory the strided loops run over the valid rows only and every thread has work from
``threads / head_dim`` rows on.

The contract's non-finite rule (masks.py): a visible score that is not finite poisons its row (NaN max, NaN sum,
NaN out and lse); a non-finite V element is loaded as 0, since P V also multiplies masked pairs' P = 0, and once
per block, after the loop, the rows that see such a key get NaN in its columns (read again from global memory).

bfloat16 arrays arrive as int16 bit patterns (dtypes.py); the kernel built for them widens on load and the merge
rounds on store.
"""

from __future__ import annotations

import functools
import math
from typing import Any

# numba.cuda at module level, as in forward.py: the simulator swaps the kernel's global `cuda` for its fake one.
from numba import cuda, float32, int32, int64, uint32

from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.kernels.variant import Variant
from numba_flash.cuda.device.dtypes import element_io
from numba_flash.cuda.device.masks import make_visible, nan_if_not_finite
from numba_flash.cuda.device.score_terms import make_pipeline

LN2 = math.log(2.0)
#: Threads of the merge kernel per query row; the head dim is strided over them.
MERGE_THREADS = 64
#: Multiply-adds per iteration of the two products' loops, which run to the head dim and to the tile's keys rounded
#: up to a multiple of this (not to the bucket and ``BLOCK_N``: no work on padding), so that the loop control is
#: paid once per 4 multiply-adds. Exact: the tiles are zero past the head dim and P is zero past the tile's keys,
#: and the bucket and ``BLOCK_N`` (at least 4, ``config``) are multiples of 4.
STEPS_PER_ITERATION = 4


@cuda.jit(device=True, inline="always")
def trips(start, stop, step):
    """Iterations of ``range(start, stop, step)`` for ``step > 0``. A loop ``for k in range(trips(...))`` with
    ``start + k * step`` inside costs a compare per iteration; numba's own ``range`` with a step works its trip
    count out in signed 64-bit arithmetic with the sign cases, dozens of instructions per loop, which the compiler
    hoists out of the tile loop and keeps in registers. Compared before subtracting: with an unsigned ``start``
    (a thread's index) past ``stop``, the simulator's numpy scalars would wrap where the GPU's signed sum does not."""
    if stop <= start:
        return 0
    return (stop - start + (step - 1)) // step


@functools.lru_cache(maxsize=None)
def make_key_locate(block_n: int, threads: int) -> Any:
    """``locate(key_page, key_slot, block_table, b, cache_row, key_start, page_size, n0, n_keys, t)``: where keys
    ``n0 .. n0 + n_keys - 1`` of batch ``b`` live, into the shared (block_n,) int32 arrays: ``key_page[c]`` is the
    cache row (dense: ``cache_row``) or physical page (paged, ``page_size > 0``: ``block_table[b, pos //
    page_size]``), ``key_slot[c]`` the position there; ``pos = key_start + n0 + c`` is the key's position in the
    sequence's logical cache. Entries from ``n_keys`` on are left as they are (never read)."""
    BN, NT = block_n, threads

    @cuda.jit(device=True, inline="always")
    def locate(key_page, key_slot, block_table, b, cache_row, key_start, page_size, n0, n_keys, t):
        for c_k in range(trips(t, BN, NT)):
            c = t + c_k * NT
            if c < n_keys:
                pos = uint32(key_start + n0 + c)
                if page_size > 0:
                    page = uint32(page_size)
                    key_page[c] = block_table[uint32(b), uint32(pos // page)]
                    key_slot[c] = pos % page
                else:
                    key_page[c] = cache_row
                    key_slot[c] = pos

    return locate


@functools.lru_cache(maxsize=None)
def make_key_tile_load(block_n: int, head_dim_bucket: int, threads: int, bf16: bool, finite_only: bool) -> Any:
    """``load(kv, cache, key_page, key_slot, hk, n_keys, head_dim, t) -> bool``: the tile's keys ``c < n_keys`` of
    kv head ``hk`` from ``cache`` (4 dimensions, any strides; int16 bfloat16 bits with ``bf16``) into the float32
    shared ``kv`` (block_n, >= head_dim_bucket), 0 past ``n_keys`` and ``head_dim``. With ``finite_only`` a
    non-finite element is stored as 0 and the result says whether this thread met one (always False without).
    Consecutive threads take consecutive columns: coalesced reads of a key's row."""
    BN, DB, NT = block_n, head_dim_bucket, threads
    TOTAL = BN * DB
    PASSES = -(-TOTAL // NT)
    RAGGED = TOTAL % NT != 0
    LOAD = element_io(bf16)[0]
    FINITE_ONLY = finite_only

    @cuda.jit(device=True, inline="always")
    def load(kv, cache, key_page, key_slot, hk, n_keys, head_dim, t):
        seen = False
        hk_u, n_keys_u, head_dim_u = uint32(hk), uint32(n_keys), uint32(head_dim)
        for k in range(PASSES):
            e = uint32(t + k * NT)
            if not RAGGED or e < uint32(TOTAL):
                c = uint32(e // uint32(DB))
                d = uint32(e % uint32(DB))
                x = float32(0.0)
                if c < n_keys_u and d < head_dim_u:
                    x = LOAD(cache[uint32(key_page[c]), uint32(key_slot[c]), hk_u, d])
                if FINITE_ONLY:
                    finite = abs(x) < float32(math.inf)
                    seen |= not finite
                    x = x if finite else float32(0.0)
                kv[c, d] = x
        return seen

    return load


@functools.lru_cache(maxsize=None)
def make_decode_kernel(cfg: FlashAttentionConfig, has_left: bool, has_right: bool, softcap: bool, bf16: bool,
                       alibi: bool = False) -> Any:
    """The decode kernel for one tile config (the decode kernel's), mask kind, softcap, ALiBi and element
    kind (a ``numba.cuda`` dispatcher, compiled lazily).

    Launch with grid ``(num_splits * ceil(group * Sq / block_m), Hkv, B)`` and ``cfg.threads`` threads, arguments:
      q (B, Sq, Hq, D): rotated queries, float32 or float16, or with ``bf16`` int16 bfloat16 bits; any strides;
      k_cache, v_cache: like q's dtype, any strides; (B_cache, S_cache, Hkv, D), or paged
      (num_blocks, page_size, Hkv, D);
      seqinfo (B, 3) int32: per sequence its cache row (ignored when paged), first and one-past-last key position
      (``cache_leftpad``, ``cache_seqlens + S_new``); the sequence attends to ``Sk_b = end - start`` keys;
      block_table (B, max_blocks) int32 (any (1, 1) int32 array when not paged);
      part_out (num_splits, B, Hq, Sq, D) float32: each split's output, normalised by its own sum, 0 where the
      row saw no key of the split;
      part_lse (num_splits, B, Hq, Sq) float32: each split's log-sum-exp in base 2 (log2 of the sum of
      exp2(score * log2(e))), +inf where the row saw no key of the split, NaN for a poisoned row;
      seqlen_q, group (= Hq // Hkv), head_dim, page_size (0: not paged), num_splits, window_left, window_right:
      ints, the window bottom-right aligned per sequence (query i sees key j iff
      ``i + Sk_b - Sq - window_left <= j <= i + Sk_b - Sq + window_right``, -1 unbounded);
      qmult: float32, scale * log2(e), or scale / softcap when softcap is on; capmult: softcap * log2(e);
      slopes (B, Hq) float32: ALiBi slopes times log2(e), read only with ``alibi``.
    """
    BM, BN, NT, DB = cfg.block_m, cfg.block_n, cfg.threads, cfg.head_dim_bucket
    TPR = NT // BM                   # softmax threads per query row
    LD, LP = DB + 1, BN + 1          # odd row strides: a warp's column walks hit 32 different banks
    STEPS = STEPS_PER_ITERATION
    HAS_LEFT, HAS_RIGHT, ALIBI = has_left, has_right, alibi
    LOAD = element_io(bf16)[0]
    visible = make_visible(has_left, has_right)
    pipeline = make_pipeline(softcap, alibi, False)
    locate = make_key_locate(BN, NT)
    load_k = make_key_tile_load(BN, DB, NT, bf16, False)
    load_v = make_key_tile_load(BN, DB, NT, bf16, True)

    def flash_decode_kernel(q, k_cache, v_cache, seqinfo, block_table, part_out, part_lse, seqlen_q, group,
                            head_dim, page_size, num_splits, window_left, window_right, qmult, capmult, slopes):
        neg_inf = float32(-math.inf)
        nan = float32(math.nan)
        t = cuda.threadIdx.x
        # Indices and sizes are non-negative: unsigned 32-bit divisions, where a signed 64-bit one is a subroutine.
        split = int64(uint32(cuda.blockIdx.x) % uint32(num_splits))
        m0 = int64(uint32(cuda.blockIdx.x) // uint32(num_splits)) * BM
        hk = cuda.blockIdx.y
        b = cuda.blockIdx.z
        n_rows = min(BM, group * seqlen_q - m0)
        cache_row = seqinfo[b, 0]
        key_start = seqinfo[b, 1]
        seqlen_k = seqinfo[b, 2] - key_start
        offset = seqlen_k - seqlen_q

        # The keys some row sees: rows' ranges only move right, so row 0 bounds them on the left and row Sq - 1
        # on the right. This block's split is its share of them.
        lo = 0
        hi = seqlen_k
        if HAS_LEFT:
            lo = max(0, offset - window_left)
        if HAS_RIGHT:
            hi = min(seqlen_k, seqlen_q + offset + window_right)
        hi = max(lo, hi)
        chunk = int64(uint32(hi - lo + num_splits - 1) // uint32(num_splits))
        j_begin = min(hi, lo + split * chunk)
        j_end = min(hi, j_begin + chunk)

        q_s = cuda.shared.array((BM, LD), float32)
        acc_s = cuda.shared.array((BM, DB), float32)    # (row, d) is thread (r * DB + d) % NT's, throughout
        kv = cuda.shared.array((BN, LD), float32)       # K of the tile, then V
        p_s = cuda.shared.array((BM, LP), float32)      # scores, then probabilities
        seg = cuda.shared.array(NT, float32)            # a softmax thread's tile max; at the end its l_i
        row_alpha = cuda.shared.array(BM, float32)      # this tile's rescale factor of each row's accumulator
        row_slope = cuda.shared.array(BM, float32)
        row_q = cuda.shared.array(BM, int32)            # each block row's query row i
        row_h = cuda.shared.array(BM, int32)            # and its query head
        key_page = cuda.shared.array(BN, int32)
        key_slot = cuda.shared.array(BN, int32)

        for r_k in range(trips(t, BM, NT)):
            r = t + r_k * NT
            g = m0 + r
            hg = int64(uint32(g) // uint32(seqlen_q))
            row_q[r] = g - hg * seqlen_q
            row_h[r] = hk * group + hg
            row_slope[r] = float32(0.0)
            if ALIBI and r < n_rows:
                row_slope[r] = slopes[b, hk * group + hg]
        for e_k in range(trips(t, BM * DB, NT)):
            e = t + e_k * NT
            r = e // DB
            d = e - r * DB
            x = float32(0.0)
            if r < n_rows and d < head_dim:
                g = m0 + r
                hg = int64(uint32(g) // uint32(seqlen_q))
                x = LOAD(q[b, g - hg * seqlen_q, hk * group + hg, d]) * qmult
            q_s[r, d] = x
            acc_s[r, d] = float32(0.0)
        locate(key_page, key_slot, block_table, b, cache_row, key_start, page_size, j_begin,
               min(BN, j_end - j_begin), t)

        # Softmax role: row sr, keys sg, sg + TPR, ... of each tile; m_i is the same in every thread of a row,
        # l_i is this thread's share of the row's sum.
        sr = uint32(t // TPR)
        sg = uint32(t % TPR)
        m_i = neg_inf
        l_i = float32(0.0)
        v_nonfinite_seen = False
        cuda.syncthreads()

        for n0_k in range(trips(j_begin, j_end, BN)):
            n0 = j_begin + n0_k * BN
            n_keys = min(BN, j_end - n0)
            load_k(kv, k_cache, key_page, key_slot, hk, n_keys, head_dim, t)
            cuda.syncthreads()

            # Masked pairs (other splits' keys included) become -inf; a visible score that is not finite becomes
            # NaN and poisons its row (the raw score decides: tanh would turn an inf into a finite cap).
            for e_k in range(trips(t, n_rows * BN, NT)):
                e = t + e_k * NT
                r = uint32(uint32(e) // uint32(BN))
                c = uint32(uint32(e) % uint32(BN))
                raw = float32(0.0)
                for d0_k in range(trips(0, head_dim, STEPS)):
                    d0 = d0_k * STEPS
                    for dd in range(STEPS):
                        d = uint32(d0 + dd)
                        raw += q_s[r, d] * kv[c, d]
                i = row_q[r]
                j = n0 + c
                # q was scaled on load: the pipeline's qmult is 1.
                x, _, _, _, finite = pipeline(raw, float32(1.0), capmult, row_slope[r], float32(i + offset - j),
                                              float32(0.0), float32(0.0), False, True, 0, 0, i, j, 0, 0)
                x = x if finite else nan
                ok = visible(i, j, seqlen_q, j_end, offset, window_left, window_right, 0, 0, 0)
                p_s[r, c] = x if ok else neg_inf
            cuda.syncthreads()

            v_nonfinite_seen |= load_v(kv, v_cache, key_page, key_slot, hk, n_keys, head_dim, t)
            if sr < n_rows:
                tile_max = neg_inf
                poisoned = False
                for c_k in range(trips(sg, BN, TPR)):
                    c = sg + c_k * TPR
                    x = p_s[sr, uint32(c)]
                    tile_max = max(tile_max, x)
                    poisoned |= x != x
                seg[t] = nan if poisoned else tile_max
            cuda.syncthreads()

            if sr < n_rows:
                m_new = m_i
                poisoned = m_i != m_i
                for g in range(TPR):
                    x = seg[sr * TPR + uint32(g)]
                    m_new = max(m_new, x)
                    poisoned |= x != x
                # A poisoned row's max is NaN: its exp2s, sum and accumulator become NaN and stay so.
                m_new = nan if poisoned else m_new
                # A row with nothing visible yet keeps max -inf; exp2 against 0 then gives 0, never NaN.
                m_use = m_new if m_new != neg_inf else float32(0.0)
                alpha = math.exp2(m_i - m_use)
                total = float32(0.0)
                for c_k in range(trips(sg, BN, TPR)):
                    c = sg + c_k * TPR
                    p = math.exp2(p_s[sr, uint32(c)] - m_use)
                    total += p
                    p_s[sr, uint32(c)] = p
                l_i = l_i * alpha + total
                m_i = m_new
                if sg == 0:
                    row_alpha[sr] = alpha
            cuda.syncthreads()

            for e_k in range(trips(t, n_rows * DB, NT)):
                e = t + e_k * NT
                r = uint32(uint32(e) // uint32(DB))
                d = uint32(uint32(e) % uint32(DB))
                a = acc_s[r, d] * row_alpha[r]
                for c0_k in range(trips(0, n_keys, STEPS)):
                    c0 = c0_k * STEPS
                    for cc in range(STEPS):
                        c = uint32(c0 + cc)
                        a += p_s[r, c] * kv[c, d]
                acc_s[r, d] = a
            # The next tile's key addresses: the V load above was the last reader of this tile's.
            locate(key_page, key_slot, block_table, b, cache_row, key_start, page_size, n0 + BN,
                   min(BN, j_end - n0 - BN), t)
            cuda.syncthreads()

        if sr < n_rows:
            seg[t] = l_i
        if cuda.syncthreads_or(int32(v_nonfinite_seen)):
            # Rare: V held an inf or NaN, loaded as 0. Each row that sees such a key gets NaN in its column.
            for e_k in range(trips(t, n_rows * DB, NT)):
                e = t + e_k * NT
                r = e // DB
                d = e - r * DB
                if d < head_dim:
                    for j in range(j_begin, j_end):
                        if visible(row_q[r], j, seqlen_q, j_end, offset, window_left, window_right, 0, 0, 0):
                            pos = uint32(key_start + j)
                            page = uint32(cache_row)
                            if page_size > 0:
                                page = uint32(block_table[b, pos // uint32(page_size)])
                                pos = uint32(pos % uint32(page_size))
                            if not abs(LOAD(v_cache[page, pos, hk, d])) < float32(math.inf):
                                acc_s[r, d] = nan
        for e_k in range(trips(t, n_rows * DB, NT)):
            e = t + e_k * NT
            r = e // DB
            d = e - r * DB
            if d < head_dim:
                total = float32(0.0)
                for g in range(TPR):
                    total += seg[r * TPR + g]
                inv = float32(1.0) / total if total > float32(0.0) else float32(0.0)
                part_out[split, b, row_h[r], row_q[r], d] = acc_s[r, d] * inv
        if sr < n_rows and sg == 0:
            total = float32(0.0)
            for g in range(TPR):
                total += seg[sr * TPR + g]
            lse2 = float32(math.inf)          # sees no key of this split
            if total > float32(0.0):
                lse2 = m_i + math.log2(total)
            elif total != total:              # poisoned
                lse2 = nan
            part_lse[split, b, row_h[sr], row_q[sr]] = lse2

    return cuda.jit(flash_decode_kernel)


def build(cfg: FlashAttentionConfig, v: Variant) -> Any:
    """This kernel for ``cfg`` and ``v`` (its registry entry's builder, kernels/registry.py): the masks, softcap,
    bfloat16 and ALiBi; decoding takes no attn_bias, dropout or mods."""
    return make_decode_kernel(cfg, v.has_left, v.has_right, v.softcap, v.bf16, v.alibi)


@functools.lru_cache(maxsize=None)
def make_split_merge_kernel(bf16: bool) -> Any:
    """The kernel ``(part_out, part_lse, out, lse)`` that merges the decode kernel's splits: part_out
    (num_splits, B, Hq, Sq, D) and part_lse (num_splits, B, Hq, Sq) float32 as ``make_decode_kernel`` writes them;
    out (B, Sq, Hq, D) float32 or float16 (int16 bfloat16 bits with ``bf16``), any strides; lse (B, Hq, Sq)
    float32, natural log. Launch with grid ``B * Hq * Sq`` and ``MERGE_THREADS`` threads (a compile-time
    constant of the kernel).

    The rules are ``numba_flash.merge_attention_states``'s: a part with lse +inf saw no key and weighs nothing,
    whatever its out row holds; a NaN lse makes the row NaN; a row no part saw gets 0 and lse +inf. Every thread
    works the weights out from the lses itself (a few flops per split, cheaper than a barrier)."""
    STORE = element_io(bf16)[1]

    def merge_splits(part_out, part_lse, out, lse):
        num_splits, batch, heads, seqlen_q, head_dim = part_out.shape
        inf = float32(math.inf)
        row = cuda.blockIdx.x
        i = row % seqlen_q
        h = (row // seqlen_q) % heads
        b = row // (seqlen_q * heads)
        top = float32(-math.inf)
        poisoned = False
        for s in range(num_splits):
            x = part_lse[s, b, h, i]
            poisoned |= x != x
            if x < inf:
                top = max(top, x)
        seen = top > float32(-math.inf)
        total = float32(0.0)
        for s in range(num_splits):
            x = part_lse[s, b, h, i]
            if x < inf:
                total += math.exp2(x - top)
        inv = float32(1.0) / total if seen else float32(0.0)
        for d_k in range(trips(cuda.threadIdx.x, head_dim, MERGE_THREADS)):
            d = cuda.threadIdx.x + d_k * MERGE_THREADS
            value = float32(0.0)
            for s in range(num_splits):
                x = part_lse[s, b, h, i]
                if x < inf:
                    value += math.exp2(x - top) * part_out[s, b, h, i, d]
            value = nan_if_not_finite(value * inv)
            out[b, i, h, d] = STORE(float32(math.nan) if poisoned else value)
        if cuda.threadIdx.x == 0:
            result = inf
            if poisoned:
                result = float32(math.nan)
            elif seen:
                result = (top + math.log2(total)) * float32(LN2)
            lse[b, h, i] = result

    return cuda.jit(merge_splits)
