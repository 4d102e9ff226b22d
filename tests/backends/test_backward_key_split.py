"""The backward of one block of keys, given the out and lse of the softmax over all the keys (what ring attention
and split-KV training pass), is that block's exact share of the gradients: dq adds up over the blocks, dk and dv
are the full call's rows of that block."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import attention_ref_backward, backend_registry

BACKENDS = ["cpu", pytest.param("rocm", marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is None, reason="torch not installed"))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("split", [1, 70, 133])
def test_blocks_of_keys_add_up_to_the_full_backward(backend, split):
    rng = np.random.default_rng(split)
    q = rng.standard_normal((2, 37, 4, 24)).astype(np.float32)
    k = rng.standard_normal((2, 134, 2, 24)).astype(np.float32)
    v = rng.standard_normal((2, 134, 2, 24)).astype(np.float32)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True)
    first = op.backward(dout, q, k[:, :split], v[:, :split], out, lse)
    second = op.backward(dout, q, k[:, split:], v[:, split:], out, lse)
    want = attention_ref_backward(dout, q, k, v)
    got = (np.asarray(first[0]) + np.asarray(second[0]),
           np.concatenate([first[1], second[1]], axis=1), np.concatenate([first[2], second[2]], axis=1))
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert np.linalg.norm(g - w) <= 1e-5 * np.linalg.norm(w), name
