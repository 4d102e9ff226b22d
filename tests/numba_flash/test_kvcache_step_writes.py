"""A decode step's writes on its cheap path: plain float32 / float64 CPU tensor caches are appended to through numpy
views of them (``backends.kvcache``), and a kept plan tests the two caches' overlap once per pair of cache
addresses (``plan_kvcache``). Neither may change what a step does:

* the append lands where torch's own assignment put it (the float64 reference's caches), for every way a
  sequence finds its cache slots (rows, cache_batch_idx, pages), with rotary keys and with several new keys;
* torch's version counters are bumped by every entry point that writes a torch cache (the registry's
  ``with_kvcache``, a plan's ``run``, the face), so a graph that saved a cache still refuses a stale backward;
* a kept plan refuses caches that overlap once their addresses change, and inference-tensor caches outside
  inference mode, naming the cache, before any write (a numpy view would not stop either write);
* new values that are a view of the cache slots the append writes still land as given on a kept plan.

Sizes are odd on purpose: B = 3, Hq = 6, Hkv = 3 (grouped-query), D = 20, capacity 11.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from numba_flash import AttentionInputError, attention_ref_kvcache, backend_registry, kvcache_plans  # noqa: E402

B, HQ, HKV, D, CAPACITY = 3, 6, 3, 20, 11


@pytest.fixture(autouse=True)
def _fresh_plans():
    kvcache_plans.clear()
    yield
    kvcache_plans.clear()


def _t(rng: np.random.Generator, shape: tuple[int, ...], dtype=np.float32) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal(shape).astype(dtype))


def _step(rng: np.random.Generator, dtype=np.float32, s_new: int = 1) -> tuple[torch.Tensor, ...]:
    """q (B, 1, Hq, D), k and v (B, s_new, Hkv, D)."""
    return _t(rng, (B, 1, HQ, D), dtype), _t(rng, (B, s_new, HKV, D), dtype), _t(rng, (B, s_new, HKV, D), dtype)


def _reference(q, k_cache, v_cache, k, v, **options):
    """The float64 reference on copies: (out, lse, k_cache after, v_cache after), numpy."""
    plain = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in options.items()}
    return attention_ref_kvcache(q.numpy(), k_cache.numpy().copy(), v_cache.numpy().copy(), k.numpy(), v.numpy(),
                                 **plain)


def _layouts(rng: np.random.Generator, case: str, dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Caches and the options that say where each sequence's slots are."""
    if case == "paged":
        caches = _t(rng, (3 * B + 1, 4, HKV, D), dtype), _t(rng, (3 * B + 1, 4, HKV, D), dtype)
        table = torch.from_numpy(rng.permutation(3 * B + 1)[:3 * B].reshape(B, 3).astype(np.int32))
        return *caches, dict(block_table=table)
    if case == "rows":
        caches = _t(rng, (B + 2, CAPACITY, HKV, D), dtype), _t(rng, (B + 2, CAPACITY, HKV, D), dtype)
        return *caches, dict(cache_batch_idx=torch.from_numpy(rng.permutation(B + 2)[:B].astype(np.int32)))
    caches = _t(rng, (B, CAPACITY, HKV, D), dtype), _t(rng, (B, CAPACITY, HKV, D), dtype)
    if case == "rotary":
        theta = rng.uniform(0, 2 * np.pi, (CAPACITY + 1, D // 4))
        return *caches, dict(rotary_cos=torch.from_numpy(np.cos(theta).astype(dtype)),
                             rotary_sin=torch.from_numpy(np.sin(theta).astype(dtype)), rotary_interleaved=False)
    return *caches, {}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["dense", "rows", "paged", "rotary"])
@pytest.mark.parametrize("entry", ["face", "op", "plan"])
def test_the_append_lands_as_the_reference_puts_it_on_every_entry_point(rng, entry, case, dtype):
    """Three steps of two new keys each (the second and third on a kept plan), compared with the reference."""
    k_cache, v_cache, options = _layouts(rng, case, dtype)
    op = backend_registry.get("flash", backend="cpu")
    lens = torch.from_numpy(rng.integers(0, 4, B).astype(np.int32))
    plan = None
    for _ in range(3):
        q, k, v = _step(rng, dtype, s_new=2)
        want_out, want_lse, want_k, want_v = _reference(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                                        **options)
        versions = k_cache._version, v_cache._version
        if entry == "face":
            out, lse = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                           causal=True, return_softmax_lse=True, **options)
        elif entry == "op":
            out, lse = op.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True, return_lse=True,
                                       **options)
        else:
            plan = plan or op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                           return_lse=True, **options)
            out, lse = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
        tol = 2e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(k_cache.numpy(), want_k, atol=tol, rtol=0)
        np.testing.assert_allclose(v_cache.numpy(), want_v, atol=tol, rtol=0)
        np.testing.assert_allclose(out.numpy(), want_out, atol=5 * tol, rtol=0)
        np.testing.assert_allclose(lse.numpy(), want_lse, atol=5 * tol, rtol=tol)
        assert k_cache._version > versions[0] and v_cache._version > versions[1]
        lens = lens + 2


@pytest.mark.parametrize("entry", ["op", "plan"])
def test_the_registrys_entry_points_bump_the_caches_version_counters(rng, entry):
    """The registry's with_kvcache and a plan's run write a torch cache as torch's assignment did: its version
    counter moves, so a graph that saved the cache refuses the stale backward."""
    k_cache, v_cache, _ = _layouts(rng, "dense", np.float32)
    op = backend_registry.get("flash", backend="cpu")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2)
    w = torch.ones((), requires_grad=True)
    saved_k, saved_v = k_cache * w, v_cache * w    # mul saves each cache for w's gradient
    if entry == "op":
        op.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2)
    else:
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=2)
    for saved in (saved_k, saved_v):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.sum().backward(retain_graph=True)


def _cache_pairs(rng: np.random.Generator, kind: str):
    """Pairs of caches of one signature (B, CAPACITY, Hkv, D) with the strides of a (B, CAPACITY + 1, Hkv, D)
    buffer, and the buffer the last pair shares: two apart pairs, the second with other k_cache, and a pair that
    overlaps (buf[:, :C] and buf[:, 1:], which share all but a row) whose k_cache is the second pair's."""
    bufs = [rng.standard_normal((B, CAPACITY + 1, HKV, D)).astype(np.float32) for _ in range(3)]
    if kind == "torch":
        bufs = [torch.from_numpy(b) for b in bufs]
    shared = bufs[2]
    apart = (bufs[0][:, :CAPACITY], bufs[1][:, 1:])
    other_k = (shared[:, :CAPACITY], bufs[1][:, 1:])
    overlapping = (shared[:, :CAPACITY], shared[:, 1:])
    return apart, other_k, overlapping, shared


def _snapshot(*arrays) -> list[np.ndarray]:
    return [np.array(np.asarray(a), copy=True) for a in arrays]


@pytest.mark.parametrize("entry", ["face", "op torch", "op numpy", "plan numpy", "plan torch"])
def test_a_kept_plan_still_refuses_caches_that_overlap_once_their_addresses_change(rng, entry):
    kind = "numpy" if "numpy" in entry else "torch"
    apart, other_k, overlapping, shared = _cache_pairs(rng, kind)
    q, k, v = _step(rng)
    if kind == "numpy":
        q, k, v = (x.numpy() for x in (q, k, v))
    op = backend_registry.get("flash", backend="cpu")
    plan = op.plan_kvcache(q, *apart, k, v, cache_seqlens=3)

    def call(caches, lens):
        if entry == "face":
            return numba_flash.flash_attn_with_kvcache(q, *caches, k, v, cache_seqlens=lens)
        if entry.startswith("plan"):
            return plan.run(q, *caches, k, v, cache_seqlens=lens)
        return op.with_kvcache(q, *caches, k, v, cache_seqlens=lens)

    call(apart, 3)
    call(apart, 4)        # a kept plan's step (face, op), or the addresses a plan found apart
    call(other_k, 4)      # k_cache elsewhere: tested anew, apart
    before = _snapshot(shared)
    for lens in (5, 5):   # only v_cache moved from the pair found apart; refused again the second time
        with pytest.raises(AttentionInputError, match="^v_cache: .*apart from k_cache"):
            call(overlapping, lens)
        np.testing.assert_array_equal(_snapshot(shared)[0], before[0])
    call(apart, 5)
    with pytest.raises(AttentionInputError, match="^v_cache: .*apart from k_cache"):
        call(overlapping, 6)
    np.testing.assert_array_equal(_snapshot(shared)[0], before[0])


def test_a_kept_plan_refuses_inference_caches_outside_inference_mode_before_any_write(rng):
    k_cache, v_cache, _ = _layouts(rng, "dense", np.float32)
    q, k, v = _step(rng)
    lens = torch.tensor([2, 7, 0], dtype=torch.int32)
    for _ in range(2):   # a plan kept for ordinary caches of this signature
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    assert kvcache_plans.kept_count() == 1
    with torch.inference_mode():
        k_inf, v_inf = k_cache.clone(), v_cache.clone()
    before = _snapshot(k_inf, v_inf)
    with pytest.raises(AttentionInputError, match="^k_cache: .*inference tensor"):
        numba_flash.flash_attn_with_kvcache(q, k_inf, v_inf, k, v, cache_seqlens=lens)
    op = backend_registry.get("flash", backend="cpu")
    with pytest.raises(AttentionInputError, match="^k_cache: .*inference tensor"):
        op.with_kvcache(q, k_inf, v_inf, k, v, cache_seqlens=lens)
    for got, want in zip(_snapshot(k_inf, v_inf), before):
        np.testing.assert_array_equal(got, want)
    want_out, _, want_k, want_v = _reference(q, k_inf, v_inf, k, v, cache_seqlens=lens)
    with torch.inference_mode():   # inside it the same plan's step appends, and lands
        out = numba_flash.flash_attn_with_kvcache(q, k_inf, v_inf, k, v, cache_seqlens=lens)
    np.testing.assert_allclose(k_inf.numpy(), want_k, atol=0, rtol=0)
    np.testing.assert_allclose(v_inf.numpy(), want_v, atol=0, rtol=0)
    np.testing.assert_allclose(out.numpy(), want_out, atol=3e-5, rtol=0)


def test_new_values_that_are_a_view_of_the_slots_written_land_as_given_on_a_kept_plan(rng):
    """v of a cache's strides: first from another buffer (the plan kept), then a view of the k_cache rows the
    append writes (k_cache[:, 3:5], appended at 3): written after k, it would read the new keys, not its own."""
    k_cache, v_cache, _ = _layouts(rng, "dense", np.float32)
    other = _t(rng, (B, CAPACITY, HKV, D))
    q, k, _ = _step(rng, s_new=2)
    for _ in range(2):
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, other[:, 3:5], cache_seqlens=3)
    assert kvcache_plans.kept_count() == 1
    k = _t(rng, k.shape)    # not the keys the two steps above wrote where v now reads
    v = k_cache[:, 3:5]
    given = v.clone()
    want_out, _, want_k, want_v = _reference(q, k_cache, v_cache, k, given, cache_seqlens=3)
    out = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3)
    assert torch.equal(v_cache[:, 3:5], given)
    np.testing.assert_allclose(k_cache.numpy(), want_k, atol=0, rtol=0)
    np.testing.assert_allclose(v_cache.numpy(), want_v, atol=0, rtol=0)
    np.testing.assert_allclose(out.numpy(), want_out, atol=3e-5, rtol=0)
