"""The disk cache under the CUDA simulator: a no-op (no machine code to keep), and the warmup's argument types are
those the launches pass. Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import factory_home

pytestmark = pytest.mark.cudasim

CC = (8, 0)


def test_the_cache_is_a_no_op_under_the_simulator(tmp_path, monkeypatch, rng):
    from backends import backend_registry
    from numba_flash.cuda import tile_config_override
    from numba_flash.cuda.host.kernel_cache import DiskCache, disk_cached, enabled
    from numba_flash.cuda.kernels.backward_dkdv import make_delta_kernel

    monkeypatch.setenv("NUMBA_FLASH_CACHE_DIR", str(tmp_path))
    assert not enabled()
    kernel = make_delta_kernel(False)
    assert disk_cached(kernel, "backward_delta", False) is kernel
    assert not isinstance(getattr(kernel, "_cache", None), DiskCache)
    q, k, v = (rng.standard_normal((1, 9, 2, 8)).astype(np.float32) for _ in range(3))
    with tile_config_override(block_m=8, block_n=8, threads=16):
        backend_registry.get("flash", backend="cuda").forward(q, k, v, causal=True)
    assert list(tmp_path.iterdir()) == []


def _captured_argtypes(monkeypatch, launch_fn, cfg, arrays, **kw) -> tuple:
    """The numba types of the arguments ``launch_fn`` passes to the launch, for simulator arrays (numpy
    underneath, typed as numba types the device arrays of the same strides)."""
    from numba import typeof
    from numba.core.typing.typeof import Purpose

    from numba_flash.cuda.host import smem

    seen = []
    monkeypatch.setattr(smem, "launch", lambda kernel, grid, threads, stream, nbytes, args: seen.append(args) or True)
    launch_fn(cfg, *arrays, softmax_scale=0.125, window_left=-1, window_right=0, softcap=0.0, bf16=False, **kw)
    (args,) = seen
    return tuple(typeof(getattr(a, "_ary", a), Purpose.argument) for a in args)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_warmups_argument_types_are_the_launches(monkeypatch, dtype):
    """A warm cache serves a launch only for the exact argument types it was compiled for: the warmup's
    (``launch_argtypes``) are those launch.py passes for contiguous (B, S, H, D) inputs, each role."""
    from numba import cuda

    from numba_flash.cuda.compile_check.warm_cache import launch_argtypes, warm_jobs
    from numba_flash.cuda.host import launch

    batch, s, h, d = 2, 16, 2, 64
    data = np.zeros((batch, s, h, d), dtype)
    rows = np.zeros((batch, h, s), np.float32)
    jobs = [j for j in warm_jobs((CC,), (dtype,), (d,)) if j.causal and j.cfg is not None and j.label != "decode"]
    assert {j.cfg.kernel for j in jobs} == ({"forward", "backward_dkdv", "backward_dq"} if dtype == "float32"
                                             else {"tc_forward", "tc_backward_dkdv", "tc_backward_dq"})
    for job in jobs:
        role = launch.kernel_spec(job.label).role
        n_data = {"forward": 4, "dkdv": 6, "dq": 5}[role]
        rows_at = {"forward": (4,), "dkdv": (4, 5), "dq": (4, 5)}[role]
        arrays = [cuda.to_device(rows if i in rows_at else data) for i in range(n_data + len(rows_at))]
        fn = {"forward": launch.launch_forward, "dkdv": launch.launch_dkdv, "dq": launch.launch_dq}[role]
        got = _captured_argtypes(monkeypatch, fn, job.cfg, arrays)
        assert got == launch_argtypes(job.label, job.variant, dtype), job.describe()


def test_the_delta_argument_types_are_the_launches(monkeypatch):
    from numba import cuda, typeof
    from numba.core.typing.typeof import Purpose

    from numba_flash.cuda.compile_check.warm_cache import DELTA, launch_argtypes
    from numba_flash.cuda.host import launch

    seen = []

    class Recorder:
        def __getitem__(self, config):
            return lambda *args: seen.append(args)

    monkeypatch.setattr(launch, "make_delta_kernel", lambda bf16: Recorder())
    data = cuda.to_device(np.zeros((2, 16, 2, 64), np.float16))
    launch.launch_delta(data, data, cuda.to_device(np.zeros((2, 2, 16), np.float32)), bf16=False)
    got = tuple(typeof(getattr(a, "_ary", a), Purpose.argument) for a in seen[0])
    assert got == launch_argtypes(DELTA, None, "float16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_decoding_steps_argument_types_are_the_warmups(monkeypatch, dtype):
    """One query row on a contiguous cache: the decode kernel's and the merge's launches take the warmup's types."""
    from numba import cuda, typeof
    from numba.core.typing.typeof import Purpose

    from numba_flash.cuda.compile_check.warm_cache import DECODE, MERGE, launch_argtypes, warm_jobs
    from numba_flash.cuda.host import launch_decode
    from numba_flash.cuda.host.config import storage_dtype

    seen = {}

    def recorder(name):
        class Recorder:
            def __getitem__(self, config):
                return lambda *args: seen.setdefault(name, args)
        return lambda *a, **k: Recorder()

    decode_home = factory_home("make_decode_kernel")   # its registry entry's builder calls it there
    monkeypatch.setattr(decode_home, "make_decode_kernel", recorder(DECODE))
    monkeypatch.setattr(launch_decode, "make_split_merge_kernel", recorder(MERGE))
    keys = {}   # the disk cache's key parts of each launch: the warmup must store under the same
    monkeypatch.setattr(launch_decode, "disk_cached", lambda kernel, label, *parts: keys.setdefault(label, parts)
                        and kernel)
    (job,) = [j for j in warm_jobs((CC,), (dtype,), (128,)) if j.label == DECODE and j.causal]
    batch, hq, hkv, d, splits = 2, 8, 2, 128, 3
    store = storage_dtype(dtype)
    q, out = (cuda.to_device(np.zeros((batch, 1, hq, d), store)) for _ in range(2))
    k_cache, v_cache = (cuda.to_device(np.zeros((batch, 64, hkv, d), store)) for _ in range(2))
    seqinfo = cuda.to_device(np.zeros((batch, 3), np.int32))
    table = cuda.to_device(np.zeros((1, 1), np.int32))
    lse = cuda.to_device(np.zeros((batch, hq, 1), np.float32))
    part_out = cuda.to_device(np.zeros((splits, batch, hq, 1, d), np.float32))
    part_lse = cuda.to_device(np.zeros((splits, batch, hq, 1), np.float32))
    launch_decode.flash_decode(job.cfg, q, k_cache, v_cache, seqinfo, table, out, lse, part_out, part_lse,
                               page_size=0, softmax_scale=0.1, window_left=-1, window_right=0, softcap=0.0,
                               dtype=dtype)
    for name, variant in ((DECODE, job.variant), (MERGE, None)):
        got = tuple(typeof(getattr(a, "_ary", a), Purpose.argument) for a in seen[name])
        assert got == launch_argtypes(name, variant, dtype), name
    assert keys == {DECODE: (job.cfg, job.variant), MERGE: (dtype == "bfloat16",)}
