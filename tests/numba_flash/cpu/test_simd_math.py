"""The CPU kernels' arithmetic-only math (numba_flash.cpu.simd), which loops vectorise where libm calls do not:
against numpy's libm on fresh random arguments spread over many magnitudes, and the special values."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
from numba import njit

from numba_flash.cpu.score_terms import apply_score_terms
from numba_flash.cpu.passes import column_exp2_sum
from numba_flash.cpu.simd import EXP2_P1, EXP2_P2, EXP2_P3, EXP2_P4, EXP2_P5, EXP2_P6, FASTMATH, fast_exp2, tanh64


@njit
def _tanh_all(x, out):
    for i in range(x.shape[0]):
        out[i] = tanh64(x[i])


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
    apply_score_terms(s, 1, x.shape[0], False, softcap, slope, 5, 0, 3, dcap.reshape((1, x.shape[0])), 1.0, True)
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


@njit(fastmath=FASTMATH)
def _exp2_scalar(x, out):
    for i in range(x.shape[0]):
        out[i] = fast_exp2(x[i])


@njit(fastmath=FASTMATH)
def _exp2_pass(st, total):
    # the forward's vectorised pass: st = exp(st - shift) in natural-log units, shift 0
    column_exp2_sum(st, st.shape[0], total, np.zeros(st.shape[1], np.float32))


def _ulps(got, want):
    return np.abs(got.astype(np.float64) - want) / np.spacing(want.astype(np.float32)).astype(np.float64)


def test_exp2_within_one_ulp_and_the_vector_pass_gives_the_scalar_bits(rng):
    # Both builds are compiled with the kernels' fast-math flags, under which a rounding written as
    # (x + 1.5 * 2**23) - 1.5 * 2**23 would fold back into x: the bits must still be right there.
    x = np.concatenate([rng.uniform(-126, 0, 200_000), -rng.uniform(0, 1, 50_000) ** 3,
                        -np.arange(0, 126.5, 0.5)]).astype(np.float32)  # the halves: rounding ties
    x = x[: x.size // 64 * 64]
    scalar = np.empty_like(x)
    _exp2_scalar(x, scalar)
    assert _ulps(scalar, np.exp2(x.astype(np.float64))).max() <= 1.0
    # the pass multiplies by log2 e in float32 first: give it x / log2 e and compare with the scalar on its product
    log2e = np.float32(1.4426950408889634)
    st = (x / log2e).astype(np.float32).reshape(-1, 64)
    seen = (st * log2e).astype(np.float32).ravel()
    total = np.zeros(64, np.float32)
    _exp2_pass(st, total)
    want = np.empty_like(seen)
    _exp2_scalar(seen, want)
    np.testing.assert_array_equal(st.ravel(), want)
    np.testing.assert_allclose(total, st.astype(np.float64).sum(axis=0), rtol=1e-5)


def test_exp2_special_values():
    x = np.array([0.0, -1.0, -126.0, -127.0, -128.0, -1e30, -np.inf, np.nan], np.float32)
    out = np.empty_like(x)
    _exp2_scalar(x, out)
    assert out[0] == 1.0 and out[1] == 0.5 and out[2] == 2.0 ** -126   # exact at integers
    assert np.all(out[3:7] == 0.0)   # 2^-127 and below: exactly 0 (a masked score's probability)
    assert np.isnan(out[7])          # a poisoned row stays poisoned


def test_exp2_coefficients_are_the_fit_of_the_tool():
    spec = importlib.util.spec_from_file_location(
        "exp2_poly_fit", Path(__file__).resolve().parents[3] / "tools" / "exp2_poly_fit.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    fitted = tool.fit(6).astype(np.float32)
    coefficients = [1.0, EXP2_P1, EXP2_P2, EXP2_P3, EXP2_P4, EXP2_P5, EXP2_P6]
    np.testing.assert_array_equal(fitted, np.array(coefficients, np.float32))
    assert tool.float32_ulps(tool.fit(6))[0] < 1.0
