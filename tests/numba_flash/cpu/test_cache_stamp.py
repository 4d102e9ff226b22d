"""numba's disk cache of the CPU kernels follows every file they inline from, not only the file defining each."""

from __future__ import annotations

import shutil

import pytest

from numba_flash.cpu import backward, cache_stamp, decode, forward, workspace


@pytest.mark.parametrize("kernel", [forward.forward_kernel, backward.backward_kv_kernel,
                                    backward.backward_dq_kernel, workspace._pack_kernel, decode._decode_kernel],
                         ids=lambda k: k.py_func.__name__)
def test_every_kernel_cache_carries_the_package_stamp(kernel):
    assert kernel._cache._cache_file._source_stamp == cache_stamp.sources_stamp()


def test_the_stamp_covers_the_inlined_helpers():
    names = {p.name for p in cache_stamp.source_files()}
    assert {"tiles.py", "passes.py", "microkernels.py", "simd.py", "dropout.py", "forward.py"} <= names


def test_editing_any_source_changes_the_stamp(tmp_path, monkeypatch):
    copies = []
    for path in cache_stamp.source_files():
        copies.append(tmp_path / path.name)
        shutil.copy(path, copies[-1])
    monkeypatch.setattr(cache_stamp, "source_files", lambda: copies)
    before = cache_stamp.sources_stamp()
    assert cache_stamp.sources_stamp() == before   # a pure function of the contents
    tiles = tmp_path / "tiles.py"
    tiles.write_text(tiles.read_text().replace("f2", "f1", 1))
    assert cache_stamp.sources_stamp() != before


def test_the_vector_width_changes_the_stamp(monkeypatch):
    """NUMBA_FLASH_CPU_SIMD=256 on an AVX-512 CPU must not load the 512-bit kernels a default run cached: numba's
    own key (the CPU, the signature) is the same for both."""
    from numba_flash.cpu import simd

    before = cache_stamp.sources_stamp()
    monkeypatch.setattr(simd, "LANES", 24 - simd.LANES)   # 8 <-> 16
    assert cache_stamp.sources_stamp() != before
