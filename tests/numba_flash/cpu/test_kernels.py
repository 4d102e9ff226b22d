"""The CPU kernels called directly (``numba_flash.cpu.flash_forward`` / ``flash_backward``), against the float64
reference on fresh random N(0, 1) inputs. Every case runs forward and backward through one compiled kernel per
dtype, so the suite pays the compile once."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from numba_flash.cpu import flash_backward, flash_forward
from numba_flash.reference import attention_ref, attention_ref_backward


def _rel_l2(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - ref) / max(np.linalg.norm(ref), 1e-300))


def _inputs(rng, batch, sq, sk, hq, hkv, d, dtype=np.float32):
    q = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((batch, sk, hkv, d)).astype(dtype)
    dout = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    return q, k, v, dout


def _forward(q, k, v, scale, left, right, softcap):
    out = np.empty(q.shape, q.dtype)
    lse = np.empty((q.shape[0], q.shape[2], q.shape[1]), q.dtype)
    flash_forward(q, k, v, out, lse, scale, left, right, softcap)
    return out, lse


def _backward(dout, q, k, v, out, lse, scale, left, right, softcap):
    dq, dk, dv = np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)
    # Poison the outputs: the kernels must overwrite every element.
    for g in (dq, dk, dv):
        g.fill(np.nan)
    flash_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, left, right, softcap)
    return dq, dk, dv


def _check(q, k, v, dout, *, left=-1, right=-1, softcap=0.0, scale=None, fwd_tol=1e-5, bwd_tol=1e-5):
    """Forward and backward against the reference; returns the reference lse for extra checks."""
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = _forward(q, k, v, scale, left, right, softcap)
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=scale, window_size=(left, right), softcap=softcap)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.abs(out - ref_out).max() <= fwd_tol
    seen = np.isfinite(ref_lse)
    assert np.array_equal(np.isposinf(lse), ~seen)
    assert np.abs(lse[seen] - ref_lse[seen]).max(initial=0.0) <= fwd_tol * 10
    grads = _backward(dout, q, k, v, out, lse, scale, left, right, softcap)
    ref_grads = attention_ref_backward(dout, q, k, v, softmax_scale=scale, window_size=(left, right),
                                       softcap=softcap)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not np.isnan(g).any(), name
        if np.linalg.norm(r) == 0:  # e.g. dq when every row sees one key: dS is 0 up to rounding
            assert np.abs(g).max(initial=0.0) <= bwd_tol, name
        else:
            assert _rel_l2(g, r) <= bwd_tol, (name, _rel_l2(g, r))
    return ref_lse, grads


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, left, right, softcap)
    (1, 1, 1, 1, 1, 3, -1, -1, 0.0),
    (2, 7, 7, 2, 2, 8, -1, -1, 0.0),
    (1, 7, 7, 3, 3, 40, -1, 0, 0.0),
    (1, 127, 127, 2, 1, 64, -1, 0, 0.0),
    (1, 127, 7, 8, 1, 80, -1, -1, 0.0),        # GQA 8:1, Sq > Sk
    (1, 7, 127, 4, 1, 128, -1, 0, 0.0),        # MQA, Sq < Sk, causal bottom-right aligned
    (1, 70, 130, 2, 2, 256, 5, 3, 0.0),        # window, the largest head dim
    (2, 100, 100, 2, 1, 40, 17, 0, 2.5),       # sliding window + softcap
    (1, 129, 65, 2, 2, 64, -1, 0, 0.0),        # Sq > Sk causal: the first 64 rows see no key
    (1, 50, 90, 2, 2, 8, 0, 0, 0.0),           # each row sees exactly one key
    (1, 1000, 1000, 1, 1, 64, -1, 0, 0.0),     # long sequence, many skipped tiles
    (1, 300, 1000, 2, 1, 40, 100, -1, 1.0),
]


@pytest.mark.parametrize("batch,sq,sk,hq,hkv,d,left,right,softcap", CASES)
def test_against_reference_float32(rng, batch, sq, sk, hq, hkv, d, left, right, softcap):
    q, k, v, dout = _inputs(rng, batch, sq, sk, hq, hkv, d)
    _check(q, k, v, dout, left=left, right=right, softcap=softcap)


def test_float64(rng):
    q, k, v, dout = _inputs(rng, 2, 129, 67, 4, 2, 24, np.float64)
    _check(q, k, v, dout, right=0, softcap=3.0, fwd_tol=1e-12, bwd_tol=1e-12)


def test_rows_without_keys_give_zero_out_inf_lse_zero_grads(rng):
    # Sq = 130 > Sk = 40 with causal: rows 0..89 see no key; the right=0, left=0 window adds no holes beyond that.
    q, k, v, dout = _inputs(rng, 1, 130, 40, 2, 1, 16)
    scale = 0.3
    out, lse = _forward(q, k, v, scale, -1, 0, 0.0)
    assert not out[:, :90].any()
    assert np.isposinf(lse[:, :, :90]).all() and np.isfinite(lse[:, :, 90:]).all()
    dq, dk, dv = _backward(dout, q, k, v, out, lse, scale, -1, 0, 0.0)
    assert not dq[:, :90].any()
    assert not any(np.isnan(g).any() for g in (dq, dk, dv))
    _check(q, k, v, dout, right=0, scale=scale)


def test_window_that_hides_everything(rng):
    # With Sk much larger than Sq and left = 0, right = 0, every row sees the single key i + Sk - Sq; keys before
    # that block get no gradient at all.
    q, k, v, dout = _inputs(rng, 1, 5, 200, 1, 1, 8)
    _, (dq, dk, dv) = _check(q, k, v, dout, left=0, right=0)
    assert not dk[:, :195].any() and not dv[:, :195].any()


def test_bhsd_views_and_noncontiguous_inputs(rng):
    # "bhsd" buffers seen through a transpose (what backends.cpu passes), and stepped slices.
    batch, h, sq, sk, d = 2, 3, 64, 128, 32
    qb = rng.standard_normal((batch, h, sq, d)).astype(np.float32)
    kb = rng.standard_normal((batch, h, sk, d)).astype(np.float32)
    vb = rng.standard_normal((batch, h, sk, d)).astype(np.float32)
    dob = rng.standard_normal((batch, h, sq, d)).astype(np.float32)
    q, k, v, dout = (x.transpose(0, 2, 1, 3) for x in (qb, kb, vb, dob))
    _check(q, k, v, dout, right=0)
    big = rng.standard_normal((2, 2 * 51, 6, 2 * 24)).astype(np.float32)
    q = big[:, ::2, ::2, 1::2]                              # (2, 51, 3, 24), every stride odd
    k = rng.standard_normal((2, 40, 24, 3)).astype(np.float32).transpose(0, 1, 3, 2)
    v = rng.standard_normal((2, 3, 40, 24)).astype(np.float32).transpose(0, 2, 1, 3)
    dout = rng.standard_normal((2, 24, 51, 3)).astype(np.float32).transpose(0, 2, 3, 1)
    assert not any(x.flags.c_contiguous for x in (q, k, v, dout))
    _check(q, k, v, dout, left=20, right=4)


def test_outputs_written_through_strided_views(rng):
    q, k, v, dout = _inputs(rng, 1, 33, 45, 2, 2, 16)
    scale = 0.25
    out_buf = np.full((1, 2, 33, 16), np.nan, np.float32)      # bhsd buffer, written through a transposed view
    lse = np.empty((1, 2, 33), np.float32)
    flash_forward(q, k, v, out_buf.transpose(0, 2, 1, 3), lse, scale, -1, -1, 0.0)
    ref_out, _ = attention_ref(q, k, v, softmax_scale=scale)
    assert np.abs(out_buf.transpose(0, 2, 1, 3) - ref_out).max() <= 1e-5
    grads_buf = [np.full((1, 33, 2, 32), np.nan, np.float32), np.full((1, 45, 2, 32), np.nan, np.float32),
                 np.full((1, 45, 2, 32), np.nan, np.float32)]
    dq, dk, dv = (g[..., ::2] for g in grads_buf)
    flash_backward(dout, q, k, v, out_buf.transpose(0, 2, 1, 3), lse, dq, dk, dv, scale, -1, -1, 0.0)
    for g, r in zip((dq, dk, dv), attention_ref_backward(dout, q, k, v, softmax_scale=scale)):
        assert _rel_l2(g, r) <= 1e-5
    for g in grads_buf:  # the skipped columns are untouched
        assert np.isnan(g[..., 1::2]).all()


def test_inputs_never_modified(rng):
    # Aligned "bhsd" views: the kernels read these buffers in place instead of packing copies.
    q = rng.standard_normal((1, 4, 128, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    dout = rng.standard_normal((1, 4, 128, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    k = rng.standard_normal((1, 2, 64, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    v = rng.standard_normal((1, 2, 64, 64)).astype(np.float32).transpose(0, 2, 1, 3)
    before = [x.copy() for x in (q, k, v, dout)]
    out, lse = _forward(q, k, v, 0.125, -1, 0, 1.5)
    out_copy, lse_copy = out.copy(), lse.copy()
    _backward(dout, q, k, v, out, lse, 0.125, -1, 0, 1.5)
    for a, b in zip((q, k, v, dout, out, lse), before + [out_copy, lse_copy]):
        assert np.array_equal(a, b)


def test_rejects_mixed_dtypes(rng):
    q, k, v, _ = _inputs(rng, 1, 4, 4, 1, 1, 8)
    out = np.empty_like(q)
    lse = np.empty((1, 1, 4), np.float32)
    with pytest.raises(TypeError):
        flash_forward(q, k.astype(np.float64), v, out, lse, 0.5, -1, -1, 0.0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sq=st.integers(1, 90), sk=st.integers(1, 90), hkv=st.integers(1, 2), group=st.sampled_from([1, 2, 3]),
    d=st.integers(1, 72), left=st.integers(-1, 40), right=st.integers(-1, 40),
    softcap=st.sampled_from([0.0, 0.0, 1.0, 7.5]), seed=st.integers(0, 2**32 - 1),
)
def test_property_matches_reference(rng, sq, sk, hkv, group, d, left, right, softcap, seed):
    # Hypothesis picks shapes and options; the numbers themselves are fresh N(0, 1) draws.
    local = np.random.default_rng([seed, int(rng.integers(2**32))])
    q, k, v, dout = _inputs(local, 1, sq, sk, hkv * group, hkv, d)
    _check(q, k, v, dout, left=left, right=right, softcap=softcap)


def test_scratch_reused_across_shapes_and_threads(rng):
    # The kernels keep their scratch buffers between calls: a smaller call after a bigger one, a bigger one after
    # that, GQA then MHA, and calls from another thread must all still match the reference.
    import threading

    from numba_flash.cpu import clear_workspace, workspace

    cases = [(1, 150, 150, 4, 2, 40), (1, 20, 33, 2, 2, 64), (2, 200, 90, 2, 1, 24), (1, 70, 70, 3, 3, 40)]
    for case in cases:
        _check(*_inputs(rng, *case), right=0)
    assert workspace._workspace.buffers, "the scratch buffers were not kept"
    seeds = rng.integers(2**32, size=2)
    errors = []

    def other_thread(seed):
        try:
            _check(*_inputs(np.random.default_rng(seed), *cases[2]), left=7, right=3)
        except AssertionError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=other_thread, args=(int(s),)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    clear_workspace()
    assert not getattr(workspace._workspace, "buffers", None)
    _check(*_inputs(rng, *cases[0]), right=0)


def test_scratch_above_the_cap_is_not_kept(rng, monkeypatch):
    from numba_flash.cpu import workspace

    workspace.clear_workspace()
    monkeypatch.setattr(workspace, "WORKSPACE_MAX_BYTES", 1024)
    _check(*_inputs(rng, 1, 90, 90, 2, 2, 40), right=0)
    assert all(b.nbytes <= 1024 for b in workspace._workspace.__dict__.get("buffers", {}).values())
