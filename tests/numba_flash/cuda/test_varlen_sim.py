"""Packed sequences (layout "thd") on the CUDA backend, under the Numba CUDA simulator with toy tiles (8 x 8, 16
threads) and tiny shapes: forward and backward against the float64 reference, the rows and keys of empty
sequences, float16, a NaN that stays in its sequence, torch tensors in and out, and paged keys (block_table). The
same cases run on the CPU and ROCm backends in tests/numba_flash/test_varlen.py and test_paged_varlen.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_varlen_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from varlen_cases import (NAMES, check_empty_sequences, check_float32, f64, packed_inputs, page_keys, reference,
                          rel_l2, unread_rows)

from backends import backend_registry
from numba_flash import attention_ref_varlen
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)
# A sequence with rows but no keys, one with keys but no rows, a 1 x 1 one, and one spanning three tiles each way
# with Sq < Sk; the first has Sq > Sk, so that causal rows see nothing.
LENS_Q, LENS_K = [6, 1, 0, 19, 2], [4, 1, 3, 21, 0]


def _inputs(rng, hq, hkv, d, dtype=np.float32):
    return packed_inputs(rng, LENS_Q, LENS_K, hq, hkv, d, dtype)


def _run(q, k, v, dout, cu_q, cu_k, **kw):
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    with tile_config_override(**TILES):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **packing, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **packing, **kw)
    return dict(zip(NAMES, (f64(x) for x in (out, lse, *grads))))


@pytest.mark.parametrize("heads,kw", [
    ((4, 2, 8), dict(causal=True, softcap=1.5)),
    ((3, 1, 5), dict(window_size=(2, 1), softmax_scale=0.6)),
    # ALiBi with a row of slopes per sequence: each sequence measures distances from its own bottom-right corner.
    ((2, 1, 6), dict(causal=True, alibi_slopes=np.array([[0.3, 0.8], [0.1, 0.5], [1.0, 0.2], [0.4, 0.05],
                                                         [0.6, 0.7]], np.float32))),
])
def test_float32_matches_reference(rng, heads, kw):
    inputs = _inputs(rng, *heads)
    copies = [x.copy() for x in inputs]
    got, ref = _run(*inputs, **kw), reference(*inputs, **kw)
    for x, c in zip(inputs, copies):
        np.testing.assert_array_equal(x, c)
    assert got["lse"].shape == (heads[0], inputs[0].shape[0])
    check_float32(got, ref)
    check_empty_sequences(got["out"], got["lse"], (got["dq"], got["dk"], got["dv"]), *inputs[4:])


def test_float16(rng):
    """float16 within the contract's relative L2 bound of 2e-3."""
    inputs = _inputs(rng, 2, 1, 8, np.float16)
    got, ref = _run(*inputs, causal=True), reference(*inputs, causal=True)
    for name in ("out", "dq", "dk", "dv"):
        assert rel_l2(got[name], ref[name]) <= 2e-3, name


def test_nan_stays_in_its_sequence(rng):
    clean_inputs = _inputs(rng, 2, 1, 8)
    q, k, v, dout, cu_q, cu_k = bad_inputs = [x.copy() for x in clean_inputs]
    k[cu_k[3] + 5, 0, 2] = np.nan                       # a key of sequence 3
    clean, bad = _run(*clean_inputs, causal=True), _run(*bad_inputs, causal=True)
    other_rows = np.r_[0:cu_q[3], cu_q[4]:cu_q[-1]]
    other_keys = np.r_[0:cu_k[3], cu_k[4]:cu_k[-1]]
    for name in ("out", "dq"):
        np.testing.assert_array_equal(bad[name][other_rows], clean[name][other_rows])
    np.testing.assert_array_equal(bad["lse"][:, other_rows], clean["lse"][:, other_rows])
    for name in ("dk", "dv"):
        np.testing.assert_array_equal(bad[name][other_keys], clean[name][other_keys])
    assert np.isnan(bad["out"][cu_q[3]:cu_q[4]]).any() and np.isnan(bad["lse"][:, cu_q[3]:cu_q[4]]).any()


def test_torch_tensors_in_and_out(rng):
    """Forced under the simulator the backend takes torch CPU tensors (and torch cu_seqlens) and returns torch."""
    torch = pytest.importorskip("torch")
    q, k, v, dout, cu_q, cu_k = _inputs(rng, 2, 2, 4)
    kw = dict(cu_seqlens_q=torch.from_numpy(cu_q), cu_seqlens_k=torch.from_numpy(cu_k), causal=True)
    with tile_config_override(**TILES):
        out, lse = backend_registry.get("flash", backend="cuda").forward(
            *(torch.from_numpy(x) for x in (q, k, v)), return_lse=True, **kw)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == (2, q.shape[0])
    ref_out, _ = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True)
    assert np.abs(out.numpy() - ref_out).max() <= 1e-5


def test_paged_keys(rng):
    """block_table: the keys on pages of 5 in shuffled blocks, NaN in every row nobody reads; the packed kernels
    run on the gathered keys, and dk, dv come back on the pages (0 where nobody reads)."""
    q, k, v, dout, cu_q, cu_k = _inputs(rng, 2, 1, 4)
    k_cache, v_cache, table = page_keys(rng, k, v, cu_k, 5)
    got = _run(q, k_cache, v_cache, dout, cu_q, cu_k, causal=True, block_table=table)
    ref = reference(q, k, v, dout, cu_q, cu_k, causal=True)
    unread = unread_rows(table, cu_k, *k_cache.shape[:2])
    for name in ("dk", "dv"):
        assert np.all(got[name][unread] == 0), name
        paged = got[name]
        got[name] = np.array([paged[table[b, j // 5], j % 5] for b in range(len(cu_k) - 1)
                              for j in range(cu_k[b + 1] - cu_k[b])])
    check_float32(got, ref)
