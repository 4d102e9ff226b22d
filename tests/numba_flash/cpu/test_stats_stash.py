"""The backward reuses the forward's row statistics (max and 1 / sum) instead of a second pass over the scores,
when the lse it is given is bit for bit the one that forward wrote; any other lse gets the statistics recomputed,
and the gradients are the same either way."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import attention_ref_backward, backend_registry
from numba_flash.cpu import flash_backward, flash_forward, stash


def _inputs(rng, sq=131, sk=150):
    q = rng.standard_normal((2, sq, 4, 40)).astype(np.float32)
    k = rng.standard_normal((2, sk, 2, 40)).astype(np.float32)
    v = rng.standard_normal((2, sk, 2, 40)).astype(np.float32)
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32)


@pytest.mark.parametrize("causal", [False, True])
def test_backward_after_forward_skips_the_stats_pass_and_gives_the_same_gradients(rng, causal):
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, causal=causal, softcap=4.0)
    before = stash.stats_passes
    reused = op.backward(dout, q, k, v, out, lse, causal=causal, softcap=4.0)
    assert stash.stats_passes == before
    recomputed = op.backward(dout, q, k, v, out, lse.copy(), causal=causal, softcap=4.0)  # not the forward's lse
    assert stash.stats_passes == before + 1
    for a, b in zip(reused, recomputed):
        np.testing.assert_array_equal(a, b)
    for got, want in zip(reused, attention_ref_backward(dout, q, k, v, causal=causal, softcap=4.0)):
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want)


def test_an_lse_changed_in_place_is_not_taken_for_the_forwards(rng):
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True)
    lse[0, 1, 7] += 0.25      # now the lse of another softmax for that row
    before = stash.stats_passes
    got = op.backward(dout, q, k, v, out, lse)
    assert stash.stats_passes == before + 1
    fresh = op.backward(dout, q, k, v, out, lse.copy())
    for a, b in zip(got, fresh):
        np.testing.assert_array_equal(a, b)


def test_a_new_forward_into_reused_memory_replaces_the_old_statistics(rng):
    q, k, v, dout = _inputs(rng)
    q2 = rng.standard_normal(q.shape).astype(np.float32)
    lse = np.empty((2, 4, 131), np.float32)
    out = np.empty_like(q)
    flash_forward(q, k, v, out, lse, 0.2, -1, -1, 0.0)
    flash_forward(q2, k, v, out, lse, 0.2, -1, -1, 0.0)   # same lse buffer, another call
    dq, dk, dv = (np.empty_like(x) for x in (q, k, v))
    before = stash.stats_passes
    flash_backward(dout, q2, k, v, out, lse, dq, dk, dv, 0.2, -1, -1, 0.0)
    assert stash.stats_passes == before
    want = attention_ref_backward(dout, q2, k, v, softmax_scale=0.2)
    for got, ref in zip((dq, dk, dv), want):
        assert np.linalg.norm(got - ref) <= 1e-5 * np.linalg.norm(ref)
