"""Extreme but valid options on the reference, the CPU backend and the ROCm (torch) path, forced: softcaps that
float32 cannot hold (``numba_flash.semantics.effective_softcap`` says what they mean), window bounds beyond int64,
and numbers that cannot be represented at all (AttentionInputError). The CUDA kernels run the same option cases in
``tests/numba_flash/cuda/test_nonfinite_sim.py``."""

from __future__ import annotations

import sys
from fractions import Fraction

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, validate_forward
from numba_flash.cpu import flash_backward, flash_forward

BACKENDS = ["reference", "cpu", "rocm"]

# Tiny: below float32's normal range (1e-40), below its subnormals (1e-50, float32 0), below 2**-27 (the kernels'
# floor) and just above it; large: float32-representable near-identity (1e38), past float32 max / log2(e) (3e38),
# past float32 itself (1e300).
SOFTCAPS = [1e-40, 1e-50, 2.0 ** -30, 1e-8, 1e38, 3e38, 1e300]
WINDOWS = [(-1, sys.maxsize), (sys.maxsize, -1), (2 ** 63, 0), (2 ** 63, 2 ** 63), (2 ** 100, 3), (3, 2 ** 100)]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    if request.param == "rocm":
        pytest.importorskip("torch")
    return request.param


def _inputs(rng, dtype=np.float32, shape=(2, 13, 17, 4, 2, 12)):
    b, sq, sk, hq, hkv, d = shape
    return (rng.standard_normal((b, sq, hq, d)).astype(dtype), rng.standard_normal((b, sk, hkv, d)).astype(dtype),
            rng.standard_normal((b, sk, hkv, d)).astype(dtype), rng.standard_normal((b, sq, hq, d)).astype(dtype))


def _run(backend, q, k, v, dout, **kw):
    if backend == "reference":
        return (*attention_ref(q, k, v, **kw), *attention_ref_backward(dout, q, k, v, **kw))
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    return (out, lse, *op.backward(dout, q, k, v, out, lse, **kw))


def _check(got, q, k, v, dout, **kw):
    """Against the float64 reference, which applies the options exactly as given."""
    ref_out, ref_lse = attention_ref(q, k, v, **kw)
    ref_grads = attention_ref_backward(dout, q, k, v, **kw)
    out, lse, *grads = (np.asarray(x, np.float64) for x in got)
    assert np.all(np.isfinite(out)) and not np.isnan(lse).any()
    assert np.abs(out - ref_out).max() <= 1e-5
    assert np.array_equal(np.isposinf(lse), np.isposinf(ref_lse))
    fin = np.isfinite(ref_lse)
    assert np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0) <= 1e-4
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert np.all(np.isfinite(g)), name
        # With a tiny softcap the cap saturates and dq, dk are 0 (to rounding): hence the absolute floor.
        assert np.linalg.norm(g - r) <= 1e-5 * np.linalg.norm(r) + 1e-6, name


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_softcap_extremes_match_the_reference(rng, backend, softcap):
    q, k, v, dout = _inputs(rng)
    kw = dict(causal=True, softcap=softcap)
    _check(_run(backend, q, k, v, dout, **kw), q, k, v, dout, **kw)


@pytest.mark.parametrize("softcap", [1e-40, 1e-320, 1e300, 1.7e308])
def test_softcap_extremes_float64(rng, backend, softcap):
    if backend == "rocm":
        pytest.skip("float64 through rocm is exercised by its own tests; this is about the float64 kernels")
    q, k, v, dout = _inputs(rng, np.float64)
    kw = dict(softcap=softcap, window_size=(4, 2))
    _check(_run(backend, q, k, v, dout, **kw), q, k, v, dout, **kw)


def test_tiny_softcap_means_uniform_attention(rng, backend):
    """Every capped score lies within +-softcap: the output is the plain mean of the visible values."""
    q, k, v, dout = _inputs(rng)
    out = np.asarray(_run(backend, q, k, v, dout, softcap=1e-40)[0], np.float64)
    group = q.shape[2] // k.shape[2]
    mean_v = np.repeat(v.astype(np.float64).mean(axis=1, keepdims=True), group, axis=2)
    assert np.abs(out - mean_v).max() <= 1e-5


def test_softcap_canonical_values():
    x32, x64 = np.zeros((1, 3, 1, 4), np.float32), np.zeros((1, 3, 1, 4), np.float64)
    assert validate_forward(x32, x32, x32, softcap=2.5).softcap == 2.5
    assert validate_forward(x32, x32, x32, softcap=1e300).softcap == 0.0       # off: the limit softcap -> inf
    assert validate_forward(x32, x32, x32, softcap=3e38).softcap == 0.0        # softcap * log2(e) > float32 max
    assert validate_forward(x32, x32, x32, softcap=1e38).softcap == 1e38
    assert validate_forward(x32, x32, x32, softcap=1e-40).softcap == 2.0 ** -27
    assert validate_forward(x64, x64, x64, softcap=1e300).softcap == 1e300    # float64 holds it
    assert validate_forward(x64, x64, x64, softcap=1e-40).softcap == 2.0 ** -56


@pytest.mark.parametrize("window", WINDOWS)
def test_huge_window_bounds(rng, backend, window):
    q, k, v, dout = _inputs(rng)
    _check(_run(backend, q, k, v, dout, window_size=window), q, k, v, dout, window_size=window)
    # Equal to the same mask with the bound spelled as unbounded (-1) or as small as it can be.
    left, right = (-1 if w >= 2 ** 31 else w for w in window)
    want = attention_ref(q, k, v, window_size=(left, right))[0]
    np.testing.assert_allclose(np.asarray(_run(backend, q, k, v, dout, window_size=window)[0], np.float64), want,
                               rtol=0, atol=1e-5)


def test_huge_window_bounds_in_the_call():
    x = np.zeros((1, 5, 1, 4), np.float32)
    kv = np.zeros((1, 7, 1, 4), np.float32)
    call = validate_forward(x, kv, kv, window_size=(2 ** 63, sys.maxsize))
    assert (call.window_left, call.window_right) == (12, 12)  # capped at Sq + Sk: the same mask, inside int64
    call = validate_forward(x, kv, kv, window_size=(2 ** 63, 2), causal=True)
    assert (call.window_left, call.window_right) == (12, 0)


def test_cpu_kernels_called_directly_take_extreme_options(rng):
    q, k, v, dout = _inputs(rng)
    out, lse = np.empty(q.shape, np.float32), np.empty((q.shape[0], q.shape[2], q.shape[1]), np.float32)
    flash_forward(q, k, v, out, lse, 0.3, 2 ** 63, 2 ** 64, 1e-40)
    ref_out, _ = attention_ref(q, k, v, softmax_scale=0.3, softcap=1e-40)
    assert np.abs(out - ref_out).max() <= 1e-5
    grads = [np.empty(x.shape, np.float32) for x in (q, k, v)]
    flash_backward(dout, q, k, v, out, lse, *grads, 0.3, 2 ** 63, 2 ** 64, 1e-40)
    for g, r in zip(grads, attention_ref_backward(dout, q, k, v, softmax_scale=0.3, softcap=1e-40)):
        assert np.linalg.norm(g - r) <= 1e-5 * np.linalg.norm(r) + 1e-6


@pytest.mark.parametrize("kw,pattern", [
    (dict(softcap=10 ** 400), r"^softcap: expected a finite number >= 0 \(0 disables it\), got 1000"),
    (dict(softmax_scale=10 ** 400), r"^softmax_scale: expected None or a finite number > 0, got 1000"),
    (dict(softmax_scale=-(10 ** 400)), r"^softmax_scale: expected None or a finite number > 0, got -1000"),
    (dict(softmax_scale=Fraction(1, 10 ** 400)), r"^softmax_scale: expected None or a finite number > 0 \(that is "
                                                 r"> 0 as a float64\), got Fraction\(1, 1000"),
    (dict(window_size=(-(2 ** 70), 0)), r"^window_size: expected each bound >= 0, or -1 for unbounded, got "
                                        r"\(-1180591620717411303424, 0\)"),
])
def test_unrepresentable_numbers_are_refused(rng, kw, pattern):
    q, k, v, _ = _inputs(rng)
    for be in ("cpu", None):
        with pytest.raises(AttentionInputError, match=pattern):
            backend_registry.get("flash", backend=be).forward(q, k, v, **kw)
