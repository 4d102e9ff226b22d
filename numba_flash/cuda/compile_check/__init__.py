"""Compile every CUDA kernel specialisation with the real compiler, no GPU needed, and report its resources.

``numba.cuda.compile_ptx`` types and lowers a kernel to PTX for a compute capability (this is what catches typing
errors: the simulator runs kernels as plain Python); nvJitLink (cuda-bindings) then assembles the PTX to SASS and
its verbose log gives registers, spills, stack and shared memory per kernel.

    python -m numba_flash.cuda.compile_check       # prints the table, exit status 1 if any kernel is bad
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import multiprocessing
import os
import re
import sys
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, Iterator

import numpy as np

from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, TC_DTYPES, TC_MIN_COMPUTE_CAPABILITY,
                                          FlashAttentionConfig, head_dim_bucket, storage_dtype)
from numba_flash.cuda.host.picker import TileOverride, all_tile_configs, tile_config_for
from numba_flash.cuda.host.plan import wgmma_reason
from numba_flash.cuda.compile_check.resources import KernelResources, parse_resources
from numba_flash.cuda.compile_check.targets import (ARCH_SPECIFIC_KINDS, Target, kernel_target, parse_target,
                                                   target_label)
from numba_flash.cuda.kernels.registry import AUX_KERNELS, REGISTRY, SPECS, kernel_spec
from numba_flash.cuda.kernels.spec import ROLE_ARRAYS, ROW_ARRAYS
from numba_flash.cuda.kernels.variant import Variant
from numba_flash.errors import AttentionInputError

#: A row of a tensor-core kernel compiled for plain loads carries this suffix; the row without it is the cp.async
#: path (the kernels copy with cp.async where launch.async_copy_ok says they can).
LOADS_SUFFIX = "_loads"


def _copy_paths(kind: str) -> dict[str, bool]:
    """Rows of the ``kind`` kernels, each compiled for its two tile-copy paths: row name -> cp.async."""
    return {spec.name + suffix: async_copy for spec in SPECS if spec.kind == kind
            for suffix, async_copy in (("", True), (LOADS_SUFFIX, False))}


#: The tensor-core kernels' two tile-copy paths, compiled as separate rows: cp.async, and plain loads for inputs
#: cp.async cannot read (launch.async_copy_ok).
TC_COPY_PATHS: dict[str, bool] = _copy_paths("mma")
#: Rows of kernels compiled with user mods (the SAMPLE_* functions below, through numba_flash/cuda/device/user_mods.py)
#: carry this suffix: the forward and both backward kernels, SIMT in float32 and tensor-core in float16, at head
#: dim MODS_HEAD_DIM, reading a BlockMask's table (``CudaMods.block_tiles``). A mod compiles into every call site
#: (the simulator types none of them). The SIMT ones are built with every option, attn_bias and (dQ) its gradient
#: too; the tensor-core ones, which take no dbias, without attn_bias, which bias_mod subsumes: attn_bias and all
#: three mods at once take the sm_90 dK/dV tensor-core kernel to 255 registers and an 8-byte spill (218 without
#: attn_bias, 222 with ALiBi too; both measured before the table).
MODS_SUFFIX = "+mods"
#: kernel -> the dtype of its mods and packed-sequence rows: float32 where it takes it (SIMT, TF32), else its first
#: (float16: the mma.sync and wgmma kernels). The wgmma forward's are built for sm_90a only (targets.py), and its
#: mods row only where the plan lets mods run on it (``plan.wgmma_reason``: not past D = 64).
MODS_KERNELS = {spec.name: "float32" if "float32" in spec.dtypes else spec.dtypes[0] for spec in SPECS
                if spec.role != "decode"}
#: The TF32 forward's two copy paths, as TC_COPY_PATHS.
TF32_COPY_PATHS: dict[str, bool] = _copy_paths("tf32")
MODS_HEAD_DIM = 64
#: Rows of the same kernels built for packed sequences in one launch (``varlen``: the block table of
#: numba_flash/cuda/device/sequences.py locates each block's sequence), at head dim VARLEN_HEAD_DIM, with every option a
#: packed call can take (attn_bias and the mods it cannot).
VARLEN_SUFFIX = "+varlen"
#: Rows of the SIMT backward kernels built to sum attn_bias's gradient over the keys (dQ, ``dbias="per_row"``) or
#: the rows (dK/dV, ``"per_key"``), for a bias broadcast over them: every tile config, every option on. Their
#: partial sums live in registers across the tile loop, so they are compiled apart from the plain rows.
DBIAS_SUMS_SUFFIX = "+dbias-sums"
DBIAS_SUMS = {spec.name: spec.dbias_sum for spec in SPECS if spec.dbias_sum}
VARLEN_HEAD_DIM = 128
#: A document-id table as a mask_mod reads one (4096 int32 entries: 16 KiB of the GPU's 64 KiB of constant
#: memory per read), a per-head table as a bias_mod reads one, and a score_mod written in float32.
SAMPLE_DOCUMENTS = np.repeat(np.arange(16, dtype=np.int32), 256)
SAMPLE_HEAD_SLOPES = np.linspace(-0.5, 0.5, 64).astype(np.float32)


def sample_mask_mod(b, h, q_idx, kv_idx):
    return SAMPLE_DOCUMENTS[q_idx] == SAMPLE_DOCUMENTS[kv_idx]


def sample_bias_mod(b, h, q_idx, kv_idx):
    return SAMPLE_HEAD_SLOPES[h % 64] * np.float32(q_idx - kv_idx)


def sample_score_mod(score, b, h, q_idx, kv_idx):
    return np.float32(20.0) * math.tanh(score / np.float32(20.0))


def sample_score_mod_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / np.float32(20.0))
    return np.float32(1.0) - t * t


def sample_mods() -> Any:
    """The SAMPLE_* mods as the kernels take them (``user_mods.CudaMods``), with the BlockMask's table on
    (``block_tiles``: a call with mask_mod and its BlockMask, the kernels' largest variant)."""
    from dataclasses import replace

    from numba_flash.cuda.device.user_mods import cuda_mods

    mods = cuda_mods(SimpleNamespace(bias_mod=sample_bias_mod, mask_mod=sample_mask_mod, score_mod=sample_score_mod,
                                     score_mod_grad=sample_score_mod_grad))
    return replace(mods, block_tiles=True)


def base_kernel(kernel: str) -> str:
    """The registered kernel a compile-table row (``kernel``: a name with the row suffixes above) was built from."""
    kernel = kernel.removesuffix(MODS_SUFFIX).removesuffix(VARLEN_SUFFIX).removesuffix(DBIAS_SUMS_SUFFIX)
    return kernel.removesuffix(LOADS_SUFFIX) if kernel.removesuffix(LOADS_SUFFIX) in REGISTRY else kernel


def kernel_signature(kernel: str, dtype: str) -> Any:
    """The numba signature the backend launches ``kernel`` (a compile-table row) with: any-stride arrays ('A'
    layout, which also covers contiguous inputs) of the dtype's storage type (int16 for bfloat16; uint16 bits for
    the kernels whose spec says ``bits``), int64 sizes, float32 multipliers, and last the (B, Hq) float32 ALiBi
    slopes, the 4-dimensional float32 attn_bias and dropout's scalars, then the spec's tail (decoding: the slopes
    only; its int32 sequence table and block table, and its float32 partials, come from the backend
    C-contiguous)."""
    from numba import types

    name = base_kernel(kernel)
    x = types.Array(getattr(types, storage_dtype(dtype)), 4, "A")
    rows = types.Array(types.float32, 3, "A")
    slopes = types.Array(types.float32, 2, "A")
    i64, f32, u64 = types.int64, types.float32, types.uint64
    dbias = types.Array(types.float32, 4, "C")   # attn_bias's gradient or its sums, allocated C-contiguous
    if name in AUX_KERNELS:
        role = AUX_KERNELS[name].role
        if role == "merge":
            return types.void(types.Array(types.float32, 5, "C"), types.Array(types.float32, 4, "C"), x, rows)
        if role == "bias_grad_sum":   # the sums, then the caller's gradient (any strides)
            return types.void(dbias, types.Array(types.float32, 4, "A"))
        return types.void(x, x, rows, *(i64,) * 6)   # the delta pre-pass
    spec = kernel_spec(name)
    if spec.role == "decode":
        ints = types.Array(types.int32, 2, "C")
        part_out, part_lse = types.Array(types.float32, 5, "C"), types.Array(types.float32, 4, "C")
        # The slopes: a (B, Hq) view of part_lse[0] without ALiBi, hence 'A'.
        return types.void(x, x, x, ints, ints, part_out, part_lse, i64, i64, i64, i64, i64, i64, i64, f32, f32,
                          slopes)
    bits = types.Array(types.uint16, 4, "A")
    data = bits if spec.bits else x
    arrays = tuple(rows if a in ROW_ARRAYS else data for a in ROLE_ARRAYS[spec.role])
    scalars = (i64,) * 6 + (f32,) * (2 if spec.role == "forward" else 3)   # sizes, multipliers[, scale]
    tiles = types.Array(types.int8, 4, "C")                # the BlockMask's table (block_tiles.py)
    seqs = types.Array(types.int32, 2, "C")                # packed sequences' block table (sequences.py)
    # ALiBi, attn_bias, dropout's five scalars, tiles, seqs
    variants = (slopes, bias_type(), u64, u64, u64, f32, i64, tiles, seqs)
    # K and V as 16-bit slots; attn_bias's gradient; the call's batch entry and head of the launch's first; the
    # row statistics and their switch
    tail_types = {"kv_slots": (bits, bits), "dbias": (dbias,), "base": (i64, i64),
                  "row_stats": (types.Array(types.float32, 4, "C"), i64)}
    tail = tuple(t for arg in spec.tail for t in tail_types[arg])
    return types.void(*arrays, *scalars, *variants, *tail)


def bias_type() -> Any:
    """attn_bias as the kernels take it: 4-dimensional float32, any strides."""
    from numba import types

    return types.Array(types.float32, 4, "A")


def python_kernel(kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
                  flags: tuple[bool, ...] = (True,) * 6) -> Any:
    """The Python function of one kernel specialisation; ``flags`` are (has_left, has_right, softcap[, alibi[,
    attn_bias[, dropout]]]), those left out off (the decode kernel has no attn_bias or dropout: it takes the first
    four). The compile check builds every flag on: the variant with the most live values, so the worst case for
    registers. A ``MODS_SUFFIX`` kernel is built with ``sample_mods()`` as well, a tensor-core one without attn_bias
    (see there); a ``VARLEN_SUFFIX`` one for packed sequences, without attn_bias."""
    if kernel in AUX_KERNELS:
        return AUX_KERNELS[kernel].build(dtype == "bfloat16").py_func
    spec = kernel_spec(cfg.kernel)
    if spec.role == "decode":   # no attn_bias or dropout
        flags = flags[:4]
    switches = dict(zip(("has_left", "has_right", "softcap", "alibi", "bias", "dropout"), flags))
    variant = Variant(bf16=dtype == "bfloat16", **switches)
    if spec.role == "decode":
        return spec.build(cfg, variant).py_func
    if kernel.endswith(MODS_SUFFIX):
        variant = replace(variant, mods=sample_mods())
        if spec.tensor_cores:   # no attn_bias beside the mods (above)
            variant = replace(variant, bias=False)
    kernel = kernel.removesuffix(MODS_SUFFIX)
    if kernel.endswith(VARLEN_SUFFIX):   # packed calls take no attn_bias
        variant = replace(variant, varlen=True, bias=False)
    kernel = kernel.removesuffix(VARLEN_SUFFIX)
    if kernel.endswith(DBIAS_SUMS_SUFFIX):
        kernel = kernel.removesuffix(DBIAS_SUMS_SUFFIX)
        variant = replace(variant, dbias=DBIAS_SUMS[kernel])
    if kernel in TC_COPY_PATHS:
        variant = replace(variant, async_copy=TC_COPY_PATHS[kernel])
    if kernel in TF32_COPY_PATHS:
        from numba_flash.cuda.host.config import TF32_BIAS_MAX_HEAD_DIM

        variant = replace(variant, async_copy=TF32_COPY_PATHS[kernel])
        if cfg.head_dim_bucket > TF32_BIAS_MAX_HEAD_DIM:   # such calls run on the SIMT kernel (plan.tf32_reason)
            variant = replace(variant, bias=False)
    if "dbias" in spec.tail and spec.role == "dq" and variant.bias and not (variant.varlen or variant.dbias):
        variant = replace(variant, dbias="pairs")   # with attn_bias, its gradient too: the worst case for registers
    return spec.build(cfg, variant).py_func


def kernel_ptx(kernel: str, cfg: FlashAttentionConfig | None, dtype: str, cc: Target,
               flags: tuple[bool, ...] = (True,) * 6, lineinfo: bool = False) -> str:
    """PTX of one kernel specialisation for target ``cc`` (targets.py; types and lowers it: typing errors show).
    ``lineinfo`` adds source-line directives (for the performance model), with inlined helpers' lines in their own
    files (``lineinfo.helper_lines_in_their_files``); the code is the same."""
    from numba import cuda

    from numba_flash.cuda.compile_check.lineinfo import helper_lines_in_their_files

    with helper_lines_in_their_files() if lineinfo else contextlib.nullcontext(), device_functions_for(cc):
        ptx, _ = cuda.compile_ptx(python_kernel(kernel, cfg, dtype, flags), kernel_signature(kernel, dtype),
                                  cc=cc, lineinfo=lineinfo)
    return ptx


@contextlib.contextmanager
def device_functions_for(cc: Target) -> Iterator[None]:
    """numba-cuda compiles a device function that numba does not inline itself (the user's mods, user_mods.py) for
    the current GPU's compute capability, which needs a GPU; in here, for ``cc`` (its IR does not depend on it)."""
    from numba.cuda import dispatcher

    real = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=tuple(cc))
    try:
        yield
    finally:
        dispatcher.get_current_device = real


def assemble(ptx: str, kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
             cc: Target) -> KernelResources:
    """Assemble PTX to SASS for ``cc`` with nvJitLink and read the kernel's resources from its log."""
    from numba_flash.cuda.compile_check.sass import link

    _, log = link(ptx, cc)
    f64 = sum(1 for line in ptx.splitlines() if re.search(r"\.f64\b", line) and not line.lstrip().startswith("//"))
    return KernelResources(kernel=kernel, cc=cc, dtype=dtype, config=cfg, f64_instructions=f64,
                           **parse_resources(log))


def compile_kernel(kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
                   cc: Target) -> KernelResources:
    """Compile one kernel to PTX and SASS for ``cc`` and report its resources."""
    return assemble(kernel_ptx(kernel, cfg, dtype, cc), kernel, cfg, dtype, cc)


def toolchain_ccs() -> tuple[tuple[int, int], ...]:
    """Compute capabilities the installed CUDA toolchain can assemble: CUDA 13 starts at 7.5, CUDA 12 (the
    ``cuda12`` extra) still has 7.0."""
    try:
        from cuda.bindings import nvjitlink

        major = nvjitlink.version()[0]
    except Exception:
        return COMPUTE_CAPABILITIES
    return COMPUTE_CAPABILITIES if major >= 13 else ((7, 0),) + COMPUTE_CAPABILITIES


#: One specialisation to lower: (kernel, tile config or None, dtype, the targets to assemble it for).
Job = tuple[str, FlashAttentionConfig | None, str, tuple[Target, ...]]


def check_all(progress: Any = None, ccs: tuple[Target, ...] | None = None,
              workers: int | None = None) -> list[KernelResources]:
    """Every (compute capability, dtype, tile config) the picker produces, plus the kernels without a tile config
    (the backward's delta pre-pass, decoding's split merge) and those built with user mods (``MODS_KERNELS``) or
    for packed sequences (the same kernels, ``VARLEN_SUFFIX``); bfloat16 only for compute capabilities it is
    offered on (``config.MIN_COMPUTE_CAPABILITY``); the kernels of ``ARCH_SPECIFIC_KINDS`` (wgmma) for their
    "a" target (sm_90a), each dtype and head-dim bucket of their spec. ``ccs`` narrows the targets (default:
    ``config.COMPUTE_CAPABILITIES``): 9.0 covers the sm_90 and the sm_90a rows, (9, 0, "a") the sm_90a rows
    alone; one the toolchain cannot build for, or an "a" target no kernel has, raises ValueError saying why.

    numba lowers each specialisation to PTX once, for the lowest compute capability that has that config (that
    is most of the time: numba's front end is the slow part); nvJitLink then assembles that PTX for every target
    that uses the config, which is how a driver runs sm_75 PTX on an sm_90 GPU. ``workers`` processes share the
    specialisations (default: one per CPU core; 1 compiles in this process).
    """
    return run_jobs(compile_jobs(ccs), progress, workers)


def compile_jobs(ccs: tuple[Target, ...] | None = None) -> list[Job]:
    """The specialisations ``check_all`` compiles, each with the targets it is assembled for."""
    ccs = tuple(dict.fromkeys(tuple(cc) for cc in ccs)) if ccs else COMPUTE_CAPABILITIES
    missing = [cc for cc in ccs if cc[:2] not in toolchain_ccs()]
    if missing:
        raise ValueError(f"compute capability {', '.join(target_label(cc) for cc in missing)}: the installed CUDA "
                         "toolchain cannot assemble for it (CUDA 13 dropped 7.0; install the 'cuda12' extra, "
                         "numba-cuda[cu12], in a separate environment)")
    known = {target for target, _, _ in arch_specific_configs()}
    unknown = [cc for cc in ccs if len(cc) > 2 and cc not in known]
    if unknown:
        raise ValueError(f"target {', '.join(target_label(cc) for cc in unknown)}: no kernel is built for it (those "
                         f"with architecture-specific targets are: {', '.join(sorted(map(target_label, known)))})")
    plain = tuple(cc for cc in ccs if len(cc) == 2)   # an "a" target selects the architecture-specific kernels only
    configs = all_tile_configs(plain)
    targets: dict[tuple[str, str, FlashAttentionConfig | None], list[Target]] = {}

    def add(kernel: str, dtype: str, cfg: FlashAttentionConfig | None, cc: Target) -> None:
        found = targets.setdefault((kernel, dtype, cfg), [])
        if cc not in found:   # 9.0 and 9.0a both name sm_90a
            found.append(cc)

    for cc, dtype, cfg in configs:
        add(cfg.kernel, dtype, cfg, cc)
        if cfg.kernel in DBIAS_SUMS:
            add(cfg.kernel + DBIAS_SUMS_SUFFIX, dtype, cfg, cc)
    for cc in sorted({cc for cc, _, _ in configs}):
        for dtype in sorted({dt for c, dt, _ in configs if c == cc}):
            for kernel in AUX_KERNELS:
                add(kernel, dtype, None, cc)
    for cc, dtype, cfg in tensor_core_configs(plain):
        for kernel in TC_COPY_PATHS:
            if base_kernel(kernel) == cfg.kernel:
                add(kernel, dtype, cfg, cc)
    for cc, dtype, cfg in tf32_configs(plain):
        for kernel in TF32_COPY_PATHS:
            add(kernel, dtype, cfg, cc)
    for target, dtype, cfg in arch_specific_configs(ccs):
        add(cfg.kernel, dtype, cfg, target)
    for cc in ccs:
        for kernel, dtype in MODS_KERNELS.items():
            target = kernel_target(REGISTRY[kernel], cc)
            if target is None:
                continue
            for suffix, head_dim in ((MODS_SUFFIX, MODS_HEAD_DIM), (VARLEN_SUFFIX, VARLEN_HEAD_DIM)):
                if served(kernel, dtype, head_dim, target, mods=suffix == MODS_SUFFIX):
                    cfg = tile_config_for(head_dim, dtype, target[:2], kernel=kernel, override=TileOverride())
                    add(kernel + suffix, dtype, cfg, target)
    return [(kernel, cfg, dtype, tuple(sorted(target_ccs))) for (kernel, dtype, cfg), target_ccs in targets.items()]


def arch_specific_configs(ccs: tuple[Target, ...] = COMPUTE_CAPABILITIES,
                          ) -> list[tuple[Target, str, FlashAttentionConfig]]:
    """Every (target, dtype, config) of the kernels of ``ARCH_SPECIFIC_KINDS`` (the wgmma forward, on sm_90a) that
    ``ccs`` covers: each dtype of the spec, one config per head-dim bucket of its tiles."""
    found = []
    for spec in (spec for spec in SPECS if spec.kind in ARCH_SPECIFIC_KINDS):
        targets = dict.fromkeys(kernel_target(spec, cc) for cc in ccs)   # 9.0 and 9.0a both give sm_90a: once
        for target in (target for target in targets if target is not None):
            found += [(target, dtype, tile_config_for(bucket, dtype, target[:2], kernel=spec.name,
                                                      override=TileOverride()))
                      for dtype in spec.dtypes for bucket in spec.tiles]
    return found


def served(kernel: str, dtype: str, head_dim: int, target: Target, mods: bool = False) -> bool:
    """Whether a call of ``dtype`` and ``head_dim`` (with mods whose values the kernels stage, ``mods``: the
    SAMPLE_* mods have bias_mod and mask_mod, which do) can run on ``kernel`` on ``target``'s GPU. Only the wgmma
    forward, which the plan refuses mods past D = 64 (``plan.wgmma_reason``), leaves a mods or packed-sequence row
    out; the others serve the head dims those rows are built at."""
    if REGISTRY[kernel].kind != "wgmma":
        return True
    try:   # wgmma=True asks for the kernel: a call it cannot serve raises, with the reason
        return wgmma_reason(dtype, head_dim, TileOverride(wgmma=True), target[:2], staged_mods=mods) is None
    except AttentionInputError:
        return False


def run_jobs(jobs: list[Job], progress: Any = None, workers: int | None = None) -> list[KernelResources]:
    """Lower and assemble ``jobs`` (``compile_jobs``), in ``workers`` processes; rows in the jobs' order."""
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers <= 1:
        done = map(_compile_for_targets, jobs)
    else:
        # Each specialisation lowers and assembles on its own: one fresh process per core (spawned, not forked:
        # NVVM's and numba's state are not fork-safe promises), results in the jobs' order.
        pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        done = pool.map(_compile_for_targets, jobs)
    results = []
    try:
        for rows in done:
            for row in rows:
                results.append(row)
                if progress:
                    progress(row)
    finally:
        if workers > 1:
            pool.shutdown()
    return results


def _compile_for_targets(job: tuple) -> list[KernelResources]:
    """One specialisation lowered to PTX once, for the lowest target, and assembled for each target."""
    kernel, cfg, dtype, target_ccs = job
    ptx = kernel_ptx(kernel, cfg, dtype, target_ccs[0])
    return [assemble(ptx, kernel, cfg, dtype, cc) for cc in target_ccs]


def tensor_core_configs(ccs: tuple[tuple[int, int], ...] = COMPUTE_CAPABILITIES,
                        ) -> list[tuple[tuple[int, int], str, FlashAttentionConfig]]:
    """Every (compute capability, dtype, config) of the tensor-core kernels the picker makes: float16 and bfloat16
    from compute capability 8.0 on, one config per head-dim bucket up to each kernel's ``max_head_dim``."""
    return _mma_configs("mma", TC_DTYPES, ccs)


def tf32_configs(ccs: tuple[tuple[int, int], ...] = COMPUTE_CAPABILITIES,
                 ) -> list[tuple[tuple[int, int], str, FlashAttentionConfig]]:
    """Every (compute capability, "float32", config) of the TF32 forward the picker makes: from compute capability
    8.0 on, one config per head-dim bucket up to its ``max_head_dim``."""
    return _mma_configs("tf32", ("float32",), ccs)


def _mma_configs(kind: str, dtypes: tuple[str, ...], ccs: tuple[tuple[int, int], ...],
                 ) -> list[tuple[tuple[int, int], str, FlashAttentionConfig]]:
    from numba_flash.cuda.host.config import HEAD_DIM_BUCKETS

    return [(cc, dtype, tile_config_for(bucket, dtype, cc, kernel=spec.name, override=TileOverride()))
            for cc in ccs if tuple(cc) >= TC_MIN_COMPUTE_CAPABILITY for dtype in dtypes
            for spec in SPECS if spec.kind == kind
            for bucket in HEAD_DIM_BUCKETS if bucket <= spec.max_head_dim]


def format_table(results: list[KernelResources]) -> str:
    """The rows as the CLI prints them, one line each, the target as ``--cc`` names it (9.0, 9.0a)."""
    width = max([15] + [len(r.kernel) + 1 for r in results])   # the suffixed rows' names are the longest
    head = (f"{'kernel':<{width}}{'cc':<5} {'D':>4} {'dtype':<9}{'tiles (m x n / thr)':<20}{'regs':>5}"
            f"{'spill':>7}{'smem':>7}{'blocks/SM':>10}  problems")
    lines = [head, "-" * len(head)]
    for r in results:
        cfg = r.config
        tiles = f"{cfg.block_m} x {cfg.block_n} / {cfg.threads}" if cfg else f"1 row / {r.threads} thr"
        bucket = str(cfg.head_dim_bucket) if cfg else "any"
        lines.append(f"{r.kernel:<{width}}{target_label(r.cc):<5} {bucket:>4} {r.dtype:<9}{tiles:<20}{r.registers:>5}"
                     f"{r.spill_stores + r.spill_loads:>7}{r.smem + r.dynamic_smem:>7}{r.occupancy.blocks_per_sm:>10}  "
                     f"{'; '.join(r.problems()) or 'ok'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The CLI (``python -m numba_flash.cuda.compile_check``): 0 when every row is good, 1 when one is bad, 2
    when the targets cannot be built."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m numba_flash.cuda.compile_check",
                                     description="Compile every CUDA kernel specialisation to SASS (no GPU needed) "
                                                 "and report registers, spills, shared memory and occupancy.")
    parser.add_argument("--cc", nargs="+", default=None, help="compute capabilities, e.g. 7.5 9.0 (default: "
                        + " ".join(map(target_label, COMPUTE_CAPABILITIES)) + "); 9.0 includes the sm_90a rows of "
                        "the kernels only Hopper runs (wgmma), 9.0a compiles those alone")
    parser.add_argument("--write-table", action="store_true",
                        help="record the results in numba_flash/cuda/compile_table.json (every target; the test "
                             "suite then compiles only a sample of it while the kernels' code is unchanged)")
    args = parser.parse_args(argv)
    if args.write_table and args.cc:
        parser.error("--write-table records every target: leave out --cc")
    ccs = None
    if args.cc:
        try:
            ccs = tuple(map(parse_target, args.cc))
        except ValueError as exc:
            parser.error(f"--cc: {exc}")
    try:
        results = check_all(ccs=ccs)
    except ValueError as exc:
        print(f"compile_check: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    if any(r.problems() for r in results):
        return 1
    if args.write_table:
        from numba_flash.cuda.compile_check.table import TABLE_PATH, save

        save(results)
        print(f"recorded {len(results)} rows in {TABLE_PATH}")
    return 0

