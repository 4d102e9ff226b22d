"""Device helpers for which (row, key) pairs count, shared by the forward and backward kernels, and for the
contract's non-finite rule (numba_flash/reference.py's docstring states it).

The rule costs the kernels little in the common case and is exact in the rare one:

* a visible score that is not finite (an inf or NaN in q or k, or an overflow) is made NaN before the softmax, so
  the row's max, sum, output and lse all become NaN ("poisoned") instead of an inf being taken for a masked key or
  hidden by ``tanh``;
* a masked pair has P = 0 and dS = 0 exactly (a select, never a product), but a product loop still adds
  ``0 * x``, which is NaN when x is not finite. The forward loads a non-finite V element as 0 and, once per block
  after its main loop, makes NaN the output columns of the rows that see such a key (read again from global
  memory; only when some thread saw one). The backward's tile loads sum ``x * 0`` over what each thread loaded
  (NaN as soon as one element is not finite), the barrier after the load ORs that over the block
  (``syncthreads_or``, no extra barrier), and a tile that holds a non-finite value goes through a product that
  skips the masked pairs. The kernels name that flag ``*_nonfinite``; the performance model counts the branch it
  guards as not taken (but not the cost its mere presence has on the compiled loop: see BENCHMARKS.md);
* every result is stored through ``nan_if_not_finite``: the contract reports every non-finite result as NaN;
* ``attn_bias`` is one more mask and one more term: a -inf entry makes its pair masked (in ``visible``, so the
  rare paths above skip it too), any other entry is added to the score, where a +inf or NaN poisons the row.

The helpers are ``inline="always"`` (see dtypes.py). The performance model counts an inlined helper's
instructions with the kernel loop around them (lineinfo.py), but recovers trip counts from kernel lines only: a
helper must not hold the loop a kernel's count depends on (it refuses such a loop).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32, uint64

from numba_flash.dropout import compile_with

from numba_flash.cuda.device.score_terms import make_pipeline
from numba_flash.cuda.device.user_mods import LN2, LOG2E  # noqa: F401  (the kernels take them from here)
from numba_flash.cuda.device.user_mods import (NO_MODS, CudaMods, make_hidden_by_mods, make_index_terms,
                                               make_tile_index_terms)


@cuda.jit(device=True, inline="always")
def nan_if_not_finite(x):
    """``x`` if it is finite, else NaN (float32)."""
    return x if abs(x) < float32(math.inf) else float32(math.nan)


@cuda.jit(device=True, inline="always")
def row_softmax_terms(lse, row_stats, stats_on, b, h, row):
    """``(m2, l2)`` with ``P = exp2((s2 - m2) - l2)`` for row ``row`` of batch ``b``, head ``h``: the forward's row
    max (log2 units) and log2 of its sum from ``row_stats`` (2, B, Hq, Sq) where ``stats_on`` and they give that
    row's ``lse`` (B, Hq, Sq) bit for bit, as the forward computed it; else ``lse`` in log2 units and 0 (an lse from
    elsewhere: ring attention's, a user's, one the caller changed). A max taken from the same scores the backward
    recomputes makes P of a dominant score exactly 1, where lse's round trip through natural units is off by an
    ulp of the score: 1% of P at a score of 1e5."""
    lse_row = lse[b, h, row]
    m2 = lse_row * float32(LOG2E)
    l2 = float32(0.0)
    if stats_on and abs(lse_row) < float32(math.inf):   # rows the forward saw no key of were never written
        row_max = row_stats[0, b, h, row]
        log2_sum = row_stats[1, b, h, row]
        if (row_max + log2_sum) * float32(LN2) == lse_row:
            m2 = row_max
            l2 = log2_sum
    return m2, l2


@cuda.jit(device=True, inline="always")
def nonfinite_probe(x):
    """0 for a finite ``x``, NaN for an inf or a NaN: summed over a tile, NaN iff the tile holds a non-finite value.
    (Without fast-math flags the compiler may not fold ``x * 0`` to 0.)"""
    return x * float32(0.0)


@cuda.jit(device=True, inline="always")
def bias_head(bias, b, h):
    """The (Sq or 1, Sk or 1) slab of attn_bias that batch ``b``, query head ``h`` read: ``bias`` is the caller's
    bias as a float32 array of 4 dimensions, each of the full size (B, Hq, Sq, Sk) or 1 (never expanded)."""
    return bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0]


@functools.lru_cache(maxsize=None)
def make_dbias_add(dbias: bool) -> Any:
    """``add(dbias_h, row, col, value, seqlen_q, seqlen_k)``: with ``dbias``, ``value`` (the pair's gradient of
    attn_bias) added into the ``bias_head`` slab of the gradient at (``row``, ``col``) when the pair is inside the
    sequences; without, nothing. A plain read-modify-write: the launches give every element to one thread at a
    time (flash.flash_backward), so the sum is the same on every run."""
    DBIAS = dbias

    @cuda.jit(device=True, inline="always")
    def add(dbias_h, row, col, value, seqlen_q, seqlen_k):
        if DBIAS and row < seqlen_q and col < seqlen_k:
            dbias_h[row, col] += value

    return add


@functools.lru_cache(maxsize=None)
def make_slot_sums(along_rows: bool, split: int, threads: int, runs: int, runs_per_slot: int, run: int,
                   stride: int, tile_count: int, tile_run: int, tile_gap: int, slots: int, length: int) -> Any:
    """``sum_slots(buf, parts, at0, t, dbias_h, first, end)``: the end of a block's sums of attn_bias's gradient
    over one axis of the score tile (a bias broadcast over it). Each thread holds ``parts``, its partial sums of
    the lines it has scores of; they go to the float32 shared buffer ``buf`` (``length`` lines of ``slots`` slots,
    a slot every ``stride`` words), then one thread per line adds its ``slots`` partials in slot order into
    ``dbias_h[first + line, 0]`` (``along_rows``: a row's sum over the keys) or ``dbias_h[0, first + line]`` (a
    key's over the rows), for lines before ``end``. The fixed order gives the same bits every run.

    How a thread's partials lie in the tile follows the score layout (config.py): with ``split`` > 1 a thread's
    ``runs`` runs of ``run`` lines, run ``u`` being the thread's ``t + threads * u``-th of ``runs_per_slot`` a
    slot; else ``tile_count`` lines from ``at0`` in runs of ``tile_run``, ``tile_gap`` words apart. Barriers
    before (the caller's readers of ``buf`` are done) and between: every thread of the block must call it."""
    ALONG_ROWS, SPLIT, NT, RUNS, RUNS_PER_SLOT, R = along_rows, split, threads, runs, runs_per_slot, run
    STRIDE, COUNT, TILE_RUN, TILE_GAP, SLOTS, LENGTH = stride, tile_count, tile_run, tile_gap, slots, length

    @cuda.jit(device=True, inline="always")
    def sum_slots(buf, parts, at0, t, dbias_h, first, end):
        cuda.syncthreads()
        if SPLIT > 1:
            for u in range(RUNS):
                slot = (t + NT * u) // RUNS_PER_SLOT
                line = (t + NT * u) % RUNS_PER_SLOT * R
                for e in range(R):
                    buf[uint64(slot * STRIDE + line + e)] = parts[u * R + e]
        else:
            for j in range(COUNT):
                buf[at0 + uint64((j // TILE_RUN) * TILE_GAP + j % TILE_RUN)] = parts[j]
        cuda.syncthreads()
        for line in range(t, LENGTH, NT):
            if first + line < end:
                total = float32(0.0)
                for slot in range(SLOTS):
                    total += buf[uint64(slot * STRIDE + line)]
                if ALONG_ROWS:
                    dbias_h[first + line, 0] += total
                else:
                    dbias_h[0, first + line] += total

    return sum_slots


@cuda.jit(device=True, inline="always")
def bias_at(bias_h, row, col):
    """The bias of (``row``, ``col``) in a ``bias_head`` slab. The clamp reads a broadcast dimension's only entry,
    and past the sequences (a tile's padding) the last one: such a pair is not visible anyway. Two indices and
    their strides stay live in the kernels, where the 4-dimensional array would keep eight."""
    return bias_h[min(row, bias_h.shape[0] - 1), min(col, bias_h.shape[1] - 1)]


@functools.lru_cache(maxsize=None)
def make_visible(has_left: bool, has_right: bool, has_bias: bool = False, mods: CudaMods = NO_MODS) -> Any:
    """``visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b, h) -> bool``: whether
    query ``row`` sees key ``col`` of batch ``b``, query head ``h`` (both inside their sequences; bottom-right
    aligned window with ``offset = seqlen_k - seqlen_q``; a side without a bound, ``has_left``/``has_right`` False,
    is not tested at all), and with ``has_bias`` whether ``attn_bias`` (``bias_h``: see ``bias_head``) leaves it: a
    -inf entry hides the key exactly as a mask does; and whether the user's mods leave it (``mods``: a mask_mod
    False or a bias_mod -inf hide it). Without ``has_bias``, ``bias_h`` is not read; without mods, ``b`` and ``h``.
    The kernels call it on their rare paths; the hot ones read the staged tile (``make_bias_tile``)."""
    HAS_LEFT, HAS_RIGHT, HAS_BIAS, MODS = has_left, has_right, has_bias, mods.stages_tile
    hidden_by_mods = make_hidden_by_mods(mods)

    @cuda.jit(device=True, inline="always")
    def visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, bias_h, b, h):
        # '&' on bools, not 'and': numba branches around the right side of an 'and'.
        ok = (row < seqlen_q) & (col < seqlen_k)
        if HAS_LEFT:
            ok = ok & (col >= row + offset - window_left)
        if HAS_RIGHT:
            ok = ok & (col <= row + offset + window_right)
        if HAS_BIAS:
            ok = ok & (bias_at(bias_h, row, col) != float32(-math.inf))
        if MODS:
            if ok:   # a mod is never called past the sequences (its tables end there)
                ok = not hidden_by_mods(b, h, row, col)
        return ok

    return visible


_KEEP = compile_with(cuda.jit(device=True, inline=True))[2]


@cuda.jit(device=True, inline="always")
def dropout_factor(seed_lo, seed_hi, threshold, scale, b, h, row, col):
    """What dropout multiplies the probability of (``row``, ``col``) of batch ``b``, query head ``h`` by: ``scale``
    = 1 / (1 - p) where the pair is kept, 0 where it is dropped (the Philox words of ``numba_flash.dropout``, bit
    for bit those of every backend). A product, not a select, so that a NaN probability stays NaN."""
    return scale if _KEEP(seed_lo, seed_hi, threshold, b, h, row, col) else float32(0.0)


@functools.lru_cache(maxsize=None)
def make_dropout_tile(block_m: int, block_n: int, threads: int, ld: int, transposed: bool = False) -> Any:
    """``fill(tile, seed_lo, seed_hi, threshold, scale, b, h, m0, n0, t)``: dropout's factors (``dropout_factor``)
    of query rows ``m0 ..`` and keys ``n0 ..`` into the flat shared ``tile``, entry (r, c) at ``r * ld + c`` (or
    with ``transposed`` at ``c * ld + r``), by the block's ``threads`` threads. A cooperative pass of its own:
    Philox written into the unrolled score loops makes them too large to unroll, and their register blocks go to
    the stack."""
    BM, BN, NT, LD, TRANSPOSED = block_m, block_n, threads, ld, transposed

    @cuda.jit(device=True, inline="always")
    def fill(tile, seed_lo, seed_hi, threshold, scale, b, h, m0, n0, t):
        for e in range(t, BM * BN, NT):
            if TRANSPOSED:   # consecutive threads on consecutive rows: no bank conflict
                r = e % BM
                c = e // BM
                tile[c * LD + r] = dropout_factor(seed_lo, seed_hi, threshold, scale, b, h, m0 + r, n0 + c)
            else:
                c = e % BN
                r = e // BN
                tile[r * LD + c] = dropout_factor(seed_lo, seed_hi, threshold, scale, b, h, m0 + r, n0 + c)

    return fill


@functools.lru_cache(maxsize=None)
def make_bias_tile(block_m: int, block_n: int, threads: int, transposed: bool, ld: int, has_bias: bool = True,
                   mods: CudaMods = NO_MODS) -> Any:
    """``load(tile, bias_h, b, h, m0, n0, seqlen_q, seqlen_k, t, check_mask)``: the score terms that do not depend on
    the score, of query rows ``m0 ..`` and keys ``n0 ..`` of batch ``b``, query head ``h``, into a (block_m x
    block_n) shared tile, by the block's ``threads`` threads (``t``: this one): attn_bias (with ``has_bias``, from the
    ``bias_head`` slab ``bias_h``) plus the user's bias_mod, and -inf where the user's mask_mod hides the pair; 0
    past the sequences (a mod is never called there). The kernels read it where they form the scores (an entry's
    address there is a constant offset, where the bias's own is a product of four indices and strides, and a mod
    is a call). ``tile`` is flat: with ``transposed`` entry (r, c) is at ``c * ld + r``, consecutive threads on
    consecutive rows (no bank conflict); else at ``r * ld + c``, consecutive threads on consecutive keys (coalesced
    reads of a row-major bias). With ``mods.block_tiles`` mask_mod runs only where ``check_mask`` (False on a tile
    the BlockMask's table calls FULL: ``user_mods.make_tile_index_terms``); without, it is not read."""
    BM, BN, NT, LD, TRANSPOSED, HAS_BIAS, MODS = block_m, block_n, threads, ld, transposed, has_bias, mods.any
    index_terms = make_tile_index_terms(mods)

    @cuda.jit(device=True, inline="always")
    def load(tile, bias_h, b, h, m0, n0, seqlen_q, seqlen_k, t, check_mask):
        for e in range(t, BM * BN, NT):
            if TRANSPOSED:
                r = e % BM
                c = e // BM
            else:
                c = e % BN
                r = e // BN
            row, col = m0 + r, n0 + c
            x = float32(0.0)
            if (row < seqlen_q) & (col < seqlen_k):
                if HAS_BIAS:
                    x = bias_at(bias_h, row, col)
                if MODS:
                    extra, hidden = index_terms(b, h, row, col, check_mask)
                    x = float32(-math.inf) if hidden else x + extra
            tile[c * LD + r if TRANSPOSED else r * LD + c] = x

    return load


@functools.lru_cache(maxsize=None)
def make_score_mod_hides(softcap: bool, alibi: bool, has_bias: bool, mods: CudaMods, load: Any) -> Any:
    """``hides(q, k, b, h, hk, row, col, head_dim, qmult, capmult, slope, offset, bias_h, seqlen_q, seqlen_k) ->
    bool``: whether the user's score_mod hides the pair (returns -inf on its score), for the kernels' rare paths,
    which know which keys a row sees from the masks (``make_visible``) but no longer hold the scores. The score is
    recomputed from q (B, Sq, Hq, D) and k (B, Sk, Hkv, D) in global memory (``load`` widens an element to
    float32), through the whole pipeline: ``qmult`` and ``capmult`` as the kernels take them, ALiBi's ``slope`` and
    ``offset``, attn_bias's slab ``bias_h``, bias_mod. False without a score_mod, and for a pair whose score is not
    finite (score_mod is not applied there). Its rounding may differ from the kernel's by an ulp or so: a mod that
    returns -inf exactly at a threshold may be judged differently at that threshold."""
    HAS_BIAS, LOAD = has_bias, load
    SCORE_MOD, INDEX_MODS = mods.score_mod is not None, mods.stages_tile
    index_terms = make_index_terms(mods)
    pipeline = make_pipeline(softcap, alibi, has_bias, mods, index_mods=INDEX_MODS)

    @cuda.jit(device=True, inline="always")
    def hides(q, k, b, h, hk, row, col, head_dim, qmult, capmult, slope, offset, bias_h, seqlen_q, seqlen_k):
        if not SCORE_MOD:
            return False
        raw = float32(0.0)
        for d in range(head_dim):
            raw += LOAD(q[b, row, h, d]) * LOAD(k[b, col, hk, d])
        bias_value, extra, hidden = float32(0.0), float32(0.0), False
        if HAS_BIAS:
            bias_value = bias_at(bias_h, row, col)
        if INDEX_MODS:
            extra, hidden = index_terms(b, h, row, col)
        _, _, _, shown, _ = pipeline(raw, qmult, capmult, slope, float32(row + offset - col), bias_value, extra,
                                     hidden, True, b, h, row, col, seqlen_q - 1, seqlen_k - 1)
        return not shown

    return hides


@functools.lru_cache(maxsize=None)
def make_score_grads(has_left: bool, has_right: bool, softcap: bool, alibi: bool, has_bias: bool,
                     dropout: bool, mods: CudaMods = NO_MODS) -> Any:
    """``grads(raw, dp, row, col, m2, l2, delta, z, bias_value, slope, qmult, capmult, offset, seqlen_q, seqlen_k,
    window_left, window_right, b, h) -> (p, ds, dbias)``: the backward's pipeline for one score of query ``row`` and key
    ``col`` of batch ``b``, query head ``h``, as both backward kernels run it. ``raw`` is Q K^T (``qmult`` 1 where Q
    was scaled on load, as the forward does), ``dp`` the dO V^T, ``m2`` and ``l2`` the row's ``row_softmax_terms``
    (``P = exp2((s2 - m2) - l2)``), ``z`` dropout's factor (read only with ``dropout``) and
    ``bias_value`` the pair's entry of the staged tile (``make_bias_tile``: attn_bias, bias_mod and mask_mod; read
    only with ``has_bias`` or such mods). ``p`` is the probability dV takes (times ``z`` with dropout); ``ds`` is
    ``P (z dP - delta)`` times softcap's derivative and score_mod_grad's, 0 for a masked pair by a select (its dP
    may be NaN: a non-finite V or dO). ``dbias`` is the same without softcap's derivative, the gradient of a bias
    added after the cap and before score_mod (attn_bias's); the kernels that do not need it leave it to dead-code
    elimination. A poisoned row has ``m2`` NaN, so its visible P and dS are NaN."""
    STAGED, DROPOUT = has_bias or mods.stages_tile, dropout
    visible = make_visible(has_left, has_right)
    pipeline = make_pipeline(softcap, alibi, STAGED, mods)   # the staged value holds attn_bias and the mods

    @cuda.jit(device=True, inline="always")
    def grads(raw, dp, row, col, m2, l2, delta, z, bias_value, slope, qmult, capmult, offset, seqlen_q, seqlen_k,
              window_left, window_right, b, h):
        ok = visible(row, col, seqlen_q, seqlen_k, offset, window_left, window_right, 0, b, h)
        x, dcap, dmod, shown, _ = pipeline(raw, qmult, capmult, slope, float32(row + offset - col), bias_value,
                                           float32(0.0), False, ok, b, h, row, col, seqlen_q - 1, seqlen_k - 1)
        ok = ok & shown
        p = math.exp2((x - m2) - l2) if ok else float32(0.0)
        if DROPOUT:
            kept = p * z
            dx = kept * dp - p * delta
            p = kept
        else:
            dx = p * (dp - delta)
        dx *= dmod
        ds = dx * dcap
        return p, ds if ok else float32(0.0), dx if ok else float32(0.0)

    return grads
