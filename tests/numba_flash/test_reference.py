"""The oracle itself is checked against independent formulations: a per-row loop written from the contract's
visibility rule, torch's float64 SDPA where its semantics coincide, and central finite differences."""

import numpy as np
import pytest

from numba_flash.reference import attention_ref, attention_ref_backward, naive_attention_numpy
from numba_flash.semantics import attention_flops, effective_window, key_range, visible_mask, visible_pairs


def _row_loop(q, k, v, scale, left, right, softcap):
    """Attention one query row at a time, straight from the contract's text (bshd, float64)."""
    b_, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((b_, hq, sq), np.inf)
    for b in range(b_):
        for h in range(hq):
            kv = h // (hq // hkv)
            for i in range(sq):
                keys = [j for j in range(sk)
                        if (left < 0 or j >= i + sk - sq - left) and (right < 0 or j <= i + sk - sq + right)]
                if not keys:
                    continue
                s = np.array([scale * q[b, i, h] @ k[b, j, kv] for j in keys])
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                w = np.exp(s - s.max())
                out[b, i, h] = (w[:, None] * v[b, keys, kv]).sum(0) / w.sum()
                lse[b, h, i] = s.max() + np.log(w.sum())
    return out, lse


OPTIONS = [
    dict(),
    dict(causal=True),
    dict(window_size=(3, 1)),
    dict(window_size=(0, 0)),
    dict(window_size=(-1, 2), softcap=1.5),
    dict(causal=True, softcap=0.8, softmax_scale=0.37),
]


@pytest.mark.parametrize("opts", OPTIONS)
@pytest.mark.parametrize("sq,sk", [(5, 9), (9, 5), (7, 7), (1, 4)])
def test_reference_matches_row_loop(rng, opts, sq, sk):
    q = rng.standard_normal((2, sq, 4, 5))
    k = rng.standard_normal((2, sk, 2, 5))
    v = rng.standard_normal((2, sk, 2, 5))
    left, right = effective_window(opts.get("causal", False), opts.get("window_size", (-1, -1)))
    scale = opts.get("softmax_scale", 1 / np.sqrt(5))
    want_o, want_l = _row_loop(q, k, v, scale, left, right, opts.get("softcap", 0.0))
    out, lse = attention_ref(q, k, v, **opts)
    np.testing.assert_allclose(out, want_o, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_l))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_l[np.isfinite(want_l)], atol=1e-12)
    assert not np.isnan(out).any()


def test_reference_layouts_agree(rng):
    q, k, v = (rng.standard_normal(s) for s in ((2, 6, 4, 3), (2, 8, 1, 3), (2, 8, 1, 3)))
    o1, l1 = attention_ref(q, k, v, causal=True)
    t = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    o2, l2 = attention_ref(t(q), t(k), t(v), causal=True, layout="bhsd")
    np.testing.assert_allclose(t(o2), o1, atol=1e-13)
    np.testing.assert_allclose(l2, l1, atol=1e-13)


def test_reference_matches_torch_sdpa_float64(rng):
    torch = pytest.importorskip("torch")
    q, k, v = (rng.standard_normal((2, 3, 11, 16)) for _ in range(3))  # bhsd, Sq == Sk so both causal rules agree
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(
            *(torch.from_numpy(x) for x in (q, k, v)), is_causal=causal).numpy()
        got, _ = attention_ref(q, k, v, causal=causal, layout="bhsd")
        np.testing.assert_allclose(got, want, atol=1e-12)


@pytest.mark.parametrize("opts", OPTIONS)
def test_reference_backward_matches_finite_differences(rng, opts):
    q = rng.standard_normal((1, 5, 2, 3))
    k = rng.standard_normal((1, 6, 1, 3))
    v = rng.standard_normal((1, 6, 1, 3))
    do = rng.standard_normal(q.shape)
    grads = attention_ref_backward(do, q, k, v, **opts)
    eps = 1e-6
    for which, g in enumerate(grads):
        x = (q, k, v)[which]
        for _ in range(4):
            idx = tuple(int(rng.integers(n)) for n in x.shape)
            plus, minus = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            plus[which][idx] += eps
            minus[which][idx] -= eps
            fd = ((attention_ref(*plus, **opts)[0] - attention_ref(*minus, **opts)[0]) * do).sum() / (2 * eps)
            assert abs(fd - g[idx]) < 1e-6 * max(1.0, abs(fd)), (which, idx, fd, g[idx])


def test_rows_that_see_no_key(rng):
    q, k, v = (rng.standard_normal((1, 6, 1, 4)) for _ in range(3))
    k, v = k[:, :3], v[:, :3]
    out, lse = attention_ref(q, k, v, causal=True)  # Sq > Sk: the first 3 rows see nothing
    assert np.all(out[0, :3] == 0) and np.all(np.isinf(lse[0, 0, :3]))
    assert np.all(np.isfinite(lse[0, 0, 3:]))
    dq, dk, dv = attention_ref_backward(rng.standard_normal(q.shape), q, k, v, causal=True)
    assert np.all(dq[0, :3] == 0) and not any(np.isnan(g).any() for g in (dq, dk, dv))


def test_inputs_not_modified(rng):
    arrays = [rng.standard_normal((1, 4, 2, 3)) for _ in range(4)]
    copies = [a.copy() for a in arrays]
    attention_ref(*arrays[:3], softcap=2.0)
    attention_ref_backward(arrays[3], *arrays[:3], causal=True)
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def test_naive_numpy_matches_reference(rng):
    q, k, v = (rng.standard_normal((2, 3, 9, 8)).astype(np.float32) for _ in range(3))
    for causal in (False, True):
        want, _ = attention_ref(q, k, v, causal=causal, layout="bhsd")
        np.testing.assert_allclose(naive_attention_numpy(q, k, v, causal=causal), want, atol=2e-6)


@pytest.mark.parametrize("sq,sk,left,right", [(5, 9, -1, 0), (9, 5, -1, 0), (7, 7, 2, 1), (4, 10, 0, -1), (3, 3, 0, 0)])
def test_key_range_matches_mask(sq, sk, left, right):
    mask = visible_mask(sq, sk, left, right)
    for i in range(sq):
        lo, hi = key_range(i, sq, sk, left, right)
        np.testing.assert_array_equal(mask[i], (np.arange(sk) >= lo) & (np.arange(sk) < hi))
    assert visible_pairs(sq, sk, left, right) == mask.sum()


def test_flop_count_convention():
    assert attention_flops(1, 2, 8, 8, 4) == 4 * 2 * 8 * 8 * 4
    assert attention_flops(1, 2, 8, 8, 4, causal=True) == 2 * 2 * 8 * 8 * 4
    assert attention_flops(1, 2, 8, 16, 4, causal=True) == 4 * 2 * 8 * 16 * 4  # halved only when Sq == Sk
    assert attention_flops(1, 1, 8, 8, 4, mode="fwd_bwd") == 3.5 * attention_flops(1, 1, 8, 8, 4)
