"""The asv targets call attention through ``numba_flash.bench``'s runners and clocks (one harness for the bench
and asv), and the memory benchmark reports what one call allocates, not the size of the process."""

from __future__ import annotations

import pytest

from benchmarks_asv import attention, common
from numba_flash import bench


@pytest.fixture(autouse=True)
def fresh_target():
    common._current.update(key=None, target=None)
    yield
    common._current.update(key=None, target=None)


def test_targets_are_the_bench_s_runners():
    target = common.get_target("tiny", "cpu", True, "float32")
    assert isinstance(target.runner, bench.BackendRunner) and isinstance(target.clock, bench.Clock)
    assert target.case == bench.Case("tiny", 2, 4, 4, 8, 64, True, "float32", "bshd")
    naive = common.get_target("tiny", "numpy_naive", False, "float32")
    assert isinstance(naive.runner, bench.NaiveNumpyRunner)
    out = naive.forward()
    ref = bench.Reference(naive.inputs).out()
    assert abs(out - ref).max() < 1e-5


def test_memory_benchmark_measures_the_call_not_the_process():
    """numpy naive attention at the medium size holds every head's 128 x 128 float32 scores: at least 1 MiB
    (2 x 8 x 128 x 128 x 4 B) for one copy, where the process itself is over 100 MiB."""
    m = attention.Memory()
    m.setup("medium", "numpy_naive", False, "float32")
    naive_fwd = m.track_peak_memory_forward("medium", "numpy_naive", False, "float32")
    naive_bwd = m.track_peak_memory_backward("medium", "numpy_naive", False, "float32")
    assert 2**20 <= naive_fwd < 32 * 2**20, naive_fwd
    assert naive_bwd > naive_fwd, (naive_bwd, naive_fwd)      # dP and dS come on top of P
    m.setup("tiny", "cpu", False, "float32")
    tiny = m.track_peak_memory_forward("tiny", "cpu", False, "float32")
    assert 0 <= tiny < 4 * 2**20, tiny
