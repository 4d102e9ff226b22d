"""The score of one (query, key) pair as the tensor-core kernels compute it from the raw product ``q . k``, shared
by the forward and both backward kernels so that the backward recomputes exactly the forward's probabilities.

Order (the contract's): scale, softcap, ALiBi, attn_bias; masks are the callers' (only tiles that cross the band
need them). Scores are in log2 units (``scale * log2(e)`` folded into ``qmult``, or ``scale / softcap`` with
softcap and ``capmult = softcap * log2(e)``), so that the softmax uses exp2.

The non-finite rule: a visible score whose raw product is not finite must poison its row, the raw product
deciding (tanh would turn an inf into a finite cap). tanh is the special-function unit's approximation
(``warp.tanh_approx``, about 2**-11 relative, the size of a 16-bit score's own rounding), as FlashAttention-2's. Adding ``raw * 0`` makes such a score NaN in one fused
multiply-add; the row's sum then carries the NaN to its output and lse. A -inf attn_bias entry hides its pair
whatever the product (the score becomes -inf, exp2 gives 0).

``inline="always"``, no loops: numba splices the helper into each unrolled element loop of the kernels, and the
performance model counts its instructions once per copy (perf_model.py).
"""

from __future__ import annotations

import functools
import math
from typing import Any

from numba import cuda, float32

from . import warp
from .masks import LOG2E, bias_at


@functools.lru_cache(maxsize=None)
def make_score(softcap: bool, alibi: bool, has_bias: bool) -> Any:
    """``score(raw, qmult, capmult, slope, distance, bias_h, row, col) -> (x, dcap)``: the score ``x`` of the pair
    (query ``row``, key ``col``) in log2 units, and ``dcap``, softcap's derivative ``1 - tanh^2`` (1 without
    softcap; the backward multiplies dS by it). ``distance``: the pair's ALiBi distance ``row + offset - col`` as a
    float32 (ignored without ALiBi); ``slope``: the head's ALiBi slope times log2(e); ``bias_h``: the attn_bias slab
    of the batch and head (``masks.bias_head``), read at (row, col) only with ``has_bias``."""
    SOFTCAP, ALIBI, HAS_BIAS = softcap, alibi, has_bias

    @cuda.jit(device=True, inline="always")
    def score(raw, qmult, capmult, slope, distance, bias_h, row, col):
        dcap = float32(1.0)
        if SOFTCAP:
            th = warp.tanh_approx(raw * qmult)
            x = capmult * th
            dcap = float32(1.0) - th * th
        else:
            x = raw * qmult
        x += raw * float32(0.0)
        if ALIBI:
            x -= slope * abs(distance)
        if HAS_BIAS:
            bias_value = bias_at(bias_h, row, col)
            x = float32(-math.inf) if bias_value == float32(-math.inf) else x + bias_value * float32(LOG2E)
        return x, dcap

    return score
