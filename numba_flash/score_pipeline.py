"""The score pipeline of one (query, key) pair, written once, for the kernels to compile.

The contract's order (design.md, "Attention variants"), each stage switched on by the call:

====  ===========  ==========================================================  =============================
 1    scale        ``x = qmult * raw``, ``raw = q . k``                         a non-finite raw poisons
 2    softcap      ``t = tanh(x); x = capmult * t``                             chain ``*= 1 - t**2``
 3    alibi        ``x -= slope * |distance|``, ``distance = row + Sk - Sq - col``
 4    attn_bias    ``x += unit * bias``                                         a -inf bias hides the pair
 5    mods         ``x += unit * bias_mod(b, h, row, col)``                     mask_mod False hides it
 6    score_mod    ``x = score_mod(x, b, h, row, col)`` on a finite score       chain ``*= score_mod_grad``;
                                                                                -inf hides the pair
====  ===========  ==========================================================  =============================

then the window and sequence masks (the callers': they know which tiles cross the band), the softmax, dropout.

The CUDA kernels work in log2 units (their softmax uses exp2): ``qmult = scale * log2(e)`` (with softcap ``scale /
softcap`` and ``capmult = softcap * log2(e)``), ALiBi's ``slope`` times log2(e), ``unit = log2(e)``; their
score_mod hook converts to natural units and back (cuda/user_mods.py). The CPU kernels work in natural units
(``unit`` 1; decoding in log2). The chain factors (``dcap``, ``dmod``: d x / d (scale * raw) is their product) are
what the backward multiplies dS by; attn_bias's gradient is dS times ``dmod`` alone.

``compile_with(jit, ...)`` builds the pipeline from one body with a backend's decorator, its tanh and its float
type, as ``numba_flash.dropout.compile_with`` builds Philox. A stage that is off is not compiled at all (the
switches are constants of the closure). Who compiles it:

* the CUDA kernels, every score they form (cuda/score_terms.py: ``cuda.jit(device=True, inline="always")``,
  float32, log2 units; the SIMT and tensor-core builds differ in tanh and in how a non-finite product poisons);
* the CPU kernels, for softcap and ALiBi in one vectorised pass over a block (cpu/score_terms.py: ``njit``,
  tanh in float64); attn_bias and the mods stay in passes of their own there, which also mask the band and skip
  the tiles a BlockMask empties;
* not the float64 reference (``numba_flash.reference``) nor the torch path (``backends.rocm``): they apply the
  same stages in the same order to whole (Sq, Sk) blocks with numpy and torch, and the reference stays an oracle
  written apart. tests/numba_flash/test_score_pipeline.py holds the compiled pipeline to the reference's
  probabilities.

A new variant of the score is one more stage here, one more argument where a backend computes its input, and its
line in the reference and in the torch path.
"""

from __future__ import annotations

import math
from typing import Any

#: The stages in the order they apply, as named in the table above.
STAGES = ("scale", "softcap", "alibi", "attn_bias", "mods", "score_mod")


def compile_with(jit: Any, tanh: Any, real: Any, unit: float, *, softcap: bool, alibi: bool, bias: bool,
                 index_mods: bool, score_mod: Any = None, poison_by_product: bool = False) -> Any:
    """``pipeline(raw, qmult, capmult, slope, distance, bias_value, extra, mod_hidden, apply, b, h, row, col,
    last_row, last_col) -> (x, dcap, dmod, shown, finite)``, compiled with ``jit``.

    Arguments (each read only where its stage is on): ``raw`` the pair's q . k; ``qmult``, ``capmult``, ``slope``
    as in the module docstring; ``distance`` ALiBi's ``row + Sk - Sq - col`` as a ``real``; ``bias_value``
    attn_bias's entry (natural units; with ``bias``); ``extra`` bias_mod's value and ``mod_hidden`` mask_mod's
    verdict (with ``index_mods``); ``apply`` whether score_mod may run on the pair (the caller's: inside the
    sequences, and for kernels that know it, visible); ``b, h, row, col, last_row, last_col`` the score_mod hook's.

    Switches: ``softcap``, ``alibi``, ``bias``, ``index_mods`` turn stages 2 to 5 on; ``score_mod``, a hook
    ``(x, apply, b, h, row, col, last_row, last_col) -> (x, dmod)`` compiled by the same ``jit`` (or None), stage 6.
    ``tanh(raw, qmult)``: the backend's ``tanh(raw * qmult)`` (a callable its ``jit`` compiles; given the factors,
    so that a backend may form the product in a wider type, as the CPU's float32 kernels do); ``real``: its float type; ``unit``: what an
    additive term in natural units is multiplied by. ``poison_by_product``: the score of a non-finite ``raw`` is
    made NaN by adding ``raw * 0`` after softcap (one fused multiply-add, so the row's sums carry it), where without
    it the caller reads ``finite``.

    Returns ``x`` (-inf for a pair a stage hides, whatever else it computed), the chain factors ``dcap`` (softcap's
    ``1 - tanh**2``) and ``dmod`` (score_mod_grad's), each 1 where its stage is off (the backward multiplies dS by
    both; attn_bias's gradient takes ``dmod`` only), ``shown``  (no stage hid the pair) and ``finite`` (the raw product was finite
    and, where shown, so is ``x``: else the pair poisons its row if the masks show it)."""
    SOFTCAP, ALIBI, BIAS, INDEX_MODS, POISON_BY_PRODUCT = softcap, alibi, bias, index_mods, poison_by_product
    SCORE_MOD = score_mod is not None
    hook = score_mod
    tanh_fn = tanh
    UNIT = real(unit)
    ONE, ZERO = real(1.0), real(0.0)
    INF, NEG_INF = real(math.inf), real(-math.inf)

    def pipeline(raw, qmult, capmult, slope, distance, bias_value, extra, mod_hidden, apply, b, h, row, col,
                 last_row, last_col):
        dcap, dmod = ONE, ONE
        if SOFTCAP:
            th = tanh_fn(raw, qmult)
            x = capmult * th
            dcap = ONE - th * th
        else:
            x = raw * qmult
        finite = abs(raw) < INF   # the raw product decides: tanh would turn an inf into a finite cap
        if POISON_BY_PRODUCT:
            x += raw * ZERO
        if ALIBI:
            x -= slope * abs(distance)
        # '&' on bools, not 'and': numba branches around the right side of an 'and'.
        shown = True
        if BIAS:
            shown = shown & (bias_value != NEG_INF)
            x = NEG_INF if bias_value == NEG_INF else x + bias_value * UNIT
        if INDEX_MODS:
            shown = shown & (not mod_hidden)
            x = NEG_INF if mod_hidden else x + extra * UNIT
        if SCORE_MOD:   # the hook runs it on finite scores only; a -inf it returns hides the pair
            x, dmod = hook(x, apply & finite & shown, b, h, row, col, last_row, last_col)
            shown = shown & (x != NEG_INF)
        if BIAS or INDEX_MODS or SCORE_MOD:   # a +inf or NaN term poisons as a non-finite product does
            finite = finite & ((abs(x) < INF) | (not shown))
        return x, dcap, dmod, shown, finite

    return jit(pipeline)


__all__ = ["STAGES", "compile_with"]
