"""The score pipeline of one (query, key) pair, written once, for the kernels and the torch path to compile.

The contract's order (design.md, "Attention variants"), each stage switched on by the call:

====  ===========  ==========================================================  =============================
 1    scale        ``x = qmult * raw``, ``raw = q . k``                         a non-finite raw poisons
 2    softcap      ``t = tanh(x); x = capmult * t``                             chain ``*= 1 - t**2``
 3    alibi        ``x -= slope * |distance|``, ``distance = row + Sk - Sq - col``
 4    attn_bias    ``x += unit * bias``                                         a -inf bias hides the pair
 5    mods         ``x += unit * bias_mod(b, h, row, col)``                     mask_mod False hides it
 6    score_mod    ``x = score_mod(x, b, h, row, col)`` on a finite score       chain ``*= score_mod_grad``;
                   (a score that is not finite passes as it is, and poisons)    a -inf it returns hides
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
* the torch path (``backends.rocm``), on whole (query block, key block) tiles of scores: the decorator is the
  identity, ``select`` is ``torch.where``, and the switches ``scaled``, ``bias_hides``, ``chain`` and
  ``check_finite`` leave out the passes a call does not need;
* not the float64 reference (``numba_flash.reference``): it is the oracle the others are tested against, so it
  applies the same stages in the same order to whole (Sq, Sk) matrices with numpy, written apart.
  tests/numba_flash/test_score_pipeline.py holds the compiled pipeline to the reference's probabilities.

A new variant of the score is one more stage here, one more argument where a backend computes its input, and its
line in the reference.
"""

from __future__ import annotations

import math
from typing import Any

#: The stages in the order they apply, as named in the table above.
STAGES = ("scale", "softcap", "alibi", "attn_bias", "mods", "score_mod")


def _pick(cond, if_true, if_false):
    return if_true if cond else if_false


def _negate(flag):
    return not flag


def compile_with(jit: Any, tanh: Any, real: Any, unit: float, *, softcap: bool, alibi: bool, bias: bool,
                 index_mods: bool, score_mod: Any = None, poison_by_product: bool = False, select: Any = None,
                 logical_not: Any = None, scaled: bool = False, bias_hides: bool = True, chain: bool = True,
                 check_finite: bool = True) -> Any:
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
    so that a backend may form the product in a wider type, as the CPU's float32 kernels do); ``real``: its float
    type; ``unit``: what an additive term in natural units is multiplied by. ``poison_by_product``: the score of a
    non-finite ``raw`` is made NaN by adding ``raw * 0`` after softcap (one fused multiply-add, so the row's sums
    carry it), where without it the caller reads ``finite``.

    For a caller that runs the pipeline on whole blocks (the torch path, ``jit`` the identity): ``select(cond, a,
    b)`` and ``logical_not(flag)`` replace Python's ``a if cond else b`` and ``not flag`` (the defaults, compiled
    by ``jit``), and what the caller knows ahead saves whole passes: ``scaled=True`` (``raw`` carries the scale
    already: without softcap it is the score, not multiplied by ``qmult``), ``bias_hides=False`` (no attn_bias
    entry is -inf), ``chain=False`` (a forward: ``dcap`` and ``dmod`` stay 1, score_mod's gradient is not asked for),
    ``check_finite=False`` (finite inputs: ``finite`` is True, not computed).

    Returns ``x`` (-inf for a pair a stage hides, whatever else it computed), the chain factors ``dcap`` (softcap's
    ``1 - tanh**2``) and ``dmod`` (score_mod_grad's), each 1 where its stage is off (the backward multiplies dS by
    both; attn_bias's gradient takes ``dmod`` only), ``shown`` (no stage hid the pair) and ``finite`` (the raw
    product was finite and, where shown, so is ``x``: else the pair poisons its row if the masks show it)."""
    SOFTCAP, ALIBI, BIAS, INDEX_MODS, POISON_BY_PRODUCT = softcap, alibi, bias, index_mods, poison_by_product
    SCALED, BIAS_HIDES, CHAIN, CHECK_FINITE = scaled, bias_hides, chain, check_finite
    SCORE_MOD = score_mod is not None
    hook = score_mod
    tanh_fn = tanh
    pick = jit(_pick) if select is None else select
    negate = jit(_negate) if logical_not is None else logical_not
    UNIT = real(unit)
    UNIT_IS_ONE = unit == 1.0   # no multiply at all: on whole blocks it would be a pass of its own
    ONE, ZERO = real(1.0), real(0.0)
    INF, NEG_INF = real(math.inf), real(-math.inf)

    def pipeline(raw, qmult, capmult, slope, distance, bias_value, extra, mod_hidden, apply, b, h, row, col,
                 last_row, last_col):
        dcap, dmod = ONE, ONE
        if SOFTCAP:
            th = tanh_fn(raw, qmult)
            x = capmult * th
            if CHAIN:
                dcap = ONE - th * th
        else:
            x = raw if SCALED else raw * qmult
        finite = True
        if CHECK_FINITE:
            finite = abs(raw) < INF   # the raw product decides: tanh would turn an inf into a finite cap
        if POISON_BY_PRODUCT:
            x += raw * ZERO
        if ALIBI:
            x -= slope * abs(distance)
        # '&' on bools, not 'and': numba branches around the right side of an 'and'.
        shown = True
        if BIAS:
            if BIAS_HIDES:
                hidden = bias_value == NEG_INF
                shown = shown & negate(hidden)
                x = pick(hidden, NEG_INF, x + (bias_value if UNIT_IS_ONE else bias_value * UNIT))
            else:
                x = x + (bias_value if UNIT_IS_ONE else bias_value * UNIT)
        if INDEX_MODS:
            shown = shown & negate(mod_hidden)
            x = pick(mod_hidden, NEG_INF, x + (extra if UNIT_IS_ONE else extra * UNIT))
        if SCORE_MOD:
            # The hook runs score_mod on finite scores only; a -inf it returns hides the pair. A score that was not
            # finite before it (a -inf raw product) comes back as it went in, and poisons rather than hides.
            x, dmod = hook(x, apply & finite & shown, b, h, row, col, last_row, last_col)
            if CHECK_FINITE:
                shown = shown & ((x != NEG_INF) | negate(finite))
            else:
                shown = shown & (x != NEG_INF)
        if CHECK_FINITE and (BIAS or INDEX_MODS or SCORE_MOD):   # a +inf or NaN term poisons as a raw one does
            finite = finite & ((abs(x) < INF) | negate(shown))
        return x, dcap, dmod, shown, finite

    return jit(pipeline)


__all__ = ["STAGES", "compile_with"]
