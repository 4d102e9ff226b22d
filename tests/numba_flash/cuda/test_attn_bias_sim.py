"""attn_bias in the CUDA kernels, under the Numba CUDA simulator with toy tiles (8 x 8, 16 threads): forward and
backward against the float64 reference for every way a bias broadcasts, -inf entries that hide keys (also from the
non-finite values behind them) and NaN ones that poison, and low precision (dbias: test_dbias_sim.py). The same
semantics run on the cpu and torch backends in tests/numba_flash/test_attn_bias.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_attn_bias_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import forward_backward as _run
from cuda_sim_cases import BACKWARD_TILES, random_inputs, rel_l2

from numba_flash import attention_ref, attention_ref_backward

# RuntimeWarnings: the simulator's numpy arithmetic on the inf and NaN the tests put in.
pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

B, SQ, SK, HQ, HKV, D = 2, 13, 19, 4, 2, 8


def _inputs(rng, dtype=np.float32):
    return random_inputs(rng, B, SQ, SK, HQ, HKV, D, dtype)


def _rel(got, want):
    return rel_l2(got, want, floor=1.0)   # a bias constant along each row has gradients of 0 to measure against


@pytest.mark.parametrize("shape,kw", [
    ((B, HQ, SQ, SK), dict(causal=True)),
    ((HQ, 1, SK), dict(window_size=(6, 2), softcap=2.5)),
    ((SQ, SK), dict(alibi_slopes=np.array([0.3, 0.1, 0.6, 0.9], np.float32))),
    ((B, 1, 1, SK), dict(softmax_scale=0.4)),
    ((B, HQ, SQ, 1), dict(causal=True)),
], ids=["full-causal", "per-head-key-window-softcap", "shared-with-alibi", "per-batch-key", "per-row"])
@pytest.mark.parametrize("tiles", list(BACKWARD_TILES))
def test_forward_and_backward_match_reference(shape, kw, tiles):
    rng = np.random.default_rng(len(shape) * 10 + len(kw))
    q, k, v, dout = _inputs(rng)
    bias = (2 * rng.standard_normal(shape)).astype(np.float32)
    got = _run(q, k, v, dout, BACKWARD_TILES[tiles], attn_bias=bias, **kw)
    want_out, want_lse = attention_ref(q, k, v, attn_bias=bias, **kw)
    np.testing.assert_allclose(got[0], want_out, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[1], want_lse, atol=1e-5, rtol=1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), got[2:], attention_ref_backward(dout, q, k, v, attn_bias=bias,
                                                                                   **kw)):
        assert _rel(g, ref) <= 1e-5, name
    if shape[-1] != 1:   # a bias constant along each row moves no probability
        assert np.abs(attention_ref(q, k, v, **kw)[0] - want_out).max() > 1e-2


@pytest.mark.parametrize("tiles", list(BACKWARD_TILES))
def test_minus_inf_hides_keys_and_their_values_and_nan_poisons_only_its_row(tiles):
    rng = np.random.default_rng(31)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    bias[0, 3] = -np.inf                 # head 0, row 3: every key hidden, so it sees nothing
    bias[1, :, 5] = -np.inf              # head 1: key 5 hidden from every row ...
    v[:, 5, 0] = np.nan                  # ... so kv head 0's NaN at key 5 reaches head 0 only
    bias[2:, :, 9] = -np.inf             # heads 2, 3 (kv head 1): key 9 hidden ...
    k[1, 9, 1] = np.inf                  # ... so its inf poisons nobody
    bias[2, 7, 11] = np.nan              # head 2, row 7: poisoned
    got = _run(q, k, v, dout, BACKWARD_TILES[tiles], attn_bias=bias, causal=True)
    want = attention_ref(q, k, v, attn_bias=bias, causal=True)
    want += attention_ref_backward(dout, q, k, v, attn_bias=bias, causal=True)
    assert np.all(got[0][:, 3, 0] == 0) and np.all(got[1][:, 0, 3] == np.inf)
    assert np.isfinite(got[0][:, :, 1]).all() and np.isfinite(got[0][:, :, 3]).all()
    assert np.isnan(got[0][:, 7, 2]).all()
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(g[fin], ref[fin], atol=5e-5, rtol=0, err_msg=name)


def test_float16_with_a_float16_bias():
    rng = np.random.default_rng(32)
    q, k, v, dout = _inputs(rng, np.float16)
    bias = rng.standard_normal((HQ, SQ, SK)).astype(np.float16)
    got = _run(q, k, v, dout, attn_bias=bias)
    assert all(x.dtype == np.float16 for x in got[:1] + got[2:])
    want = attention_ref(q, k, v, attn_bias=bias)[:1] + attention_ref_backward(dout, q, k, v, attn_bias=bias)
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got[:1] + got[2:], want):
        assert _rel(g, ref) <= 2e-3, name
