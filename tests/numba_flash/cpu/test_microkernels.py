"""The CPU kernels' register-blocked products (numba_flash.cpu.microkernels), on their own: the fused updates (the
forward's O = O * alpha + P^T V, the backward's gradient sums) against numpy in float64 on random tiles of odd
reduction lengths, and against the two steps they replace, bit for bit in float32; and the backward's row sums
delta against the score product they must cancel."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from numba_flash.cpu.microkernels import mm, mm_add, mm_at, mm_at_add, mm_at_rescale, mm_dot
from numba_flash.cpu.schedule import call_sequences
from numba_flash.cpu.simd import FASTMATH
from numba_flash.cpu.workspace import kernel_entry, row_dot_kernel


@njit
def _rescale(c, at, b, kdim, alpha):
    mm_at_rescale(c, at, b, kdim, alpha)


@njit(fastmath=FASTMATH)
def _two_steps(c, at, b, kdim, alpha, tile):
    # what the forward did before the fusion: the tile's product first, then O = O * alpha + P^T V
    mm_at(tile, at, b, kdim, False)
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
        mm_at_add(c, a, b, kdim)
    else:
        mm_add(c, a, b, kdim)


@njit(fastmath=FASTMATH)
def _add_two_steps(c, a, b, kdim, transposed, tile):
    if transposed:
        mm_at(tile, a, b, kdim, False)
    else:
        mm(tile, a, b, kdim, False)
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


@njit
def _dot(c, a, bt, kdim):
    mm_dot(c, a, bt, kdim)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("seqlen, head_dim", [(61, 40), (64, 200), (3, 16), (1, 112)])
def test_row_dots_are_the_score_products_diagonal(rng, dtype, seqlen, head_dim):
    """delta = rowsum(dO * O) (``row_dot_kernel``, four rows at a time) must be summed exactly as the product dP =
    dO V^T is (``mm_dot``, chunks of the head dim): where a row sees one key, O = v and delta cancels dP to 0, as
    torch's does. So in float32 (the micro-kernels' products; float64 has plain loops) each row's delta is bit for
    bit the diagonal of the product of the same rows, for every row of a sequence whose length leaves 1-3 rows after
    the groups of four."""
    a = rng.standard_normal((1, seqlen, 2, head_dim)).astype(dtype)
    b = rng.standard_normal((1, seqlen, 2, head_dim)).astype(dtype)
    seqs = call_sequences(a, a, None, None)
    delta = np.full((1, 2, seqs.stat_len), np.nan, dtype)
    kernel_entry(row_dot_kernel, np.dtype(dtype))(a, b, delta, seqs.table)
    rows = -(-seqlen // 16) * 16
    for h in range(2 if dtype == np.float32 else 0):
        a_rows = np.zeros((rows, head_dim), dtype)
        bt = np.zeros((head_dim, rows), dtype)
        a_rows[:seqlen], bt[:, :seqlen] = a[0, :, h], b[0, :, h].T
        c = np.empty((rows, rows), dtype)
        _dot(c, a_rows, bt, head_dim)
        np.testing.assert_array_equal(delta[0, h, :seqlen], np.diagonal(c)[:seqlen])
        np.testing.assert_array_equal(delta[0, h, seqlen:], 0)   # the padding rows of the statistics
    want = np.einsum("bshd,bshd->bhs", a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(delta[:, :, :seqlen], want, rtol=1e-4 if dtype == np.float32 else 1e-12,
                               atol=1e-4 if dtype == np.float32 else 1e-12)
