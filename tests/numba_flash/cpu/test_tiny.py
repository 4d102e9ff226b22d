"""Tiny forwards (``numba_flash.cpu.tiny``): the cpu backend's one-thread path for decode steps and short
sequences, against the float64 reference on fresh random odd-size inputs, with the contract's non-finite rules,
every layout and the inputs left as they were. Each test checks that the tiny path really served the call."""

from __future__ import annotations

import numba
import numpy as np
import pytest

import backends.cpu as cpu_backend
from numba_flash import backend_registry
from numba_flash.cpu import tiny
from numba_flash.reference import attention_ref, attention_ref_backward

OP = backend_registry.get("flash", backend="cpu")


@pytest.fixture
def served(monkeypatch):
    """Counts the calls the tiny kernel serves."""
    calls = []
    real = tiny.tiny_forward

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny, "tiny_forward", spy)
    return calls


def _textbook_f32_error(q, k, v, ref, **kw):
    """Max abs error of plain float32 attention (scores, softmax, P V in float32) on the same inputs."""
    from numba_flash.semantics import default_scale

    qh, kh, vh = (np.swapaxes(x, 1, 2).astype(np.float32) for x in (q, k, v))
    group = qh.shape[1] // kh.shape[1]
    kh, vh = np.repeat(kh, group, axis=1), np.repeat(vh, group, axis=1)
    s = (qh @ np.swapaxes(kh, 2, 3)) * np.float32(default_scale(q.shape[-1]))
    sq, sk = s.shape[-2:]
    i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
    if kw.get("causal"):
        s = np.where(j <= i + sk - sq, s, -np.inf)
    with np.errstate(invalid="ignore"):   # rows that see no key are NaN here; nanmax skips them
        p = np.exp(s - s.max(-1, keepdims=True))
        o = (p / p.sum(-1, keepdims=True)) @ vh
    return float(np.nanmax(np.abs(np.swapaxes(o, 1, 2) - ref)))


CASES = [   # (B, Sq, Sk, Hq, Hkv, D, Dv, options)
    (1, 1, 17, 8, 8, 64, 64, {}),
    (2, 3, 19, 6, 2, 33, 21, {"causal": True}),
    (1, 5, 9, 4, 1, 7, 7, {"window_size": (2, 1), "softcap": 5.0}),
    (3, 7, 5, 2, 2, 16, 16, {"causal": True}),          # Sq > Sk: the first rows see no key
    (1, 2, 13, 3, 3, 11, 11, {"alibi": True}),
]


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])))
def test_matches_the_float64_reference(case, dtype, layout, served):
    b, sq, sk, hq, hkv, d, dv, options = case
    rng = np.random.default_rng()   # fresh draws each run
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    options = dict(options)
    slopes = rng.uniform(0.1, 1.0, hq).astype(np.float32) if options.pop("alibi", False) else None
    if layout == "bhsd":
        args = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v)]
    elif layout == "strided":   # every other element of the head dim: no array is contiguous
        args = [np.repeat(x, 2, axis=-1)[..., ::2] for x in (q, k, v)]
    else:
        args = [q, k, v]
    before = [a.copy() for a in args]
    out, lse = OP.forward(*args, layout="bhsd" if layout == "bhsd" else "bshd", return_lse=True,
                          alibi_slopes=slopes, **options)
    assert served, "the tiny path did not serve this call"
    for a, was in zip(args, before):
        np.testing.assert_array_equal(a, was)   # inputs never modified
    if layout == "bhsd":
        out = out.transpose(0, 2, 1, 3)
    ref, ref_lse = attention_ref(*(x.astype(np.float64) for x in (q, k, v)), alibi_slopes=slopes, **options)
    assert out.dtype == dtype and lse.shape == (b, hq, sq)
    err = float(np.abs(out - ref).max())
    if dtype == np.float32:
        bound = 1e-5 if slopes is not None or options.get("softcap") or options.get("window_size") else \
            max(1e-5, 4 * _textbook_f32_error(q, k, v, ref, **options))
        assert err <= bound, (err, bound)
    else:
        assert err <= 1e-12, err
    seen = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isposinf(lse), ~seen)   # a row with no key: lse +inf, out 0
    np.testing.assert_allclose(lse[seen], ref_lse[seen], rtol=0, atol=1e-5 if dtype == np.float32 else 1e-12)
    assert not np.isnan(out).any()


def test_non_finite_inputs_poison_exactly_the_rows_that_see_them(served):
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 5, 2, 9)).astype(np.float32)
    k = rng.standard_normal((1, 5, 2, 9)).astype(np.float32)
    v = rng.standard_normal((1, 5, 2, 9)).astype(np.float32)
    q[0, 1, 0, 3] = np.nan       # row 1 of head 0
    k[0, 3, 1, 0] = np.inf       # key 3 of head 1: causal rows 3 and 4 see it
    v[0, 2, 0, 5] = -np.inf      # value 2 of head 0: rows 2, 3, 4 see it
    out, lse = OP.forward(q, k, v, causal=True, return_lse=True)
    assert served
    bad = np.isnan(out).any(-1)  # (B, Sq, H)
    expected = np.zeros_like(bad)
    expected[0, 1, 0] = True
    expected[0, 3:, 1] = True
    expected[0, 2:, 0] = True
    np.testing.assert_array_equal(bad, expected)
    assert np.isnan(lse[0, 0, 1]) and np.isnan(lse[0, 1, 3:]).all() and np.isfinite(lse[0, 1, :3]).all()
    assert not np.isinf(out).any()


def test_big_calls_and_features_the_tiny_kernel_lacks_go_to_the_tiled_kernels(served):
    rng = np.random.default_rng()
    q = rng.standard_normal((1, 64, 8, 64)).astype(np.float32)
    OP.forward(q, q, q)                                    # 4.2M multiply-adds: past TINY_WORK
    small = q[:, :3]
    OP.forward(small, small, small, attn_bias=np.zeros((3, 3), np.float32))
    OP.forward(small, small, small, dropout_p=0.1, dropout_seed=3)
    assert not served


def test_small_tiled_calls_run_on_one_thread_and_give_numba_its_thread_count_back(monkeypatch):
    seen = []
    real = cpu_backend._run_backward

    def spy(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_backend, "_run_backward", spy)
    before = numba.get_num_threads()
    rng = np.random.default_rng()
    q, k, v, dout = (rng.standard_normal((1, 3, 2, 8)).astype(np.float32) for _ in range(4))
    drop = dict(dropout_p=0.25, dropout_seed=int(rng.integers(1 << 62)))   # a feature only the tiled kernels have
    out, lse = OP.forward(q, k, v, return_lse=True, **drop)
    OP.backward(dout, q, k, v, out, lse, **drop)
    assert seen == [1] and numba.get_num_threads() == before


def test_small_decode_steps_run_one_tiny_forward_per_sequence(served):
    rng = np.random.default_rng()
    q = rng.standard_normal((3, 2, 6, 33)).astype(np.float32)
    k_cache = rng.standard_normal((4, 40, 3, 33)).astype(np.float32)
    v_cache = rng.standard_normal((4, 40, 3, 33)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((3, 2, 3, 33)).astype(np.float32) for _ in range(2))
    held = np.array([0, 5, 17], np.int32)   # the first sequence sees only its two new keys
    rows = np.array([2, 0, 3], np.int32)
    expect_k, expect_v = k_cache.copy(), v_cache.copy()
    for b, (r, n) in enumerate(zip(rows, held)):
        expect_k[r, n:n + 2], expect_v[r, n:n + 2] = k_new[b], v_new[b]
    out = OP.with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=held, cache_batch_idx=rows, causal=True,
                          window_size=(3, -1))
    assert len(served) == 3
    np.testing.assert_array_equal(k_cache, expect_k)   # the append, the only modification
    for b, (r, n) in enumerate(zip(rows, held)):
        ref, _ = attention_ref(q[b:b + 1].astype(np.float64), expect_k[r:r + 1, :n + 2].astype(np.float64),
                               expect_v[r:r + 1, :n + 2].astype(np.float64), causal=True, window_size=(3, -1))
        assert np.abs(out[b:b + 1] - ref).max() <= 1e-5


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "strided"])   # the kernel's "C" entry, then its "A" one
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c[:7])))
def test_backward_matches_the_float64_reference(case, dtype, layout, monkeypatch):
    b, sq, sk, hq, hkv, d, dv, options = case
    calls = []
    real = tiny.tiny_backward
    monkeypatch.setattr(tiny, "tiny_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    rng = np.random.default_rng()
    q, k = rng.standard_normal((b, sq, hq, d)).astype(dtype), rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v, dout = rng.standard_normal((b, sk, hkv, dv)).astype(dtype), rng.standard_normal((b, sq, hq, dv)).astype(dtype)
    options = dict(options)
    slopes = rng.uniform(0.1, 1.0, hq).astype(np.float32) if options.pop("alibi", False) else None
    if layout == "bhsd":
        given = [np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (dout, q, k, v)]
    elif layout == "strided":   # every other element of the head dim: no array is contiguous
        given = [np.repeat(x, 2, axis=-1)[..., ::2] for x in (dout, q, k, v)]
    else:
        given = [dout, q, k, v]
    kw = dict(layout="bhsd" if layout == "bhsd" else "bshd", alibi_slopes=slopes, **options)
    out, lse = OP.forward(*given[1:], return_lse=True, **kw)
    before = [x.copy() for x in (*given, out, lse)]
    grads = OP.backward(given[0], *given[1:], out, lse, **kw)
    assert calls, "the tiny path did not serve this call"
    for x, was in zip((*given, out, lse), before):
        np.testing.assert_array_equal(x, was)
    if layout == "bhsd":
        grads = [g.transpose(0, 2, 1, 3) for g in grads]
    want = attention_ref_backward(*(x.astype(np.float64) for x in (dout, q, k, v)), alibi_slopes=slopes, **options)
    for got, want in zip(grads, want):
        assert got.shape == want.shape and got.dtype == dtype
        rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)
        assert rel <= (1e-5 if dtype == np.float32 else 1e-12), rel


def test_backward_with_another_softmax_s_lse_takes_it():
    """Ring attention's blocks: the lse of a softmax over more keys than this call holds gives that softmax's share
    of the gradients, exp(score - lse), as the tiled backward does."""
    rng = np.random.default_rng()
    q, k, v, dout = (rng.standard_normal((1, 4, 2, 8)).astype(np.float64) for _ in range(4))
    out, lse = OP.forward(q, k, v, return_lse=True)
    wider = lse + 0.7   # as if other keys held e^0.7 - 1 of the mass
    got = OP.backward(dout, q, k, v, out, wider)
    numba_flash_cpu = pytest.importorskip("numba_flash.cpu")
    want = [np.empty_like(x) for x in (q, k, v)]
    numba_flash_cpu.flash_backward(dout, q, k, v, out, wider, *want, 8 ** -0.5, -1, -1, 0.0)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
