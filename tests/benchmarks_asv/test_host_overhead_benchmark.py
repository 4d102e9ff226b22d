"""The asv host-overhead benchmark times ``numba_flash.bench.host_overhead``'s own rows and tracks a ratio to torch
SDPA that means what it says; a row whose path cannot run skips in setup."""

from __future__ import annotations

import math

import pytest

from benchmarks_asv import host_overhead as asv_host


@pytest.mark.parametrize("backend, call", [("cpu", "forward"), ("cpu", "decode")])
def test_points_are_the_bench_s_rows(backend, call):
    b = asv_host.HostOverhead()
    b.setup(backend, call)
    assert (b.case.backend, b.case.call, b.case.seqlen_q, b.case.seqlen_k) == (backend, call, 1, 16)
    b.time_call(backend, call)
    pytest.importorskip("torch")
    ratio = b.track_x_sdpa(backend, call)
    assert math.isfinite(ratio) and ratio > 0


def test_params_cover_the_table():
    assert asv_host.HostOverhead.params == (["cpu", "torch"], ["forward", "forward_backward", "decode"])
