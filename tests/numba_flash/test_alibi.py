"""ALiBi (``alibi_slopes``) on the backends that run it, against the float64 reference, and its bad input."""

from __future__ import annotations

import re

import numpy as np
import pytest

import numba_flash
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, backend_registry

torch = pytest.importorskip("torch")

BACKENDS = ("rocm", "cpu")
CASES = [dict(), dict(causal=True), dict(window_size=(6, 3), softcap=2.5), dict(causal=True, softmax_scale=0.3)]


def _inputs(rng, b=2, sq=13, sk=29, hq=4, hkv=2, d=16):
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("per_batch", [False, True])
def test_forward_backward_match_reference(backend, case, per_batch):
    rng = np.random.default_rng(10 + case + 100 * per_batch)
    q, k, v, dout = _inputs(rng, sq=13 if case % 2 else 31)
    slopes = rng.uniform(0.02, 1.0, (2, 4) if per_batch else (4,)).astype(np.float32)
    kw = CASES[case]
    t = {n: torch.from_numpy(x) for n, x in dict(q=q, k=k, v=v, dout=dout, slopes=slopes).items()}
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(t["q"], t["k"], t["v"], alibi_slopes=t["slopes"], return_lse=True, **kw)
    grads = op.backward(t["dout"], t["q"], t["k"], t["v"], out, lse, alibi_slopes=t["slopes"], **kw)
    want_out, want_lse = attention_ref(q, k, v, alibi_slopes=slopes, **kw)
    want_grads = attention_ref_backward(dout, q, k, v, alibi_slopes=slopes, **kw)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, want_grads):
        assert np.linalg.norm(got.numpy() - want) <= 1e-5 * np.linalg.norm(want)
    # the slopes matter: without them the answer is a different one
    assert np.abs(attention_ref(q, k, v, **kw)[0] - want_out).max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_with_alibi_and_autograd(backend):
    rng = np.random.default_rng(20)
    q, k, v, dout = _inputs(rng)
    slopes = rng.uniform(0.02, 1.0, 4).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = numba_flash.flash_attn_func(tq, tk, tv, 0.0, None, True, (-1, -1), 0.0, torch.from_numpy(slopes),
                                      backend=backend)
    out.backward(torch.from_numpy(dout))
    want = attention_ref(q, k, v, causal=True, alibi_slopes=slopes)[0]
    np.testing.assert_allclose(out.detach().numpy(), want, atol=2e-5, rtol=0)
    for got, ref in zip((tq.grad, tk.grad, tv.grad),
                        attention_ref_backward(dout, q, k, v, causal=True, alibi_slopes=slopes)):
        assert np.linalg.norm(got.numpy() - ref) <= 1e-5 * np.linalg.norm(ref)


def test_every_backend_offers_alibi_and_one_without_would_say_so():
    from backends.base import Backend
    from numba_flash.validation import validate_forward

    rng = np.random.default_rng(21)
    q, k, v, _ = _inputs(rng)
    call = validate_forward(q, k, v, alibi_slopes=np.ones(4, np.float32))
    for be in backend_registry.backends("flash"):
        assert "ALiBi not supported" not in be.feature_reasons(call), be.name   # cuda's: simulator-tested
    assert "ALiBi not supported" in Backend.feature_reasons(Backend(), call)
    assert " alibi " in backend_registry.get("flash").explain(q, k, v, alibi_slopes=np.ones(4, np.float32))


@pytest.mark.parametrize("slopes,match", [
    (np.ones(3, np.float32), r"\(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\)"),
    (np.ones((4, 2), np.float32), "shape"),
    (np.array([1, 2, 3, 4]), "floating dtype"),
    (np.array([0.1, np.nan, 0.2, 0.3], np.float32), "finite"),
    ([0.1, 0.2, 0.3, 0.4], "an array"),
])
def test_bad_slopes(slopes, match):
    rng = np.random.default_rng(22)
    q, k, v, _ = _inputs(rng)
    with pytest.raises(AttentionInputError, match=f"^alibi_slopes: expected .*{match}"):
        backend_registry.get("flash", backend="rocm").forward(q, k, v, alibi_slopes=slopes)


def test_slopes_of_another_kind_are_refused():
    rng = np.random.default_rng(23)
    q, k, v, _ = _inputs(rng)
    with pytest.raises(AttentionInputError, match="^alibi_slopes: expected a numpy array"):
        backend_registry.get("flash").forward(q, k, v, alibi_slopes=torch.ones(4))
    cu = np.array([0, 13, 26], np.int32)
    with pytest.raises(AttentionInputError, match=r"^alibi_slopes: expected \(Hq,\) = \(4,\) or \(B, Hq\) = \(2, 4\)"):
        backend_registry.get("flash", backend="rocm").forward(
            q.reshape(26, 4, 16), k.reshape(58, 2, 16), v.reshape(58, 2, 16), cu_seqlens_q=cu,
            cu_seqlens_k=np.array([0, 29, 58], np.int32), alibi_slopes=np.ones((3, 4), np.float32))



@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("per_batch", [False, True])
def test_packed_sequences_with_alibi_match_each_sequence_run_alone(backend, per_batch):
    rng = np.random.default_rng(24 + per_batch)
    cu_q, cu_k = np.array([0, 5, 5, 17, 20], np.int32), np.array([0, 9, 13, 26, 26], np.int32)
    q = rng.standard_normal((20, 4, 16)).astype(np.float32)
    k = rng.standard_normal((26, 2, 16)).astype(np.float32)
    v = rng.standard_normal((26, 2, 16)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    slopes = rng.uniform(0.05, 1.0, (4, 4) if per_batch else (4,)).astype(np.float32)
    kw = dict(causal=True, alibi_slopes=slopes)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    want_out, want_lse = numba_flash.attention_ref_varlen(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, numba_flash.attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, **kw)):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)
    # the packed reference against the dense one, one sequence at a time (each with its own slopes)
    for b in (0, 2):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        own = slopes[b] if per_batch else slopes
        dense, _ = attention_ref(q[None, rows], k[None, keys], v[None, keys], causal=True, alibi_slopes=own)
        np.testing.assert_allclose(want_out[rows], dense[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_varlen_func_with_alibi_and_autograd(backend):
    rng = np.random.default_rng(26)
    cu = np.array([0, 7, 19], np.int32)
    q, k, v, dout = (rng.standard_normal((19, h, 16)).astype(np.float32) for h in (4, 2, 2, 4))
    slopes = rng.uniform(0.05, 1.0, (2, 4)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = numba_flash.flash_attn_varlen_func(tq, tk, tv, torch.from_numpy(cu), torch.from_numpy(cu), 12, 12,
                                             causal=True, alibi_slopes=torch.from_numpy(slopes), backend=backend)
    out.backward(torch.from_numpy(dout))
    kw = dict(causal=True, alibi_slopes=slopes)
    np.testing.assert_allclose(out.detach().numpy(), numba_flash.attention_ref_varlen(q, k, v, cu, cu, **kw)[0],
                               atol=2e-5, rtol=0)
    for got, ref in zip((tq.grad, tk.grad, tv.grad),
                        numba_flash.attention_ref_varlen_backward(dout, q, k, v, cu, cu, **kw)):
        assert np.linalg.norm(got.numpy() - ref) <= 1e-5 * np.linalg.norm(ref)


@pytest.mark.parametrize("dtype, compute", [(np.float32, "float32"), (np.float64, "float64")])
def test_slopes_whose_bias_overflows_are_refused_and_the_largest_allowed_matches_the_reference(rng, dtype, compute):
    """-slope * distance must be finite in the compute dtype: past that the kernels' bias became -inf (a key
    hidden) or +inf (a NaN row) where the float64 reference has a number. Distances reach max(Sq, Sk) - 1 = 28."""
    q, k, v, _ = (x.astype(dtype) for x in _inputs(rng))
    limit = float(np.finfo(compute).max) / 28
    op = backend_registry.get("flash")
    for bad in (1.01 * limit, -1.01 * limit):
        slopes = np.array([0.5, bad, 0.25, 0.125])
        with pytest.raises(AttentionInputError, match=rf"^alibi_slopes: expected \|slope\| <= {re.escape(f'{limit:.3g}')}, .*"
                                                      rf"distances up to 28 here.* in {compute}, got .*head 1\)$"):
            op.forward(q, k, v, alibi_slopes=slopes)
        cache = np.concatenate([k, k], axis=1)   # a KV cache of capacity 58: distances up to 57
        with pytest.raises(AttentionInputError, match=r"^alibi_slopes: expected \|slope\| <= .*up to 57"):
            op.with_kvcache(q[:, :1], cache, cache, cache_seqlens=29, alibi_slopes=slopes * 0.6)
    # just inside the limit the biases are enormous but finite: each query sees its nearest keys only, on every
    # backend as in the reference (hugely negative slopes: its farthest)
    for big in (0.99 * limit, -0.99 * limit):
        slopes = np.array([0.5, big, 0.25, 0.125])
        want, _ = attention_ref(q, k, v, alibi_slopes=slopes)
        for backend in BACKENDS:
            got = backend_registry.get("flash", backend=backend).forward(q, k, v, alibi_slopes=slopes)
            assert np.isfinite(got).all(), backend
            np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=backend)
