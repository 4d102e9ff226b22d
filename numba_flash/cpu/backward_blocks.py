"""The block steps of the CPU backward kernels (``backward``): a block's scores recomputed as the forward made
them, P and dS from the forward's row statistics, dropout factors, the tile products that sum a gradient one tile
at a time, and dbias added into the bias's own shape. All inline into the kernels.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .cache_stamp import stamp_kernels
from .score_terms import apply_score_terms
from .simd import FASTMATH, as_dtype_of, fast_exp
from .microkernels import mm_add, mm_at_add
from .passes import rows_finite
from .tiles import bias_scores, dropout_block, mask_block, visible_product, zero_bias_hidden


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _gradient_terms(score, dp, row_max, inv_l, delta, dscore):
    """(P, dS) for one score (as the forward computed it) and dp = dO.v, given the row's max and 1 / sum of the
    forward's last pass (``forward_kernel`` with ``stats_only``) and delta = dO . O: P is exp(score - max) / sum,
    dS the gradient with respect to q.k, ``P * (dP - delta) * dscore`` (dscore: scale, times 1 - tanh^2 with
    softcap). A poisoned row has max NaN, which makes P and dS NaN; a row that sees no key has max +inf and
    1 / sum = 0, which make P = 0."""
    prob = fast_exp(score - row_max) * inv_l
    return prob, prob * (dp - delta) * dscore


@njit(inline="always", fastmath=FASTMATH, cache=True)
def block_scores(s, dcap, i0, j0, nk, keys_are_rows, scale, softcap, per_pair, slope, diag, bias_bh, bias_tile,
                 row_lo, row_hi, mods_on):
    """The forward's scores of a block from its q.k (Q pre-scaled as in the forward): softcap, ALiBi, attn_bias
    (-inf where it hides a pair; the band is masked later). Keys are the rows of s when ``keys_are_rows`` (a
    (BN, BM) block), else its columns. ``per_pair``: dcap (the block's shape) receives d score / d q.k (scale,
    times 1 - tanh^2 with softcap), which the user's score_mod then multiplies (``modhooks``); else dcap is
    untouched and the derivative is the scale. bias_bh: this head's attn_bias (Sq, Sk) or a (0, 0) array;
    bias_tile: (BN, BM) scratch for it where keys are rows. ``mods_on``: the mods read a -inf score as hidden, so
    a product that is not finite becomes NaN first (as softcap and ALiBi make it): it poisons, as in the forward."""
    nrows = nk if keys_are_rows else s.shape[0]
    if per_pair and softcap <= 0:
        dcap[:] = as_dtype_of(dcap, scale)
    apply_score_terms(s, nrows, s.shape[1], keys_are_rows, softcap, slope, i0, j0, diag, dcap, scale, per_pair)
    if mods_on and softcap <= 0 and slope == 0.0:
        inf, nan = as_dtype_of(s, np.inf), as_dtype_of(s, np.nan)
        for a in range(nrows):
            for e in range(s.shape[1]):
                x = s[a, e]
                s[a, e] = x if abs(x) < inf else nan
    if bias_bh.shape[0] > 0:
        bias_scores(s, bias_bh, i0, j0, nk, keys_are_rows, row_lo, row_hi, False, bias_tile)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def probs_and_dscores_rows(s, dps, dcap, row_max, row_inv, delta, i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                           scale, per_pair, bias_bh):
    """A (BM, BN) block with queries as rows: s holds the scores (``block_scores``) on entry and P on exit, dps
    holds dO.v on entry and dS on exit. row_max, row_inv (the forward's row max and 1 / sum, see
    ``_gradient_terms``) and delta are indexed by query. Masked entries and key columns past nk become 0 in both.
    dcap: d score / d q.k per pair where ``per_pair``, else the scale is. bias_bh: this head's attn_bias (Sq, Sk)
    (``bias_scores``) or a (0, 0) array."""
    zero = as_dtype_of(s, 0.0)
    sc = as_dtype_of(s, scale)
    if per_pair:
        for r in range(s.shape[0]):
            mr = row_max[i0 + r]
            il = row_inv[i0 + r]
            dl = delta[i0 + r]
            for c in range(s.shape[1]):
                s[r, c], dps[r, c] = _gradient_terms(s[r, c], dps[r, c], mr, il, dl, dcap[r, c])
    else:
        for r in range(s.shape[0]):
            mr = row_max[i0 + r]
            il = row_inv[i0 + r]
            dl = delta[i0 + r]
            for c in range(s.shape[1]):
                s[r, c], dps[r, c] = _gradient_terms(s[r, c], dps[r, c], mr, il, dl, sc)
    if bias_bh.shape[0] > 0:
        zero_bias_hidden(s, dps, bias_bh, i0, j0, nk, False)
    if not (full_lo <= j0 and j0 + nk <= full_hi):
        for r in range(s.shape[0]):
            lo = row_lo[r] - j0
            hi = row_hi[r] - j0
            for c in range(s.shape[1]):
                if c < lo or c >= hi:
                    s[r, c] = zero
                    dps[r, c] = zero
    elif nk < s.shape[1]:
        for r in range(s.shape[0]):
            for c in range(nk, s.shape[1]):
                s[r, c] = zero
                dps[r, c] = zero


@njit(inline="always", fastmath=FASTMATH, cache=True)
def probs_and_dscores_cols(st, dpt, dcap, row_max, row_inv, delta, i0, j0, nk, row_lo, row_hi, full_lo, full_hi,
                           scale, per_pair, bias_bh):
    """The same on a transposed (BN, BM) block, keys as rows: st holds the scores and becomes P^T, dpt holds v.dO
    and becomes dS^T; row_max, row_inv and delta are indexed by column. Key rows past nk and masked entries
    become 0."""
    zero = as_dtype_of(st, 0.0)
    sc = as_dtype_of(st, scale)
    if per_pair:
        for c in range(nk):
            for r in range(st.shape[1]):
                st[c, r], dpt[c, r] = _gradient_terms(st[c, r], dpt[c, r], row_max[i0 + r], row_inv[i0 + r],
                                                      delta[i0 + r], dcap[c, r])
    else:
        for c in range(nk):
            for r in range(st.shape[1]):
                st[c, r], dpt[c, r] = _gradient_terms(st[c, r], dpt[c, r], row_max[i0 + r], row_inv[i0 + r],
                                                      delta[i0 + r], sc)
    if bias_bh.shape[0] > 0:
        zero_bias_hidden(st, dpt, bias_bh, i0, j0, nk, True)
    if not (full_lo <= j0 and j0 + nk <= full_hi):
        mask_block(st, j0, nk, row_lo, row_hi, zero)
        mask_block(dpt, j0, nk, row_lo, row_hi, zero)
    for c in range(nk, st.shape[0]):
        for r in range(st.shape[1]):
            st[c, r] = zero
            dpt[c, r] = zero


@njit(inline="always", cache=True)
def dropout_factors(factors, drop, b, h, i0, j0, nk):
    """factors (BM, BN), queries as rows, = the dropout factors of the block at (i0, j0) (``dropout_block``), 1
    past nk."""
    one = as_dtype_of(factors, 1.0)
    for r in range(factors.shape[0]):
        for c in range(factors.shape[1]):
            factors[r, c] = one
    dropout_block(factors, drop, b, h, i0, j0, nk, False)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def scale_block(block, factors):
    """block *= factors, elementwise."""
    for r in range(block.shape[0]):
        for c in range(block.shape[1]):
            block[r, c] *= factors[r, c]


@njit(inline="always", cache=True)
def tile_product_add(acc, tile, a, b_rows, n, a_transposed, b_is_keys, masked, j0, row_lo, row_hi, bias_bh, i0,
                     vis):
    """acc += A @ b_rows[:n] (A = a[:n].T with ``a_transposed``, else a[:, :n]), the tile's product summed first and
    then added: a gradient summed over a long sequence then takes one rounding per tile, not one per row of the
    sequence (dK and dV at Sq = 20000 erred 10x torch's). A masked block whose b_rows hold a non-finite value goes
    through ``visible_product`` (with bias_bh, i0 and vis) into ``tile``, scratch of acc's shape."""
    if masked and not rows_finite(b_rows, n):
        tile[:] = as_dtype_of(acc, 0.0)
        visible_product(tile, a, b_rows, n, a_transposed, b_is_keys, j0, row_lo, row_hi, bias_bh, i0, vis)
        for r in range(acc.shape[0]):
            for d in range(acc.shape[1]):
                acc[r, d] += tile[r, d]
    elif a_transposed:   # the product summed in registers, then added: no store and reload through ``tile``
        mm_at_add(acc, a, b_rows, n)
    else:
        mm_add(acc, a, b_rows, n)


@njit(inline="always", cache=True)
def add_dbias(dbias_bh, ds, i0, j0, nq, nk, keys_are_rows):
    """dbias_bh[i, j] += the score gradient of query i = i0 + r and key j = j0 + c in block ``ds``: ds[c, r] when
    ``keys_are_rows`` (a transposed (BN, BM) block), else ds[r, c]; over nq queries and nk keys. dbias_bh: this
    head's (Sq', Sk') slice of the bias's own shape, where an axis of length 1 (broadcast along queries or keys)
    takes the sum over that axis. The inner loop runs along dbias's rows: strided reads then stay in the block,
    which is in L1 (down dbias's columns, the (S, S) case took 2.2x the backward's time with a bias)."""
    every_row = dbias_bh.shape[0] > 1
    every_col = dbias_bh.shape[1] > 1
    for r in range(nq):
        i = i0 + r if every_row else 0
        if every_col and keys_are_rows:
            for c in range(nk):
                dbias_bh[i, j0 + c] += ds[c, r]
        elif every_col:   # both along rows: this loop vectorises
            for c in range(nk):
                dbias_bh[i, j0 + c] += ds[r, c]
        else:
            for c in range(nk):
                dbias_bh[i, 0] += ds[c, r] if keys_are_rows else ds[r, c]


@njit(inline="always", fastmath=FASTMATH, cache=True)
def chain_factor(dst, dcap, scale, per_pair):
    """dst *= d score / d q.k, over the whole block: dcap per pair where ``per_pair``, else the scale. A 0 stays 0:
    dcap is NaN where a raw score is, also at pairs a mask hid (a non-finite k row a query does not see), which
    must keep their 0."""
    if per_pair:
        for c in range(dst.shape[0]):
            for r in range(dst.shape[1]):
                x = dst[c, r]
                dst[c, r] = x * dcap[c, r] if x != 0 else x
    else:
        sc = as_dtype_of(dst, scale)
        for c in range(dst.shape[0]):
            for r in range(dst.shape[1]):
                dst[c, r] *= sc


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
