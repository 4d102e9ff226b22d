"""attn_bias and ALiBi in the float64 reference (the oracle the backends will be held to), against cases derived by
hand: a -inf bias is a mask, a per-row constant changes nothing but lse, ALiBi is its explicit bias, and dbias is
the finite-difference gradient, summed over broadcast dimensions."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import attention_ref, attention_ref_backward
from numba_flash.semantics import visible_mask


def _qkv(rng, b=2, sq=5, sk=7, hq=4, hkv=2, d=6):
    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, d))
    return q, k, v, rng.standard_normal(q.shape)


def test_minus_inf_bias_is_the_causal_mask():
    rng = np.random.default_rng(1)
    q, k, v, dout = _qkv(rng)
    bias = np.where(visible_mask(5, 7, -1, 0), 0.0, -np.inf)   # (Sq, Sk), broadcast over B and Hq
    for got, want in zip(attention_ref(q, k, v, attn_bias=bias), attention_ref(q, k, v, causal=True)):
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    for got, want in zip(attention_ref_backward(dout, q, k, v, attn_bias=bias),
                         attention_ref_backward(dout, q, k, v, causal=True)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)


def test_per_row_constant_shifts_lse_only_and_has_zero_gradient():
    rng = np.random.default_rng(2)
    q, k, v, dout = _qkv(rng)
    shift = rng.standard_normal((2, 4, 5, 1)) * 3
    out, lse = attention_ref(q, k, v, attn_bias=shift)
    out0, lse0 = attention_ref(q, k, v)
    np.testing.assert_allclose(out, out0, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, lse0 + shift[..., 0], rtol=1e-12)
    *_, dbias = attention_ref_backward(dout, q, k, v, attn_bias=shift, return_dbias=True)
    assert dbias.shape == shift.shape
    # sum_j P_ij (dP_ij - delta_i) = delta_i - delta_i: softmax does not see a row's constant
    np.testing.assert_allclose(dbias, 0.0, atol=1e-12)


def test_alibi_is_its_explicit_bias():
    rng = np.random.default_rng(3)
    q, k, v, dout = _qkv(rng)
    slopes = rng.uniform(0.05, 1.0, 4)
    i, j = np.arange(5)[:, None], np.arange(7)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + 7 - 5 - j)    # (Hq, Sq, Sk)
    for got, want in zip(attention_ref(q, k, v, alibi_slopes=slopes, causal=True),
                         attention_ref(q, k, v, attn_bias=bias, causal=True)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    per_batch = np.stack([slopes, slopes[::-1]])            # (B, Hq)
    out, _ = attention_ref(q, k, v, alibi_slopes=per_batch)
    np.testing.assert_allclose(out[1], attention_ref(q[1:], k[1:], v[1:], alibi_slopes=slopes[::-1])[0][0],
                               rtol=1e-12)


@pytest.mark.parametrize("shape", [(2, 4, 5, 7), (4, 1, 7), (5, 7), (2, 1, 1, 7)])
def test_dbias_is_the_finite_difference_gradient(shape):
    rng = np.random.default_rng(4)
    q, k, v, dout = _qkv(rng)
    bias = rng.standard_normal(shape)
    *grads, dbias = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, softcap=2.0,
                                           window_size=(3, 1))
    assert dbias.shape == bias.shape
    eps = 1e-6
    for idx in [tuple(rng.integers(0, n) for n in shape) for _ in range(6)]:
        plus, minus = bias.copy(), bias.copy()
        plus[idx] += eps
        minus[idx] -= eps
        loss = [np.sum(attention_ref(q, k, v, attn_bias=b, softcap=2.0, window_size=(3, 1))[0] * dout)
                for b in (plus, minus)]
        np.testing.assert_allclose(dbias[idx], (loss[0] - loss[1]) / (2 * eps), rtol=1e-5, atol=1e-8)
    # and the other gradients still follow the loss with the bias in place
    plus, minus = q.copy(), q.copy()
    plus[1, 2, 3, 4] += eps
    minus[1, 2, 3, 4] -= eps
    loss = [np.sum(attention_ref(x, k, v, attn_bias=bias, softcap=2.0, window_size=(3, 1))[0] * dout)
            for x in (plus, minus)]
    np.testing.assert_allclose(grads[0][1, 2, 3, 4], (loss[0] - loss[1]) / (2 * eps), rtol=1e-5, atol=1e-8)


def test_non_finite_bias_follows_the_rule():
    rng = np.random.default_rng(5)
    q, k, v, dout = _qkv(rng, b=1, hq=2, hkv=1)
    bias = np.zeros((5, 7))
    bias[1, 6] = np.nan      # row 1 cannot see key 6 under causal: hidden, harmless
    bias[3, 0] = np.inf      # row 3 sees key 0: poisoned
    bias[4, :] = -np.inf     # row 4 sees nothing
    out, lse = attention_ref(q, k, v, attn_bias=bias, causal=True)
    assert np.isnan(out[0, 3]).all() and np.isnan(lse[0, :, 3]).all()
    assert (out[0, 4] == 0).all() and np.isposinf(lse[0, :, 4]).all()
    clean = [0, 1, 2]
    want = attention_ref(q, k, v, causal=True)
    np.testing.assert_allclose(out[0, clean], want[0][0, clean], rtol=1e-12)
    dq, dk, dv, dbias = attention_ref_backward(dout, q, k, v, attn_bias=bias, causal=True, return_dbias=True)
    assert (dq[0, 4] == 0).all() and (dbias[4] == 0).all()
    assert np.isfinite(dbias[clean]).all()


def test_return_dbias_needs_a_bias():
    rng = np.random.default_rng(6)
    q, k, v, dout = _qkv(rng)
    with pytest.raises(ValueError, match="attn_bias"):
        attention_ref_backward(dout, q, k, v, return_dbias=True)
