"""The CPU kernels in fresh processes: the 256-bit micro-kernel (what CPUs without AVX-512 run; this test forces it
with NUMBA_FLASH_CPU_SIMD=256) against the float64 reference, and numba's on-disk cache (``cache=True``): a second
process loads the compiled kernels instead of compiling them again.

Where 256 bits is what the CPU runs anyway, the process uses the checkout's own cache, which ``make test``'s
warmup filled: its first run is then already the second process (a cold cache gets a second run). Elsewhere it
compiles into an empty directory of its own (about 4 min on 2 cores), so as not to replace the 512-bit kernels
there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from numba_flash.cpu import simd

_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from numba_flash.cpu import backward, forward, simd
    from numba_flash.cpu import flash_backward, flash_forward
    from numba_flash.reference import attention_ref, attention_ref_backward

    rng = np.random.default_rng(int(sys.argv[1]))
    errors = []
    # (B, Sq, Sk, Hq, Hkv, D, left, right, softcap): ragged tiles, GQA, causal with Sq != Sk, a window with softcap,
    # a head dim that is padded (40) and one that is not (64); "bhsd" views for the second case.
    for b, sq, sk, hq, hkv, d, left, right, cap, bhsd in [(1, 77, 150, 4, 2, 40, -1, 0, 0.0, False),
                                                          (2, 130, 65, 2, 1, 64, 30, 5, 2.0, True)]:
        shape_q, shape_k = ((b, hq, sq, d), (b, hkv, sk, d)) if bhsd else ((b, sq, hq, d), (b, sk, hkv, d))
        q, dout = (rng.standard_normal(shape_q).astype(np.float32) for _ in range(2))
        k, v = (rng.standard_normal(shape_k).astype(np.float32) for _ in range(2))
        if bhsd:
            q, k, v, dout = (x.transpose(0, 2, 1, 3) for x in (q, k, v, dout))
        scale = d ** -0.5
        out, lse = np.empty(q.shape, np.float32), np.empty((b, hq, sq), np.float32)
        flash_forward(q, k, v, out, lse, scale, left, right, cap)
        grads = [np.empty(x.shape, np.float32) for x in (q, k, v)]
        flash_backward(dout, q, k, v, out, lse, *grads, scale, left, right, cap)
        ref_out, _ = attention_ref(q, k, v, softmax_scale=scale, window_size=(left, right), softcap=cap)
        ref_grads = attention_ref_backward(dout, q, k, v, softmax_scale=scale, window_size=(left, right),
                                           softcap=cap)
        errors.append(float(np.abs(out - ref_out).max()))
        errors.extend(float(np.linalg.norm(g - r) / np.linalg.norm(r)) for g, r in zip(grads, ref_grads))
    kernels = (forward.forward_kernel, backward.backward_kv_kernel, backward.backward_dq_kernel)
    print(json.dumps({
        "lanes": simd.LANES,
        "errors": errors,
        "hits": sum(sum(f.stats.cache_hits.values()) for f in kernels),
        "misses": sum(sum(f.stats.cache_misses.values()) for f in kernels),
    }))
    """
)


def _run(cache_dir, seed: int) -> dict:
    env = dict(os.environ, NUMBA_FLASH_CPU_SIMD="256", NUMBA_NUM_THREADS="2")
    if cache_dir is not None:
        env["NUMBA_CACHE_DIR"] = str(cache_dir)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(seed)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(run: dict) -> None:
    assert run["lanes"] == 8
    # forward max abs error and dq, dk, dv relative L2 error per case: the contract's float32 bounds
    assert max(run["errors"]) <= 1e-5, run["errors"]


@pytest.mark.slow
def test_256_bit_kernel_matches_reference_and_second_process_hits_the_cache(tmp_path, rng):
    native = simd.LANES == 8    # this process's width: the CPU's, or NUMBA_FLASH_CPU_SIMD's if it is set to 256
    cache_dir = None if native else tmp_path
    first = _run(cache_dir, int(rng.integers(2**32)))
    _check(first)
    if cache_dir is not None:
        assert first["misses"] > 0 and first["hits"] == 0  # an empty cache directory: everything compiled here
    if first["misses"] > 0:
        second = _run(cache_dir, int(rng.integers(2**32)))
        _check(second)
        assert second["misses"] == 0 and second["hits"] > 0, second
    else:   # every kernel came from the cache an earlier process wrote (the warmup)
        assert first["hits"] > 0, first


def test_the_width_variable_is_read_without_case_and_a_typo_is_named(monkeypatch):
    monkeypatch.delenv(simd.SIMD_ENV, raising=False)
    native = simd._simd_lanes()
    for value, lanes in (("AVX2", 8), (" 256 ", 8), ("Avx512", 16), ("512", 16)):
        monkeypatch.setenv(simd.SIMD_ENV, value)
        assert simd._simd_lanes() == lanes, value
    monkeypatch.setenv(simd.SIMD_ENV, "avx-512")
    with pytest.warns(RuntimeWarning, match=r"NUMBA_FLASH_CPU_SIMD='avx-512' is none of 256, avx2, 512, avx512"):
        assert simd._simd_lanes() == native
