"""The asv benchmark that tracks the static performance model reports what the model computes, skips what it
cannot model, and imports without the CUDA toolchain. Compiles two kernels with the real compiler (no GPU)."""

import pytest

from benchmarks_asv import model as bench


@pytest.mark.ptx
def test_track_ceiling_reports_the_model(model_cache_dir, monkeypatch):
    if bench._toolchain_reason():
        pytest.skip(bench._toolchain_reason())
    from numba_flash.cuda.perf_model import run_model

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(model_cache_dir))
    # A narrow grid: the forward and the backward (two kernels) at one head dim, two dtypes, two GPUs.
    monkeypatch.setattr(bench, "HEAD_DIMS", [64])
    monkeypatch.setattr(bench, "DTYPES", ["float32", "bfloat16"])
    monkeypatch.setattr(bench, "CCS", ["8.0", "9.0"])
    b = bench.CudaModel()
    cache = b.setup_cache()
    want = {(r.kernel, r.dtype, r.cc): r for r in run_model(["forward", "backward"], ["float32"], [64], ["plain"],
                                                            [(8, 0), (9, 0)])}
    for (kernel, dtype, cc), r in want.items():
        b.setup(cache, kernel, 64, dtype, cc)
        ceiling = b.track_ceiling(cache, kernel, 64, dtype, cc)
        assert ceiling == r.ceiling and 0 < ceiling <= 1
        assert 0 < b.track_ffma_share(cache, kernel, 64, dtype, cc) < 1
    # The backward's ceiling is its five useful products over both kernels' clocks, and each kernel's ceiling is
    # its executed products (4 in dK/dV, 3 in dQ) over its own clocks.
    for cc in ("8.0", "9.0"):
        dkdv, dq = want[("backward_dkdv", "float32", cc)].ceiling, want[("backward_dq", "float32", cc)].ceiling
        assert want[("backward", "float32", cc)].ceiling == pytest.approx(5 / (4 / dkdv + 3 / dq), rel=2e-3)
    assert ("forward", 64, "bfloat16", "8.0") in cache
    with pytest.raises(NotImplementedError):   # a point outside the grid the cache holds
        b.setup(cache, "forward", 128, "float32", "8.0")


def test_no_toolchain_skips_every_point(monkeypatch):
    monkeypatch.setattr(bench, "_toolchain_reason", lambda: "ModuleNotFoundError: no cuda.bindings")
    b = bench.CudaModel()
    cache = b.setup_cache()
    assert cache == {}
    with pytest.raises(NotImplementedError, match="no cuda.bindings"):
        b.setup(cache, "forward", 64, "float32", "9.0")
