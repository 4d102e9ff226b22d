"""The asv decode and varlen benchmarks time ``numba_flash.bench``'s own steps, report a bandwidth fraction, a
memory figure, an error and a work ratio that mean what they say, and skip a backend the machine lacks in setup."""

from __future__ import annotations

import math

import pytest

from benchmarks_asv import inference
from numba_flash import bench


@pytest.fixture(autouse=True)
def small_and_fresh(monkeypatch):
    # The suite's points are 1k/8k decode and a 2048-token mix; the same code on smaller sizes keeps this quick.
    monkeypatch.setattr(inference, "VARLEN_TOKENS", 256)
    for target in (inference._decode, inference._varlen):
        target.clear()
        target["key"] = None
    yield
    for target in (inference._decode, inference._varlen):
        target.clear()
        target["key"] = None


def test_decode_points_are_the_bench_s_steps():
    d = inference.Decode()
    d.setup(1024, "cpu")
    t = inference._decode
    assert isinstance(t["step"], bench.Step) and t["step"].device == "cpu"
    assert (t["case"].nheads, t["case"].nheads_kv, t["case"].headdim, t["case"].cache_len) == (32, 8, 128, 1024)
    d.time_decode(1024, "cpu")
    frac = d.track_frac_of_copy(1024, "cpu")
    assert math.isfinite(frac) and 0 < frac < 10, frac
    assert 0 <= d.track_max_error(1024, "cpu") < 1e-5
    assert 0 <= d.track_peak_memory_decode(1024, "cpu") < 64 * 2**20
    d.setup(1024, "torch_sdpa")
    assert inference._decode["key"] == (1024, "torch_sdpa")
    assert 0 <= d.track_max_error(1024, "torch_sdpa") < 1e-5


@pytest.mark.parametrize("backend, node", [("cuda", "/dev/nvidiactl"), ("rocm", "/dev/kfd")])
def test_a_missing_gpu_skips_in_setup(backend, node):
    import os

    if os.path.exists(node):
        pytest.skip(f"{node} is here")
    with pytest.raises(NotImplementedError):
        inference.Decode().setup(1024, backend)
    with pytest.raises(NotImplementedError):
        inference.Varlen().setup(backend, "packed")


def test_varlen_points_and_the_work_ratio():
    v = inference.Varlen()
    v.setup("cpu", "packed")
    case = inference._varlen["case"]
    assert sum(case.lengths) == 256 and case.causal
    assert case.flops("dense") == pytest.approx(case.flops("packed"), rel=0.1)
    v.time_forward("cpu", "packed")
    v.time_forward("cpu", "dense")
    r = inference.VarlenRatio()
    r.setup("cpu")
    ratio = r.track_work_time_vs_dense("cpu")
    assert math.isfinite(ratio) and ratio > 0, ratio
