"""Head dims past 256 and a value head dim Dv different from D (Gemma's 512, MLA's 576 / 512): the float64
reference against an independent torch autograd computation, the backends that run them against the reference,
and the ones that do not saying so."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import attention_ref, attention_ref_backward, backend_registry

torch = pytest.importorskip("torch")

BACKENDS = ("rocm", "cpu")
# (D, Dv): value dim smaller, larger, MLA's, Gemma's
DIMS = [(24, 7), (40, 72), (576, 512), (512, 512)]


def _inputs(rng, d, dv, b=2, sq=11, sk=19, hq=4, hkv=2, dtype=np.float32):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    return q, k, v, rng.standard_normal((b, sq, hq, dv)).astype(dtype)


def _torch_autograd(q, k, v, dout, causal, softcap):
    """Attention written out in float64 torch with autograd: S x S, no tiling, nothing shared with the reference."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", tq, tk.repeat_interleave(g, dim=2)) / q.shape[-1] ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        sq, sk = s.shape[-2:]
        s = s.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq), float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), tv.repeat_interleave(g, dim=2))
    out.backward(torch.tensor(dout, dtype=torch.float64))
    return out.detach().numpy(), tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy()


@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("causal,softcap", [(False, 0.0), (True, 4.0)])
def test_reference_matches_torch_autograd(d, dv, causal, softcap):
    rng = np.random.default_rng(d * 1000 + dv)
    q, k, v, dout = _inputs(rng, d, dv, dtype=np.float64)
    want = _torch_autograd(q, k, v, dout, causal, softcap)
    out, _ = attention_ref(q, k, v, causal=causal, softcap=softcap)
    got = (out,) + attention_ref_backward(dout, q, k, v, causal=causal, softcap=softcap)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, atol=1e-12, rtol=1e-10, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("d,dv", DIMS)
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_backend_matches_reference(backend, d, dv, layout):
    rng = np.random.default_rng(d + 7 * dv)
    q, k, v, dout = _inputs(rng, d, dv)
    kw = dict(causal=True, window_size=(6, 0), softcap=3.0)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    want = attention_ref_backward(dout, q, k, v, **kw)
    if layout == "bhsd":
        q, k, v, dout = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, dout))
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, layout=layout, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, layout=layout, **kw)
    if layout == "bhsd":
        out, grads = out.transpose(0, 2, 1, 3), [g.transpose(0, 2, 1, 3) for g in grads]
    assert out.shape == want_out.shape
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=3e-5, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == ref.shape, name
        assert np.linalg.norm(got - ref) <= 3e-5 * np.linalg.norm(ref), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_sequences_with_a_different_value_dim(backend):
    rng = np.random.default_rng(41)
    cu_q, cu_k = np.array([0, 5, 12, 13], np.int32), np.array([0, 9, 20, 31], np.int32)
    q = rng.standard_normal((13, 4, 16)).astype(np.float32)
    k = rng.standard_normal((31, 2, 16)).astype(np.float32)
    v = rng.standard_normal((31, 2, 6)).astype(np.float32)
    dout = rng.standard_normal((13, 4, 6)).astype(np.float32)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
    grads = op.backward(dout, q, k, v, out, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    want_out, _ = numba_flash.attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True)
    want = numba_flash.attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    for got, ref in zip(grads, want):
        assert got.shape == ref.shape and np.linalg.norm(got - ref) <= 2e-5 * np.linalg.norm(ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_autograd_with_mla_dims(backend):
    rng = np.random.default_rng(42)
    q, k, v, dout = _inputs(rng, 576, 512, b=1, sq=5, sk=9, hq=2, hkv=1)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    out = numba_flash.flash_attn_func(tq, tk, tv, causal=True, backend=backend)
    out.backward(torch.from_numpy(dout))
    assert out.shape == (1, 5, 2, 512)
    np.testing.assert_allclose(out.detach().numpy(), attention_ref(q, k, v, causal=True)[0], atol=2e-5, rtol=0)
    for got, ref in zip((tq.grad, tk.grad, tv.grad), attention_ref_backward(dout, q, k, v, causal=True)):
        assert np.linalg.norm(got.numpy() - ref) <= 2e-5 * np.linalg.norm(ref)


def test_backends_without_them_say_so():
    rng = np.random.default_rng(43)
    q, k, v, _ = _inputs(rng, 24, 7)
    text = str(backend_registry.get("flash").explain(q, k, v))
    assert "Dv=7" in text and "chosen: cpu" in text
    assert "Dv=7" not in text.split("cuda [priority 30]:")[1].split("\n")[0]   # cuda serves Dv != D (no GPU here)
    q, k, v, _ = _inputs(rng, 320, 320, sq=3, sk=4)
    text = str(backend_registry.get("flash").explain(q, k, v))
    assert "head dim" not in text.split("cuda [priority 30]:")[1].split("\n")[0] and "chosen: cpu" in text


@pytest.mark.parametrize("d,dv,batch,hkv", [(40, 24, 1, 1), (24, 40, 2, 2), (576, 512, 1, 1)])
def test_cpu_kernels_over_many_tiles(d, dv, batch, hkv):
    """Several query and key tiles with partial last ones, GQA, a window and ALiBi; one kv head per call runs dQ in
    its own pass, two batches of two kv heads fuse it into the key-tile pass (2 threads)."""
    rng = np.random.default_rng(d * 3 + dv)
    sq, sk = (70, 93) if d > 256 else (131, 197)
    q, k, v, dout = _inputs(rng, d, dv, b=batch, sq=sq, sk=sk, hq=2 * hkv, hkv=hkv)
    slopes = rng.uniform(0.0, 0.2, 2 * hkv).astype(np.float32)
    kw = dict(causal=True, window_size=(90, 0), alibi_slopes=slopes)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    assert out.shape == want_out.shape == (batch, sq, 2 * hkv, dv)
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=3e-5, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, attention_ref_backward(dout, q, k, v, **kw)):
        assert got.shape == ref.shape, name
        assert np.linalg.norm(got - ref) <= 3e-5 * np.linalg.norm(ref), name


def test_ring_attention_refuses_a_different_value_dim():
    rng = np.random.default_rng(44)
    q, k, v, _ = _inputs(rng, 16, 8)
    with pytest.raises(numba_flash.AttentionInputError, match="^v: expected q's head dim 16"):
        numba_flash.ring_attention(*(torch.from_numpy(x) for x in (q, k, v)), group=None)


def test_cpu_decode_with_a_576_wide_cache():
    """The KV-cache decode kernel at MLA's width (k and v caches share D there), with an append and softcap."""
    rng = np.random.default_rng(45)
    b, hq, hkv, d, cache_len = 2, 4, 1, 576, 150
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k_cache = rng.standard_normal((b, cache_len, hkv, d)).astype(np.float32)
    v_cache = rng.standard_normal((b, cache_len, hkv, d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((b, 1, hkv, d)).astype(np.float32) for _ in range(2))
    seqlens = np.array([97, 141], np.int32)
    want_out, want_lse, _, _ = numba_flash.attention_ref_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                                 cache_seqlens=seqlens, causal=True, softcap=6.0)
    out, lse = backend_registry.get("flash", backend="cpu").with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, softcap=6.0, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=3e-5, rtol=1e-5)
    assert np.array_equal(k_cache[np.arange(b), seqlens, :, :], k_new[:, 0])   # appended in place
