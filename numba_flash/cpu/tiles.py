"""Tile geometry of the causal / sliding-window band: which keys each query row and query tile sees, which query
tiles see a key tile, masking a score block to it, and products that count only the pairs a query sees (so a
non-finite value of a key a row does not see never reaches that row); and the per-block score terms, ALiBi and
dropout.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from ..dropout import philox4x32_10_jit
from .simd import BLOCK_M, FASTMATH, LANES, as_dtype_of
from .microkernels import mm, mm_at, transpose_lanes
from .passes import copy_rows, load_transposed

# ---------------------------------------------------------------------------------------------------------------
# Masks


@njit(inline="always", cache=True)
def row_key_range(i, seqlen_q, seqlen_k, left, right):
    """Half-open range of keys query row ``i`` sees (numba twin of ``numba_flash.semantics.key_range``); rows past
    the end of the sequence (tile padding) see nothing."""
    if i >= seqlen_q:
        return 0, 0
    centre = i + seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, centre - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
    return lo, max(lo, hi)


@njit(inline="always", cache=True)
def tile_key_span(i0, seqlen_q, seqlen_k, left, right, row_lo, row_hi):
    """Fill the per-row key ranges of the query tile starting at ``i0`` and return ``(lo, hi, full_lo, full_hi)``:
    the union ``[lo, hi)`` of the ranges of its rows (empty when no row sees a key), and the keys
    ``[full_lo, full_hi)`` that every real row sees (a key tile inside it needs no mask)."""
    lo = seqlen_k
    hi = 0
    full_lo = 0
    full_hi = seqlen_k
    for r in range(row_lo.shape[0]):
        a, e = row_key_range(i0 + r, seqlen_q, seqlen_k, left, right)
        row_lo[r] = a
        row_hi[r] = e
        if i0 + r < seqlen_q:
            full_lo = max(full_lo, a)
            full_hi = min(full_hi, e)
        if a < e:
            lo = min(lo, a)
            hi = max(hi, e)
    return lo, hi, full_lo, full_hi


@njit(inline="always", cache=True)
def query_tiles_seeing(j0, j1, seqlen_q, seqlen_k, left, right):
    """Query tiles ``[first, end)`` containing a row that may see a key in ``[j0, j1)``: key j is visible to row i
    iff ``j - off - right <= i <= j - off + left`` (off = Sk - Sq), each bound dropped when unbounded."""
    off = seqlen_k - seqlen_q
    i_lo = 0 if right < 0 else max(0, j0 - off - right)
    i_hi = seqlen_q if left < 0 else min(seqlen_q, j1 - 1 - off + left + 1)
    if i_lo >= i_hi:
        return 0, 0
    return i_lo // BLOCK_M, (i_hi + BLOCK_M - 1) // BLOCK_M


@njit(inline="always", cache=True)
def mask_block(st, j0, nk, row_lo, row_hi, fill):
    """st[c, r] = fill where query r does not see key j0 + c, for the first nk key rows of a (BN, BM) block."""
    for c in range(nk):
        j = j0 + c
        for r in range(st.shape[1]):
            if j < row_lo[r] or j >= row_hi[r]:
                st[c, r] = fill


@njit(inline="always", cache=True)
def mask_scores(st, j0, nk, row_lo, row_hi):
    """The forward's mask on the first nk key rows of a (BN, BM) block of scores: -inf where query r does not see
    key j0 + c, and NaN where it does but the score is not finite. After it, -inf means "masked" and nothing else,
    so the max pass ('max_nan') can poison a query for a visible -inf (an inf in q or k, or an overflow) instead of
    dropping that key."""
    neg_inf = as_dtype_of(st, -np.inf)
    inf = as_dtype_of(st, np.inf)
    nan = as_dtype_of(st, np.nan)
    for c in range(nk):
        j = j0 + c
        for r in range(st.shape[1]):
            # selects, no branches: the loop vectorises
            x = st[c, r]
            x = x if abs(x) < inf else nan
            st[c, r] = x if (j >= row_lo[r]) & (j < row_hi[r]) else neg_inf


@njit(inline="always", cache=True)
def visible_product(c_arr, a, b_rows, n, a_transposed, b_is_keys, j0, row_lo, row_hi, bias_bh, i0, vis):
    """c += A @ b_rows[:n] with A = a[:n].T (``a_transposed``) or a[:, :n], counting only the (query, key) pairs a
    query sees, for a block whose mask hides some pairs (A is 0 there) and whose b_rows hold a value that is not
    finite: a plain product adds 0 * nan = nan to every row of c, also to queries that do not see that key.

    b_rows has one row per key j0 + c (``b_is_keys``; c's rows are the queries of row_lo/row_hi) or one per query
    (c's rows are the keys j0 + r). The finite rows go through the same micro-kernel as the fast path, from a copy
    with the non-finite rows zeroed, so that rows of c that see none of those get exactly the result of a run
    without them; the non-finite rows are then added pair by pair where a query sees the key. bias_bh: this
    head's (Sq, Sk) attn_bias, whose -inf hides a pair as the band does (``bias_scores``), or a (0, 0) array; i0:
    the first query of c's rows (``b_is_keys``) or of b_rows; vis: bool in a's layout, False where the user's mods
    hide the pair (``modhooks``), or a (0, 0) array without mods."""
    inf = as_dtype_of(b_rows, np.inf)
    zero = as_dtype_of(b_rows, 0.0)
    width = b_rows.shape[1]
    clean = np.empty((n, width), b_rows.dtype)
    bad = np.zeros(n, np.bool_)
    for c in range(n):
        for d in range(width):
            x = b_rows[c, d]
            clean[c, d] = x
            if not abs(x) < inf:
                bad[c] = True
        if bad[c]:
            for d in range(width):
                clean[c, d] = zero
    if a_transposed:
        mm_at(c_arr, a, clean, n, True)
    else:
        mm(c_arr, a, clean, n, True)
    for c in range(n):
        if not bad[c]:
            continue
        for r in range(c_arr.shape[0]):
            if b_is_keys:
                i, j, rr = i0 + r, j0 + c, r
            else:
                i, j, rr = i0 + c, j0 + r, c
            seen = row_lo[rr] <= j < row_hi[rr]
            if seen and bias_bh.shape[0] > 0:
                seen = i < bias_bh.shape[0] and bias_bh[i, j] != -np.inf
            if seen and vis.shape[0] > 0:
                seen = vis[c, r] if a_transposed else vis[r, c]
            if seen:
                coef = a[c, r] if a_transposed else a[r, c]
                for d in range(width):
                    c_arr[r, d] += coef * b_rows[c, d]


@njit(inline="always", cache=True)
def load_rows(dst, src, n, head_dim):
    """dst[:n, :head_dim] = src[:n, :head_dim] and zero in dst's rows n..; columns past head_dim keep their
    (zero) contents. src is a 2-D view of a head-major buffer (unit-stride rows)."""
    zero = as_dtype_of(dst, 0.0)
    copy_rows(dst, src, n, head_dim)
    for c in range(n, dst.shape[0]):
        for d in range(dst.shape[1]):
            dst[c, d] = zero


@njit(inline="always", fastmath=FASTMATH, cache=True)
def dropout_block(block, drop, b, h, i0, j0, nk, keys_are_rows):
    """Dropout: block *= 1 / (1 - p) where ``numba_flash.dropout`` keeps (b, h, i, j) and 0 where it drops it, for
    query i = i0 + (column or row) and key j = j0 + (row or column) < j0 + nk, keys indexing the rows of ``block``
    when ``keys_are_rows``. drop: (seed_lo, seed_hi, threshold, 1 / (1 - p), b of this call's first batch row) as
    float64 (each exact), or an empty array for no dropout (``workspace.dropout_args``). j0 is a multiple of 4, so
    each Philox call serves four neighbouring keys of one query, and the loop over queries is the vectorised one."""
    if drop.shape[0] == 0:
        return
    u = np.uint64
    seed_lo, seed_hi, threshold = u(drop[0]), u(drop[1]), u(drop[2])
    kept = as_dtype_of(block, drop[3])
    zero = as_dtype_of(block, 0.0)
    bb = u(b + np.int64(drop[4]))
    hh = u(h)
    nq = block.shape[1] if keys_are_rows else block.shape[0]
    for c in range(0, nk, 4):
        jw = u((j0 + c) >> 2)
        n4 = min(4, nk - c)
        for r in range(nq):
            w0, w1, w2, w3 = philox4x32_10_jit(jw, u(i0 + r), hh, bb, seed_lo, seed_hi)
            f0 = kept if w0 < threshold else zero
            f1 = kept if w1 < threshold else zero
            f2 = kept if w2 < threshold else zero
            f3 = kept if w3 < threshold else zero
            if keys_are_rows:
                block[c, r] *= f0
                if n4 == 4:
                    block[c + 1, r] *= f1
                    block[c + 2, r] *= f2
                    block[c + 3, r] *= f3
                else:
                    if n4 > 1:
                        block[c + 1, r] *= f1
                    if n4 > 2:
                        block[c + 2, r] *= f2
            else:
                block[r, c] *= f0
                if n4 == 4:
                    block[r, c + 1] *= f1
                    block[r, c + 2] *= f2
                    block[r, c + 3] *= f3
                else:
                    if n4 > 1:
                        block[r, c + 1] *= f1
                    if n4 > 2:
                        block[r, c + 2] *= f2


def _bias_tile_t(tile_t, bias_bh, i0, j0, nq, nk):  # pragma: no cover - typed by the overload below
    raise NotImplementedError


@overload(_bias_tile_t, inline="always")
def _bias_tile_t_impl(tile_t, bias_bh, i0, j0, nq, nk):
    """tile_t[c, r] = bias_bh[i0 + r, j0 + c] for r < nq, c < nk. float32 tiles whose bias rows are unit-stride
    go through registers, LANES x LANES at a time (``transpose_lanes``): the scalar copy's one strided store per
    element made a forward with a bias 1.45x the plain one. Partial tiles, float64 and strided rows: the scalar
    copy (``load_transposed``), which reads along the bias's rows and scatters its writes in L1."""
    if not (tile_t.dtype == types.float32 and bias_bh.dtype == types.float32):
        def impl_scalar(tile_t, bias_bh, i0, j0, nq, nk):
            load_transposed(tile_t, bias_bh[i0:i0 + nq, j0:j0 + nk], nq, nk)
        return impl_scalar

    def impl(tile_t, bias_bh, i0, j0, nq, nk):
        if (nq == tile_t.shape[1] and nk == tile_t.shape[0] and nq % LANES == 0 and nk % LANES == 0
                and bias_bh.strides[1] == 4):
            for rb in range(0, nq, LANES):
                for cb in range(0, nk, LANES):
                    transpose_lanes(tile_t, bias_bh, i0 + rb, j0 + cb, cb, rb)
        else:
            load_transposed(tile_t, bias_bh[i0:i0 + nq, j0:j0 + nk], nq, nk)
    return impl


@njit(inline="always", fastmath=FASTMATH, cache=True)
def bias_scores(block, bias_bh, i0, j0, nk, keys_are_rows, row_lo, row_hi, forward, tile_t):
    """attn_bias on a block of scores after softcap and ALiBi, for query i = i0 + (column or row) and key j = j0 +
    (row or column) < j0 + nk, keys indexing the rows of ``block`` when ``keys_are_rows``. bias_bh: this head's
    (Sq, Sk) bias, read in place. Where the bias is -inf the pair is hidden, as the band hides it, whatever the
    score: the block gets -inf there. Elsewhere the score gets the bias added. Query rows past Sq (tile padding)
    become -inf. With keys as rows, the bias tile is first copied transposed into ``tile_t`` (BN, BM)
    (``_bias_tile_t``), so that the pass over the block reads both along rows.

    With ``forward`` this also is the forward's ``mask_scores`` for the block (every block with a bias goes
    through it): -inf for pairs outside the band, NaN for a visible score that is not finite, so that -inf means
    hidden and nothing else.

    Returns whether the bias hides any pair of the block (is -inf there): where it does not, the block hides no
    more than the band does."""
    neg_inf = as_dtype_of(block, -np.inf)
    inf = as_dtype_of(block, np.inf)
    nan = as_dtype_of(block, np.nan)
    nq = min(block.shape[1] if keys_are_rows else block.shape[0], bias_bh.shape[0] - i0)
    hidden = 0
    if keys_are_rows:
        _bias_tile_t(tile_t, bias_bh, i0, j0, nq, nk)
        # The band test compares 64-bit key bounds per element: only in blocks the band cuts, each case its own
        # branch-free loop. Both bounds grow with the row, so the last row's lo and the first row's hi decide.
        in_band = nq > 0 and row_lo[nq - 1] <= j0 and row_hi[0] >= j0 + nk
        for c in range(nk):
            j = j0 + c
            if forward and not in_band:
                for r in range(nq):   # selects, no branches: the loop vectorises
                    bv = tile_t[c, r]
                    s = block[c, r] + bv
                    hidden |= bv == neg_inf
                    s = s if abs(s) < inf else nan
                    seen = (bv != neg_inf) & (j >= row_lo[r]) & (j < row_hi[r])
                    block[c, r] = s if seen else neg_inf
            else:
                for r in range(nq):
                    bv = tile_t[c, r]
                    s = block[c, r] + bv
                    hidden |= bv == neg_inf
                    if forward:
                        s = s if abs(s) < inf else nan
                    block[c, r] = s if bv != neg_inf else neg_inf
            for r in range(nq, block.shape[1]):
                block[c, r] = neg_inf
    else:   # the backward's (BM, BN) blocks, which mask the band themselves
        for r in range(nq):
            for c in range(nk):
                bv = as_dtype_of(block, bias_bh[i0 + r, j0 + c])
                s = block[r, c] + bv
                hidden |= bv == neg_inf
                block[r, c] = s if bv != neg_inf else neg_inf
        for r in range(nq, block.shape[0]):
            for c in range(block.shape[1]):
                block[r, c] = neg_inf
    return hidden != 0


@njit(inline="always", fastmath=FASTMATH, cache=True)
def zero_bias_hidden(s, dps, bias_bh, i0, j0, nk, keys_are_rows):
    """s and dps (P and dS of a backward block, laid out as in ``bias_scores``) = 0 where the (Sq, Sk) bias
    bias_bh is -inf and so hides the pair: P is 0 there already, but dS may be 0 * NaN."""
    zero = as_dtype_of(s, 0.0)
    neg_inf = as_dtype_of(s, -np.inf)
    nq = min(s.shape[1] if keys_are_rows else s.shape[0], bias_bh.shape[0] - i0)
    for r in range(nq):
        for c in range(nk):
            if as_dtype_of(s, bias_bh[i0 + r, j0 + c]) == neg_inf:
                if keys_are_rows:
                    s[c, r] = zero
                    dps[c, r] = zero
                else:
                    s[r, c] = zero
                    dps[r, c] = zero
