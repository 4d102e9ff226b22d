"""Plans for decode loops (``op.plan_kvcache`` / ``plan.run``, ``numba_flash.plan_kvcache``): a loop of decoding
steps through a plan gives the bits the same loop through ``op.with_kvcache`` gives on copies of the caches, for
the outputs and the caches after every step, and matches the float64 reference; a step the caches cannot hold, or
whose arrays have another signature, or that breaks a rule following from cache_seqlens (left padding, pages, rotary
rows), is refused by name before anything is written or run; a run does not check the call again.

Sizes are odd on purpose: B = 2, Hq = 4, Hkv = 2 (grouped-query), D = 24, capacity 37 (paged: 8 pages of 5).
"""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash.plan_kvcache as plan_kvcache_module
from backends import backend_registry
from numba_flash import AttentionInputError, attention_ref_kvcache
from numba_flash.backends.cpu import CpuBackend

B, HQ, HKV, D, CAPACITY, S_NEW, STEPS = 2, 4, 2, 24, 37, 1, 5
PAGE, PAGES, NUM_BLOCKS = 5, 8, 19       # paged: capacity 40, 16 blocks used at most, 3 spare
LENS = np.array([6, 29], np.int32)      # the keys held before the first step; both grow by S_NEW a step
SLOPES = np.array([[0.3, 0.1, 0.05, 0.5], [0.2, 0.7, 0.01, 0.4]], np.float32)
ROTARY = 41
CASES = {
    "causal": dict(causal=True),
    "window": dict(window_size=(6, 0), softmax_scale=0.3, softcap=2.5),
    "alibi": dict(causal=True, alibi_slopes=SLOPES),
    "rows_leftpad": dict(causal=True, cache_batch_idx=np.array([2, 0], np.int32),
                         cache_leftpad=np.array([1, 3], np.int32), return_lse=True),
    "rotary": dict(causal=True, rotary_interleaved=False),
    "paged": dict(causal=True, window_size=(9, 0)),
}


@pytest.fixture(autouse=True)
def _no_env_backend(monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)


@pytest.fixture
def op():
    return backend_registry.get("flash", backend="cpu")


def _block_table(rng: np.random.Generator) -> np.ndarray:
    """Each sequence's PAGES pages in shuffled block order."""
    return rng.permutation(NUM_BLOCKS)[:B * PAGES].reshape(B, PAGES).astype(np.int32)


def _caches(rng: np.random.Generator, name: str) -> tuple[np.ndarray, np.ndarray]:
    rows = 3 if "cache_batch_idx" in CASES[name] else B
    shape = (NUM_BLOCKS, PAGE, HKV, D) if name == "paged" else (rows, CAPACITY, HKV, D)
    return (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))


def _step(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A step's fresh q (B, 1, Hq, D), k and v (B, S_NEW, Hkv, D), float32."""
    return (rng.standard_normal((B, 1, HQ, D)).astype(np.float32),
            rng.standard_normal((B, S_NEW, HKV, D)).astype(np.float32),
            rng.standard_normal((B, S_NEW, HKV, D)).astype(np.float32))


def _options(rng: np.random.Generator, name: str) -> dict:
    opts = dict(CASES[name])
    if name == "paged":
        opts["block_table"] = _block_table(rng)
    if name == "rotary":
        theta = rng.uniform(0, 2 * np.pi, (ROTARY, 6))
        opts.update(rotary_cos=np.cos(theta).astype(np.float32), rotary_sin=np.sin(theta).astype(np.float32))
    return opts


@pytest.mark.parametrize("name", CASES)
def test_a_decode_loop_through_the_plan_gives_with_kvcaches_bits_and_the_reference(op, name):
    rng = np.random.default_rng(sorted(CASES).index(name))
    opts = _options(rng, name)
    k_cache, v_cache = _caches(rng, name)
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, **opts)
    assert plan.backend == "cpu"
    np.testing.assert_array_equal(k_cache, k_copy)   # a plan writes nothing
    lens = LENS.copy()
    for _ in range(STEPS):
        before_k, before_v = k_cache.copy(), v_cache.copy()
        got = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
        want = op.with_kvcache(q, k_copy, v_copy, k, v, cache_seqlens=lens, **opts)
        for g, w in zip(*((got, want) if opts.get("return_lse") else ((got,), (want,)))):
            np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(k_cache, k_copy)
        np.testing.assert_array_equal(v_cache, v_copy)
        ref_opts = {n: x for n, x in opts.items() if n != "return_lse"}
        ref_out, ref_lse, ref_k, ref_v = attention_ref_kvcache(q, before_k, before_v, k, v, cache_seqlens=lens,
                                                               **ref_opts)
        out = got[0] if opts.get("return_lse") else got
        np.testing.assert_allclose(out, ref_out, atol=2e-5, rtol=0)
        if opts.get("return_lse"):
            np.testing.assert_allclose(got[1], ref_lse, atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(k_cache, ref_k, atol=2e-6, rtol=0)
        np.testing.assert_allclose(v_cache, ref_v, atol=2e-6, rtol=0)
        lens = lens + S_NEW
        q, k, v = _step(rng)


def test_a_paged_plan_takes_each_steps_block_table_of_the_planned_shape(op):
    """vLLM's tables grow as sequences get pages: -1 (never read) until a page is used."""
    rng = np.random.default_rng(7)
    k_cache, v_cache = _caches(rng, "paged")
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    full = _block_table(rng)
    lens = np.array([8, 14], np.int32)      # 9 and 15 keys after the first step: pages 2 and 3; then 4
    q, k, v = _step(rng)

    def table(lens):
        t = full.copy()
        t[np.arange(PAGES)[None, :] >= -(-(lens[:, None] + S_NEW) // PAGE)] = -1
        return t

    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table(lens), causal=True)
    for _ in range(STEPS):
        got = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table(lens))
        want = op.with_kvcache(q, k_copy, v_copy, k, v, cache_seqlens=lens, block_table=table(lens), causal=True)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(k_cache, k_copy)
        np.testing.assert_array_equal(v_cache, v_copy)
        lens = lens + 3 * S_NEW       # skip ahead, across page boundaries
        q, k, v = _step(rng)
    with pytest.raises(AttentionInputError, match=r"^block_table: .*block_table\[1, 6\] = -1"):
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=np.array([1, 35], np.int32), block_table=table(lens))
    with pytest.raises(AttentionInputError, match=r"^block_table: .*planned shape"):
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=full[:, :4])
    np.testing.assert_array_equal(k_cache, k_copy)


def _counting(monkeypatch) -> list:
    """Count the cpu backend's with_kvcache calls (a refused step must never reach it)."""
    calls = []
    real = CpuBackend.with_kvcache

    def spy(self, call):
        calls.append(call)
        return real(self, call)

    monkeypatch.setattr(CpuBackend, "with_kvcache", spy)
    return calls


@pytest.mark.parametrize("lens, why", [
    (np.array([40, 5], np.int32), r"cache_seqlens\[0\] = 40"),
    (np.array([3, 37], np.int32), r"cache_seqlens\[1\] = 37"),          # 37 + 1 > 37
    (np.array([3, -1], np.int32), r"every entry >= 0, got cache_seqlens\[1\] = -1"),
    (None, r"cache_seqlens\[0\] = 37"),                                  # None: the whole capacity, full
    (np.array([3, 4, 5], np.int32), r"shape \(2,\)"),
    (np.array([3, 4], np.float32), "dtype int32"),
])
def test_a_step_the_caches_cannot_hold_is_refused_by_name_and_writes_nothing(op, monkeypatch, lens, why):
    rng = np.random.default_rng(3)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=True)
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    calls = _counting(monkeypatch)
    with pytest.raises(AttentionInputError, match=r"^cache_seqlens: .*" + why) as planned:
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    with pytest.raises(AttentionInputError) as direct:
        op.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    assert str(planned.value) == str(direct.value)     # the rule validate_kvcache applies, word for word
    assert calls == []
    np.testing.assert_array_equal(k_cache, k_copy)
    np.testing.assert_array_equal(v_cache, v_copy)


def _others(k_cache: np.ndarray) -> dict:
    """One step's arrays of another signature each: (argument, array, the fact that differs)."""
    wide = np.zeros((B, CAPACITY, HKV, 2 * D), np.float32)
    return {
        "q_dtype": ("q", np.zeros((B, 1, HQ, D)), "dtype"),
        "q_shape": ("q", np.zeros((B, 2, HQ, D), np.float32), "shape"),
        "k_cache_strides": ("k_cache", wide[..., :D], "strides"),
        "v_cache_shape": ("v_cache", np.zeros((B, CAPACITY - 1, HKV, D), np.float32), "shape"),
        "k_shape": ("k", np.zeros((B, 2, HKV, D), np.float32), "shape"),
        "v_masked": ("v", np.ma.zeros((B, S_NEW, HKV, D), np.float32), "MaskedArray"),
        "k_none": ("k", None, "NoneType"),
    }


@pytest.mark.parametrize("case", list(_others(np.zeros(1))))
def test_a_step_of_another_signature_is_refused_by_name_and_never_runs(op, monkeypatch, case):
    rng = np.random.default_rng(4)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=True)
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    calls = _counting(monkeypatch)
    name, other, fact = _others(k_cache)[case]
    step = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    step[name] = other
    with pytest.raises(AttentionInputError, match=rf"^{name}: .*{fact}"):
        plan.run(**step, cache_seqlens=LENS)
    assert calls == []
    np.testing.assert_array_equal(k_cache, k_copy)
    np.testing.assert_array_equal(v_cache, v_copy)


def test_what_no_signature_holds_is_checked_each_step(op, monkeypatch):
    """A read-only cache, or k_cache given as v_cache too, has the planned signature and still cannot be appended."""
    rng = np.random.default_rng(5)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=True)
    calls = _counting(monkeypatch)
    frozen = v_cache.copy()
    frozen.flags.writeable = False
    with pytest.raises(AttentionInputError, match=r"^v_cache: expected a writable array"):
        plan.run(q, k_cache, frozen, k, v, cache_seqlens=LENS)
    k_copy = k_cache.copy()
    with pytest.raises(AttentionInputError, match=r"^v_cache: .*apart from k_cache"):
        plan.run(q, k_cache, k_cache, k, v, cache_seqlens=LENS)
    assert calls == []
    np.testing.assert_array_equal(k_cache, k_copy)


def test_a_plan_without_new_keys_refuses_a_step_with_them(op):
    rng = np.random.default_rng(6)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, cache_seqlens=LENS, causal=True)
    np.testing.assert_array_equal(plan.run(q, k_cache, v_cache, cache_seqlens=LENS),
                                  op.with_kvcache(q, k_cache, v_cache, cache_seqlens=LENS, causal=True))
    with pytest.raises(AttentionInputError, match=r"^k: expected None, as planned"):
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=LENS)


def test_a_bad_call_reads_the_same_at_plan_time_as_through_with_kvcache(op):
    rng = np.random.default_rng(8)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    for bad in (dict(cache_seqlens=np.array([40, 1], np.int32)), dict(window_size=(1, 2, 3)),
                dict(cache_batch_idx=np.array([1, 1], np.int32))):
        with pytest.raises(AttentionInputError) as planned:
            op.plan_kvcache(q, k_cache, v_cache, k, v, **bad)
        with pytest.raises(AttentionInputError) as direct:
            op.with_kvcache(q, k_cache, v_cache, k, v, **bad)
        assert str(planned.value) == str(direct.value)
    with pytest.raises(AttentionInputError, match="cache_seqlen"):
        op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlen=LENS)       # a typo is named with the closest
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS)
    with pytest.raises(AttentionInputError, match="cache_seqlens"):
        plan.run(q, k_cache, v_cache, k, v, cache_seqlen=LENS)


def test_a_run_does_not_check_the_call_again(op, monkeypatch):
    rng = np.random.default_rng(9)
    k_cache, v_cache = _caches(rng, "causal")
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=True)
    calls = []
    real = plan_kvcache_module.validate_kvcache
    monkeypatch.setattr(plan_kvcache_module, "validate_kvcache", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for step in range(3):
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=LENS + step)
    assert calls == []
    op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=True)
    assert calls == [1]           # the counter counts: a plan checks its call once


def test_a_decode_loop_of_torch_tensors(op):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    k_cache, v_cache = (torch.from_numpy(c) for c in _caches(rng, "causal"))
    k_copy, v_copy = k_cache.clone(), v_cache.clone()
    lens = torch.from_numpy(LENS.copy())
    q, k, v = (torch.from_numpy(x) for x in _step(rng))
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
    for _ in range(3):
        got = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
        want = op.with_kvcache(q, k_copy, v_copy, k, v, cache_seqlens=lens, causal=True)
        assert isinstance(got, torch.Tensor)
        assert torch.equal(got, want) and torch.equal(k_cache, k_copy) and torch.equal(v_cache, v_copy)
        lens = lens + S_NEW
        q, k, v = (torch.from_numpy(x) for x in _step(rng))
    with pytest.raises(AttentionInputError, match=r"^q: .*differs in type"):
        plan.run(q.numpy(), k_cache, v_cache, k, v, cache_seqlens=lens)


@pytest.mark.parametrize("name, lens, argument", [
    ("rows_leftpad", np.array([0, 29], np.int32), "cache_leftpad"),     # leftpad 1 past the keys held
    ("rotary", np.array([6, 35], np.int32), "rotary_cos"),              # the new key's position past the table
    ("paged", np.array([6, 39], np.int32), "block_table"),              # a page no sequence may share
])
def test_the_rules_that_follow_cache_seqlens_are_checked_each_step(op, monkeypatch, name, lens, argument):
    """Each step's lengths against the planned leftpad, rotary tables and block table, word for word as
    with_kvcache checks them."""
    rng = np.random.default_rng(12)
    opts = _options(rng, name)
    if name == "rotary":
        opts.update(rotary_cos=opts["rotary_cos"][:35], rotary_sin=opts["rotary_sin"][:35])
    if name == "paged":        # sequence 1's last page is sequence 0's first: written twice once both append there
        opts["block_table"][1, 7] = opts["block_table"][0, 1]
    k_cache, v_cache = _caches(rng, name)
    q, k, v = _step(rng)
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, **opts)
    k_copy, v_copy = k_cache.copy(), v_cache.copy()
    calls = _counting(monkeypatch)
    with pytest.raises(AttentionInputError, match=rf"^{argument}: ") as planned:
        plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)
    with pytest.raises(AttentionInputError) as direct:
        op.with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, **opts)
    assert str(planned.value) == str(direct.value)
    assert calls == []
    np.testing.assert_array_equal(k_cache, k_copy)
    np.testing.assert_array_equal(v_cache, v_copy)
