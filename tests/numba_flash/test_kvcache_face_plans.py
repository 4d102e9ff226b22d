"""Plans kept by ``flash_attn_with_kvcache`` and ``op.with_kvcache`` (``numba_flash.kvcache_plans``): a decode loop
gives the bits of the same loop with the cache off (outputs, lse, and both caches after every step) and the float64
reference's values; the full checks run once per entry point for the loop; a call of another shape, dtype, strides
or keyword is planned anew, never run on a stale plan; a refused step names the argument as the full checks do and
writes nothing.

Sizes are odd on purpose: B = 3, Hq = 6, Hkv = 2 (grouped-query), D = 40, capacity 29 (paged: 9 pages of 4).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from backends import backend_registry  # noqa: E402
from numba_flash import AttentionInputError, attention_ref_kvcache, kvcache_plans  # noqa: E402

B, HQ, HKV, D, CAPACITY, STEPS = 3, 6, 2, 40, 29, 5
PAGE, PAGES, NUM_BLOCKS = 4, 9, 30
LENS = np.array([4, 17, 0], np.int32)
CASES = {
    "causal_lse": dict(causal=True, return_softmax_lse=True),
    "rows_leftpad_alibi": dict(causal=True, cache_batch_idx=torch.tensor([3, 0, 1], dtype=torch.int32),
                               cache_leftpad=torch.tensor([1, 2, 0], dtype=torch.int32),
                               alibi_slopes=torch.tensor([0.3, 0.1, 0.05, 0.5, 0.2, 0.7]),
                               return_softmax_lse=True),
    "rotary_window": dict(window_size=(7, 0), softcap=3.0, rotary_interleaved=False),
    "paged": dict(causal=True, softmax_scale=0.2),
}


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    kvcache_plans.clear()
    yield
    kvcache_plans.set_enabled(True)
    kvcache_plans.clear()


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _caches(rng: np.random.Generator, name: str, dtype=np.float32) -> tuple[torch.Tensor, torch.Tensor]:
    rows = 4 if "cache_batch_idx" in CASES[name] else B
    shape = (NUM_BLOCKS, PAGE, HKV, D) if name == "paged" else (rows, CAPACITY, HKV, D)
    return _t(rng.standard_normal(shape).astype(dtype)), _t(rng.standard_normal(shape).astype(dtype))


def _step(rng: np.random.Generator, dtype=np.float32, batch: int = B) -> tuple[torch.Tensor, ...]:
    """A step's fresh q (B, 1, Hq, D), k and v (B, 1, Hkv, D)."""
    return (_t(rng.standard_normal((batch, 1, HQ, D)).astype(dtype)),
            _t(rng.standard_normal((batch, 1, HKV, D)).astype(dtype)),
            _t(rng.standard_normal((batch, 1, HKV, D)).astype(dtype)))


def _options(rng: np.random.Generator, name: str) -> dict:
    opts = dict(CASES[name])
    if name == "paged":
        opts["block_table"] = _t(rng.permutation(NUM_BLOCKS)[:B * PAGES].reshape(B, PAGES).astype(np.int32))
    if name == "rotary_window":
        theta = rng.uniform(0, 2 * np.pi, (CAPACITY + 1, 8))
        opts.update(rotary_cos=_t(np.cos(theta).astype(np.float32)), rotary_sin=_t(np.sin(theta).astype(np.float32)))
    return opts


def _uncached(*args, **kwargs):
    """flash_attn_with_kvcache with the cache off: every call checked in full, as before plans were kept."""
    previous = kvcache_plans.set_enabled(False)
    try:
        return numba_flash.flash_attn_with_kvcache(*args, **kwargs)
    finally:
        kvcache_plans.set_enabled(previous)


def _as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def _counting(monkeypatch) -> list:
    """Count the full checks (every entry point's: the face's, the op's, a plan's)."""
    calls = []
    real = kvcache_plans.validate_kvcache
    monkeypatch.setattr(kvcache_plans, "validate_kvcache", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("name", CASES)
def test_a_decode_loop_through_the_face_gives_the_uncached_bits_and_the_reference(name):
    rng = np.random.default_rng(sorted(CASES).index(name) + 11)
    opts = _options(rng, name)
    k_cache, v_cache = _caches(rng, name)
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    lens = torch.from_numpy(LENS.copy())
    for _ in range(STEPS):
        q, k, v = _step(rng)
        before_k, before_v = k_cache.clone(), v_cache.clone()
        got = _as_tuple(numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **opts))
        want = _as_tuple(_uncached(q, k_copy, v_copy, k, v, cache_seqlens=lens, **opts))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
        ref_opts = {n: (x.numpy() if isinstance(x, torch.Tensor) else x) for n, x in opts.items()
                    if n != "return_softmax_lse"}
        ref_out, ref_lse, ref_k, ref_v = attention_ref_kvcache(
            q.numpy(), before_k.numpy(), before_v.numpy(), k.numpy(), v.numpy(), cache_seqlens=lens.numpy(),
            **ref_opts)
        np.testing.assert_allclose(got[0].numpy(), ref_out, atol=2e-5, rtol=0)
        if opts.get("return_softmax_lse"):
            np.testing.assert_allclose(got[1].numpy(), ref_lse, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(k_cache.numpy(), ref_k, atol=2e-6, rtol=0)
        np.testing.assert_allclose(v_cache.numpy(), ref_v, atol=2e-6, rtol=0)
        lens = lens + 1
    assert kvcache_plans.kept_count() == 1   # an eager face call runs op.with_kvcache's checks and plan alone


def test_the_full_checks_run_once_per_entry_point_for_a_loop(monkeypatch):
    rng = np.random.default_rng(1)
    calls = _counting(monkeypatch)
    k_cache, v_cache = _caches(rng, "causal_lse")
    for step in range(STEPS):
        q, k, v = _step(rng)
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=step, causal=True)
    assert len(calls) == 1   # op.with_kvcache's, which the eager face calls, at the first step only
    calls.clear()
    op = backend_registry.get("flash", backend="cpu")
    k_np, v_np = k_cache.numpy().copy(), v_cache.numpy().copy()
    for step in range(STEPS):
        q, k, v = (x.numpy() for x in _step(rng))
        op.with_kvcache(q, k_np, v_np, k, v, cache_seqlens=step)
    assert len(calls) == 1
    kvcache_plans.set_enabled(False)
    calls.clear()
    for step in range(2):
        q, k, v = (x.numpy() for x in _step(rng))
        op.with_kvcache(q, k_np, v_np, k, v, cache_seqlens=step)
    assert len(calls) == 2   # off: every call in full


CHANGES = {
    "shape": lambda rng, kc, vc: ((*_step(rng, batch=2), kc, vc), {}),
    "dtype": lambda rng, kc, vc: ((*_step(rng, np.float64), kc.double(), vc.double()), {}),
    "strides": lambda rng, kc, vc: ((*_step(rng), kc.transpose(0, 1).contiguous().transpose(0, 1),
                                     vc.clone()), {}),
    "causal": lambda rng, kc, vc: ((*_step(rng), kc, vc), dict(causal=False)),
    "softcap": lambda rng, kc, vc: ((*_step(rng), kc, vc), dict(softcap=1.5)),
    "window_size": lambda rng, kc, vc: ((*_step(rng), kc, vc), dict(window_size=(2, 0))),
    "softmax_scale": lambda rng, kc, vc: ((*_step(rng), kc, vc), dict(softmax_scale=0.05)),
    "cache_leftpad": lambda rng, kc, vc: ((*_step(rng), kc, vc), dict(cache_leftpad=torch.tensor([2, 1, 0],
                                                                                                 dtype=torch.int32))),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_shape_dtype_stride_or_keyword_is_planned_anew(monkeypatch, change):
    """After a loop's plans are kept, a call that differs in one thing is checked in full and gives the uncached
    bits; a plan of the old call would attend with the old keyword or refuse the array by its signature."""
    rng = np.random.default_rng(2)
    base = dict(causal=True, return_softmax_lse=True)
    k_cache, v_cache = _caches(rng, "causal_lse")
    for step in range(2):
        q, k, v = _step(rng)
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=4 + step, **base)
    calls = _counting(monkeypatch)
    (q, k, v, kc, vc), extra = CHANGES[change](rng, k_cache, v_cache)
    kc_copy, vc_copy = kc.clone(), vc.clone()
    lens = torch.tensor([6, 3, 5], dtype=torch.int32)
    got = numba_flash.flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens[:q.shape[0]], **{**base, **extra})
    assert len(calls) == 1    # checked in full: a new key for the op the eager face calls
    want = _uncached(q, kc_copy, vc_copy, k, v, cache_seqlens=lens[:q.shape[0]], **{**base, **extra})
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    assert torch.equal(kc, kc_copy) and torch.equal(vc, vc_copy)


def test_a_refused_step_names_the_argument_as_the_full_checks_do_and_writes_nothing():
    rng = np.random.default_rng(3)
    k_cache, v_cache = _caches(rng, "causal_lse")
    q, k, v = _step(rng)
    for step in range(2):
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=step, causal=True)
    assert kvcache_plans.kept_count() == 1
    k_before, v_before = k_cache.clone(), v_cache.clone()
    for bad in (torch.tensor([3, CAPACITY, 1], dtype=torch.int32), CAPACITY, np.array([1, 2, -1], np.int32),
                torch.tensor([1.0, 2.0, 3.0])):
        with pytest.raises(AttentionInputError, match=r"^cache_seqlens: ") as planned:
            numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=bad, causal=True)
        with pytest.raises(AttentionInputError) as full:
            _uncached(q, k_cache, v_cache, k, v, cache_seqlens=bad, causal=True)
        assert str(planned.value) == str(full.value)
        assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before)
    op = backend_registry.get("flash", backend="cpu")
    k_np, v_np = k_cache.numpy(), v_cache.numpy()
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    op.with_kvcache(qn, k_np, v_np, kn, vn, cache_seqlens=2)
    op.with_kvcache(qn, k_np, v_np, kn, vn, cache_seqlens=3)
    k_before = k_cache.clone()
    with pytest.raises(AttentionInputError, match=r"^cache_seqlens: .*room for the 1 new keys"):
        op.with_kvcache(qn, k_np, v_np, kn, vn, cache_seqlens=CAPACITY)
    assert torch.equal(k_cache, k_before)


def test_calls_without_a_key_are_checked_in_full_every_time(monkeypatch):
    rng = np.random.default_rng(4)
    k_cache, v_cache = _caches(rng, "causal_lse")
    calls = _counting(monkeypatch)
    for step in range(3):   # a list for window_size has no key (the eager face hands the op the list as given)
        q, k, v = _step(rng)
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=step, window_size=[3, 0])
    assert len(calls) == 3 and kvcache_plans.kept_count() == 0
    calls.clear()
    for step in range(3):   # rotary tables made anew each step are other tables: planned anew, never reused
        theta = torch.from_numpy(rng.uniform(0, 2 * np.pi, (CAPACITY + 1, 4)).astype(np.float32))
        q, k, v = _step(rng)
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, theta.cos(), theta.sin(), cache_seqlens=step)
    assert len(calls) == 3


def test_the_plans_kept_are_bounded_and_dropped_when_the_backends_change():
    rng = np.random.default_rng(5)
    op = backend_registry.get("flash", backend="cpu")
    k_np, v_np = (x.numpy() for x in _caches(rng, "causal_lse"))
    q, k, v = (x.numpy() for x in _step(rng))
    for i in range(kvcache_plans.MAX_PLANS + 5):
        op.with_kvcache(q, k_np, v_np, k, v, cache_seqlens=0, softmax_scale=0.1 + i / 100)
    assert kvcache_plans.kept_count() == kvcache_plans.MAX_PLANS
    backend_registry.register("flash", "plans_test_backend", "numba_flash.backends.cpu:CpuBackend")
    try:
        assert kvcache_plans.kept_count() == 0
    finally:
        backend_registry.unregister("flash", "plans_test_backend")


VALUES = {
    "cache_batch_idx": (torch.tensor([3, 0, 1], dtype=torch.int32), [1, 3, 2]),
    "cache_leftpad": (torch.tensor([1, 2, 0], dtype=torch.int32), [3, 0, 2]),
    "alibi_slopes": (torch.tensor([0.3, 0.1, 0.05, 0.5, 0.2, 0.7]), [0.9, 0.0, 0.4, 0.1, 0.6, 0.2]),
}


@pytest.mark.parametrize("name", VALUES)
def test_index_arrays_and_slopes_given_new_values_in_place_are_planned_anew(name):
    """A plan reads these values once; the same tensor with new values is another call (a stale plan would attend
    with the old rows, padding or slopes)."""
    rng = np.random.default_rng(6)
    given, new_values = VALUES[name]
    x = given.clone()
    k_cache, v_cache = _caches(rng, "rows_leftpad_alibi")
    lens = torch.tensor([5, 9, 4], dtype=torch.int32)
    for step in range(3):
        if step == 2:
            x.copy_(torch.tensor(new_values, dtype=x.dtype))   # same object, same signature, other values
        q, k, v = _step(rng)
        k_copy, v_copy = k_cache.clone(), v_cache.clone()
        got = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True,
                                                  return_softmax_lse=True, **{name: x})
        want = _uncached(q, k_copy, v_copy, k, v, cache_seqlens=lens, causal=True, return_softmax_lse=True,
                         **{name: x})
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
        lens = lens + 1


def test_a_kept_plan_does_not_keep_the_caches_of_its_first_call_alive():
    """A kept plan is reused for every later call of its signature, other caches included: holding the first
    call's caches would keep a released (possibly large, possibly GPU) cache alive for as long as the plan is kept."""
    import gc
    import weakref

    rng = np.random.default_rng(8)
    k_cache, v_cache = _caches(rng, "causal_lse")
    q, k, v = _step(rng)
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1, causal=True)
    assert kvcache_plans.kept_count() == 1
    refs = [weakref.ref(x) for x in (q, k_cache, v_cache, k, v)]
    del q, k_cache, v_cache, k, v
    gc.collect()
    assert [r() for r in refs] == [None] * 5
    k_cache, v_cache = _caches(rng, "causal_lse")    # the kept plans serve new caches of the signature
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    q, k, v = _step(rng)
    got = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, causal=True)
    assert torch.equal(got, _uncached(q, k_copy, v_copy, k, v, cache_seqlens=2, causal=True))
    assert torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)


def test_a_backend_that_is_not_a_name_is_refused_by_name_even_unhashable():
    rng = np.random.default_rng(9)
    k_cache, v_cache = _caches(rng, "causal_lse")
    q, k, v = _step(rng)
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=1)
    for bad in ([1], 5):
        with pytest.raises(AttentionInputError, match="backend"):
            numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=2, backend=bad)
