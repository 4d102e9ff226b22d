"""The CPU forward kernel and ``flash_forward``; how the CPU kernels lay their work out (the backward's too).

How the work is laid out:

* Scores are computed transposed, one (key tile x query tile) block at a time: ``S^T = K Q^T``, shape
  (BLOCK_N, BLOCK_M). The softmax statistics of a query (running max, running sum, the rescale factor) then sit
  along a row of the block, so the online-softmax updates are elementwise vector operations over 64 queries instead
  of horizontal reductions; and every product of the forward and backward reads K, V, Q and dO as they are stored,
  one row per key or query with the head dim contiguous:

      forward   S^T = K Q^T       O += P V            (P read as P^T)
      backward  S^T = K Q^T       dP^T = V dO^T       dV += P^T dO      dK += dS^T Q      dQ += dS K

  Only Q^T and dO^T tiles are built (the forward transposes each query tile once; the backward packs them once per
  call). K, V (and, for the backward, Q and dO) are read in place from a head-major ``(B, H, S, D_pad)`` buffer:
  the caller's own array when it already is one (contiguous "bhsd" with D a multiple of 16), else a copy made once
  per call (``head_major``). Extra memory is O(B*H*S*D); the S x S matrix is never stored: per thread there is one
  score block and one accumulator tile.
* Every product is ``C (+)= A @ B`` (``mm``) or ``C (+)= A^T @ B`` (``mm_at``) with row-major B and C, run by a
  register-blocked outer-product micro-kernel written in LLVM IR (``mm_block_codegen``): MR rows of C times two
  vectors of columns stay in registers for the whole reduction, each step broadcasting MR values of A, loading two
  vectors of B and issuing 2*MR fused multiply-adds. On CPUs with AVX-512 the block is 8 x 32 in 512-bit vectors,
  elsewhere 6 x 16 in 256-bit vectors, 4 x 16 for a tile's last 4 rows (LLVM splits those where vectors are
  narrower; ``MR_TALL`` in ``simd`` says why 6). Python loop nests for these
  shapes compile to dot products with a horizontal sum each, at about half the speed of the 256-bit block and a
  third of the 512-bit one.
* ``exp`` is a polynomial on the bits of the float (``fast_exp2``) because ``math.exp`` is a scalar libm call that
  LLVM cannot vectorise. Scores stay in natural-log units; ``fast_exp`` turns score - max into base 2.
* Tiles entirely outside the causal/window band are never visited (loop bounds); only tiles that straddle the
  band's edge are masked.
* Accuracy, float32 against torch's (issue 16; ``tools/accuracy_vs_torch.py``): the backward recomputes P as
  exp(score - row max) / row sum with the statistics of a stats-only forward pass over the forward's own scores,
  not from the float32 lse; head-dim dot products are summed in chunks of ``DOT_CHUNK``; sums across tiles
  (P V and row sums over key tiles, dK / dV / dQ over query or key tiles) are formed per tile and then added (in
  the micro-kernel's registers: ``mm_at_rescale``, ``mm_at_add``).

The kernels take (B, S, H, D) views with any strides and are compiled once per dtype (float32, float64) with
layout-generic array types (``kernel_entry``), so "bshd", "bhsd" and strided inputs share one cached compilation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit, prange

from .cache_stamp import stamp_kernels
from .score_terms import apply_score_terms
from .simd import BLOCK_M, BLOCK_N, FASTMATH, as_dtype_of, fast_exp
from .microkernels import mm_at_rescale, mm_dot
from .passes import column_exp2_sum, column_max, rows_finite
from .tiles import bias_scores, dropout_block, load_rows, mask_scores, tile_key_span, visible_product
from .workspace import bias_view, check_dtypes, dropout_args, head_major, kernel_options, kernel_slopes
from .stash import stash_stats
from .schedule import (BATCH, K0, P0, Q0, SK, SQ, call_sequences, max_tiles, next_unit, query_tile_units,
                       work_counter)
from .modhooks import has_mods, kernel_with_mods, mod_errors, mod_scores, states_for_call, tile_state
from ..mods import EMPTY

# ---------------------------------------------------------------------------------------------------------------
# Forward


# The worker's steps, inlined into it (``inline="always"``: numba splices their IR into the caller before typing,
# so the compiled worker is the one with their code written in place).


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _load_q_tile(q_t, q, bi, row0, h, nq, head_dim, qscale):
    """q_t (D, BLOCK_M) = Q^T of query rows row0..row0 + nq of q[bi, :, h] (q: (B, S, Hq, D)) times ``qscale``,
    with 0 in the padding columns nq..BLOCK_M."""
    q_t[:] = as_dtype_of(q_t, 0.0)
    for r in range(nq):
        for d in range(head_dim):
            q_t[d, r] = q[bi, row0 + r, h, d] * qscale


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _online_softmax(st, nk, masked, m_run, l_run, m_use, l_tile, alpha):
    """One key tile's step of the online softmax, per query (a column of st, (BLOCK_N, BLOCK_M) scores): m_run
    (BLOCK_M,) takes the tile's max, alpha the factor exp(old max - new max) the query's earlier sums are rescaled
    by, st[:nk] becomes P = exp(score - max), and l_run (BLOCK_M,) float64 = l_run * alpha + the tile's row sum
    (summed in ``l_tile`` first). m_use, l_tile: (BLOCK_M,) scratch. ``masked``: the block may hold -inf."""
    zero = as_dtype_of(st, 0.0)
    neg_inf = as_dtype_of(st, -np.inf)
    for r in range(BLOCK_M):
        m_use[r] = m_run[r]
    column_max(st, nk, m_use, not masked)
    for r in range(BLOCK_M):
        m_new = m_use[r]
        # A query that has seen no key yet keeps max -inf; shifting by 0 makes its exp2 0, never NaN.
        # A poisoned query has max NaN: its alpha, sum and accumulator become NaN and stay so. (A select,
        # not a branch: the loop vectorises.)
        shift = zero if m_new == neg_inf else m_new
        m_use[r] = shift
        alpha[r] = fast_exp(m_run[r] - shift)
        m_run[r] = m_new
        l_tile[r] = zero
    column_exp2_sum(st, nk, l_tile, m_use)
    for r in range(BLOCK_M):
        l_run[r] = l_run[r] * alpha[r] + l_tile[r]


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _store_row_stats(row_max, row_inv, m_run, l_run):
    """row_max[r], row_inv[r] = the query tile's row max and 1 / sum for r < BLOCK_M (views from its first
    statistics row), with +inf and 0 for a row that sees no key (P = 0 there). The stats-only pass writes them,
    and a forward too when given arrays for them (the backward reuses them, see stash_stats)."""
    inf = as_dtype_of(row_max, np.inf)
    for r in range(BLOCK_M):
        seen = l_run[r] != 0
        row_max[r] = m_run[r] if seen else inf
        row_inv[r] = 1.0 / l_run[r] if seen else 0.0


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _store_rows_out(out, lse, bi, row0, h, nq, acc, m_run, l_run, row_lo, row_hi):
    """out[bi, row0 + r, h] = acc[r] / l_run[r] and lse[bi, h, row0 + r] = m_run[r] + log(l_run[r]) for the
    query tile's nq rows; 0 and +inf for a row that sees no key, NaN and NaN for a poisoned one."""
    zero = as_dtype_of(acc, 0.0)
    inf = as_dtype_of(acc, np.inf)
    neg_inf = as_dtype_of(acc, -np.inf)
    nan = as_dtype_of(acc, np.nan)
    for r in range(nq):
        if row_lo[r] >= row_hi[r]:
            # Sees no key: 0 and lse = +inf, whatever its q holds (it reads nothing).
            for d in range(out.shape[3]):
                out[bi, row0 + r, h, d] = zero
            lse[bi, h, row0 + r] = inf
        elif l_run[r] > 0 and m_run[r] == m_run[r]:
            inv = as_dtype_of(acc, 1.0 / l_run[r])
            for d in range(out.shape[3]):
                o = acc[r, d] * inv
                out[bi, row0 + r, h, d] = o if abs(o) < inf else nan
            # in float64, rounded once
            lse[bi, h, row0 + r] = np.float64(m_run[r]) + math.log(l_run[r])
        elif m_run[r] == neg_inf:   # every key it could see is hidden by the bias: as if it saw none
            for d in range(out.shape[3]):
                out[bi, row0 + r, h, d] = zero
            lse[bi, h, row0 + r] = inf
        else:  # poisoned by a score that is not finite
            for d in range(out.shape[3]):
                out[bi, row0 + r, h, d] = nan
            lse[bi, h, row0 + r] = nan


@njit(fastmath=FASTMATH, cache=True)
def _forward_worker(q, k, v, out, lse, head_dim, scale, left, right, softcap, row_max, row_inv, stats_only, alibi,
                    bias, drop, tile_states, seqs, units, counter, hooks):
    """One thread's share of ``forward_kernel`` (arguments and units as there): claims units until none is left.

    The kernels' parallel loops call a worker like this one instead of holding its code: numba's parfor passes
    (fusion, lowering, a gufunc compiled around the body) then see a loop of one call, where they took over half of
    a kernel's compile time with the body inside. The compiled code is the same (forward and backward within noise
    of the inlined body, BENCHMARKS.md); float32 with a cold cache, one kernel at a time on the 2-vCPU VM beside
    other work: forward_kernel 64 -> 40 s, backward_kv_kernel 128 -> 88 s, backward_dq_kernel 87 -> 62 s."""
    nheads_q = q.shape[2]
    nheads_kv = k.shape[2]
    group = nheads_q // nheads_kv
    dp = v.shape[3]
    n_qt = max_tiles(seqs, SQ, BLOCK_M)
    n_units = units.shape[0] if units.shape[0] > 0 else seqs.shape[0] * nheads_q * n_qt
    # Scores in natural-log units, as torch's: Q carries the scale, and exp(score - max) converts the difference
    # to base 2 (fast_exp). With softcap, the raw score is divided by the softcap after the product: that keeps
    # an inf in q or k, which tanh would turn into a finite +-1, visible as a non-finite raw score.
    qscale = as_dtype_of(q, scale)
    neg_inf = as_dtype_of(q, -np.inf)
    zero = as_dtype_of(q, 0.0)
    # a thread's scratch, reused by its units (a packed batch of short sequences has thousands of units)
    bias_tile = np.empty((BLOCK_N, BLOCK_M) if bias.shape[0] > 0 else (0, 0), q.dtype)
    row_lo = np.empty(BLOCK_M, np.int64)
    row_hi = np.empty(BLOCK_M, np.int64)
    q_t = np.empty((head_dim, BLOCK_M), q.dtype)  # scaled Q^T
    mods_on = has_mods(hooks)   # a constant: hooks is None, or the mods' hooks
    vis = np.empty((BLOCK_N, BLOCK_M) if mods_on else (0, 0), np.bool_)
    no_grad = np.empty((0, 0), q.dtype)
    k_tail = np.empty((BLOCK_N, head_dim), q.dtype)  # a last, partial key tile, zero-padded
    st = np.empty((BLOCK_N, BLOCK_M), q.dtype)
    acc = np.empty((BLOCK_M, dp), q.dtype)
    m_run = np.empty(BLOCK_M, q.dtype)
    m_use = np.empty(BLOCK_M, q.dtype)
    # Sums across key tiles: each tile's P V and row sums go to a tile buffer first and are then added in, one
    # rounding per tile instead of one per key (the sums in float64): at Sk = 131072 a running sum over every
    # key erred 10x torch's.
    pv = np.empty((BLOCK_M, dp), q.dtype)
    l_run = np.empty(BLOCK_M, np.float64)
    l_tile = np.empty(BLOCK_M, q.dtype)
    alpha = np.empty(BLOCK_M, q.dtype)
    while True:
        w = next_unit(counter, units, n_units)
        if w < 0:
            break
        b = w // (nheads_q * n_qt)   # the sequence: ALiBi's, dropout's and the mods' batch index
        # Query tiles innermost, with or without a bias: a thread's consecutive units share K and V (in L2).
        # Heads innermost (so that heads sharing a bias read its rows from cache) measured 1.29x the plain
        # forward against 1.24x this way, once the bias tile was transposed in registers.
        h = (w // n_qt) % nheads_q
        qt = w % n_qt
        hk = h // group
        bi, q0, k0, p0 = seqs[b, BATCH], seqs[b, Q0], seqs[b, K0], seqs[b, P0]
        seqlen_q, seqlen_k = seqs[b, SQ], seqs[b, SK]
        i0 = qt * BLOCK_M
        nq = min(BLOCK_M, seqlen_q - i0)
        slope = alibi[b, h] if alibi.shape[0] > 0 else 0.0
        bias_bh = bias[b, h] if bias.shape[0] > 0 else bias[0:0, 0:0, 0, 0]
        span_lo, span_hi, full_lo, full_hi = tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo,
                                                           row_hi)
        _load_q_tile(q_t, q, bi, q0 + i0, h, nq, head_dim, qscale)
        acc[:] = zero
        m_run[:] = neg_inf
        l_run[:] = 0.0
        k_seq = k[bi, k0:k0 + seqlen_k]
        v_seq = v[bi, k0:k0 + seqlen_k]
        kt_first = span_lo // BLOCK_N
        kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
        for kt in range(kt_first, kt_end):
            j0 = kt * BLOCK_N
            nk = min(BLOCK_N, seqlen_k - j0)
            state = tile_state(hooks, tile_states, vis, b, h, qt, kt, i0, j0, nq, nk, True)
            if state == EMPTY:
                continue
            if nk == BLOCK_N:
                mm_dot(st, k_seq[j0:j0 + BLOCK_N, hk], q_t, head_dim)
            else:
                load_rows(k_tail, k_seq[j0:j0 + nk, hk], nk, head_dim)
                mm_dot(st, k_tail, q_t, head_dim)
            apply_score_terms(st, nk, BLOCK_M, True, softcap, slope, i0, j0, seqlen_k - seqlen_q, no_grad, 1.0, False)
            # Every block that no mask touches is all visible: there any non-finite score poisons its query. A bias
            # may hide any pair (-inf), so with one every block is masked.
            band_masked = not (full_lo <= j0 and j0 + nk <= full_hi)
            masked = mods_on or bias_bh.shape[0] > 0 or band_masked
            bias_hides = False
            if bias_bh.shape[0] > 0:
                bias_hides = bias_scores(st, bias_bh, i0, j0, nk, True, row_lo, row_hi, True, bias_tile)
            elif masked:
                mask_scores(st, j0, nk, row_lo, row_hi)
            mod_scores(hooks, st, vis, no_grad, state, b, h, i0, j0, nq, nk, True)
            _online_softmax(st, nk, masked, m_run, l_run, m_use, l_tile, alpha)
            if not stats_only:
                dropout_block(st, drop, b, h, i0, j0, nk, True)
                v_rows = v_seq[j0:j0 + nk, hk]
                # a non-finite v row must reach only the queries that see it: where nothing hides a pair of the
                # block, that is every query, and the plain product does it
                if (mods_on or band_masked or bias_hides) and not rows_finite(v_rows, nk):
                    pv[:] = zero
                    visible_product(pv, st, v_rows, nk, True, True, j0, row_lo, row_hi, bias_bh, i0, vis)
                    for r in range(BLOCK_M):
                        a = alpha[r]
                        for d in range(dp):
                            acc[r, d] = acc[r, d] * a + pv[r, d]
                else:
                    mm_at_rescale(acc, st, v_rows, nk, alpha)
        if stats_only or row_max.shape[2] > 1:
            _store_row_stats(row_max[bi, h, p0 + i0:], row_inv[bi, h, p0 + i0:], m_run, l_run)
        if not stats_only:
            _store_rows_out(out, lse, bi, q0 + i0, h, nq, acc, m_run, l_run, row_lo, row_hi)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def forward_kernel(q, k, v, out, lse, head_dim, scale, left, right, softcap, row_max, row_inv, stats_only, alibi,
                   bias, drop, tile_states, seqs, units, counter, hooks):
    """Online-softmax forward. A unit is a (sequence, query head, query tile); each writes only its own rows of
    out and lse. The prange runs one iteration per thread, each claiming units until none is left (``schedule``).

    q: (B, Sq, Hq, D), out: (B, Sq, Hq, Dv), any strides; lse: (B, Hq, Sq), any strides; head_dim: D;
    k, v: (B, Sk, Hkv, D_pad) and (B, Sk, Hkv, Dv_pad), views of head-major buffers (``head_major``), each head dim
    rounded up to 16, zero past it.
    All one float dtype.
    seqs: the sequences (``schedule.Sequences.table``): B dense ones, or packed ones at their offsets in a batch of
    1; units: flat (sequence, head, query tile) ids in the order to take them, or empty for all in order; counter:
    (next unit, threads) = (0, numba's thread count) (``schedule.work_counter``; numba.get_num_threads() here
    would keep numba from caching the kernel).
    With ``stats_only`` (the backward's first pass) it skips P V and writes neither out nor lse, but each row's
    final max and 1 / sum of exp(score - max) into row_max and row_inv, (B, Hq, stat rows) at the sequence's
    statistics rows (+inf and 0 for padding rows and rows that see no key): the backward then recomputes
    P = exp(score - max) / sum from the very scores of the forward (P = 1 exactly for the max of a row with one
    key), where exp(score - lse) carried the rounding of lse, as large as lse itself.
    alibi: (sequences, Hq) float64 ALiBi slopes, added after softcap (``score_terms.apply_score_terms``); (0, 0)
    for none.
    bias: attn_bias broadcast to (B, Hq, Sq, Sk), read in place (``bias_scores``), or a (0, 0, 0, 0) array.
    drop: dropout (``dropout_block``), keyed by sequence, applied to P after its row sums (lse is the softmax's
    before dropout), or an empty array for none; the stats-only pass ignores it.
    tile_states, hooks: the user's mods' tiles and their compiled hooks, or None for no mods (``modhooks``).
    """
    for _ in prange(counter[1]):
        _forward_worker(q, k, v, out, lse, head_dim, scale, left, right, softcap, row_max, row_inv, stats_only, alibi,
                        bias, drop, tile_states, seqs, units, counter, hooks)


def flash_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray, scale: float,
                  window_left: int, window_right: int, softcap: float, alibi: np.ndarray | None = None,
                  dropout_p: float = 0.0, dropout_seed: int = 0, dropout_batch0: int = 0,
                  attn_bias: np.ndarray | None = None, mods: Any = None, cu_seqlens_q: np.ndarray | None = None,
                  cu_seqlens_k: np.ndarray | None = None) -> None:
    """Exact attention forward, written into ``out`` and ``lse``.

    Arguments:
        q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv) with Hq % Hkv == 0. Any strides; not modified.
        out: (B, Sq, Hq, Dv), any strides; written with the attention output.
        lse: (B, Hq, Sq), any strides; written with the natural-log sum of exp(score) over visible keys, +inf for a
            row that sees no key (its output row is 0).
        All arrays float32, or all float64; accumulation is in that dtype.
        scale: multiplies q.k; window_left / window_right: -1 = unbounded (causal is right = 0);
        softcap: 0 = off, else scores become softcap * tanh(score / softcap).
        alibi: None, or (B, Hq) ALiBi slopes: adds -slope * |i + Sk - Sq - j| after softcap.
        dropout_p, dropout_seed: dropout on P with ``numba_flash.dropout``'s mask, batch b of these arrays taking
            the mask of batch ``dropout_batch0 + b``; lse stays the softmax's own.
        attn_bias: None, or an array broadcastable to (B, Hq, Sq, Sk) of the compute dtype, added after softcap and
            ALiBi; -inf hides a pair (a row whose every pair is hidden gets 0 and lse +inf). Read in place.
        mods: None, or the call's ``numba_flash.mods.Mods`` (bias_mod, mask_mod, score_mod, block_mask), run by
            the kernel's variant for mods through hooks compiled around them (``modhooks``; seconds the first time
            per mod in a process). Tiles the mask_mod hides entirely are skipped.
        cu_seqlens_q, cu_seqlens_k: packed sequences (layout "thd"), (B + 1,) prefix sums of validated lengths,
            both or neither. q, out: (total_q, Hq, D / Dv); k, v: (total_k, Hkv, D / Dv); lse: (Hq, total_q);
            alibi (B, Hq) and the dropout's batch count sequences; masks are aligned per sequence (bottom-right
            of its own block); no attn_bias or mods. One kernel call serves every sequence.
    """
    seqs = call_sequences(q, k, cu_seqlens_q, cu_seqlens_k)
    if seqs.packed:
        q, k, v, out, lse = (x[None] for x in (q, k, v, out, lse))
    dtype = check_dtypes(q, k, v, out, lse)
    head_dim = q.shape[3]
    left, right, softcap = kernel_options(q.shape[1], k.shape[1], window_left, window_right, softcap, dtype)
    stats_shape = (q.shape[0], q.shape[2], seqs.stat_len)
    row_max, row_inv = np.empty(stats_shape, dtype), np.empty(stats_shape, dtype)
    kernel = kernel_with_mods(forward_kernel, dtype, mods)
    with mod_errors(mods):
        kernel(q, head_major(k, head_dim, "k"), head_major(v, v.shape[3], "v"), out, lse, head_dim, float(scale),
               left, right, softcap, row_max, row_inv, False, kernel_slopes(alibi), bias_view(attn_bias, q, k),
               dropout_args(dropout_p, dropout_seed, dropout_batch0),
               states_for_call(mods, q.shape[0], q.shape[2], q.shape[1], k.shape[1]), seqs.table,
               query_tile_units(seqs, q.shape[2], left, right), work_counter())
    stash_stats(lse, row_max, row_inv, seqs.stash_tag)


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
