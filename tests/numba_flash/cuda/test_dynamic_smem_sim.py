"""The kernels with their shared memory past 48 KiB taken dynamically (smem.py, the registry's wide_tiles), under
the simulator with the race and bounds checker, against the float64 reference; and the launcher's fallback to the
48 KiB tiles when a GPU refuses the opt-in. The picker's sm_90 configs run in test_production_tiles_sim.py; here the
ones it gives sm_80 and the 99 KiB GPUs, through tile_config_override (which applies one size to every kernel).
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim \
tests/numba_flash/cuda/test_dynamic_smem_sim.py
"""

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.cuda import tile_config_override
from numba_flash.cuda import simcheck
from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, smem_limit_for

pytestmark = pytest.mark.cudasim


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture
def dynamic_launches(monkeypatch):
    """(kernel, tile config, dynamic bytes) of every tiled launch, the simulator planning for sm_90 (227 KiB)."""
    import numba_flash.cuda.host.devices as devices
    import numba_flash.cuda.host.launch as launch

    seen = []
    real = launch._run

    def recorded(kernel, grid, cfg, stream, args):
        seen.append((cfg.kernel, cfg, cfg.dynamic_smem_bytes()))
        return real(kernel, grid, cfg, stream, args)

    monkeypatch.setattr(launch, "_run", recorded)
    monkeypatch.setattr(devices, "smem_limit", lambda: smem_limit_for((9, 0)))
    with simcheck.checking():
        yield seen


def _run_and_check(rng, sq, sk, d, **kw):
    q, k, v = (rng.standard_normal((1, s, h, d)).astype(np.float32) for s, h in ((sq, 2), (sk, 1), (sk, 1)))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    op = backend_registry.get("flash", backend="cuda")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert np.max(np.abs(out - ref)) <= 1e-5
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-5)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, **kw)):
        assert np.all(np.isfinite(got)) and _rel_l2(got, want) <= 1e-5


# (block_m, block_n, threads): sm_80's dQ tiles and the 99 KiB GPUs' dK/dV and dQ tiles; each kernel gets them.
@pytest.mark.parametrize("tiles", [(32, 16, 128), (16, 16, 128)], ids=lambda t: "x".join(map(str, t)))
def test_dynamic_tiles_match_reference(rng, dynamic_launches, tiles):
    bm, bn, nt = tiles
    with tile_config_override(block_m=bm, block_n=bn, threads=nt):
        _run_and_check(rng, 13, 11, 200, causal=True)   # one ragged tile each way
    kernels = [(name, nbytes) for name, _, nbytes in dynamic_launches]
    assert [name for name, _ in kernels] == ["forward", "backward_dkdv", "backward_dq"]
    # Every backward config here is past 48 KiB, and so launched with its whole buffer dynamic.
    for name, cfg, nbytes in dynamic_launches:
        assert (cfg.block_m, cfg.block_n, cfg.threads) == tiles
        assert nbytes == (cfg.smem_bytes() if cfg.smem_bytes() > STATIC_SMEM_LIMIT else 0)
        assert name == "forward" or nbytes > STATIC_SMEM_LIMIT


def test_a_refused_opt_in_runs_the_48_kib_tiles(rng, dynamic_launches, monkeypatch):
    """smem.launch says False (the device refused the attribute): each kernel runs again on its static config."""
    import numba_flash.cuda.host.launch as launch

    real = launch.smem.launch

    def refusing(kernel, grid, threads, stream, dynamic_bytes, args):
        return False if dynamic_bytes > STATIC_SMEM_LIMIT else real(kernel, grid, threads, stream, dynamic_bytes,
                                                                     args)

    monkeypatch.setattr(launch.smem, "launch", refusing)
    _run_and_check(rng, 13, 11, 256, window_size=(5, 3))
    got = [(name, nbytes) for name, _, nbytes in dynamic_launches]
    # The picker's dynamic config first (refused), then the 48 KiB one, for each of the three tiled kernels.
    assert [name for name, _ in got] == ["forward", "forward", "backward_dkdv", "backward_dkdv", "backward_dq",
                                         "backward_dq"]
    assert [nbytes > STATIC_SMEM_LIMIT for _, nbytes in got] == [True, False] * 3
