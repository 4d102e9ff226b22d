"""The asv variants benchmarks time ``numba_flash.bench.variants``' own calls, skip in setup what a backend does
not run (saying why), and report a ratio to the plain forward."""

from __future__ import annotations

import math

import pytest

from benchmarks_asv import variants

pytest.importorskip("torch")


@pytest.fixture(autouse=True)
def small_and_fresh(monkeypatch):
    monkeypatch.setattr(variants, "SIZE", {"batch": 1, "nheads": 2, "seqlen": 64, "headdim": 16})
    variants._target.clear()
    variants._target["key"] = None
    yield
    variants._target.clear()
    variants._target["key"] = None


def test_every_variant_runs_on_the_torch_path_with_a_ratio():
    for variant in variants.VARIANTS:
        b = variants.Variants()
        b.setup("rocm", variant)
        b.time_forward("rocm", variant)
    r = variants.VariantRatio()
    r.setup("rocm", "mask_mod")
    ratio = r.track_time_vs_plain("rocm", "mask_mod")
    assert math.isfinite(ratio) and 0 < ratio < 100


def test_a_variant_the_backend_lacks_skips_in_setup_with_the_reason(monkeypatch):
    from backends.cpu import CpuBackend

    monkeypatch.setattr(CpuBackend, "SUPPORTS_MODS", False)   # as a backend without mods
    variants.Variants().setup("cpu", "plain")
    with pytest.raises(NotImplementedError, match="bias_mod, mask_mod and score_mod not supported"):
        variants.Variants().setup("cpu", "mask_mod")
