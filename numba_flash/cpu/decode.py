"""Flash-decoding for the CPU: a few new query rows against a KV cache, with the key range split in parallel.

Decoding is memory-bound: each new token reads the whole cache once and does ~4 flops per byte. So the kernel
is shaped around reading the cache once, in place:

* One work unit per (batch, kv head, split). A unit takes every query row that reads its kv head, all
  ``Hq / Hkv`` query heads of the group times all ``Sq`` rows (``rows = group * Sq``), and streams its part of
  the keys through once, in tiles of ``BLOCK_N`` keys: each key's k and v rows are loaded once from memory and
  used for every row while they sit in L1. Where the keys are long enough and a key's rows of all heads are
  adjacent ("bshd"), a unit takes all kv heads and the splits multiply by Hkv instead (``_heads_per_unit``):
  the same number of units, each reading the cache in address order.
* The caches are never copied or packed. They reach the kernel as flat 1-D views of their memory
  (``_flat_view``) plus element strides, so that one compilation serves contiguous, strided and paged caches, and
  the loops over the head dim read unit-stride memory that LLVM vectorises (numba types a strided 4-D view as
  layout 'A', whose inner loops it compiles one element at a time).
* Each unit keeps the online-softmax state of its rows, Triton's names: ``m_i`` (running max, base 2),
  ``l_i`` (running sum of exp2(score - m_i)), ``acc`` (unnormalised output). Scratch is O(rows x D) per unit.
* Splits (flash-decoding): a batch's visible key span is cut into ``num_splits`` contiguous parts; each unit writes
  its partial (m_i, l_i, acc), and a second parallel pass merges the parts of a row by their log-sum-exps,
  exactly: ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``. A part in which a row sees no key has
  ``m = -inf, l = 0`` and weighs nothing. This is ``merge_attention_states`` on (out_s, lse_s), done on the
  unnormalised state so that no division happens before the merge.
* A tile's three steps (its scores, the online-softmax update, P V) are functions of ``decode_tile``, with the
  head-dim products they run.

Semantics are ``numba_flash.reference.attention_ref``'s, per batch on its own keys (see ``decode_forward``). The
non-finite rule is kept without masks: a row only ever touches the keys it sees (each row's visible keys in a tile
are one contiguous run), so a NaN in a v row it does not see never meets it as ``0 * nan``; a visible score that is
not finite marks the row poisoned (its out and lse become NaN) and the row is skipped from then on.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numba
import numpy as np
from numba import njit, prange, types

from numba_flash.cpu.cache_stamp import stamp_kernels
from numba_flash.cpu.decode_tile import tile_pv, tile_scores, tile_softmax
from numba_flash.cpu.simd import FASTMATH, LN2, LOG2E, as_dtype_of, fast_exp2
from numba_flash.cpu.tiles import row_key_range
from numba_flash.cpu.workspace import kernel_slopes
from numba_flash.kvcache import MAX_SPLITS, MIN_KEYS_PER_SPLIT, choose_num_splits  # noqa: F401 (re-exported)
from numba_flash.semantics import clamp_window_bound, effective_softcap

BLOCK_N = 64  # keys per tile: their k and v rows (64 x D) stay in L1/L2 while every row of the unit uses them


@njit(inline="always", cache=True)
def _cache_offset(strides, b, pos, hk, cache_rows, key_start, block_table, page_size):
    """Element offset in the flat view of the cache row of batch b's logical key ``pos`` (0-based within its
    keys) for kv head hk. strides: (origin, s0, s1, s2, s3) in elements, see ``_flat_view``."""
    p = key_start[b] + pos
    if page_size > 0:
        return strides[0] + block_table[b, p // page_size] * strides[1] + (p % page_size) * strides[2] \
            + hk * strides[3]
    return strides[0] + cache_rows[b] * strides[1] + p * strides[2] + hk * strides[3]


@njit(parallel=True, fastmath=FASTMATH, cache=True)
def _decode_kernel(q, k_flat, k_str, v_flat, v_str, cache_rows, key_start, key_end, block_table, page_size,
                   nheads_kv, heads_per_unit, out, lse, part_acc, part_m, part_l, scale, left, right, softcap,
                   num_splits, alibi):
    """Both passes of ``decode_forward``. q (B, Sq, Hq, D), out likewise, lse (B, Hq, Sq): any strides. k_flat,
    v_flat: 1-D views of the caches' memory, k_str/v_str (5,) int64 their origin and element strides.
    A unit is (batch, block of ``heads_per_unit`` kv heads, split): U = B * Hkv / heads_per_unit * num_splits units.
    part_acc (U, rows, D), part_m and part_l (U, rows): the units' partial states.
    Row r of a unit: kv head hk0 + r // (group * Sq), query head that * group + (r // Sq) % group, query row r % Sq.
    alibi: (B, Hq) float64 slopes, or (0, 0) for none.
    """
    batch, seqlen_q, nheads_q, head_dim = q.shape
    group = nheads_q // nheads_kv
    n_blocks = nheads_kv // heads_per_unit
    rows_per_head = group * seqlen_q
    n_rows = heads_per_unit * rows_per_head
    k_step, v_step = k_str[4], v_str[4]
    # Scores in base 2 (log2 e folded into the scale) for exp2. With softcap the raw score keeps the scale alone
    # and is checked for finiteness before tanh, which would turn an inf from q or k into a finite +-1.
    qscale = as_dtype_of(q, scale if softcap > 0 else scale * LOG2E)
    neg_inf = as_dtype_of(q, -np.inf)
    inf = as_dtype_of(q, np.inf)
    nan = as_dtype_of(q, np.nan)
    zero = as_dtype_of(q, 0.0)
    one = as_dtype_of(q, 1.0)
    has_alibi = alibi.shape[0] > 0
    for u in prange(batch * n_blocks * num_splits):
        b = u // (n_blocks * num_splits)
        hk0 = (u // num_splits) % n_blocks * heads_per_unit
        split = u % num_splits
        seqlen_k = max(0, key_end[b] - key_start[b])
        # Row r's visible keys are [row_lo[r], row_hi[r]); k_head/v_head: its kv head's offset from hk0's rows.
        row_lo = np.empty(n_rows, np.int64)
        row_hi = np.empty(n_rows, np.int64)
        span_lo, span_hi = seqlen_k, 0
        for r in range(n_rows):
            lo, hi = row_key_range(r % seqlen_q, seqlen_q, seqlen_k, left, right)
            row_lo[r], row_hi[r] = lo, hi
            if lo < hi:
                span_lo, span_hi = min(span_lo, lo), max(span_hi, hi)
        # Split the keys some row sees, not [0, Sk): a sliding window over a long cache still splits evenly.
        chunk = -(-max(0, span_hi - span_lo) // num_splits)
        j_begin = min(span_hi, span_lo + split * chunk)
        j_end = min(span_hi, j_begin + chunk)
        qs = np.empty((n_rows, head_dim), q.dtype)
        k_head = np.empty(n_rows, np.int64)
        v_head = np.empty(n_rows, np.int64)
        slope2 = np.zeros(n_rows, q.dtype)  # ALiBi slopes in the base-2 score domain
        shift = np.zeros(n_rows, np.int64)
        for r in range(n_rows):
            k_head[r] = r // rows_per_head * k_str[3]
            v_head[r] = r // rows_per_head * v_str[3]
            h = hk0 * group + r // seqlen_q
            if has_alibi:
                slope2[r] = as_dtype_of(q, alibi[b, h] * LOG2E)
            for d in range(head_dim):
                qs[r, d] = q[b, r % seqlen_q, h, d] * qscale
        m_i = np.full(n_rows, neg_inf, q.dtype)
        l_i = np.zeros(n_rows, q.dtype)
        acc = np.zeros((n_rows, head_dim), q.dtype)
        poisoned = np.zeros(n_rows, np.bool_)
        s = np.empty((n_rows, BLOCK_N), q.dtype)
        k_off = np.empty(BLOCK_N, np.int64)
        v_off = np.empty(BLOCK_N, np.int64)
        run_lo = np.empty(n_rows, np.int64)  # row r's visible keys in the tile: [run_lo[r], run_hi[r])
        run_hi = np.empty(n_rows, np.int64)
        for j0 in range(j_begin, j_end, BLOCK_N):
            nk = min(BLOCK_N, j_end - j0)
            for c in range(nk):
                k_off[c] = _cache_offset(k_str, b, j0 + c, hk0, cache_rows, key_start, block_table, page_size)
                v_off[c] = _cache_offset(v_str, b, j0 + c, hk0, cache_rows, key_start, block_table, page_size)
            for r in range(n_rows):
                run_lo[r] = max(j0, row_lo[r]) - j0
                run_hi[r] = run_lo[r] if poisoned[r] else max(run_lo[r], min(j0 + nk, row_hi[r]) - j0)
                if has_alibi:
                    shift[r] = r % seqlen_q + seqlen_k - seqlen_q - j0
            tile_scores(qs, k_flat, k_off, k_head, k_step, nk, run_lo, run_hi, s)
            tile_softmax(s, run_lo, run_hi, m_i, l_i, acc, poisoned, softcap, slope2, shift)
            tile_pv(acc, s, v_flat, v_off, v_head, v_step, run_lo, run_hi)
        for r in range(n_rows):
            part_m[u, r] = nan if poisoned[r] else m_i[r]
            part_l[u, r] = l_i[r]
            for d in range(head_dim):
                part_acc[u, r, d] = acc[r, d]

    # Merge the splits of each row by their log-sum-exps.
    ln2 = as_dtype_of(q, LN2)
    for w in prange(batch * n_blocks * n_rows):
        b = w // (n_blocks * n_rows)
        blk = (w // n_rows) % n_blocks
        r = w % n_rows
        i = r % seqlen_q
        h = blk * heads_per_unit * group + r // seqlen_q
        u0 = (b * n_blocks + blk) * num_splits
        seqlen_k = max(0, key_end[b] - key_start[b])
        lo, hi = row_key_range(i, seqlen_q, seqlen_k, left, right)
        if lo >= hi:  # sees no key: 0 and lse = +inf, whatever its q holds (it reads nothing)
            for d in range(head_dim):
                out[b, i, h, d] = zero
            lse[b, h, i] = inf
            continue
        m_all = neg_inf
        bad = False
        for sp in range(num_splits):
            m = part_m[u0 + sp, r]
            bad |= m != m
            m_all = max(m_all, m)
        if bad:  # poisoned by a visible score that is not finite
            for d in range(head_dim):
                out[b, i, h, d] = nan
            lse[b, h, i] = nan
            continue
        l_all = zero
        for sp in range(num_splits):
            l_all += part_l[u0 + sp, r] * fast_exp2(part_m[u0 + sp, r] - m_all)
        inv = one / l_all
        for d in range(head_dim):
            o = zero
            for sp in range(num_splits):
                o += part_acc[u0 + sp, r, d] * fast_exp2(part_m[u0 + sp, r] - m_all)
            o *= inv
            out[b, i, h, d] = o if abs(o) < inf else nan
        lse[b, h, i] = m_all * ln2 + math.log(l_all)


_compiled: dict[Any, Any] = {}
_compiled_lock = threading.Lock()


def _kernel_for(dtype: np.dtype) -> Any:
    """``_decode_kernel`` compiled for ``dtype``, with layout-generic types for the caller's q, out and lse so
    that every layout shares one compilation (and one on-disk cache entry)."""
    dtype = np.dtype(dtype)
    fn = _compiled.get(dtype)
    if fn is None:
        nb = numba.from_dtype(dtype)
        i64 = types.int64
        ints1, ints2 = types.Array(i64, 1, "C"), types.Array(i64, 2, "C")
        flat = types.Array(nb, 1, "C", readonly=True)
        sig = (types.Array(nb, 4, "A", readonly=True), flat, ints1, flat, ints1, ints1, ints1, ints1, ints2, i64,
               i64, i64, types.Array(nb, 4, "A"), types.Array(nb, 3, "A"), types.Array(nb, 3, "C"),
               types.Array(nb, 2, "C"), types.Array(nb, 2, "C"), types.float64, i64, i64, types.float64, i64,
               types.Array(types.float64, 2, "C", readonly=True))
        with _compiled_lock:
            fn = _compiled.get(dtype)
            if fn is None:
                fn = _compiled[dtype] = _decode_kernel.compile(sig)
    return fn


def _heads_per_unit(nheads_kv: int, max_seqlen_k: int, num_splits: int) -> int:
    """How many kv heads one work unit takes: all Hkv where the keys still split into ``num_splits * Hkv`` parts
    of at least MIN_KEYS_PER_SPLIT, else 1. The kernel then runs ``num_splits * Hkv`` splits of all heads: as
    many units as the caller's (b, kv head, split) ones, but in a "bshd" cache the rows of one key for all heads
    are one contiguous block, so a unit streams through memory in address order instead of reading D of every
    Hkv * D elements. Measured single-threaded at Sk = 32768, Hkv = 8, D = 128: 28.0 ms with one head per unit,
    22.0 ms with all 8. Blocks of 2 or 4 of 8 heads measured slower than either (14-16 ms against 6-9 ms at
    Sk = 8192), so they are not used."""
    if nheads_kv > 1 and max_seqlen_k // (num_splits * nheads_kv) >= MIN_KEYS_PER_SPLIT:
        return nheads_kv
    return 1


def _flat_view(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A read-only 1-D unit-stride view of the memory a 4-D array spans, and (origin, s0, s1, s2, s3) int64 such
    that ``x[i0, i1, i2, i3]`` is ``flat[origin + i0 * s0 + ... + i3 * s3]``. No copy, except for arrays whose
    strides are not whole elements (views into structured arrays), which cannot be indexed that way."""
    if any(st % x.itemsize for st in x.strides):
        x = np.ascontiguousarray(x)
    steps = [st // x.itemsize for st in x.strides]
    origin = sum((n - 1) * -st for n, st in zip(x.shape, steps) if st < 0)
    # The lowest address is x with its negative-stride axes reversed; the view starts there.
    low = x[tuple(slice(None, None, -1) if st < 0 else slice(None) for st in steps)]
    span = 0 if x.size == 0 else 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, steps))
    flat = np.lib.stride_tricks.as_strided(low, shape=(span,), strides=(x.itemsize,), writeable=False)
    return flat, np.array([origin, *steps], np.int64)


def _readonly(x: np.ndarray) -> np.ndarray:
    view = x.view()
    view.flags.writeable = False
    return view


def decode_forward(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, cache_rows: np.ndarray,
                   key_start: np.ndarray, key_end: np.ndarray, block_table: np.ndarray, page_size: int,
                   out: np.ndarray, lse: np.ndarray, scale: float, window_left: int, window_right: int,
                   softcap: float, num_splits: int, alibi_slopes: np.ndarray | None = None) -> None:
    """Attention of new query rows against a KV cache (flash-decoding), written into ``out`` and ``lse``.

    Arguments (no validation here beyond dtypes: the public ``with_kvcache`` validates):
        q: (B, Sq, Hq, D), any strides, already rotated. Not modified.
        k_cache, v_cache: any strides, not modified, never copied. Not paged (``page_size == 0``):
            (B_cache, S_cache, Hkv, D), batch b reads cache row ``cache_rows[b]``. Paged (``page_size > 0``):
            (num_blocks, page_size, Hkv, D); batch b's logical key position p lives at
            ``[block_table[b, p // page_size], p % page_size]``. Hq % Hkv == 0; query head h reads kv head
            ``h // (Hq // Hkv)``.
        cache_rows: (B,) int64, ignored when paged. block_table: (B, max_blocks) int64, a (1, 1) dummy when not
            paged.
        key_start, key_end: (B,) int64; batch b's keys are its logical positions [key_start[b], key_end[b]).
            Batch b is dense attention over its Sk_b = key_end[b] - key_start[b] keys, renumbered from 0, with
            the contract's bottom-right alignment: row i sees key j iff
            ``i + Sk_b - Sq - left <= j <= i + Sk_b - Sq + right`` (a bound of -1: unbounded; causal: right = 0)::

                Sq = 2, Sk_b = 5, causal:   row 0:  x x x x .
                                            row 1:  x x x x x
        out: (B, Sq, Hq, D), any strides; written. lse: (B, Hq, Sq), any strides; written with the natural log of
            the sum of exp(score) over the row's keys: +inf (and out 0) for a row that sees none (Sk_b may be 0),
            NaN (and out NaN) for a row that sees a key whose raw score is not finite. A non-finite v row makes
            NaN only the rows that see it.
        q, caches, out and lse: all float32 or all float64 (the compute dtype).
        scale: multiplies q.k. softcap: 0 = off, else score = softcap * tanh(scale * q.k / softcap).
        num_splits: >= 1 parts of each batch's visible keys, run in parallel and merged exactly (see
            ``choose_num_splits``).
        alibi_slopes: None or (B, Hq) float64: adds ``-slope * |i + Sk_b - Sq - j|`` to the scores after softcap.
    """
    dtype = q.dtype
    if dtype not in (np.float32, np.float64) or any(a.dtype != dtype for a in (k_cache, v_cache, out, lse)):
        raise TypeError(f"decode_forward needs q, k_cache, v_cache, out and lse all float32 or all float64, got "
                        f"{sorted({str(a.dtype) for a in (q, k_cache, v_cache, out, lse)})}")
    batch, seqlen_q, nheads_q, head_dim = q.shape
    nheads_kv = k_cache.shape[2]
    num_splits = max(1, int(num_splits))
    ints = [np.array(x, np.int64, order="C", ndmin=1) for x in (cache_rows, key_start, key_end)]
    table = np.array(block_table, np.int64, order="C", ndmin=2)
    longest = int(max(0, (ints[2] - ints[1]).max())) if batch else 0
    left, right = (clamp_window_bound(int(w), seqlen_q, longest) for w in (window_left, window_right))
    softcap = effective_softcap(float(softcap), dtype.name)
    k_flat, k_str = _flat_view(k_cache)
    v_flat, v_str = _flat_view(v_cache)
    # Head blocks pay where a key's rows of consecutive heads are adjacent ("bshd"); in a head-major cache they
    # are Sk * D apart, the same low address bits, and 2 x heads streams thrashed L1 sets (19.6 -> 29.5 ms).
    adjacent = all(st[3] == head_dim and st[4] == 1 for st in (k_str, v_str))
    heads_per_unit = _heads_per_unit(nheads_kv, longest, num_splits) if adjacent else 1
    n_rows = heads_per_unit * (nheads_q // nheads_kv) * seqlen_q
    splits = num_splits * heads_per_unit
    units = batch * nheads_kv * num_splits
    part_acc = np.empty((units, n_rows, head_dim), dtype)
    part_m = np.empty((units, n_rows), dtype)
    part_l = np.empty((units, n_rows), dtype)
    _kernel_for(dtype)(_readonly(q), k_flat, k_str, v_flat, v_str, *ints, table, int(page_size), nheads_kv,
                       heads_per_unit, out, lse, part_acc, part_m, part_l, float(scale), left, right, softcap, splits,
                       _readonly(np.ascontiguousarray(kernel_slopes(alibi_slopes))))


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
