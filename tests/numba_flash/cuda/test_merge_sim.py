"""The device merge of split-KV parts (``numba_flash.cuda.kernels.merge``) under the CUDA simulator, against
``numba_flash.merge_attention_states`` and against attention over all the keys at once; rows that saw no key in a
part, in both parts, and poisoned rows included.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_merge_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import attention_ref, merge_attention_states

pytestmark = pytest.mark.cudasim


def _merge_on_device(out_a, lse_a, out_b, lse_b):
    from numba import cuda

    from numba_flash.cuda.kernels.merge import merge_states_device

    parts = [cuda.to_device(np.ascontiguousarray(x, dtype=np.float32)) for x in (out_a, lse_a, out_b, lse_b)]
    out, lse = merge_states_device(*parts)
    return out.copy_to_host(), lse.copy_to_host()


def test_matches_attention_over_all_keys():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, s, 3, 5)) for s in (4, 11, 11))
    a = attention_ref(q, k[:, :6], v[:, :6], softcap=2.0)
    b = attention_ref(q, k[:, 6:], v[:, 6:], softcap=2.0)
    out, lse = _merge_on_device(*a, *b)
    want_out, want_lse = attention_ref(q, k, v, softcap=2.0)
    np.testing.assert_allclose(out, want_out, atol=2e-6, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-6, rtol=0)


def test_rows_without_keys_and_poisoned_rows_follow_merge_attention_states():
    rng = np.random.default_rng(1)
    out_a, out_b = (rng.standard_normal((1, 6, 2, 7)).astype(np.float32) for _ in range(2))
    lse_a, lse_b = (rng.standard_normal((1, 2, 6)).astype(np.float32) for _ in range(2))
    lse_a[0, 0, 1] = np.inf                       # part a saw no key: its out row (NaN here) must not matter
    out_a[0, 1, 0] = np.nan
    lse_a[0, 1, 2] = lse_b[0, 1, 2] = np.inf      # neither part saw a key: 0 and +inf
    lse_b[0, 0, 4] = np.nan                       # poisoned
    lse_a[0, 1, 5], lse_b[0, 1, 5] = 80.0, -80.0  # far apart: no overflow, b weighs ~nothing
    out, lse = _merge_on_device(out_a, lse_a, out_b, lse_b)
    want_out, want_lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert np.array_equal(np.isnan(out), np.isnan(want_out)) and np.array_equal(np.isnan(lse), np.isnan(want_lse))
    ok = ~np.isnan(want_out)
    np.testing.assert_allclose(out[ok], want_out[ok], atol=1e-6, rtol=0)
    np.testing.assert_allclose(lse[~np.isnan(lse)], want_lse[~np.isnan(want_lse)], atol=1e-5, rtol=0)
    assert np.all(out[0, 2, 1] == 0) and lse[0, 1, 2] == np.inf
    np.testing.assert_array_equal(out[0, 1, 0], out_b[0, 1, 0])
