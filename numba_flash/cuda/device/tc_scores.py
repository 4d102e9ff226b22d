"""The score of one (query, key) pair as the tensor-core kernels compute it from the raw product ``q . k``, shared
by the forward and both backward kernels so that the backward recomputes exactly the forward's probabilities: the
score pipeline of ``numba_flash.score_pipeline`` (score_terms.make_pipeline), fed attn_bias and the mods' values.

Order (the contract's): scale, softcap, ALiBi, attn_bias, the user's mask_mod and bias_mod, then score_mod; the
window and sequence-end masks are the callers' (only tiles that cross the band need them). Scores are in log2
units (``scale * log2(e)`` folded into ``qmult``, or ``scale / softcap`` with softcap and ``capmult = softcap *
log2(e)``), so that the softmax uses exp2.

The non-finite rule: a visible score whose raw product is not finite must poison its row, the raw product
deciding (tanh would turn an inf into a finite cap). tanh is the special-function unit's approximation
(``warp.tanh_approx``, about 2**-11 relative, the size of a 16-bit score's own rounding), as FlashAttention-2's.
Adding ``raw * 0`` makes such a score NaN in one fused multiply-add; the row's sum then carries the NaN to its
output and lse. A -inf attn_bias entry hides its pair whatever the product (the score becomes -inf, exp2 gives
0), as do mask_mod, a -inf bias_mod and a -inf score_mod. The backward keeps hidden pairs' probabilities as -0.0
(``hidden_p``) so that their dS is 0 by a select, whatever the chain factor and dP.

``inline="always"``, no loops: numba splices the helper into each unrolled element loop of the kernels, and the
performance model counts its instructions once per copy (perf_model.py). The mods themselves are device functions
of their own that NVVM inlines (user_mods.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32, int32, uint32, uint64

from numba_flash.dropout import compile_with

from numba_flash.cuda.device import warp
from numba_flash.cuda.device.masks import LOG2E, bias_at
from numba_flash.cuda.device.score_terms import make_pipeline
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods, make_tile_index_terms


@functools.lru_cache(maxsize=None)
def make_score(softcap: bool, alibi: bool, has_bias: bool, mods: CudaMods = NO_MODS) -> Any:
    """``score(raw, qmult, capmult, slope, distance, bias_h, row, col, b, h, seqlen_q, seqlen_k, check_mask) -> (x,
    chain)``: the tensor-core kernels' score pipeline (score_terms.make_pipeline). The score ``x`` of the pair
    (query ``row``, key ``col``) of batch ``b``, query head ``h`` in log2 units, -inf for
    a pair that attn_bias or the mods hide, and ``chain``, d x / d (raw * scale) for the backward: softcap's
    derivative ``1 - tanh^2`` times score_mod_grad's (1 without either). ``distance``: the pair's ALiBi distance
    ``row + offset - col`` as a float32 (ignored without ALiBi); ``slope``: the head's ALiBi slope times log2(e);
    ``bias_h``: the attn_bias slab of the batch and head (``masks.bias_head``), read at (row, col) only with
    ``has_bias``. ``mods`` (user_mods.py) are called for pairs inside the sequences only (``seqlen_q``,
    ``seqlen_k``; not read without mods): mask_mod and bias_mod, then score_mod on a finite score. With
    ``mods.block_tiles``, mask_mod runs only where ``check_mask`` (False on a tile the BlockMask's table calls FULL:
    a uniform branch, mask_mod's code once); without, ``check_mask`` is not read."""
    HAS_BIAS, MODS, INDEX_MODS = has_bias, mods.any, mods.stages_tile
    index_terms = make_tile_index_terms(mods)
    pipeline = make_pipeline(softcap, alibi, has_bias, mods, index_mods=INDEX_MODS, tensor_cores=True)

    @cuda.jit(device=True, inline="always")
    def score(raw, qmult, capmult, slope, distance, bias_h, row, col, b, h, seqlen_q, seqlen_k, check_mask):
        bias_value, extra, hidden, inside = float32(0.0), float32(0.0), False, True
        if HAS_BIAS:
            bias_value = bias_at(bias_h, row, col)
        if MODS:
            inside = (row < seqlen_q) & (col < seqlen_k)
            if INDEX_MODS and inside:
                extra, hidden = index_terms(b, h, row, col, check_mask)
        x, dcap, dmod, _, _ = pipeline(raw, qmult, capmult, slope, distance, bias_value, extra, hidden, inside, b, h,
                                       row, col, seqlen_q - 1, seqlen_k - 1)
        return x, dcap * dmod

    return score


@cuda.jit(device=True, inline="always")
def hidden_p(x, lse):
    """The probability ``exp2(x - lse)`` of a score ``x`` in a row of ``lse`` (log2 units), as the backward kernels
    keep it: -0.0 for a hidden pair, which no exp2 returns, so that ``is_hidden`` can tell it from a visible
    probability that underflowed to +0 (whose dS must still carry a NaN dP, as the reference's does). Hidden: ``x``
    is -inf (attn_bias or a mod hides it; a poisoned row's NaN ``lse`` must not unhide it), or the row sees no key
    (``lse`` +inf, as rows past the sequence have too, whose scores are not masked)."""
    y = x - lse
    return float32(-0.0) if (x == float32(-math.inf)) | (y == float32(-math.inf)) else warp.exp2_approx(y)


@cuda.jit(device=True, inline="always")
def is_hidden(p):
    """Whether ``p`` (see ``hidden_p``) is a hidden pair's: -0.0."""
    return (p == float32(0.0)) & (math.copysign(float32(1.0), p) < float32(0.0))


def staged_words(n_tiles: int, threads: int, mods: CudaMods) -> int:
    """Shared words ``make_mod_stage`` needs: a slot per score a thread holds (``n_tiles`` 8-key tiles of 4), per
    thread; 1 (unused) without mask_mod and bias_mod."""
    return n_tiles * 4 * threads if mods.stages_tile else 1


@functools.lru_cache(maxsize=None)
def make_mod_stage(n_tiles: int, threads: int, mods: CudaMods) -> Any:
    """``stage(slots, t, b, h, row_top, col0, seqlen_q, seqlen_k, check_mask)``: mask_mod (with ``mods.block_tiles``
    only where ``check_mask``: ``make_tile_index_terms``) and bias_mod of the scores thread
    ``t`` holds (rows ``row_top`` and ``row_top + 8``, columns ``col0 + 8 j + c``, the C-fragment layout) into its
    slots of the shared array ``slots`` (``staged_words``): bias_mod in log2 units, -inf where mask_mod hides the
    pair, 0 past the sequences; slot of score ``(j, r)`` at ``(4 j + r) * threads + t`` (consecutive threads,
    consecutive banks), which ``staged_value`` reads.

    Why shared memory that only its own thread reads: computed in the unrolled score loop, the mods' code for every
    score interleaves with the live accumulators and spills (the tensor-core forward with every variant on, sm_80
    and sm_90: 24-32 B); here it runs in a loop of its own, ahead of the products, and the score loop reads one word
    per score (none spills)."""
    N_SCORES, NT = n_tiles * 4, threads
    index_terms = make_tile_index_terms(mods)

    @cuda.jit(device=True, inline="always")
    def stage(slots, t, b, h, row_top, col0, seqlen_q, seqlen_k, check_mask):
        for e in range(N_SCORES):
            row = row_top + 8 * ((e & 3) >> 1)
            col = col0 + 8 * (e >> 2) + (e & 1)
            value = float32(0.0)
            if (row < seqlen_q) & (col < seqlen_k):
                extra, hidden = index_terms(b, h, row, col, check_mask)
                value = float32(-math.inf) if hidden else extra * float32(LOG2E)
            slots[e * NT + t] = value

    return stage


@cuda.jit(device=True, inline="always")
def staged_value(x, value):
    """Score ``x`` with a staged mods value (``make_mod_stage``) applied: -inf hides the pair whatever ``x`` is."""
    return float32(-math.inf) if value == float32(-math.inf) else x + value


_PHILOX = compile_with(cuda.jit(device=True, inline=True))[0]


@cuda.jit(device=True, inline="always")
def _shfl_u64(x, lane_mask):
    """A uint64 of lane ``laneid ^ lane_mask``, as two 32-bit shuffles."""
    lo = warp.shfl_xor(int32(x & uint64(0xFFFFFFFF)), lane_mask)
    hi = warp.shfl_xor(int32(x >> uint64(32)), lane_mask)
    return (uint64(uint32(hi)) << uint64(32)) | uint64(uint32(lo))


@functools.lru_cache(maxsize=None)
def make_keep_bits(n_tiles: int, transposed: bool = False) -> Any:
    """``keep_bits(seed_lo, seed_hi, threshold, b, h, top, col0) -> uint64``: dropout's keep mask of the scores a
    lane holds, ``n_tiles`` (at most 16) 8-wide C fragments: bit ``4 j + r`` set where score ``(j, r)`` is kept,
    score ``(j, r)`` being fragment row ``top + 8 (r >> 1)`` and column ``col0 + 8 j + (r & 1)``. Those are (query
    row, key) of batch ``b``, query head ``h``, or with ``transposed`` (the dK/dV kernel's S^T) (key, query row).
    The words are ``numba_flash.dropout``'s, bit for bit (``numba_flash.dropout_mask``). Every lane of the warp
    must call it together (it shuffles).

    Why bits: Philox written into the kernels' unrolled score loops would make them too large to unroll and send
    the score arrays to local memory (as masks.make_dropout_tile says of the SIMT kernels). Here it runs in a loop
    of its own that writes one register, so the compiler may keep it rolled, and the score loops read a bit per
    score (``make_kept_factor``). The performance model's "dropout" variant prices this loop from its trip count
    (perf_counts._helper_loops).

    One Philox call gives the words of four neighbouring keys of one query row, and a warp's fragment of an 8-wide
    tile holds 32 such groups of four: so each lane makes one call per tile, for a group its neighbours need too,
    and takes the bits it holds from them by shuffle. Untransposed, lanes ``l`` and ``l ^ 1`` hold the two halves
    of the same groups (an even column and the next): one calls for row ``top``, the other for ``top + 8``, one
    shuffle swaps the keep bits (two calls per lane and tile before, half of them repeated by the neighbour).
    Transposed, a group of four keys is four lanes' rows (``g = lane // 4``, keys ``g`` and ``g + 8``): the four
    lanes of one ``g // 4`` and one query pair each call for one (key half, query) and two shuffles gather all
    four calls' bits (four calls per lane and tile before, each for one word)."""
    if n_tiles * 4 > 64:
        raise ValueError(f"{n_tiles} 8-wide tiles: more scores than a 64-bit keep mask holds")
    N_TILES, TRANSPOSED = n_tiles, transposed

    @cuda.jit(device=True, inline="always")
    def keep_bits(seed_lo, seed_hi, threshold, b, h, top, col0):
        lo, hi, limit = uint64(seed_lo), uint64(seed_hi), uint64(threshold)
        # The call this lane makes, as its slot among the lanes that share the keep bits: transposed, slot =
        # (key half, query) = g % 4 of the four lanes with this g // 4 and this query pair; else the row half, the
        # even/odd half of the columns' group of four (lanes l and l ^ 1).
        slot = (top & 3) if TRANSPOSED else ((col0 >> 1) & 1)
        # Pass 1, one Philox call per tile (a loop the compiler keeps rolled): nibble j of `own` holds the keep
        # bits of the call's four keys.
        own = uint64(0)
        for j in range(N_TILES):
            if TRANSPOSED:   # keys top + 8 (slot >> 1) and the three beside it, query col0 + 8 j + (slot & 1)
                w0, w1, w2, w3 = _PHILOX(uint64((top >> 2) + 2 * (slot >> 1)), uint64(col0 + 8 * j + (slot & 1)),
                                         uint64(h), uint64(b), lo, hi)
            else:            # row top + 8 slot, the group of four keys holding columns col0 + 8 j and the next
                w0, w1, w2, w3 = _PHILOX(uint64((col0 >> 2) + 2 * j), uint64(top + 8 * slot), uint64(h),
                                         uint64(b), lo, hi)
            nibble = (uint64(w0 < limit) | (uint64(w1 < limit) << uint64(1)) | (uint64(w2 < limit) << uint64(2))
                      | (uint64(w3 < limit) << uint64(3)))
            own |= nibble << uint64(4 * j)
        # Pass 2: the other slots' nibbles by shuffle (lanes l ^ 4, l ^ 8, l ^ 12 differ in g % 4; l ^ 1 in the
        # column half), then each score's bit from the slot that holds it.
        x1 = _shfl_u64(own, 4 if TRANSPOSED else 1)
        x2 = _shfl_u64(own, 8) if TRANSPOSED else own
        x3 = _shfl_u64(own, 12) if TRANSPOSED else own
        bits = uint64(0)
        for j in range(N_TILES):
            for r in range(4):
                if TRANSPOSED:   # score r is slot r's call: lane slot ^ r away; the word of key top (or top + 8)
                    d = r ^ slot
                    at = 4 * j + (top & 3)
                else:            # score r's row half r >> 1 is this lane's call or its neighbour's
                    d = (r >> 1) ^ slot
                    at = 4 * j + 2 * slot + (r & 1)
                held = own if d == 0 else (x1 if d == 1 else (x2 if d == 2 else x3))
                bits |= ((held >> uint64(at)) & uint64(1)) << uint64(4 * j + r)
        return bits

    return keep_bits


@functools.lru_cache(maxsize=None)
def make_kept_factor(dropout: bool) -> Any:
    """``factor(bits, e, scale) -> float32``: what dropout multiplies score ``e`` of a ``make_keep_bits`` mask by,
    ``scale`` (1 / (1 - p)) where kept, 0 where dropped; without ``dropout``, 1 (a product the compiler removes), so
    that one loop serves both kernels. A product, not a select, so that a NaN probability stays NaN."""
    DROPOUT = dropout

    @cuda.jit(device=True, inline="always")
    def factor(bits, e, scale):
        if not DROPOUT:
            return float32(1.0)
        return scale if (bits >> uint64(e)) & uint64(1) else float32(0.0)

    return factor
