"""The CPU backend through the registry: forced (``backend="cpu"``) and chosen automatically for host arrays,
checked against the float64 reference on fresh random N(0, 1) inputs."""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from numba_flash.reference import attention_ref, attention_ref_backward
from numba_flash.semantics import visible_mask


def _rel_l2(got, ref) -> float:
    got = np.asarray(got, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _qkv(rng, shape_q, shape_kv, dtype=np.float32):
    return (rng.standard_normal(shape_q).astype(dtype), rng.standard_normal(shape_kv).astype(dtype),
            rng.standard_normal(shape_kv).astype(dtype))


@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("causal,window,softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                   (False, (9, 2), 4.0)])
def test_forced_cpu_forward_backward(rng, layout, causal, window, softcap):
    b, sq, sk, hq, hkv, d = 2, 37, 53, 4, 2, 24
    shape_q, shape_kv = ((b, sq, hq, d), (b, sk, hkv, d)) if layout == "bshd" else ((b, hq, sq, d), (b, hkv, sk, d))
    q, k, v = _qkv(rng, shape_q, shape_kv)
    dout = rng.standard_normal(shape_q).astype(np.float32)
    op = backend_registry.get("flash", backend="cpu")
    kw = dict(causal=causal, window_size=window, softcap=softcap, layout=layout)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (b, hq, sq)
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    assert np.abs(out - ref_out).max() <= 1e-5
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), seen)
    assert np.abs(lse[seen] - ref_lse[seen]).max() <= 1e-4
    grads = op.backward(dout, q, k, v, out, lse, **kw)
    for g, r, x in zip(grads, attention_ref_backward(dout, q, k, v, **kw), (q, k, v)):
        assert g.shape == x.shape and g.dtype == np.float32
        assert _rel_l2(g, r) <= 1e-5


def test_numpy_inputs_dispatch_to_cpu(rng):
    q, k, v = _qkv(rng, (1, 20, 2, 16), (1, 20, 2, 16))
    op = backend_registry.get("flash")
    assert "chosen: cpu" in op.explain(q, k, v)
    out = op.forward(q, k, v, causal=True)
    assert isinstance(out, np.ndarray)
    assert np.abs(out - attention_ref(q, k, v, causal=True)[0]).max() <= 1e-5


def test_torch_cpu_tensors_in_torch_out(rng):
    torch = pytest.importorskip("torch")
    q, k, v = _qkv(rng, (1, 2, 31, 40), (1, 1, 45, 40))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
    op = backend_registry.get("flash")
    out, lse = op.forward(tq, tk, tv, causal=True, layout="bhsd", return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.device.type == "cpu"
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    ref_out, _ = attention_ref(q, k, v, causal=True, layout="bhsd")
    assert np.abs(out.numpy() - ref_out).max() <= 1e-5
    dq, dk, dv = op.backward(tdo, tq, tk, tv, out, lse, causal=True, layout="bhsd")
    assert all(isinstance(g, torch.Tensor) for g in (dq, dk, dv))
    for g, r in zip((dq, dk, dv), attention_ref_backward(dout, q, k, v, causal=True, layout="bhsd")):
        assert _rel_l2(g.numpy(), r) <= 1e-5
    # The inputs are untouched.
    for t, a in zip((tq, tk, tv, tdo), (q, k, v, dout)):
        assert np.array_equal(t.numpy(), a)


class _HostDLPack:
    """A host array known only through DLPack, as a JAX CPU array is: none of numpy's, torch's or CUDA's types."""

    def __init__(self, a):
        self._a, self.shape, self.dtype = a, a.shape, a.dtype

    def __dlpack__(self, **kwargs):
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_host_dlpack_inputs_and_the_forwards_results_in_the_backward(rng):
    """Nothing can build the exporter's own type, so the results are numpy; the backward takes them beside the
    DLPack inputs (it refused them as 'not the same array kind as q')."""
    q, k, v = _qkv(rng, (2, 29, 4, 24), (2, 37, 2, 24))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    wrapped = [_HostDLPack(x.copy()) for x in (q, k, v, dout)]
    op = backend_registry.get("flash")
    out, lse = op.forward(*wrapped[:3], causal=True, return_lse=True)
    assert isinstance(out, np.ndarray) and isinstance(lse, np.ndarray)
    ref_out, ref_lse = attention_ref(q, k, v, causal=True)
    assert np.abs(out - ref_out).max() <= 1e-5 and np.abs(lse - ref_lse).max() <= 1e-5
    grads = op.backward(wrapped[3], *wrapped[:3], out, lse, causal=True)
    for g, r in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert isinstance(g, np.ndarray) and _rel_l2(g, r) <= 1e-5
    for w, a in zip(wrapped, (q, k, v, dout)):
        assert np.array_equal(w._a, a)


def _naive_fp16(q, k, v, causal):
    """The reference formula evaluated in float16 throughout (layout bshd, Hq == Hkv)."""
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    s = np.matmul(qh, kh.transpose(0, 1, 3, 2)) * np.float16(1 / np.sqrt(q.shape[-1]))
    if causal:
        s = np.where(visible_mask(s.shape[-2], s.shape[-1], -1, 0), s, np.float16(-np.inf))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s = s / s.sum(axis=-1, keepdims=True)
    return np.matmul(s, vh).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("causal", [False, True])
def test_float16(rng, causal):
    q, k, v = _qkv(rng, (1, 131, 2, 64), (1, 131, 2, 64), np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, causal=causal, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref_out, _ = attention_ref(q, k, v, causal=causal)
    err = _rel_l2(out, ref_out)
    assert err <= 2e-3
    assert err <= 2 * _rel_l2(_naive_fp16(q, k, v, causal), ref_out)
    grads = op.backward(dout, q, k, v, out, lse, causal=causal)
    for g, r in zip(grads, attention_ref_backward(dout, q, k, v, causal=causal)):
        assert g.dtype == np.float16 and not np.isnan(g).any()
        assert _rel_l2(g, r) <= 2e-3


def test_float64_stays_float64(rng):
    q, k, v = _qkv(rng, (1, 17, 3, 8), (1, 9, 1, 8), np.float64)
    out, lse = backend_registry.get("flash", backend="cpu").forward(q, k, v, softcap=2.0, return_lse=True)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    assert np.abs(out - attention_ref(q, k, v, softcap=2.0)[0]).max() <= 1e-12


def test_rows_without_keys_through_backend(rng):
    q, k, v = _qkv(rng, (1, 30, 1, 8), (1, 10, 1, 8))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, causal=True, return_lse=True)  # rows 0..19 see no key
    assert not out[:, :20].any() and np.isposinf(lse[:, :, :20]).all()
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, causal=True)
    assert not dq[:, :20].any()
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))


@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_torch_tensors(rng, causal):
    # bfloat16 reaches the CPU backend as torch tensors only; it is widened to float32 and the results rounded back.
    torch = pytest.importorskip("torch")
    shape_q, shape_kv = (1, 97, 4, 64), (1, 130, 2, 64)    # GQA 2:1, Sq < Sk: causal aligned bottom-right
    tq, tk, tv, tdo = (torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to(torch.bfloat16)
                       for s in (shape_q, shape_kv, shape_kv, shape_q))
    before = [t.clone() for t in (tq, tk, tv, tdo)]
    op = backend_registry.get("flash")
    assert "chosen: cpu" in op.explain(tq, tk, tv, causal=causal)
    out, lse = op.forward(tq, tk, tv, causal=causal, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    q, k, v, dout = (t.float().numpy() for t in (tq, tk, tv, tdo))
    ref_out, _ = attention_ref(q, k, v, causal=causal)
    err = _rel_l2(out.float().numpy(), ref_out)
    # The contract: relative L2 <= 1.6e-2, and at most 2x naive attention computed in bfloat16.
    qh, kh, vh = (t.transpose(1, 2) for t in (tq, tk, tv))
    kh, vh = (x.repeat_interleave(2, dim=1) for x in (kh, vh))
    scores = (qh @ kh.transpose(-1, -2)) * (64 ** -0.5)
    if causal:
        scores = scores.masked_fill(~torch.from_numpy(visible_mask(97, 130, -1, 0)), float("-inf"))
    naive = (torch.softmax(scores, dim=-1) @ vh).transpose(1, 2)
    assert err <= 1.6e-2
    assert err <= 2 * _rel_l2(naive.float().numpy(), ref_out)
    grads = op.backward(tdo, tq, tk, tv, out, lse, causal=causal)
    for g, r, t in zip(grads, attention_ref_backward(dout, q, k, v, causal=causal), (tq, tk, tv)):
        assert g.dtype == torch.bfloat16 and g.shape == t.shape
        assert _rel_l2(g.float().numpy(), r) <= 1.6e-2
    assert all(torch.equal(a, b) for a, b in zip((tq, tk, tv, tdo), before))
