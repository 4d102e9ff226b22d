"""Plans kept by ``flash_attn_func`` for plain eager calls (``numba_flash.dense_plans``): a loop gives the bits of
the same loop with the store off and the float64 reference's values; the full checks run once for the loop; a call
of another shape, dtype, strides, keyword or forced backend is planned anew, never run on a stale plan; a bad call
after a plan is kept is still refused by name; calls that record autograd never use a plan; a plan holds none of
its first call's tensors; the registry drops the plans when the backends change.

Sizes are odd on purpose: B = 2, Sq = 3, Sk = 13, Hq = 6, Hkv = 2 (grouped-query), D = 24.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from backends import backend_registry  # noqa: E402
from backends.cpu import CpuBackend  # noqa: E402
from numba_flash import AttentionInputError, attention_ref, dense_plans  # noqa: E402
from numba_flash import torch_api  # noqa: E402

B, SQ, SK, HQ, HKV, D, STEPS = 2, 3, 13, 6, 2, 24, 4


@pytest.fixture(autouse=True)
def _fresh_plans(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    dense_plans.store.clear()
    yield
    dense_plans.store.set_enabled(True)
    dense_plans.store.clear()


def _inputs(rng: np.random.Generator, dtype=np.float32, sk: int = SK) -> tuple[torch.Tensor, ...]:
    """Fresh q (B, Sq, Hq, D), k and v (B, Sk, Hkv, D)."""
    return (torch.from_numpy(rng.standard_normal((B, SQ, HQ, D)).astype(dtype)),
            torch.from_numpy(rng.standard_normal((B, sk, HKV, D)).astype(dtype)),
            torch.from_numpy(rng.standard_normal((B, sk, HKV, D)).astype(dtype)))


def _uncached(*args, **kwargs):
    """flash_attn_func with the store off: every call checked in full, as before plans were kept."""
    previous = dense_plans.store.set_enabled(False)
    try:
        return numba_flash.flash_attn_func(*args, **kwargs)
    finally:
        dense_plans.store.set_enabled(previous)


def _counting(monkeypatch) -> list:
    """Count the face's full checks."""
    calls = []
    real = torch_api.validate_forward
    monkeypatch.setattr(torch_api, "validate_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


OPTIONS = {
    "plain": dict(),
    "causal_lse": dict(causal=True, return_lse=True),
    "window_softcap_scale": dict(window_size=(4, 1), softcap=2.5, softmax_scale=0.3),
    "bhsd": dict(layout="bhsd", return_lse=True),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_a_loop_gives_the_uncached_bits_and_the_reference(monkeypatch, name):
    rng = np.random.default_rng(sorted(OPTIONS).index(name) + 21)
    opts = OPTIONS[name]
    calls = _counting(monkeypatch)
    for _ in range(STEPS):
        q, k, v = _inputs(rng)
        if opts.get("layout") == "bhsd":
            q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        given = [x.clone() for x in (q, k, v)]
        got = numba_flash.flash_attn_func(q, k, v, **opts)
        want = _uncached(q, k, v, **opts)
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert all(torch.equal(x, y) for x, y in zip((q, k, v), given))   # inputs not modified
        assert got[0].untyped_storage().data_ptr() not in {x.untyped_storage().data_ptr() for x in (q, k, v)}
        ref_opts = {n: x for n, x in opts.items() if n != "return_lse"}
        ref_out, ref_lse = attention_ref(q.numpy(), k.numpy(), v.numpy(), **ref_opts)
        np.testing.assert_allclose(got[0].numpy(), ref_out, atol=2e-5, rtol=0)
        if opts.get("return_lse"):
            np.testing.assert_allclose(got[1].numpy(), ref_lse, atol=2e-5, rtol=1e-5)
    assert len(calls) == 1 + STEPS   # the first call's full checks, and the uncached call's of every step
    assert dense_plans.store.kept_count() == 1


CHANGES = {
    "shape": lambda rng: (_inputs(rng, sk=SK + 2), {}),
    "dtype": lambda rng: (_inputs(rng, np.float64), {}),
    "strides": lambda rng: (tuple(x.transpose(1, 2).contiguous().transpose(1, 2) for x in _inputs(rng)), {}),
    "causal": lambda rng: (_inputs(rng), dict(causal=False)),
    "softcap": lambda rng: (_inputs(rng), dict(softcap=1.5)),
    "window_size": lambda rng: (_inputs(rng), dict(window_size=(2, 0))),
    "softmax_scale": lambda rng: (_inputs(rng), dict(softmax_scale=0.05)),
    "softmax_scale_type": lambda rng: (_inputs(rng), dict(softmax_scale=1)),
}


@pytest.mark.parametrize("change", CHANGES)
def test_a_changed_shape_dtype_stride_or_keyword_is_planned_anew(monkeypatch, change):
    """After a loop's plan is kept, a call that differs in one thing is checked in full and gives the uncached
    bits and the reference's values; the old plan would attend with the old keyword or the old shapes."""
    rng = np.random.default_rng(2)
    base = dict(causal=True, return_lse=True, softmax_scale=0.25)
    for _ in range(2):
        numba_flash.flash_attn_func(*_inputs(rng), **base)
    calls = _counting(monkeypatch)
    (q, k, v), extra = CHANGES[change](rng)
    opts = {**base, **extra}
    got = numba_flash.flash_attn_func(q, k, v, **opts)
    assert len(calls) == 1
    want = _uncached(q, k, v, **opts)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)
    ref_out, _ = attention_ref(q.numpy(), k.numpy(), v.numpy(), **{n: x for n, x in opts.items() if n != "return_lse"})
    np.testing.assert_allclose(got[0].numpy(), ref_out, atol=1e-5, rtol=0)


def test_a_bad_call_after_a_plan_is_kept_is_still_refused_by_name():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng)
    numba_flash.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(AttentionInputError, match="softcap"):
        numba_flash.flash_attn_func(q, k, v, causal=True, softcap=-1.0)
    with pytest.raises(AttentionInputError, match="causal"):
        numba_flash.flash_attn_func(q, k, v, causal=1)   # equal to True as a key, but not a bool
    with pytest.raises(AttentionInputError, match="return_attn_probs"):
        numba_flash.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    with pytest.raises(AttentionInputError, match="q"):
        numba_flash.flash_attn_func(q.numpy(), k, v, causal=True)
    bad_k = torch.from_numpy(rng.standard_normal((B, SK, 4, D)).astype(np.float32))   # 4 does not divide Hq = 6
    with pytest.raises(AttentionInputError, match="k"):
        numba_flash.flash_attn_func(q, bad_k, bad_k, causal=True)


class _CountingCpu(CpuBackend):
    """The cpu backend under another name, counting the forwards it serves."""

    name = "dense_plans_counting"
    PRIORITY = -1   # never chosen unless forced
    forwards = 0

    def forward(self, call):
        type(self).forwards += 1
        return super().forward(call)


def test_the_forced_backend_is_part_of_the_key_and_registering_drops_the_plans():
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng)
    numba_flash.flash_attn_func(q, k, v)
    assert dense_plans.store.kept_count() == 1
    backend_registry.register("flash", _CountingCpu.name, _CountingCpu)
    try:
        assert dense_plans.store.kept_count() == 0
        numba_flash.flash_attn_func(q, k, v)    # kept again, for the registry's choice
        _CountingCpu.forwards = 0
        with backend_registry.use(_CountingCpu.name):
            for _ in range(2):
                got = numba_flash.flash_attn_func(q, k, v)
        assert _CountingCpu.forwards == 2      # a plan for the unforced call would run on the cpu backend
        got_named = numba_flash.flash_attn_func(q, k, v, backend=_CountingCpu.name)
        assert _CountingCpu.forwards == 3
        assert torch.equal(got, got_named) and torch.equal(got, _uncached(q, k, v))
    finally:
        backend_registry.unregister("flash", _CountingCpu.name)
    assert dense_plans.store.kept_count() == 0


def test_calls_that_record_autograd_never_use_a_plan(monkeypatch):
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng)
    numba_flash.flash_attn_func(q, k, v, causal=True)
    assert dense_plans.store.kept_count() == 1
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    out = numba_flash.flash_attn_func(qg, kg, vg, causal=True)
    assert out.grad_fn is not None
    dout = torch.from_numpy(rng.standard_normal(out.shape).astype(np.float32))
    out.backward(dout)
    ref = [x.detach().double().requires_grad_() for x in (q, k, v)]
    scores = torch.einsum("bqhd,bkhd->bhqk", ref[0], ref[1].repeat_interleave(HQ // HKV, 2)) / D ** 0.5
    scores = scores.masked_fill(torch.ones(SQ, SK, dtype=torch.bool).triu(SK - SQ + 1), float("-inf"))
    want = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), ref[2].repeat_interleave(HQ // HKV, 2))
    want.backward(dout.double())
    for g, w in zip((qg, kg, vg), ref):
        np.testing.assert_allclose(g.grad.numpy(), w.grad.numpy(), atol=2e-5, rtol=0)
    with torch.no_grad():   # no graph to record: the kept plan serves the same tensors
        calls = _counting(monkeypatch)
        assert torch.equal(numba_flash.flash_attn_func(qg, kg, vg, causal=True), out.detach())
        assert calls == []


def test_a_kept_plan_does_not_keep_the_tensors_of_its_first_call_alive():
    import gc
    import weakref

    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng)
    numba_flash.flash_attn_func(q, k, v)
    assert dense_plans.store.kept_count() == 1
    refs = [weakref.ref(x) for x in (q, k, v)]
    del q, k, v
    gc.collect()
    assert [r() for r in refs] == [None] * 3
    q, k, v = _inputs(rng)
    assert torch.equal(numba_flash.flash_attn_func(q, k, v), _uncached(q, k, v))


def test_calls_without_a_key_are_checked_in_full_every_time(monkeypatch):
    """A list for window_size or a numpy bool has no exact key: every such call goes the full way."""
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng)
    calls = _counting(monkeypatch)
    for _ in range(2):
        numba_flash.flash_attn_func(q, k, v, window_size=[3, 0])
        numba_flash.flash_attn_func(q, k, v, causal=np.bool_(True))
    assert len(calls) == 4 and dense_plans.store.kept_count() == 0


def test_a_backend_that_is_not_a_name_is_refused_by_name_even_unhashable():
    rng = np.random.default_rng(10)
    q, k, v = _inputs(rng)
    numba_flash.flash_attn_func(q, k, v)
    for bad in ([1], 5):
        with pytest.raises(AttentionInputError, match="backend"):
            numba_flash.flash_attn_func(q, k, v, backend=bad)
