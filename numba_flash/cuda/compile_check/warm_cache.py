"""``numba-flash warmup --cuda --cc 8.0 9.0``: compile the CUDA kernels common models use into the disk cache
(host/kernel_cache.py), on a machine without a GPU (a container build step), so that a process on the GPU launches
them without compiling.

What is compiled: for each compute capability, dtype (float16, bfloat16 where offered, float32) and head dim (64
and 128 by default), causal and not, the kernels the picker gives a plain call (no window, softcap, ALiBi,
attn_bias or dropout): the forward, the backward's dK/dV and dQ kernels, and its delta pre-pass; and a decoding
step's kernel (one query row, a contiguous cache, paged or not) and its merge of the splits. Each for the argument
types of a launch on contiguous "bshd" inputs (``launch_argtypes``). A call of another layout or variant compiles
on its first use, once per machine: the cache keeps it for the next process.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from dataclasses import dataclass
from typing import Any, Callable

from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, FlashAttentionConfig, dtype_supported_on,
                                          smem_limit_for, storage_dtype)
from numba_flash.cuda.kernels.registry import AUX_KERNELS, kernel_name, kernel_spec
from numba_flash.cuda.kernels.spec import ROLE_ARRAYS, ROW_ARRAYS
from numba_flash.cuda.kernels.variant import Variant

DTYPES = ("float16", "bfloat16", "float32")
HEAD_DIMS = (64, 128)
#: The kernels without a tile config (their jobs carry their registry names): the delta pre-pass of the backward
#: and decoding's merge of the splits; and decoding's kernel, whose arguments are its own.
DELTA, MERGE = (next(aux.name for aux in AUX_KERNELS.values() if aux.role == role) for role in ("delta", "merge"))
DECODE = kernel_name("decode")


@dataclass(frozen=True)
class WarmJob:
    """One specialisation to compile: kernel ``label`` (a spec's name, or ``DELTA``), its tile config and variant
    (None for ``DELTA``), the call's dtype, head dim and causality, and the compute capability."""

    label: str
    cfg: FlashAttentionConfig | None
    variant: Variant | None
    dtype: str
    head_dim: int
    causal: bool
    cc: tuple[int, int]

    def describe(self) -> str:
        """How the progress line names it."""
        where = f"sm_{self.cc[0]}{self.cc[1]} {self.label}"
        if self.cfg is None:   # the delta pre-pass and the merge: any head dim, no mask
            return f"{where} {self.dtype}"
        return (f"{where} {self.cfg.block_m}x{self.cfg.block_n}/{self.cfg.threads} {self.dtype} D={self.head_dim} "
                f"{'causal' if self.causal else 'full'}")


def warm_jobs(ccs: tuple[tuple[int, int], ...] = COMPUTE_CAPABILITIES, dtypes: tuple[str, ...] = DTYPES,
              head_dims: tuple[int, ...] = HEAD_DIMS) -> list[WarmJob]:
    """The specialisations a warmup compiles (see the module's docstring), each once; dtypes a compute capability
    is not offered are left out for it."""
    from numba_flash.cuda.host.picker import TileOverride, tile_config_for
    from numba_flash.cuda.host.plan import backward_kernels, forward_kernel

    jobs: list[WarmJob] = []
    for cc in ccs:
        for dtype in dtypes:
            if not dtype_supported_on(dtype, cc):
                continue
            for d in head_dims:
                kernels = (forward_kernel(dtype, d, TileOverride(), cc),
                           *backward_kernels(dtype, d, TileOverride(), cc))
                for causal in (False, True):
                    for name in kernels + (DECODE,):
                        cfg = tile_config_for(d, dtype, cc, smem_limit_for(cc), name, override=TileOverride())
                        variant = Variant(has_right=causal, bf16=dtype == "bfloat16", async_copy=cfg.tensor_cores)
                        jobs.append(WarmJob(name, cfg, variant, dtype, d, causal, cc))
            # The delta pre-pass and the merge depend on the dtype only: one job each per compute capability and dtype.
            jobs += [WarmJob(name, None, None, dtype, 0, False, cc) for name in (DELTA, MERGE)]
    return list(dict.fromkeys(jobs))


def launch_argtypes(label: str, variant: Variant | None, dtype: str) -> tuple:
    """The numba argument types of a launch of kernel ``label`` (launch.py's ``_launch``, or ``launch_delta`` for
    ``DELTA``; launch_decode.py's for ``DECODE`` and ``MERGE``) on C-contiguous (B, S, H, D) inputs with Sq > 1
    (decoding: Sq = 1), no ALiBi, attn_bias, BlockMask or packed sequences: the placeholders launch.py passes
    instead are C-contiguous, and the slopes' placeholder, a (B, Hq) view of lse, is not (but for Sq = 1)."""
    from numba import types

    data = types.Array(getattr(types, storage_dtype(dtype)), 4, "C")
    rows = types.Array(types.float32, 3, "C")
    i64, f32, u64 = types.int64, types.float32, types.uint64
    if label == DELTA:
        return (data, data, rows) + (i64,) * 6
    part_out, part_lse = types.Array(f32, 5, "C"), types.Array(f32, 4, "C")
    if label == MERGE:
        return (part_out, part_lse, data, rows)
    if label == DECODE:   # the sequence table and the block table are int32 (B, 3) and (B or 1, pages)
        ints = types.Array(types.int32, 2, "C")
        return (data, data, data, ints, ints, part_out, part_lse) + (i64,) * 7 + (f32, f32, types.Array(f32, 2, "C"))
    spec = kernel_spec(label)
    if spec.bits:
        data = types.Array(types.uint16, 4, "C")
    args = tuple(rows if name in ROW_ARRAYS else data for name in ROLE_ARRAYS[spec.role])
    args += (i64,) * 6 + (f32, f32) + (() if spec.role == "forward" else (f32,))
    args += (types.Array(f32, 2, "A"), types.Array(f32, 4, "C"), u64, u64, u64, f32, i64,
             types.Array(types.int8, 4, "C"), types.Array(types.int32, 2, "C"))
    for name in spec.tail:
        args += {"kv_slots": (types.Array(types.uint16, 4, "C"),) * 2, "dbias": (types.Array(f32, 4, "C"),),
                 "base": (i64, i64), "row_stats": (types.Array(f32, 4, "C"), i64)}[name]
    return args


def compile_job(job: WarmJob) -> tuple[WarmJob, bool, float]:
    """Compile ``job`` into the disk cache unless it is there: (job, whether it compiled, seconds)."""
    from numba_flash.cuda.host.kernel_cache import precompile

    t0 = time.perf_counter()
    bf16 = job.dtype == "bfloat16"
    argtypes = launch_argtypes(job.label, job.variant, job.dtype)
    if job.label in (DELTA, MERGE):   # their factories take bf16 alone, as launch.py and launch_decode.py key them
        from numba_flash.cuda.kernels.backward_dkdv import make_delta_kernel
        from numba_flash.cuda.kernels.decode import make_split_merge_kernel

        make = make_delta_kernel if job.label == DELTA else make_split_merge_kernel
        compiled = precompile(make(bf16), job.label, (bf16,), argtypes, job.cc)
    else:   # a tiled kernel or decoding's, built through its registry entry as launch.py and launch_decode.py do
        dispatcher = kernel_spec(job.label).build(job.cfg, job.variant)
        compiled = precompile(dispatcher, job.label, (job.cfg, job.variant), argtypes, job.cc)
    return job, compiled, time.perf_counter() - t0


def warm(jobs: list[WarmJob], report: Callable[[str], None] | None = None, workers: int = 1,
         compile_one: Callable[[WarmJob], tuple[WarmJob, bool, float]] | None = None,
         ) -> list[tuple[WarmJob, bool, float]]:
    """Compile ``jobs`` into the disk cache (``compile_one``, default ``compile_job``) in ``workers`` spawned
    processes (numba's and NVVM's state are no fork-safe promise); ``report`` gets one line per kernel as it
    finishes. Returns each job's result in order."""
    compile_one = compile_one or compile_job
    results: list[tuple[WarmJob, bool, float]] = []
    pool: Any = None
    if workers > 1 and len(jobs) > 1:
        pool = concurrent.futures.ProcessPoolExecutor(min(workers, len(jobs)),
                                                      mp_context=multiprocessing.get_context("spawn"))
        done = pool.map(compile_one, jobs)
    else:
        done = map(compile_one, jobs)
    try:
        for i, (job, compiled, seconds) in enumerate(done, 1):
            results.append((job, compiled, seconds))
            if report is not None:
                how = f"compiled in {seconds:.1f} s" if compiled else "cached already"
                report(f"[{i}/{len(jobs)}] {job.describe()}: {how}")
    finally:
        if pool is not None:
            pool.shutdown()
    return results
