"""The CPU backward kernels and ``flash_backward``: a key-tile pass (dK, dV, and dQ when fused) and a query-tile
pass (dQ alone), both recomputing P from the forward's row statistics (``stash``), never storing an S x S array.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numba import njit, prange

from .cache_stamp import stamp_kernels
from .simd import BLOCK_M, BLOCK_N, FASTMATH
from .microkernels import mm_dot
from .passes import load_transposed, store_rows
from .tiles import dropout_block, load_rows, query_tiles_seeing, tile_key_span
from .backward_blocks import (add_dbias, block_scores, chain_factor, dropout_factors, probs_and_dscores_cols,
                              probs_and_dscores_rows, scale_block, tile_product_add)
from .workspace import (bias_view, check_dtypes, dropout_args, head_major, kernel_entry, kernel_options, kernel_slopes,
                        pack_scaled_kernel, row_dot_kernel, score_scale, scratch, store_dq_kernel)
from . import stash
from .stash import defer_to_caller_lse, stashed_stats
from . import schedule
from .schedule import (BATCH, K0, P0, Q0, SK, SQ, Sequences, call_sequences, max_tiles, next_unit, query_tile_units,
                       work_counter)
from .forward import forward_kernel
from .modhooks import (has_mods, kernel_with_mods, mod_errors, mod_scores, mod_zero_hidden, states_for_call,
                       tile_state)
from ..mods import EMPTY

# ---------------------------------------------------------------------------------------------------------------
# Backward
#
# The key-tile pass (dK, dV, and dQ when fused) walks query tiles inside a key tile, so it computes S = Q K^T with
# queries as rows: it needs K^T and V^T of its key tile only, built once per tile, and reads Q and dO rows in place.
# The query-tile pass (dQ alone) walks key tiles inside a query tile, so it computes S^T = K Q^T like the forward,
# building Q^T and dO^T once per query tile and reading K and V rows in place. Either way every transposed copy
# is made once per call, in parallel, and no O(S^2) array exists.


@njit(fastmath=FASTMATH, cache=True)
def _backward_kv_worker(q, qs, k, v, dout, row_max, row_inv, delta, dq_acc, dk, dv, head_dim, scale, left, right,
                        softcap, kt_per_unit, fuse_dq, alibi, bias, drop, tile_states, want_dbias, dbias, seqs,
                        units, counter, hooks):
    """One thread's share of ``backward_kv_kernel`` (arguments and units as there): claims units until none is left.
    A function of its own for numba's compile time (``forward._forward_worker`` says why)."""
    batch, nheads_q, nheads_kv = seqs.shape[0], q.shape[2], k.shape[2]   # batch: the sequences
    group = nheads_q // nheads_kv
    dp = q.shape[3]
    dpv = v.shape[3]
    head_dim_v = dv.shape[3]
    n_chunks = (max_tiles(seqs, SK, BLOCK_N) + kt_per_unit - 1) // kt_per_unit
    # dbias: as in backward_dq_kernel, the units that add into the same elements (those that differ in batch or
    # kv head where the bias is broadcast along it) run in order in one unit, in parts.
    n_parts = dbias.shape[0] if want_dbias else 1
    sum_b = want_dbias and dbias.shape[1] == 1
    sum_h = want_dbias and dbias.shape[2] == 1
    runs_b, runs_h = (1 if sum_b else batch), (1 if sum_h else nheads_kv)
    in_b, in_h = (batch if sum_b else 1), (nheads_kv if sum_h else 1)
    in_run = in_b * in_h
    n_units = units.shape[0] if units.shape[0] > 0 else runs_b * runs_h * n_chunks * n_parts
    mods_on = has_mods(hooks)   # a constant: hooks is None, or the mods' hooks
    per_pair = softcap > 0 or mods_on   # d score / d q.k varies per pair (else it is the scale)
    # a thread's scratch, reused by its units
    row_lo = np.empty(BLOCK_M, np.int64)
    row_hi = np.empty(BLOCK_M, np.int64)
    k_t = np.empty((head_dim, BLOCK_N), q.dtype)
    v_t = np.empty((head_dim_v, BLOCK_N), q.dtype)
    q_tail = np.empty((BLOCK_M, dp), q.dtype)   # a last, partial query tile, zero-padded
    do_tail = np.empty((BLOCK_M, dpv), q.dtype)
    s = np.empty((BLOCK_M, BLOCK_N), q.dtype)
    dps = np.empty((BLOCK_M, BLOCK_N), q.dtype)
    dcap = np.empty((BLOCK_M, BLOCK_N) if per_pair else (1, 1), q.dtype)
    # with dbias and mods, score_mod_grad's factor apart from dcap: the bias enters before score_mod, after the rest
    mod_grad = np.empty((BLOCK_M, BLOCK_N) if want_dbias and mods_on else (1, 1), q.dtype)
    vis = np.empty((BLOCK_M, BLOCK_N) if mods_on else (0, 0), np.bool_)
    factors = np.empty((BLOCK_M, BLOCK_N) if drop.shape[0] > 0 else (1, 1), q.dtype)
    dk_acc = np.empty((BLOCK_N, dp), q.dtype)
    dv_acc = np.empty((BLOCK_N, dpv), q.dtype)
    kv_tile = np.empty((BLOCK_N, dp), q.dtype)
    v_tile = np.empty((BLOCK_N, dpv), q.dtype)
    q_tile = np.empty((BLOCK_M, dp), q.dtype)
    while True:
        w = next_unit(counter, units, n_units)
        if w < 0:
            break
        run = w // n_parts
        part = w % n_parts
        chunk = run % n_chunks
        for m in range(in_run * part // n_parts, in_run * (part + 1) // n_parts):
            b = m // in_h if sum_b else run // (runs_h * n_chunks)
            hk = m % in_h if sum_h else (run // n_chunks) % runs_h
            bi, q0, k0, p0 = seqs[b, BATCH], seqs[b, Q0], seqs[b, K0], seqs[b, P0]
            seqlen_q, seqlen_k = seqs[b, SQ], seqs[b, SK]
            q_seq, qs_seq = q[bi, q0:q0 + seqlen_q], qs[bi, q0:q0 + seqlen_q]
            do_seq = dout[bi, q0:q0 + seqlen_q]
            k_seq, v_seq = k[bi, k0:k0 + seqlen_k], v[bi, k0:k0 + seqlen_k]
            dk_seq, dv_seq = dk[bi, k0:k0 + seqlen_k], dv[bi, k0:k0 + seqlen_k]
            n_kt = (seqlen_k + BLOCK_N - 1) // BLOCK_N
            for kt in range(chunk * kt_per_unit, min(n_kt, (chunk + 1) * kt_per_unit)):
                j0 = kt * BLOCK_N
                nk = min(BLOCK_N, seqlen_k - j0)
                k_rows = k_seq[j0:j0 + nk, hk]
                load_transposed(k_t, k_rows, nk, head_dim)
                load_transposed(v_t, v_seq[j0:j0 + nk, hk], nk, head_dim_v)
                dk_acc[:] = 0
                dv_acc[:] = 0
                qt_first, qt_end = query_tiles_seeing(j0, j0 + nk, seqlen_q, seqlen_k, left, right)
                for h in range(hk * group, (hk + 1) * group):
                    slope = alibi[b, h] if alibi.shape[0] > 0 else 0.0
                    bias_bh = bias[b, h] if bias.shape[0] > 0 else bias[0:0, 0:0, 0, 0]
                    dbias_bh = dbias[part, 0 if sum_b else b, 0 if dbias.shape[2] == 1 else h]
                    for qt in range(qt_first, qt_end):
                        i0 = qt * BLOCK_M
                        nq = min(BLOCK_M, seqlen_q - i0)
                        state = tile_state(hooks, tile_states, vis, b, h, qt, kt, i0, j0, nq, nk, False)
                        if state == EMPTY:
                            continue
                        _, _, full_lo, full_hi = tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi)
                        q_rows = q_seq[i0:i0 + nq, h]
                        qs_rows = qs_seq[i0:i0 + nq, h]
                        do_rows = do_seq[i0:i0 + nq, h]
                        if nq == BLOCK_M:
                            mm_dot(s, qs_rows, k_t, head_dim)
                            mm_dot(dps, do_rows, v_t, head_dim_v)
                        else:  # the products read whole tiles of their A operand: pad the partial one
                            load_rows(q_tail, qs_rows, nq, dp)
                            load_rows(do_tail, do_rows, nq, dpv)
                            mm_dot(s, q_tail, k_t, head_dim)
                            mm_dot(dps, do_tail, v_t, head_dim_v)
                        if drop.shape[0] > 0:
                            dropout_factors(factors, drop, b, h, i0, j0, nk)
                            scale_block(dps, factors)
                        block_scores(s, dcap, i0, j0, nk, False, scale, softcap, per_pair, slope,
                                     seqlen_k - seqlen_q, bias_bh, s, row_lo, row_hi, mods_on)
                        if want_dbias and mods_on:
                            mod_grad[:] = 1
                        mod_scores(hooks, s, vis, mod_grad if want_dbias else dcap, state, b, h, i0, j0, nq, nk,
                                   False)
                        # dbias first, before the chain factor (see backward_dq_kernel)
                        probs_and_dscores_rows(s, dps, dcap, row_max[bi, h, p0:], row_inv[bi, h, p0:],
                                               delta[bi, h, p0:], i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                                               1.0 if want_dbias else scale, per_pair and not want_dbias,
                                               bias_bh)
                        mod_zero_hidden(hooks, s, dps, vis, nq, nk, False)
                        if want_dbias:
                            if mods_on:
                                chain_factor(dps, mod_grad, 1.0, True)
                            add_dbias(dbias_bh, dps, i0, j0, nq, nk, False)
                            chain_factor(dps, dcap, scale, per_pair)
                        if drop.shape[0] > 0:
                            scale_block(s, factors)
                        # P and dS are 0 where a query does not see a key; a non-finite row of Q, dO or K must
                        # not reach those pairs through 0 * nan (see visible_product). Only masked blocks have
                        # such pairs.
                        masked = mods_on or bias_bh.shape[0] > 0 or not (full_lo <= j0 and j0 + nk <= full_hi)
                        tile_product_add(dv_acc, v_tile, s, do_rows, nq, True, False, masked, j0, row_lo, row_hi,
                                         bias_bh, i0, vis)
                        tile_product_add(dk_acc, kv_tile, dps, q_rows, nq, True, False, masked, j0, row_lo, row_hi,
                                         bias_bh, i0, vis)
                        if fuse_dq:
                            tile_product_add(dq_acc[bi, h, p0 + i0:p0 + i0 + BLOCK_M], q_tile, dps, k_rows,
                                             nk, False, True, masked, j0, row_lo, row_hi, bias_bh, i0, vis)
                store_rows(dk_seq[j0:j0 + nk, hk], dk_acc, nk, head_dim)
                store_rows(dv_seq[j0:j0 + nk, hk], dv_acc, nk, head_dim_v)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def backward_kv_kernel(q, qs, k, v, dout, row_max, row_inv, delta, dq_acc, dk, dv, head_dim, scale, left, right,
                       softcap, kt_per_unit, fuse_dq, alibi, bias, drop, tile_states, want_dbias, dbias, seqs,
                       units, counter, hooks):
    """dK and dV (and, with ``fuse_dq``, dQ into ``dq_acc``; with ``want_dbias`` dbias into ``dbias``, as
    ``backward_dq_kernel`` describes it, which needs ``kt_per_unit`` covering every key tile).

    q, qs: (B, Sq, Hq, D_pad), dout: (B, Sq, Hq, Dv_pad), k: (B, Sk, Hkv, D_pad) and v: (B, Sk, Hkv, Dv_pad), views
    of head-major buffers (``head_major``; each head dim rounded up to 16);
    qs is q times the forward's score scale (``score_scale``), so that the scores are the forward's to the bit;
    row_max, row_inv, delta: (B, Hq, statistics rows), the forward's row max and 1 / sum (+inf and 0 in
    the padding and for rows that see no key) and rowsum(dO * O);
    dq_acc: (B, Hq, statistics rows, D_pad), zeroed, accumulated into when ``fuse_dq``; dk: (B, Sk, Hkv, D) and dv:
    (B, Sk, Hkv, Dv), any strides, written. alibi: (B, Hq) float64 slopes, or (0, 0) for none; bias: attn_bias
    broadcast to (B, Hq, Sq, Sk), or (0, 0, 0, 0) for none. tile_states, hooks: the user's mods' (``modhooks``).
    drop: dropout (``dropout_block``; empty for none): out = (P * F) V with F the dropout factors, so dV takes
    P * F and dS = P (F dP - delta).
    seqs, units, counter: the sequences and the order of the units, as in ``forward_kernel``; here ``b`` is the
    sequence and ``bi`` its batch entry, and the statistics rows above are the sequence's (``schedule``).
    A unit is a (sequence, kv head, run of ``kt_per_unit`` key tiles): it sums dK/dV for its key tiles over every
    query head of the group and every query tile that sees them and writes only those rows of dk, dv.
    dQ rows collect contributions from all key tiles, so they may be accumulated here only when one unit owns
    all key tiles of its (sequence, kv head): then it is the only writer of its group's dQ, and the scores need
    not be recomputed in a second pass.
    """
    for _ in prange(counter[1]):
        _backward_kv_worker(q, qs, k, v, dout, row_max, row_inv, delta, dq_acc, dk, dv, head_dim, scale, left, right,
                            softcap, kt_per_unit, fuse_dq, alibi, bias, drop, tile_states, want_dbias, dbias, seqs,
                            units, counter, hooks)


@njit(fastmath=FASTMATH, cache=True)
def _backward_dq_worker(qs, k, v, dout, row_max, row_inv, delta, dq, head_dim, head_dim_v, scale, left, right,
                        softcap, alibi, bias, drop, tile_states, want_dbias, dbias, seqs, units, counter, hooks):
    """One thread's share of ``backward_dq_kernel`` (arguments and units as there): claims units until none is left.
    A function of its own for numba's compile time (``forward._forward_worker`` says why)."""
    batch, nheads_q, nheads_kv = seqs.shape[0], qs.shape[2], k.shape[2]   # batch: the sequences
    group = nheads_q // nheads_kv
    dp = qs.shape[3]
    dpv = v.shape[3]
    n_qt = max_tiles(seqs, SQ, BLOCK_M)
    n_parts = dbias.shape[0] if want_dbias else 1
    # Summed along an axis: a run of units covers it (the bias has length 1 there).
    sum_b = want_dbias and dbias.shape[1] == 1
    sum_h = want_dbias and dbias.shape[2] == 1
    sum_q = want_dbias and dbias.shape[3] == 1
    runs_b, runs_h, runs_q = (1 if sum_b else batch), (1 if sum_h else nheads_q), (1 if sum_q else n_qt)
    in_b, in_h, in_q = (batch if sum_b else 1), (nheads_q if sum_h else 1), (n_qt if sum_q else 1)
    in_run = in_b * in_h * in_q
    n_units = units.shape[0] if units.shape[0] > 0 else runs_b * runs_h * runs_q * n_parts
    mods_on = has_mods(hooks)   # a constant: hooks is None, or the mods' hooks
    per_pair = softcap > 0 or mods_on
    # a thread's scratch, reused by its units
    bias_tile = np.empty((BLOCK_N, BLOCK_M) if bias.shape[0] > 0 else (0, 0), qs.dtype)
    row_lo = np.empty(BLOCK_M, np.int64)
    row_hi = np.empty(BLOCK_M, np.int64)
    q_t = np.empty((head_dim, BLOCK_M), qs.dtype)
    do_t = np.empty((head_dim_v, BLOCK_M), qs.dtype)
    k_tail = np.zeros((BLOCK_N, dp), qs.dtype)
    v_tail = np.zeros((BLOCK_N, dpv), qs.dtype)
    st = np.empty((BLOCK_N, BLOCK_M), qs.dtype)
    dpt = np.empty((BLOCK_N, BLOCK_M), qs.dtype)
    dcap = np.empty((BLOCK_N, BLOCK_M) if per_pair else (1, 1), qs.dtype)
    mod_grad = np.empty((BLOCK_N, BLOCK_M) if want_dbias and mods_on else (1, 1), qs.dtype)   # as in the dK/dV pass
    vis = np.empty((BLOCK_N, BLOCK_M) if mods_on else (0, 0), np.bool_)
    acc = np.empty((BLOCK_M, dp), qs.dtype)
    tile = np.empty((BLOCK_M, dp), qs.dtype)
    while True:
        w = next_unit(counter, units, n_units)
        if w < 0:
            break
        run = w // n_parts
        part = w % n_parts
        for m in range(in_run * part // n_parts, in_run * (part + 1) // n_parts):
            b = m // (in_h * in_q) if sum_b else run // (runs_h * runs_q)
            h = (m // in_q) % in_h if sum_h else (run // runs_q) % runs_h
            qt = m % in_q if sum_q else run % runs_q
            hk = h // group
            bi, q0, k0, p0 = seqs[b, BATCH], seqs[b, Q0], seqs[b, K0], seqs[b, P0]
            seqlen_q, seqlen_k = seqs[b, SQ], seqs[b, SK]
            i0 = qt * BLOCK_M
            nq = min(BLOCK_M, seqlen_q - i0)
            k_seq, v_seq = k[bi, k0:k0 + seqlen_k], v[bi, k0:k0 + seqlen_k]
            slope = alibi[b, h] if alibi.shape[0] > 0 else 0.0
            bias_bh = bias[b, h] if bias.shape[0] > 0 else bias[0:0, 0:0, 0, 0]
            dbias_bh = dbias[part, 0 if sum_b else b, 0 if sum_h else h]
            span_lo, span_hi, full_lo, full_hi = tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo,
                                                               row_hi)
            load_transposed(q_t, qs[bi, q0 + i0:q0 + i0 + nq, h], nq, head_dim)
            load_transposed(do_t, dout[bi, q0 + i0:q0 + i0 + nq, h], nq, head_dim_v)
            acc[:] = 0
            kt_first = span_lo // BLOCK_N
            kt_end = (span_hi + BLOCK_N - 1) // BLOCK_N if span_lo < span_hi else kt_first
            for kt in range(kt_first, kt_end):
                j0 = kt * BLOCK_N
                nk = min(BLOCK_N, seqlen_k - j0)
                state = tile_state(hooks, tile_states, vis, b, h, qt, kt, i0, j0, nq, nk, True)
                if state == EMPTY:
                    continue
                if nk == BLOCK_N:
                    kr = k_seq[j0:j0 + BLOCK_N, hk]
                    vr = v_seq[j0:j0 + BLOCK_N, hk]
                else:  # a last, partial key tile: the products read whole tiles, so pad it with zero rows
                    load_rows(k_tail, k_seq[j0:j0 + nk, hk], nk, head_dim)
                    load_rows(v_tail, v_seq[j0:j0 + nk, hk], nk, head_dim_v)
                    kr = k_tail[:, :]
                    vr = v_tail[:, :]
                mm_dot(st, kr, q_t, head_dim)
                mm_dot(dpt, vr, do_t, head_dim_v)
                dropout_block(dpt, drop, b, h, i0, j0, nk, True)   # dS needs F dP; dQ = dS K needs no P
                block_scores(st, dcap, i0, j0, nk, True, scale, softcap, per_pair, slope, seqlen_k - seqlen_q,
                             bias_bh, bias_tile, row_lo, row_hi, mods_on)
                if want_dbias and mods_on:
                    mod_grad[:] = 1
                mod_scores(hooks, st, vis, mod_grad if want_dbias else dcap, state, b, h, i0, j0, nq, nk, True)
                # With dbias, dS is first formed without the chain factor (scale, softcap's): the bias enters the
                # score after both, so dbias is P (dP - delta) itself, times score_mod_grad's factor (the bias
                # enters before score_mod), kept apart in mod_grad.
                probs_and_dscores_cols(st, dpt, dcap, row_max[bi, h, p0:], row_inv[bi, h, p0:],
                                       delta[bi, h, p0:], i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                                       1.0 if want_dbias else scale, per_pair and not want_dbias, bias_bh)
                mod_zero_hidden(hooks, st, dpt, vis, nq, nk, True)
                if want_dbias:
                    if mods_on:
                        chain_factor(dpt, mod_grad, 1.0, True)
                    add_dbias(dbias_bh, dpt, i0, j0, nq, nk, True)
                    chain_factor(dpt, dcap, scale, per_pair)
                masked = mods_on or bias_bh.shape[0] > 0 or not (full_lo <= j0 and j0 + nk <= full_hi)
                tile_product_add(acc, tile, dpt, kr, nk, True, True, masked, j0, row_lo, row_hi, bias_bh, i0, vis)
            store_rows(dq[bi, q0 + i0:q0 + i0 + nq, h], acc, nq, head_dim)


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def backward_dq_kernel(qs, k, v, dout, row_max, row_inv, delta, dq, head_dim, head_dim_v, scale, left, right,
                       softcap, alibi, bias, drop, tile_states, want_dbias, dbias, seqs, units, counter, hooks):
    """dQ, and dbias when ``dbias`` has parts. A unit is a (sequence, query head, query tile); it recomputes P and
    dS for the key tiles its rows see and is the only writer of its dq rows. qs, k, v, dout, row_max, row_inv,
    delta as in ``backward_kv_kernel``, and alibi, bias, drop, tile_states, hooks, seqs, units, counter; head_dim,
    head_dim_v: D and Dv;
    dq: (B, Sq, Hq, >= D), any strides, written.
    dbias: with ``want_dbias``, (parts, B', H', Sq', Sk') zeros in the bias's own shape (each of B', H', Sq', Sk'
    the full size or 1); else any (1, sequences, Hq, 1, 1) array, untouched. Units whose bias elements coincide
    (those that differ only along an axis the bias is broadcast along) run one after another as one unit, split
    into ``parts`` runs with a slice of dbias each, so no two units add into the same element; the caller sums the
    parts (``_dbias_parts``)."""
    for _ in prange(counter[1]):
        _backward_dq_worker(qs, k, v, dout, row_max, row_inv, delta, dq, head_dim, head_dim_v, scale, left, right,
                            softcap, alibi, bias, drop, tile_states, want_dbias, dbias, seqs, units, counter, hooks)


def flash_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                   lse: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, scale: float,
                   window_left: int, window_right: int, softcap: float, alibi: np.ndarray | None = None,
                   dropout_p: float = 0.0, dropout_seed: int = 0, dropout_batch0: int = 0,
                   attn_bias: np.ndarray | None = None, mods: Any = None, return_dbias: bool = False,
                   cu_seqlens_q: np.ndarray | None = None, cu_seqlens_k: np.ndarray | None = None
                   ) -> np.ndarray | None:
    """Gradients of ``sum(out * dout)`` with respect to q, k and v, written into dq, dk, dv; with
    ``return_dbias`` also returns the gradient of attn_bias.

    Arguments:
        q: (B, Sq, Hq, D); dout, out: (B, Sq, Hq, Dv); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); any strides, not
            modified.
        lse: (B, Hq, Sq), as written by ``flash_forward`` (+inf for rows that see no key), or the lse of a softmax
            over more keys than k holds (ring attention). Where it is these keys' own, the kernels use each row's
            max and sum recomputed from q and k (``forward_kernel`` with ``stats_only``), which gives P with one
            rounding; elsewhere P = exp(score - lse) (``defer_to_caller_lse``).
        dq: (B, Sq, Hq, D); dk: (B, Sk, Hkv, D); dv: (B, Sk, Hkv, Dv); any strides, contents ignored and
            overwritten. With GQA the gradients of a kv head are summed over the query heads of its group.
        All arrays float32, or all float64. scale, window_left, window_right, softcap, alibi, dropout and attn_bias
            as in ``flash_forward`` (the same dropout_seed as the forward's).
        mods: as in ``flash_forward``, with the score_mod's score_mod_grad.
        return_dbias: needs attn_bias. Returns dbias in the compute dtype and in the bias's shape with leading
            axes of length 1 up to 4 dimensions (B', H', Sq', Sk'): the gradient of the biased score (before
            score_mod, so times score_mod_grad), summed over the axes the bias is broadcast along, 0 where a pair
            is hidden, NaN where it is not finite. Otherwise returns None.
        cu_seqlens_q, cu_seqlens_k: packed sequences, as in ``flash_forward``: q, dout, out, dq (total_q, H, D);
            k, v, dk, dv (total_k, Hkv, D); lse (Hq, total_q). One call of each pass serves every sequence.
    """
    if return_dbias and attn_bias is None:
        raise ValueError("flash_backward: return_dbias needs attn_bias")
    with mod_errors(mods):
        seqs = call_sequences(q, k, cu_seqlens_q, cu_seqlens_k)
        if seqs.packed:
            dout, q, k, v, out, lse, dq, dk, dv = (x[None] for x in (dout, q, k, v, out, lse, dq, dk, dv))
        return _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, window_left, window_right, softcap, alibi,
                         dropout_p, dropout_seed, dropout_batch0, attn_bias, mods, return_dbias, seqs)


# dbias's partial sums (``_dbias_parts``) together take at most this much memory beyond one copy of the bias.
DBIAS_PARTS_BYTES = 256 << 20


def _dbias_parts(bias_shape: tuple[int, ...], units: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Zeros (parts, B', H', Sq', Sk') for the dbias of the pass whose units are indexed by ``units``: (B, Hkv) for
    the fused key-tile pass, (B, Hq, query tiles) for the query-tile pass, whose axes meet the bias's first ones
    (a kv head's units cover its group's query heads, so an H' of 1 is the only one shared across them). Units
    that add into the same elements (along the axes where the bias has length 1) form a run, one unit of the pass;
    where the runs are fewer than the threads each is cut into ``parts`` pieces with their own partial sums, so
    that every thread has work (a (1, 1, 1, Sk) bias with B = 1 would otherwise run on one thread). No more parts
    than threads: each costs a zeroed copy of the bias and its sum."""
    shape4 = (1,) * (4 - len(bias_shape)) + tuple(int(n) for n in bias_shape)
    runs = int(np.prod([n for n, own in zip(units, shape4) if own != 1] or [1]))
    in_run = int(np.prod(units)) // runs
    wanted = numba.get_num_threads()
    parts = 1 if runs >= wanted else min(in_run, -(-wanted // runs))
    one = int(np.prod(shape4)) * np.dtype(dtype).itemsize
    parts = max(1, min(parts, 1 + DBIAS_PARTS_BYTES // max(one, 1)))
    return np.zeros((parts,) + shape4, dtype)


def _backward(dout, q, k, v, out, lse, dq, dk, dv, scale, window_left, window_right, softcap, alibi, dropout_p,
              dropout_seed, dropout_batch0, attn_bias, mods, return_dbias, seqs) -> np.ndarray | None:
    dtype = check_dtypes(dout, q, k, v, out, lse, dq, dk, dv)
    slopes = kernel_slopes(alibi)
    drop = dropout_args(dropout_p, dropout_seed, dropout_batch0)
    batch, seqlen_q, nheads_q, head_dim = q.shape   # packed: batch 1, seqlen_q total_q
    nheads_kv = k.shape[2]
    n_seqs = len(seqs.table)
    window_left, window_right, softcap = kernel_options(seqlen_q, k.shape[1], window_left, window_right, softcap,
                                                        dtype)
    stat_shape = (batch, nheads_q, seqs.stat_len)
    # delta_i = dO_i . O_i, the row term of the softmax gradient, summed the way dP = dO . v is (row_dot_kernel).
    delta = scratch("delta", stat_shape, dtype)
    kernel_entry(row_dot_kernel, dtype)(dout, out, delta, seqs.table)
    head_dim_v = v.shape[3]
    k_in, v_in = head_major(k, head_dim, "k"), head_major(v, head_dim_v, "v")
    # The forward's softmax statistics of every row, recomputed from the forward's own scores: P is then
    # exp(score - max) / sum with the forward's max and sum, not exp(score - lse) with lse rounded to float32
    # (which made P = 1 for one visible key come out 1 - 1e-7, and erred in proportion to |lse|).
    stashed = stashed_stats(lse, seqs.stash_tag)
    bias = bias_view(attn_bias, q, k)
    tile_states = states_for_call(mods, batch, nheads_q, seqlen_q, k.shape[1])
    q_units = query_tile_units(seqs, nheads_q, window_left, window_right)
    if stashed is not None:
        row_max, row_inv = stashed
    else:
        stash.stats_passes += 1
        row_max = scratch("row_max", stat_shape, dtype)
        row_inv = scratch("row_inv", stat_shape, dtype)
        no_lse = np.empty((1, 1, 1), dtype)
        kernel_with_mods(forward_kernel, dtype, mods)(q, k_in, v_in, q, no_lse, head_dim, float(scale), window_left,
                                                      window_right, softcap, row_max, row_inv, True, slopes, bias,
                                                      drop, tile_states, seqs.table, q_units, work_counter())
    _defer_to_caller_lse_rows(lse, row_max, row_inv, seqs)
    q_in, do_in = head_major(q, head_dim, "q"), head_major(dout, head_dim_v, "dout")
    qs = scratch("qs", (batch, nheads_q, seqlen_q, q_in.shape[3]), dtype)
    kernel_entry(pack_scaled_kernel, dtype)(q, qs, head_dim, score_scale(scale, softcap))
    qs_in = qs.transpose(0, 2, 1, 3)
    fuse_dq = schedule.fuse_dq(seqs, nheads_kv, window_left, window_right, numba.get_num_threads())
    kt_per_unit = max(seqs.max_k_tiles, 1) if fuse_dq else 1
    dq_acc = scratch("dq", stat_shape + (q_in.shape[3],) if fuse_dq else (1, 1, 1, 1), dtype)
    dq_acc.fill(0)
    # dbias is summed in whichever pass forms dQ: the fused key-tile pass (units per (batch, kv head)) or the
    # query-tile pass (units per (batch, query head, query tile)).
    no_dbias = np.zeros((1, n_seqs, nheads_q, 1, 1), dtype)
    dbias = no_dbias
    if return_dbias:
        units = (batch, nheads_kv) if fuse_dq else (batch, nheads_q, -(-seqlen_q // BLOCK_M))
        dbias = _dbias_parts(attn_bias.shape, units, dtype)
    kernel_with_mods(backward_kv_kernel, dtype, mods)(
        q_in, qs_in, k_in, v_in, do_in, row_max, row_inv, delta, dq_acc, dk, dv, head_dim, float(scale), window_left,
        window_right, softcap, kt_per_unit, fuse_dq, slopes, bias, drop, tile_states,
        bool(return_dbias and fuse_dq), dbias if fuse_dq else no_dbias, seqs.table,
        schedule.key_tile_units(seqs, nheads_kv, window_left, window_right, kt_per_unit), work_counter())
    if fuse_dq:
        kernel_entry(store_dq_kernel, dtype)(dq_acc, dq, head_dim, seqs.table)
    else:
        kernel_with_mods(backward_dq_kernel, dtype, mods)(
            qs_in, k_in, v_in, do_in, row_max, row_inv, delta, dq, head_dim, head_dim_v, float(scale), window_left,
            window_right, softcap, slopes, bias, drop, tile_states, bool(return_dbias), dbias, seqs.table, q_units,
            work_counter())
    if not return_dbias:
        return None
    total = dbias[0] if dbias.shape[0] == 1 else dbias.sum(axis=0)
    total[~np.isfinite(total)] = np.nan  # as the torch path gives it: an inf in a sum of gradients is not a limit
    return total


def _defer_to_caller_lse_rows(lse: np.ndarray, row_max: np.ndarray, row_inv: np.ndarray, seqs: Sequences) -> None:
    """``defer_to_caller_lse`` on the statistics rows of lse's rows: the first Sq of each batch entry for a dense
    call, gathered (and, where changed, put back) for packed sequences."""
    if not seqs.packed:
        seqlen_q = lse.shape[2]
        defer_to_caller_lse(lse, row_max[:, :, :seqlen_q], row_inv[:, :, :seqlen_q])
        return
    rows = seqs.stat_rows()
    row_max_q, row_inv_q = row_max[:, :, rows], row_inv[:, :, rows]
    if defer_to_caller_lse(lse, row_max_q, row_inv_q):
        row_max[:, :, rows], row_inv[:, :, rows] = row_max_q, row_inv_q


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
