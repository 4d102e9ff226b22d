"""The CPU kernels' arithmetic-only math (numba_flash.cpu.simd), which loops vectorise where libm calls do not:
against numpy's libm on fresh random arguments spread over many magnitudes, and the special values."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from numba_flash.cpu.simd import _capped, _tanh64


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
def _capped_all(x, softcap, out, t):
    for i in range(x.shape[0]):
        out[i], t[i] = _capped(x[i], softcap)


def test_capped_scores_round_once_from_float64(rng):
    """softcap * tanh(x / softcap) in float64, rounded once to float32: equal to numpy's float64 result rounded,
    except where a few ulp of float64 straddle a float32 rounding boundary."""
    x = (rng.standard_normal(200_001) * 40).astype(np.float32)
    out, t = np.empty_like(x), np.empty(x.shape, np.float64)
    _capped_all(x, 30.0, out, t)
    want_t = np.tanh(x.astype(np.float64) / 30.0)
    want = (30.0 * want_t).astype(np.float32)
    assert (out != want).mean() < 1e-5
    assert np.abs(out - want).max() <= np.spacing(np.abs(want)).max()
    assert np.abs(t - want_t).max() <= 4 * np.spacing(1.0)
