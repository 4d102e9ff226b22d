"""The cpu backend's prepared decode step (``CpuBackend.kvcache_step``), which a ``KVCachePlan`` runs its steps on:
served exactly where its plan-time decisions cannot change between steps (a tiny unpaged decode without rotary on
float32 / float64 numpy arrays or plain CPU tensors), and on those a plan's loop gives the bits of the same loop
through ``with_kvcache``'s general path, the same caches after each append, and the float64 reference's values.

Sizes are odd on purpose: B = 3, Hq = 6, Hkv = 2 (grouped-query), D = 20, capacity 23.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from backends.cpu import CpuBackend
from numba_flash import attention_ref_kvcache, kvcache_plans
from numba_flash.kvcache import validate_kvcache

B, HQ, HKV, D, CAPACITY, STEPS = 3, 6, 2, 20, 23, 4


def _arrays(rng, dtype=np.float32, capacity=CAPACITY, seqlen_new=1):
    q = rng.standard_normal((B, 1, HQ, D)).astype(dtype)
    k_cache, v_cache = (rng.standard_normal((B + 1, capacity, HKV, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, seqlen_new, HKV, D)).astype(dtype) for _ in range(2))
    return q, k_cache, v_cache, k, v


def _served(q, k_cache, v_cache, k, v, **options) -> bool:
    kv = validate_kvcache(q, k_cache, v_cache, k, v, **{"cache_seqlens": 2, **options})
    return CpuBackend().kvcache_step(kv) is not None


def test_it_serves_tiny_host_decodes_and_leaves_the_rest_to_with_kvcache(rng):
    torch = pytest.importorskip("torch")
    q, k_cache, v_cache, k, v = _arrays(rng)
    assert _served(q, k_cache, v_cache, k, v)
    assert _served(*(x.astype(np.float64) for x in (q, k_cache, v_cache, k, v)))
    assert _served(*(torch.from_numpy(x) for x in (q, k_cache, v_cache, k, v)))
    assert _served(q, k_cache, v_cache, None, None)
    assert not _served(*(x.astype(np.float16) for x in (q, k_cache, v_cache, k, v)))   # widened every step
    assert not _served(*(torch.from_numpy(x).to(torch.bfloat16) for x in (q, k_cache, v_cache, k, v)))
    theta = rng.uniform(0, 2 * np.pi, (CAPACITY + 1, 4))
    assert not _served(q, k_cache, v_cache, k, v, rotary_cos=np.cos(theta).astype(np.float32),
                       rotary_sin=np.sin(theta).astype(np.float32))
    pages = rng.standard_normal((12, 4, HKV, D)).astype(np.float32)
    assert not _served(q, pages, pages.copy(), k, v,
                       block_table=rng.permutation(12)[:B * 4].reshape(B, 4).astype(np.int32))
    big = _arrays(rng, capacity=8192)
    assert not _served(*big)   # past the tiny bound: the split decode kernel


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_plans_loop_gives_the_general_paths_bits_and_the_reference(rng, monkeypatch, kind, dtype):
    served = []
    prepare = CpuBackend.kvcache_step

    def counting(self, kv):
        step = prepare(self, kv)
        return None if step is None else (lambda call: served.append(1) or step(call))
    monkeypatch.setattr(CpuBackend, "kvcache_step", counting)
    if kind == "torch":
        torch = pytest.importorskip("torch")
        wrap = torch.from_numpy
    else:
        wrap = np.asarray
    op = backend_registry.get("flash", backend="cpu")
    _, k_cache, v_cache, _, _ = (wrap(x) for x in _arrays(rng, dtype))
    k_general, v_general = (wrap(np.asarray(x).copy()) for x in (k_cache, v_cache))
    options = dict(cache_batch_idx=np.array([3, 0, 1], np.int32), cache_leftpad=np.array([1, 0, 2], np.int32),
                   causal=True, window_size=(6, 0), softcap=4.0, return_lse=True)
    lens = np.array([4, 9, 2], np.int32)
    plan = None
    for step in range(STEPS):
        q, _, _, k, v = (wrap(x) for x in _arrays(rng, dtype))
        before_k, before_v = (np.asarray(x).copy() for x in (k_cache, v_cache))
        if plan is None:
            plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **options)
        got = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
        assert len(served) == step + 1   # the prepared step served it
        previous = kvcache_plans.set_enabled(False)
        try:
            want = op.with_kvcache(q, k_general, v_general, k, v, cache_seqlens=lens, **options)
        finally:
            kvcache_plans.set_enabled(previous)
        for g, w in zip(got, want, strict=True):
            assert type(g) is type(w) and g.dtype == w.dtype
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(k_cache), np.asarray(k_general))
        np.testing.assert_array_equal(np.asarray(v_cache), np.asarray(v_general))
        ref_out, ref_lse, ref_k, ref_v = attention_ref_kvcache(
            *(np.asarray(x, np.float64) for x in (q, before_k, before_v, k, v)), cache_seqlens=lens,
            **{n: x for n, x in options.items() if n != "return_lse"})
        tol = 2e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(np.asarray(got[0]), ref_out, atol=tol, rtol=0)
        np.testing.assert_allclose(np.asarray(got[1]), ref_lse, atol=tol, rtol=tol)
        np.testing.assert_array_equal(np.asarray(k_cache), ref_k.astype(dtype))
        np.testing.assert_array_equal(np.asarray(v_cache), ref_v.astype(dtype))
        lens = lens + 1


def test_a_subclass_that_overrides_with_kvcache_gets_no_prepared_step(rng):
    class Own(CpuBackend):
        def with_kvcache(self, call):
            return super().with_kvcache(call)

    kv = validate_kvcache(*_arrays(rng), cache_seqlens=2)
    assert CpuBackend().kvcache_step(kv) is not None and Own().kvcache_step(kv) is None
