"""with_kvcache on the CUDA backend under the Numba CUDA simulator, with toy tiles and tiny caches: the append,
rotary, paged caches and key splits against the float64 reference. The same cases run on the cpu and torch
backends in tests/numba_flash/test_kvcache.py.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_kvcache_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from kvcache_cases import as_torch, copy_args, random_case

from backends import backend_registry
from numba_flash import attention_ref_kvcache
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)
SMALL = dict(batch=2, hq=2, hkv=1, d=8, capacity=13)


@pytest.mark.parametrize("case,options", [
    (dict(paged=False, batch_idx=True, leftpad=True, s_new=2, sq=2), dict(causal=True, num_splits=3)),
    (dict(paged=True, page=4, s_new=1, sq=1), dict(window_size=(4, 0), softcap=2.0)),
    (dict(paged=False, rotary=False, s_new=0, sq=3), dict(num_splits=2)),
    (dict(paged=True, page=4, leftpad=False, s_new=1, sq=2),
     dict(causal=True, num_splits=2, alibi_slopes=np.array([[0.4, 0.9], [0.2, 0.05]], np.float32))),
])
def test_float32_matches_reference(case, options):
    rng = np.random.default_rng(7)
    args = random_case(rng, **SMALL, **case)
    splits = options.pop("num_splits", 0)
    want_out, want_lse, want_k, want_v = attention_ref_kvcache(**args, **options)
    given = copy_args(args)
    with tile_config_override(**TILES):
        out, lse = backend_registry.get("flash", backend="cuda").with_kvcache(**given, **options,
                                                                              num_splits=splits, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(given["k_cache"], want_k, atol=2e-6, rtol=0)
    np.testing.assert_array_equal(given["v_cache"], want_v)


def test_torch_float16_cache():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(8)
    args = random_case(rng, **SMALL, paged=True, page=4, s_new=2, sq=2)
    want_out = attention_ref_kvcache(**args, causal=True)[0]
    given = {n: (t.half() if t.dtype.is_floating_point else t) for n, t in as_torch(args).items()}
    with tile_config_override(**TILES):
        out = backend_registry.get("flash", backend="cuda").with_kvcache(**given, causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16
    err = np.linalg.norm(out.float().numpy() - want_out) / np.linalg.norm(want_out)
    assert err < 2e-3
