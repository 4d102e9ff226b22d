"""The score pipeline (``numba_flash.score_pipeline``) compiled for the CPU kernels: softcap and ALiBi, the stages
a block's scores go through in one pass before attn_bias and the mods (``tiles.bias_scores``,
``modhooks.mod_scores``: passes of their own, which also mask the band and skip the tiles a BlockMask empties).

The kernels' scores are in natural-log units with Q carrying the scale (``unit`` 1, ``qmult = 1 / softcap``).
tanh is ``simd.tanh64``: arithmetic only (a loop around a libm call cannot vectorise), and in float64, so that a
float32 kernel's capped score (and ALiBi after it) is rounded once, where float32 steps round at each (1 / 50 is
not a float32). The forward and the backward both run ``apply_score_terms``, so the backward's recomputed scores are
the forward's to the bit.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..score_pipeline import compile_with

from .cache_stamp import stamp_kernels
from .simd import FASTMATH, as_dtype_of, tanh64


@njit(inline="always", cache=True)
def _tanh_of_product(raw, qmult):
    """tanh(raw * qmult) in float64, qmult a float64."""
    return tanh64(np.float64(raw) * qmult)


def _build(softcap: bool, alibi: bool) -> object:
    # float32 constants (0, 1, +-inf: exact in either dtype), so that a float32 score stays float32 where no
    # stage widens it.
    return compile_with(njit(inline="always"), _tanh_of_product, np.float32, 1.0, softcap=softcap, alibi=alibi,
                        bias=False, index_mods=False)


_CAPPED, _CAPPED_ALIBI, _ALIBI = _build(True, False), _build(True, True), _build(False, True)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def _terms_loop(pipeline, s, nrows, ncols, qmult, capmult, slope, base, step_a, step_e, dcap, scale, want_dcap):
    """``pipeline`` (one of the builds above) over ``s[:nrows, :ncols]``; arguments as for ``apply_score_terms``, the
    distance of entry (a, e) being ``base + a * step_a + e * step_e``: no branch in the loops."""
    nan = as_dtype_of(s, np.nan)
    for a in range(nrows):
        for e in range(ncols):
            distance = np.float64(base + a * step_a + e * step_e)
            x, d, _, _, finite = pipeline(s[a, e], qmult, capmult, slope, distance, 0.0, 0.0, False, True, 0, 0, 0,
                                          0, 0, 0)
            s[a, e] = as_dtype_of(s, x) if finite else nan
            if want_dcap:
                dcap[a, e] = as_dtype_of(dcap, scale * d)


@njit(inline="always", fastmath=FASTMATH, cache=True)
def apply_score_terms(s, nrows, ncols, keys_are_rows, softcap, slope, i0, j0, diag, dcap, scale, want_dcap, unit=1.0):
    """Softcap (``softcap`` > 0) and ALiBi (``slope`` != 0) on the raw scores ``s[:nrows, :ncols]`` (Q already
    scaled), in place, as the pipeline's stages 2 and 3: query i = i0 + column and key j = j0 + row when
    ``keys_are_rows`` (a forward S^T block), else the other way round; ALiBi's distance ``i + diag - j`` (diag =
    Sk - Sq). A score whose raw value is not finite becomes NaN (tanh would turn an inf into a finite cap). With
    ``want_dcap`` and softcap, ``dcap[:nrows, :ncols]`` receives d score / d q.k: ``scale`` times softcap's ``1 -
    tanh**2``. ``unit``: 1 for scores in natural-log units, log2(e) for base 2 (decoding's; ``slope`` is then in
    base 2 too). Neither stage on: nothing is read or written."""
    base = i0 + diag - j0
    step_a, step_e = (-1, 1) if keys_are_rows else (1, -1)
    inv_cap = 1.0 / softcap if softcap > 0 else 0.0
    if softcap > 0 and slope != 0.0:
        _terms_loop(_CAPPED_ALIBI, s, nrows, ncols, inv_cap, softcap * unit, slope, base, step_a, step_e, dcap,
                    scale, want_dcap)
    elif softcap > 0:
        _terms_loop(_CAPPED, s, nrows, ncols, inv_cap, softcap * unit, slope, base, step_a, step_e, dcap, scale,
                    want_dcap)
    elif slope != 0.0:
        _terms_loop(_ALIBI, s, nrows, ncols, 1.0, 0.0, slope, base, step_a, step_e, dcap, scale, False)


stamp_kernels(globals())
