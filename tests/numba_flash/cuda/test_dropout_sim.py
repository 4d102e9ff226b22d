"""Dropout in the CUDA kernels, under the Numba CUDA simulator with toy tiles (8 x 8, 16 threads): forward and
backward against the float64 reference (whose mask is ``numba_flash.dropout_mask``, the one every backend draws),
with the other switches on, packed sequences keyed by their index, float16, and seeds. The same semantics run on
the cpu and torch backends in tests/numba_flash/test_dropout.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_dropout_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import BACKWARD_TILES
from cuda_sim_cases import forward_backward as _run
from cuda_sim_cases import random_inputs as _inputs
from cuda_sim_cases import rel_l2 as _rel

from numba_flash import attention_ref, attention_ref_backward

pytestmark = pytest.mark.cudasim

SEED = 2 ** 63 + 977     # the top bit set: the key's high word is not a small number
P = 0.3


@pytest.mark.parametrize("sizes,kw", [
    ((2, 13, 19, 4, 2, 8), {}),
    ((1, 18, 11, 2, 1, 12), dict(causal=True, window_size=(5, 1), softcap=2.0)),
    ((1, 11, 17, 2, 2, 8), dict(attn_bias=np.linspace(-1, 1, 17, dtype=np.float32),
                                alibi_slopes=np.array([0.2, 0.7], np.float32))),
], ids=["gqa", "causal-window-softcap", "bias-alibi"])
@pytest.mark.parametrize("tiles", list(BACKWARD_TILES))
def test_forward_and_backward_match_reference(sizes, kw, tiles):
    rng = np.random.default_rng(sum(sizes))
    q, k, v, dout = _inputs(rng, *sizes)
    kw = dict(kw, dropout_p=P, dropout_seed=SEED)
    got = _run(q, k, v, dout, BACKWARD_TILES[tiles], **kw)
    want = attention_ref(q, k, v, **kw) + attention_ref_backward(dout, q, k, v, **kw)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[1], want[1], atol=1e-5, rtol=1e-5)   # the lse of the softmax before dropout
    for name, g, ref in zip(("dq", "dk", "dv"), got[2:], want[2:]):
        assert _rel(g, ref) <= 1e-5, name
    no_dropout = attention_ref(q, k, v, **dict(kw, dropout_p=0.0))[0]
    assert np.abs(no_dropout - want[0]).max() > 1e-2          # the mask matters


def test_packed_sequences_are_keyed_by_their_index():
    rng = np.random.default_rng(5)
    lens_q, lens_k = [6, 0, 11, 9], [7, 5, 12, 3]
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(n)]).astype(np.int32) for n in (lens_q, lens_k))
    q = rng.standard_normal((cu_q[-1], 2, 8)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], 1, 8)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    kw = dict(causal=True, dropout_p=P, dropout_seed=SEED)
    got = _run(q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)
    for b in range(4):
        if not lens_q[b]:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        # sequence b alone with batch index b's mask: a dense batch of b + 1 whose first b entries are ignored
        pad = lambda x, sl: np.concatenate([np.zeros((b,) + x[sl].shape, np.float32), x[sl][None]])  # noqa: E731
        dense = (pad(q, rows), pad(k, keys), pad(v, keys))
        np.testing.assert_allclose(got[0][rows], attention_ref(*dense, **kw)[0][b], atol=1e-5, rtol=0)
        for g, sl, w in zip(got[2:], (rows, keys, keys), attention_ref_backward(pad(dout, rows), *dense, **kw)):
            assert np.linalg.norm(g[sl] - w[b]) <= 1e-5 * np.linalg.norm(w[b])


def test_float16_and_seeds():
    rng = np.random.default_rng(6)
    q, k, v, dout = _inputs(rng, 1, 12, 14, 2, 1, 8, np.float16)
    kw = dict(dropout_p=P, dropout_seed=SEED)
    got = _run(q, k, v, dout, **kw)
    want = attention_ref(q, k, v, **kw)[:1] + attention_ref_backward(dout, q, k, v, **kw)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:], want):
        assert g.dtype == np.float16 and _rel(g, ref) <= 2e-3, name
    np.testing.assert_array_equal(_run(q, k, v, dout, **kw)[0], got[0])       # the same seed, the same mask
    other = _run(q, k, v, dout, dropout_p=P, dropout_seed=SEED + 1)[0]
    assert np.abs(other.astype(np.float32) - got[0]).max() > 1e-2
