"""Every CUDA kernel under the simulator with the tile config the picker gives a real GPU (64 or 128 threads, tiles
of 16 to 64 rows), not the toy 8 x 8 tiles of test_kernels_sim.py, under the race, bounds and barrier checker,
against the float64 reference.

Sequence lengths are odd and small (the simulator runs one Python thread per CUDA thread), so every kernel still
meets a ragged last tile in both dimensions. Run:
NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_production_tiles_sim.py
"""

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.cuda import tile_config_for
from numba_flash.cuda import simcheck
from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, smem_limit_for

pytestmark = pytest.mark.cudasim

CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param(1, 37, 45, 2, 1, 64, dict(causal=True), id="d64-causal-gqa"),
    pytest.param(1, 21, 27, 2, 1, 128, dict(window_size=(12, 3), softcap=2.5), id="d128-window-softcap-gqa"),
    pytest.param(1, 13, 11, 1, 1, 200, dict(causal=True), id="d256-causal"),   # GQA: the d64 and 48k cases
    # The simulator plans for sm_90 (227 KiB): D = 256 runs the dynamic-shared-memory tiles above; sm_7x, or a GPU
    # that refuses the opt-in, runs these 48 KiB ones.
    pytest.param(1, 13, 11, 2, 1, 200, dict(causal=True, smem_limit=STATIC_SMEM_LIMIT), id="d256-causal-gqa-48k"),
]


class _Recorder:
    """Stands in for a kernel dispatcher and notes the launch configuration it is given."""

    def __init__(self, kernel, name, cfg, launches):
        self._kernel, self._name, self._cfg, self._launches = kernel, name, cfg, launches

    def __getitem__(self, launch_config):
        self._launches.append((self._name, self._cfg, launch_config))
        return self._kernel[launch_config]


@pytest.fixture
def launches(monkeypatch):
    """The (kernel, tile config, launch configuration) of every kernel launch.py starts, under the checker."""
    from cuda_sim_cases import factory_home   # imports numba.cuda: only in the simulator's process

    seen = []
    for attr, name in (("make_forward_kernel", "forward"), ("make_dkdv_kernel", "backward_dkdv"),
                       ("make_dq_kernel", "backward_dq"), ("make_delta_kernel", "delta")):
        home = factory_home(attr)
        factory = getattr(home, attr)

        def recorded(*args, _factory=factory, _name=name):
            cfg = args[0] if _name != "delta" else None
            return _Recorder(_factory(*args), _name, cfg, seen)

        monkeypatch.setattr(home, attr, recorded)
    with simcheck.checking():
        yield seen


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _check_lse(lse, ref_lse):
    assert lse.dtype == np.float32
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    assert np.all(lse[~finite] == np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-5)


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_production_tiles_match_reference(rng, launches, monkeypatch, b, sq, sk, hq, hkv, d, kw):
    import numba_flash.cuda.host.devices as devices

    kw = dict(kw)
    limit = kw.pop("smem_limit", smem_limit_for((9, 0)))
    monkeypatch.setattr(devices, "smem_limit", lambda: limit)
    q = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    v = rng.standard_normal((b, sk, hkv, d)).astype(np.float32)
    dout = rng.standard_normal((b, sq, hq, d)).astype(np.float32)
    op = backend_registry.get("flash", backend="cuda")

    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, **kw)

    # Each kernel ran once, with the picker's config and its thread count: no override crept in.
    assert [name for name, _, _ in launches] == ["forward", "delta", "backward_dkdv", "backward_dq"]
    for name, cfg, (grid, threads, *rest) in launches:
        if name == "delta":
            assert threads == 128
            continue
        assert cfg == tile_config_for(d, kernel=name, smem_limit=limit) and threads == cfg.threads >= 64
        # Past 48 KiB the launch asks for the config's whole shared memory dynamically; below it, for none.
        assert (rest[1] if len(rest) > 1 else 0) == cfg.dynamic_smem_bytes()
        assert cfg.dynamic_smem == (d > 128 and limit > STATIC_SMEM_LIMIT)
        rows = sk if name == "backward_dkdv" else sq
        tile = cfg.block_n if name == "backward_dkdv" else cfg.block_m
        assert grid[0] == -(-rows // tile)
        # Both sequence lengths end in a partial tile of this kernel.
        assert sq % cfg.block_m and sk % cfg.block_n

    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert out.shape == q.shape and np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) <= 1e-5
    _check_lse(lse, ref_lse)
    for got, want in zip((dq, dk, dv), attention_ref_backward(dout, q, k, v, **kw)):
        assert got.shape == want.shape and got.dtype == np.float32
        assert np.all(np.isfinite(got))
        assert _rel_l2(got, want) <= 1e-5
