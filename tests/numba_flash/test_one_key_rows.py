"""Rows that see exactly one key, on every backend that runs without a GPU (issue 47, finding 6).

With one visible key P = 1, so the output row is that key's v and dS = P (dP - dO . O) is exactly 0 (dP = dO . v and
dO . O with O = v are the same dot product): dq of the row, and dk of a key only such rows see, are exactly 0, as
torch's autograd gives them (its softmax backward forms dO . O as sum_j P dP). A backward whose delta is summed in
another order than dP leaves dq and dk of about 1e-6 there: the contract asks for exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry

BACKENDS = ["cpu", "rocm"]
HEAD_DIMS = [16, 59, 128, 160, 256]


def _inputs(rng, sq, sk, d, hq=4, hkv=2, batch=2):
    """Random N(0, 9) q, k, v, dout in float32: large enough that dP and delta carry many bits."""
    q, dout = (rng.standard_normal((batch, sq, hq, d)).astype(np.float32) * 3 for _ in range(2))
    k, v = (rng.standard_normal((batch, sk, hkv, d)).astype(np.float32) * 3 for _ in range(2))
    return q, k, v, dout


def _grads(backend, q, k, v, dout, **kw):
    if backend == "rocm":
        pytest.importorskip("torch")
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    return out, op.backward(dout, q, k, v, out, lse, **kw)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_one_key_many_queries(backend, d, softcap, rng):
    """Sk = 1 without a window: every row sees the one key, so dq and dk are 0 everywhere."""
    q, k, v, dout = _inputs(rng, 339, 1, d)
    out, (dq, dk, dv) = _grads(backend, q, k, v, dout, softcap=softcap)
    np.testing.assert_array_equal(out, np.repeat(v, 2, axis=2).repeat(339, axis=1))
    assert not dq.any(), f"max |dq| = {np.abs(dq).max():.3g}"
    assert not dk.any(), f"max |dk| = {np.abs(dk).max():.3g}"


@pytest.mark.parametrize("sq, sk", [(339, 1), (77, 77), (40, 97)])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_window_zero_rows(backend, sq, sk, d, rng):
    """window (0, 0): row i sees key i + Sk - Sq alone (or nothing), so dq and dk are 0 everywhere."""
    q, k, v, dout = _inputs(rng, sq, sk, d)
    _, (dq, dk, _) = _grads(backend, q, k, v, dout, window_size=(0, 0))
    assert not dq.any(), f"max |dq| = {np.abs(dq).max():.3g}"
    assert not dk.any(), f"max |dk| = {np.abs(dk).max():.3g}"


@pytest.mark.parametrize("d", [59, 160])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_first_visible_row(backend, d, rng):
    """Causal with Sq > Sk: row Sq - Sk is the first that sees a key, key 0 alone; its dq is exactly 0 while the
    rows below it see more keys."""
    sq, sk = 130, 50
    q, k, v, dout = _inputs(rng, sq, sk, d)
    _, (dq, _, _) = _grads(backend, q, k, v, dout, causal=True)
    row = sq - sk
    assert not dq[:, :row + 1].any(), f"max |dq| of the one-key row = {np.abs(dq[:, row]).max():.3g}"
    assert dq[:, row + 1].any()
