"""The CPU kernels' register-blocked products (numba_flash.cpu.microkernels), on their own: the fused updates (the
forward's O = O * alpha + P^T V, the backward's gradient sums) against numpy in float64 on random tiles of odd
reduction lengths, and against the two steps they replace, bit for bit in float32."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from numba_flash.cpu.microkernels import _mm, _mm_add, _mm_at, _mm_at_add, _mm_at_rescale
from numba_flash.cpu.simd import _FASTMATH


@njit
def _rescale(c, at, b, kdim, alpha):
    _mm_at_rescale(c, at, b, kdim, alpha)


@njit(fastmath=_FASTMATH)
def _two_steps(c, at, b, kdim, alpha, tile):
    # what the forward did before the fusion: the tile's product first, then O = O * alpha + P^T V
    _mm_at(tile, at, b, kdim, False)
    for r in range(c.shape[0]):
        for d in range(c.shape[1]):
            c[r, d] = c[r, d] * alpha[r] + tile[r, d]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, cols, kdim", [(64, 16, 37), (64, 48, 64), (64, 128, 1), (8, 32, 29)])
def test_rescaled_product_is_the_accumulator_update(rng, dtype, rows, cols, kdim):
    at = rng.standard_normal((kdim + 3, rows)).astype(dtype)      # rows past kdim must not be read
    b = rng.standard_normal((kdim + 3, cols + 16)).astype(dtype)  # nor columns past c's
    alpha = rng.uniform(0, 1.5, rows).astype(dtype)
    alpha[rows // 3] = 0.0
    c0 = rng.standard_normal((rows, cols)).astype(dtype)
    c = c0.copy()
    _rescale(c, at, b, kdim, alpha)
    want = c0.astype(np.float64) * alpha[:, None] + at[:kdim].T.astype(np.float64) @ b[:kdim, :cols]
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * np.sqrt(kdim))
    if dtype == np.float32:
        # the same bits as the two-step update: one rounding of the summed product, then one fused multiply-add
        two = c0.copy()
        _two_steps(two, at, b, kdim, alpha, np.empty_like(c0))
        np.testing.assert_array_equal(c, two)


@njit
def _add(c, a, b, kdim, transposed):
    if transposed:
        _mm_at_add(c, a, b, kdim)
    else:
        _mm_add(c, a, b, kdim)


@njit(fastmath=_FASTMATH)
def _add_two_steps(c, a, b, kdim, transposed, tile):
    if transposed:
        _mm_at(tile, a, b, kdim, False)
    else:
        _mm(tile, a, b, kdim, False)
    for r in range(c.shape[0]):
        for d in range(c.shape[1]):
            c[r, d] += tile[r, d]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("transposed", [True, False])
# (64, 64, 128): the 4 x 64 block of 512-bit CPUs (``_WIDE_BLOCK_MIN_KDIM``); 144: a last 16-column panel there
@pytest.mark.parametrize("rows, cols, kdim", [(64, 16, 37), (64, 144, 64), (8, 32, 1), (64, 64, 128)])
def test_added_product_is_the_gradient_sum(rng, dtype, transposed, rows, cols, kdim):
    a = rng.standard_normal((kdim + 2, rows) if transposed else (rows, kdim + 2)).astype(dtype)
    a_mat = a[:kdim].T if transposed else a[:, :kdim]
    b = rng.standard_normal((kdim + 2, cols + 16)).astype(dtype)
    c0 = rng.standard_normal((rows, cols)).astype(dtype)
    c = c0.copy()
    _add(c, a, b, kdim, transposed)
    want = c0.astype(np.float64) + a_mat.astype(np.float64) @ b[:kdim, :cols]
    tol = 1e-5 if dtype == np.float32 else 1e-13
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * np.sqrt(kdim))
    if dtype == np.float32:
        two = c0.copy()
        _add_two_steps(two, a, b, kdim, transposed, np.empty_like(c0))
        np.testing.assert_array_equal(c, two)   # one rounding of the summed product, then one addition
