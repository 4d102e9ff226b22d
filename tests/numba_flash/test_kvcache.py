"""with_kvcache (flash-attn's flash_attn_with_kvcache) on the reference and on the cpu and torch backends.

The reference is checked first against hand-built cases (rotary as plane rotations, the cache's keys concatenated
by hand), then every backend against the reference on fresh random caches of odd sizes.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import numba_flash
from numba_flash import AttentionInputError, attention_ref, attention_ref_kvcache, backend_registry
from numba_flash.rotary import apply_rotary

torch = pytest.importorskip("torch")

from kvcache_cases import as_torch as _as_torch, copy_args as _copy, random_case as _case  # noqa: E402

BACKENDS = ("cpu", "rocm")


# ---- the reference against hand-built cases ----

@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_turns_each_pair_by_its_angle(interleaved):
    rng = np.random.default_rng(11)
    d, half = 10, 3
    x = rng.standard_normal((1, 2, 1, d))
    theta = rng.uniform(0, 2 * np.pi, (5, half))
    positions = np.array([[4, 1]])
    got = apply_rotary(x, np.cos(theta), np.sin(theta), positions, interleaved)
    for t, p in enumerate(positions[0]):
        for i in range(half):
            a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
            c, s = np.cos(theta[p, i]), np.sin(theta[p, i])
            want = np.array([[c, -s], [s, c]]) @ x[0, t, 0, [a, b]]
            np.testing.assert_allclose(got[0, t, 0, [a, b]], want, rtol=1e-12)
    np.testing.assert_array_equal(got[..., 2 * half:], x[..., 2 * half:])  # beyond rotary_dim: untouched


def test_reference_equals_attention_over_the_keys_gathered_by_hand():
    rng = np.random.default_rng(12)
    args = _case(rng, rotary=False, batch_idx=True, leftpad=True)
    out, lse, k_after, v_after = attention_ref_kvcache(**args, causal=True)
    for b in range(3):
        row, n, start = args["cache_batch_idx"][b], args["cache_seqlens"][b], args["cache_leftpad"][b]
        keys = np.concatenate([args["k_cache"][row, start:n], args["k"][b]])[None]
        values = np.concatenate([args["v_cache"][row, start:n], args["v"][b]])[None]
        o, l = attention_ref(args["q"][b:b + 1], keys, values, causal=True)
        np.testing.assert_allclose(out[b:b + 1], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], l, rtol=1e-12)
        np.testing.assert_array_equal(k_after[row, n:n + 3], args["k"][b])
    untouched = np.setdiff1d(np.arange(5), args["cache_batch_idx"])
    np.testing.assert_array_equal(k_after[untouched], args["k_cache"][untouched])


def test_reference_alibi_is_the_bias_over_each_sequences_own_keys():
    """ALiBi with a cache: -slope * |i + Sk_b - Sq - j|, j counted from cache_leftpad and Sk_b the keys sequence b
    attends to (its cache, then its new keys), written here as an explicit attn_bias on keys gathered by hand."""
    rng = np.random.default_rng(14)
    args = _case(rng, rotary=False, leftpad=True, sq=3)
    slopes = rng.uniform(0.05, 1.0, (3, 4))
    out, lse, _, _ = attention_ref_kvcache(**args, alibi_slopes=slopes, causal=True)
    for b in range(3):
        n, start = args["cache_seqlens"][b], args["cache_leftpad"][b]
        keys = np.concatenate([args["k_cache"][b, start:n], args["k"][b]])[None]
        values = np.concatenate([args["v_cache"][b, start:n], args["v"][b]])[None]
        sk = keys.shape[1]
        bias = np.empty((1, 4, 3, sk))
        for h in range(4):
            for i in range(3):
                for j in range(sk):
                    bias[0, h, i, j] = -slopes[b, h] * abs(i + sk - 3 - j)
        o, l = attention_ref(args["q"][b:b + 1], keys, values, causal=True, attn_bias=bias)
        np.testing.assert_allclose(out[b:b + 1], o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[b:b + 1], l, rtol=1e-12)


def test_reference_paged_equals_the_same_cache_unpaged():
    rng = np.random.default_rng(13)
    args = _case(rng, paged=True, page=4)
    table, page = args["block_table"], 4
    dense = {name: args[name][table].reshape(3, -1, *args[name].shape[2:]) for name in ("k_cache", "v_cache")}
    unpaged = {**{n: a for n, a in args.items() if n != "block_table"}, **dense}
    got = attention_ref_kvcache(**args, causal=True)
    want = attention_ref_kvcache(**unpaged, causal=True)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got[2][table].reshape(want[2].shape), want[2])


# ---- every backend against the reference ----

GRID = [dict(paged=p, batch_idx=bi, leftpad=lp, rotary=r, s_new=s, sq=sq)
        for p, bi, lp, r, s, sq in [(False, False, False, True, 3, 1), (False, True, True, True, 1, 4),
                                   (True, False, False, True, 3, 2), (True, False, False, False, 0, 3),
                                   (False, False, True, False, 0, 1), (False, True, False, True, 5, 5)]]
OPTIONS = [dict(), dict(causal=True), dict(window_size=(6, 0)), dict(window_size=(-1, 2), softcap=3.0),
           dict(causal=True, rotary_interleaved=False, softmax_scale=0.3),
           dict(alibi_slopes="per batch", causal=True), dict(alibi_slopes="per head", window_size=(6, 0), softcap=3.0)]


def _options(index, rng, batch=3, nheads=4):
    """OPTIONS[index] with ALiBi slopes drawn: (B, Hq) or (Hq,), float32 as flash-attn takes them."""
    opts = dict(OPTIONS[index])
    if opts.get("alibi_slopes") == "per batch":
        opts["alibi_slopes"] = rng.uniform(0.01, 1.0, (batch, nheads)).astype(np.float32)
    elif opts.get("alibi_slopes") == "per head":
        opts["alibi_slopes"] = rng.uniform(0.01, 1.0, nheads).astype(np.float32)
    return opts


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,options", list(itertools.product(range(len(GRID)), range(len(OPTIONS)))))
def test_backend_matches_reference(backend, case, options):
    rng = np.random.default_rng(100 + 10 * case + options)
    args = _case(rng, **GRID[case])
    opts = _options(options, rng)
    splits = int(rng.choice([0, 1, 3, 64]))
    want_out, want_lse, want_k, want_v = attention_ref_kvcache(**args, **opts)
    given = _copy(args)
    out, lse = backend_registry.get("flash", backend=backend).with_kvcache(**given, **opts, num_splits=splits,
                                                                           return_lse=True)
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == args["q"].shape
    naive_err = 4 * np.abs(attention_ref_kvcache(**{n: (a.astype(np.float32) if isinstance(a, np.ndarray) and
                                                        a.dtype.kind == "f" else a) for n, a in args.items()},
                                                 **opts)[0] - want_out).max()
    np.testing.assert_allclose(out, want_out, atol=max(2e-5, naive_err), rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(given["k_cache"], want_k, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(given["v_cache"], want_v)
    for name in ("q", "k", "v", "rotary_cos", "block_table", "cache_seqlens"):
        if name in args:
            np.testing.assert_array_equal(given[name], args[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_tensors_float16_and_bfloat16(backend):
    rng = np.random.default_rng(21)
    args = _case(rng, paged=True, rotary=True, sq=3)
    want_out, _, want_k, _ = attention_ref_kvcache(**args, causal=True)
    for dt, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        given = {n: (t.to(dt) if t.dtype.is_floating_point else t) for n, t in _as_torch(args).items()}
        out = backend_registry.get("flash", backend=backend).with_kvcache(**given, causal=True)
        assert isinstance(out, torch.Tensor) and out.dtype == dt
        err = np.linalg.norm(out.float().numpy() - want_out) / np.linalg.norm(want_out)
        assert err < tol
        k_err = np.abs(given["k_cache"].float().numpy() - want_k).max()
        assert k_err < 8 * tol  # the appended keys, rounded to the cache's dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_garbage_outside_the_attended_keys_stays_out(backend):
    """Real caches hold uninitialised memory past cache_seqlens and before cache_leftpad: it must never leak."""
    rng = np.random.default_rng(22)
    args = _case(rng, rotary=False, leftpad=True, s_new=1)
    want = attention_ref_kvcache(**args)[0]
    given = _copy(args)
    for b in range(3):
        for cache in (given["k_cache"], given["v_cache"]):
            cache[b, args["cache_seqlens"][b] + 1:] = np.nan
            cache[b, :args["cache_leftpad"][b]] = np.inf
    out = backend_registry.get("flash", backend=backend).with_kvcache(**given, num_splits=3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_with_no_keys_gets_zero_and_inf(backend):
    rng = np.random.default_rng(23)
    args = _case(rng, rotary=False, s_new=0)
    args["cache_seqlens"][1] = 0
    out, lse = backend_registry.get("flash", backend=backend).with_kvcache(**args, return_lse=True)
    assert np.all(out[1] == 0) and np.all(np.isposinf(lse[1]))
    assert np.all(np.isfinite(out[[0, 2]]))


# ---- bad input: refused before anything is written ----

def _bad_cases():
    rng = np.random.default_rng(31)
    plain, paged = _case(rng), _case(rng, paged=True)
    yield "cache_seqlens", {**plain, "cache_seqlens": np.array([35, 0, 1], np.int32)}  # 35 + 3 > 37
    yield "cache_seqlens", {**plain, "cache_seqlens": np.array([-1, 0, 1], np.int32)}
    table = paged["block_table"].copy()
    table[2, 0] = 10_000
    yield "block_table", {**paged, "block_table": table}
    yield "rotary_cos", {**plain, "rotary_cos": plain["rotary_cos"][:4], "rotary_sin": plain["rotary_sin"][:4]}
    yield "rotary_cos", {**plain, "rotary_cos": np.ones((37, 20), np.float32), "rotary_sin": np.ones((37, 20),
                                                                                                    np.float32)}
    yield "rotary_cos", {n: a for n, a in plain.items() if n not in ("k", "v")}  # rotary without new keys
    yield "v", {n: a for n, a in plain.items() if n != "v"}
    yield "cache_batch_idx", {**plain, "k_cache": np.concatenate([plain["k_cache"]] * 2),
                              "v_cache": np.concatenate([plain["v_cache"]] * 2),
                              "cache_batch_idx": np.array([1, 4, 1], np.int32)}
    yield "cache_leftpad", {**plain, "cache_leftpad": plain["cache_seqlens"] + 1}
    yield "k", {**plain, "k": plain["k"][:, :, :1]}
    yield "alibi_slopes", {**plain, "alibi_slopes": np.ones(5, np.float32)}  # Hq = 4
    yield "alibi_slopes", {**plain, "alibi_slopes": np.array([0.5, np.nan, 0.5, 0.5], np.float32)}
    yield "alibi_slopes", {**plain, "alibi_slopes": [0.5] * 4}
    yield "num_splits", {**plain, "num_splits": -2}
    yield "num_splits", {**plain, "num_splits": 10**9}   # would allocate a partial output per part
    frozen = plain["k_cache"].copy()
    frozen.flags.writeable = False
    yield "k_cache", {**plain, "k_cache": frozen}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("argument,args", list(_bad_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_is_refused_and_the_cache_untouched(backend, argument, args):
    given = _copy(args)
    with pytest.raises(AttentionInputError, match=f"^{argument}: expected"):
        backend_registry.get("flash", backend=backend).with_kvcache(**given)
    for name in ("k_cache", "v_cache"):
        np.testing.assert_array_equal(given[name], args[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_buffer_as_both_caches_is_refused_and_two_halves_of_one_are_not(backend):
    """Appending to one buffer given as k_cache and v_cache would write each new position twice (the value over the
    key) and read values as keys; flash-attn's packed layout, k and v as two halves of one (.., 2, Hkv, D) buffer,
    shares no element and is served."""
    rng = np.random.default_rng(43)
    args = _case(rng, rotary=False)
    op = backend_registry.get("flash", backend=backend)
    for kind in ("numpy", "torch"):
        cache = args["k_cache"].copy()
        given = dict(args, k_cache=cache, v_cache=cache)
        if kind == "torch":
            given = _as_torch(given)
        with pytest.raises(AttentionInputError, match="^v_cache: expected an array apart from k_cache"):
            op.with_kvcache(**given)
        np.testing.assert_array_equal(np.asarray(given["k_cache"]), args["k_cache"])
    packed = np.stack([args["k_cache"], args["v_cache"]], axis=2)   # (B, capacity, 2, Hkv, D)
    got = op.with_kvcache(**dict(args, k_cache=packed[:, :, 0], v_cache=packed[:, :, 1]))
    want = attention_ref_kvcache(**_copy(args))[0]
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)


def test_explain_and_choice_of_splits():
    from numba_flash.backends import kvcache as driver
    from numba_flash.kvcache import MAX_SPLITS, MIN_KEYS_PER_SPLIT, validate_kvcache

    rng = np.random.default_rng(41)
    args = _case(rng, rotary=False, s_new=0, capacity=5000)
    kv = validate_kvcache(**args)
    assert driver.choose_num_splits(kv, 1) == 1
    many = driver.choose_num_splits(kv, 64)
    assert 1 < many <= MAX_SPLITS and many <= int(kv.seqlens_k.max()) // MIN_KEYS_PER_SPLIT
    assert driver.choose_num_splits(validate_kvcache(**args, num_splits=5), 64) == 5
    assert "with_kvcache" in kv.dense_call().describe()
    assert numba_flash.attention_ref_kvcache is attention_ref_kvcache


# ---- the torch face, flash-attn's argument order ----

def test_flash_attn_with_kvcache_positional_like_flash_attn():
    rng = np.random.default_rng(51)
    args = _case(rng, sq=3, s_new=3, batch_idx=True)
    want_out, want_lse, want_k, _ = attention_ref_kvcache(**args, causal=True, rotary_interleaved=False)
    t = _as_torch(args)
    out, lse = numba_flash.flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], t["rotary_cos"], t["rotary_sin"], t["cache_seqlens"],
        t["cache_batch_idx"], None, None, None, True, (-1, -1), 0.0, False, None, 0, True)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(t["k_cache"].numpy(), want_k, atol=2e-6, rtol=0)


def test_flash_attn_with_kvcache_int_seqlens_and_compile():
    rng = np.random.default_rng(52)
    args = _case(rng, rotary=False, s_new=1, sq=1)
    args["cache_seqlens"] = np.full(3, 20, np.int32)
    want = attention_ref_kvcache(**args)[0]
    t = _as_torch({n: a for n, a in args.items() if n != "cache_seqlens"})

    def step(q, k_cache, v_cache, k, v):
        return numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=20)

    out = step(**t)
    np.testing.assert_allclose(out.numpy(), want, atol=2e-5, rtol=0)
    again = _as_torch({n: a for n, a in args.items() if n != "cache_seqlens"})
    compiled = torch.compile(step, backend="aot_eager")(**again)
    np.testing.assert_allclose(compiled.numpy(), want, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(again["k_cache"].numpy(), t["k_cache"].numpy())  # the append happened there too


def test_flash_attn_with_kvcache_refuses_numpy():
    rng = np.random.default_rng(53)
    args = _case(rng, rotary=False)
    with pytest.raises(AttentionInputError, match="^q: expected a torch.Tensor"):
        numba_flash.flash_attn_with_kvcache(args["q"], args["k_cache"], args["v_cache"])
    t = _as_torch(args)
    for name in ("k_cache", "v_cache"):   # named as the function names them, not as flash_attn_func's k, v
        given = dict(t, **{name: args[name]})
        with pytest.raises(AttentionInputError, match=f"^{name}: expected a torch.Tensor"):
            numba_flash.flash_attn_with_kvcache(given["q"], given["k_cache"], given["v_cache"])
    with pytest.raises(AttentionInputError, match="^alibi_slopes: expected a torch array"):
        numba_flash.flash_attn_with_kvcache(t["q"], t["k_cache"], t["v_cache"], alibi_slopes=np.ones(4))


def test_flash_attn_with_kvcache_alibi_in_flash_attns_position():
    rng = np.random.default_rng(54)
    args = _case(rng, sq=2, s_new=2, leftpad=True)
    slopes = rng.uniform(0.01, 1.0, 4).astype(np.float32)
    want_out, want_lse, _, _ = attention_ref_kvcache(**args, causal=True, alibi_slopes=slopes)
    t = _as_torch(args)
    out, lse = numba_flash.flash_attn_with_kvcache(
        t["q"], t["k_cache"], t["v_cache"], t["k"], t["v"], t["rotary_cos"], t["rotary_sin"], t["cache_seqlens"],
        None, t["cache_leftpad"], None, None, True, (-1, -1), 0.0, True, torch.from_numpy(slopes), 0, True)
    np.testing.assert_allclose(out.numpy(), want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse.numpy(), want_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_a_new_key_poisons_exactly_the_rows_that_see_it(backend):
    rng = np.random.default_rng(61)
    args = _case(rng, rotary=False, s_new=4, sq=4)
    args["k"][1, 2, 0, 3] = np.nan   # sequence 1's third new key, kv head 0 (query heads 0 and 1)
    want_out, want_lse, _, _ = attention_ref_kvcache(**args, causal=True)
    out, lse = backend_registry.get("flash", backend=backend).with_kvcache(**_copy(args), causal=True,
                                                                           return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.isnan(want_out[1, 2:, :2]).all() and not np.isnan(want_out[1, :2]).any()  # rows 2, 3 see it
    clean = ~np.isnan(want_out)
    np.testing.assert_allclose(out[clean], want_out[clean], atol=2e-5, rtol=0)
