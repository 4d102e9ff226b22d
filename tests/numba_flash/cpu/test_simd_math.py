"""The CPU kernels' arithmetic-only math (numba_flash.cpu.simd), which loops vectorise where libm calls do not:
against numpy's libm on fresh random arguments spread over many magnitudes, and the special values."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numba_flash.cpu.score_terms import _score_terms
from numba_flash.cpu.simd import _tanh64


@njit
def _tanh_all(x, out):
    for i in range(x.shape[0]):
        out[i] = _tanh64(x[i])


def test_tanh64_within_a_few_ulp_of_libm(rng):
    scales = [1e-12, 1e-7, 1e-3, 0.05, 0.3, 1.0, 3.0, 9.0, 30.0]
    x = np.concatenate([rng.standard_normal(100_003) * s for s in scales])
    # the seams: where n, the power of two of exp(2|x|), steps, and where the argument is clamped
    seams = np.arange(1, 60) * math.log(2) / 2
    x = np.concatenate([x, seams, np.nextafter(seams, 0), np.nextafter(seams, 1), [19.999, 20.0, 20.001]])
    x = np.concatenate([x, -x])
    got = np.empty_like(x)
    _tanh_all(x, got)
    want = np.tanh(x)
    ulp = np.spacing(np.abs(want))
    assert (np.abs(got - want) / ulp).max() <= 4
    assert np.array_equal(np.sign(got), np.sign(want))


def test_tanh64_special_values():
    x = np.array([0.0, np.inf, -np.inf, np.nan, 1e300, -1e300, 5e-324])
    got = np.empty_like(x)
    _tanh_all(x, got)
    assert got[0] == 0 and got[1] == 1 and got[2] == -1 and np.isnan(got[3])
    assert got[4] == 1 and got[5] == -1 and got[6] == 5e-324


@njit
def _score_terms_row(x, softcap, slope, dcap):
    s = x.reshape((1, x.shape[0])).copy()
    _score_terms(s, 1, x.shape[0], False, softcap, slope, 5, 0, 3, dcap.reshape((1, x.shape[0])), 1.0, True)
    return s[0]


def test_capped_scores_round_once_from_float64(rng):
    """The CPU kernels' softcap and ALiBi pass (cpu/score_terms.py): softcap * tanh(x / softcap) - slope * |i +
    diag - j| in float64, rounded once to float32: equal to numpy's float64 result rounded, except where a few ulp
    of float64 straddle a float32 rounding boundary; the chain factor 1 - tanh**2 to a few float64 ulp."""
    x = (rng.standard_normal(200_001) * 40).astype(np.float32)
    slope = 0.0078125 * 3
    dcap = np.empty(x.shape, np.float64)
    out = _score_terms_row(x, 30.0, slope, dcap)
    want_t = np.tanh(x.astype(np.float64) / 30.0)
    distance = np.abs(5 + 3 - np.arange(x.shape[0]))   # query 5, diag 3, key j
    want = (30.0 * want_t - slope * distance).astype(np.float32)
    assert (out != want).mean() < 1e-5
    assert (np.abs(out - want) <= np.spacing(np.abs(want))).all()
    assert np.abs(dcap - (1.0 - want_t * want_t)).max() <= 8 * np.spacing(1.0)


def test_capped_scores_of_a_non_finite_raw_score_are_nan():
    """tanh would turn an inf into a finite cap: the raw score decides, and the row is poisoned."""
    x = np.array([np.inf, -np.inf, np.nan, 3.0], np.float32)
    out = _score_terms_row(x, 30.0, 0.0, np.empty(4))
    assert np.isnan(out[:3]).all() and np.isfinite(out[3])
