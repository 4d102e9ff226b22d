"""A static performance model of the CUDA kernels: SASS instruction counts and occupancy, no GPU.

    python -m numba_flash.cuda.perf_model                 # table: every kernel x dtype x D x variant x GPU
    python -m numba_flash.cuda.perf_model --json          # the same records as JSON
    python -m numba_flash.cuda.perf_model --kernel forward --head-dim 64 128 --cc 9.0

What it does, per kernel specialisation (kernel, dtype, head-dim bucket, mask variant, compute capability):

1. Lowers the kernel to PTX with line info (numba), assembles it for the compute capability (nvJitLink: registers,
   spills, shared memory) and disassembles the cubin (nvdisasm), so every SASS instruction has its source line.
2. Counts what one *steady-state iteration* of the kernel's main loop issues per warp: the loop over key tiles in
   the forward and dQ kernels, over query tiles in the dK/dV kernel (perf_counts.py). The source says how often
   each line runs per iteration (``loop_counts``: the trip counts of the loops inside, from the tile config's
   constants, for the lanes of each warp); the SASS says how the compiler laid those lines out (``dynamic_counts``:
   each inner SASS loop's trip count is recovered from lines whose instructions issue exactly once per execution --
   an FFMA, a MUFU, a min/max, or one 32-bit word of a load or store: the one the loop body holds most copies of
   -- which undoes unrolling; remainder loops get what the main unrolled loop leaves).
3. Turns the counts into cycles per SM for the blocks that fit an SM at once (``gpus.occupancy``), as the largest of
   these bounds, and reports useful multiply-adds per cycle as a fraction of the peak (``ceiling``):
   - issue: every warp instruction takes one issue slot; 4 schedulers per SM issue one each per clock (fewer
     when fewer warps are resident);
   - warp: one warp issues at most one instruction per clock, so a block's slowest warp bounds its iteration;
   - latency: a warp issues in order and an instruction waits for the registers it reads, so a warp's iteration
     takes at least the replay of its stream with each result ready an assumed latency after its issue
     (``perf_latency.py``: 4-5 clocks for ALU and FMA work, about 30 for shared-memory loads, ldmatrix and
     mma.sync), dependencies carried across inner loops and from one iteration to the next; the other warps of
     a scheduler fill the waits only up to the issue bound;
   - pipes: float32 ops and IMAD on the FMA pipe (``fp32_lanes`` per clock per SM; IMAD at most ``int_lanes``),
     integer adds, logic, compares and selects on the ALU (``int_lanes``), MUFU and conversions at
     ``mufu_lanes``;
   - shared memory: 128 bytes per clock per SM; an access costs its bytes (a 32-bit load by a whole warp is one
     clock), assuming no bank conflicts (the tiles are padded) and giving no credit for broadcast.
   Useful work is what the contract counts: the forward's two products (4 * Sq * Sk * D FLOP), the backward's
   five, per score element. The peak is the float32 CUDA-core peak for SIMT kernels and the dense float16
   tensor-core peak for kernels that issue HMMA (``unit``).

It is a bound, not a measurement: latency enters only as a warp's own dependency waits (with assumed latencies,
not what a given GPU takes); barrier stalls, bank conflicts, instruction-cache misses, global-memory bandwidth and
the partial tiles on a causal diagonal are not modelled, so a real GPU runs below it. Its use is to compare
kernels and commits, and to show where the instructions go. GPU figures (SMs, clocks, pipe widths) are in gpus.py.
Results are cached on disk per source version (``--no-cache`` recomputes).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from numba_flash.cuda.host.config import HEAD_DIM_BUCKETS, KERNEL_DTYPES, FlashAttentionConfig, smem_limit_for
from numba_flash.cuda.host.picker import TileOverride, tile_config_for
from numba_flash.cuda.host.gpus import GPUS, GpuSpec, gpu_spec, occupancy
from numba_flash.cuda.perf_model.counts import LATENCY_KEY, dynamic_counts, loop_counts
from numba_flash.cuda.compile_check.sass import FP32_PIPE, disassemble, kernel_function, link, parse
from numba_flash.cuda.compile_check.targets import kernel_target
from numba_flash.cuda.kernels.registry import REGISTRY, SPECS, kernel_name

#: Variants: (has_left, has_right, softcap[, alibi, attn_bias, dropout]) flags of the kernel factories. "dropout" is
#: causal with dropout on: the Philox words of every score (numba_flash.dropout) priced beside the products.
VARIANTS: dict[str, tuple[bool, ...]] = {
    "plain": (False, False, False), "causal": (False, True, False),
    "window": (True, True, False), "softcap": (False, False, True),
    "dropout": (False, True, False, False, False, True),
}
#: The kernels modelled: those whose registry entry counts their products.
MODEL_KERNELS: tuple[str, ...] = tuple(spec.name for spec in SPECS if spec.products)
#: Products (matrix multiplies over the tile) each kernel executes per main-loop iteration (its registry entry's
#: ``products``): the forward's QK^T and PV; dK/dV recomputes QK^T and dP, then dV and dK; dQ recomputes QK^T and
#: dP, then dQ. A single kernel's products all count as useful; the backward's useful work is five products per
#: score element.
PRODUCTS = {name: REGISTRY[name].products for name in MODEL_KERNELS}
#: The backward pairs, by the name their combined records take, and the kind of their kernels.
BACKWARD_PAIRS = {"backward": "simt", "tc_backward": "mma"}
#: The dense TF32 tensor-core peak is half the float16 one (A100: 156 against 312 TFLOP/s; H100 SXM: 495 against
#: 989): an m16n8k8 TF32 mma has half the multiply-adds of an m16n8k16 and takes as long, so the "tensor pipe"
#: bound prices every HMMA alike and a TF32 kernel's ceiling is against this fraction of ``tensor_fma``.
TF32_PEAK_FRACTION = 0.5
USEFUL_BACKWARD_PRODUCTS = 5
DEFAULT_CCS: tuple[tuple[int, int], ...] = ((8, 0), (9, 0))


# ---- bounds ----

@dataclass
class ModelRecord:
    """One kernel specialisation's model result. ``ceiling``: useful multiply-adds per clock over the peak's, a
    fraction in [0, 1] and an upper bound. ``per_iteration``: instructions per main-loop iteration summed over the
    block's warps, by class."""

    kernel: str
    dtype: str
    cc: str
    head_dim: int
    variant: str
    unit: str
    ceiling: float
    bound: str
    registers: int
    spills: int
    smem_bytes: int
    threads: int
    tiles: str
    blocks_per_sm: int
    warps_per_sm: int
    ffma_share: float
    flop_per_smem_byte: float
    ffma_per_useful: float
    bounds: dict[str, float] = field(default_factory=dict)
    per_iteration: dict[str, float] = field(default_factory=dict)
    cycles_per_score: float = 0.0        # SM clocks per score element (per head-dim column), for combining

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def _cycles(spec: GpuSpec, per_warp: list[dict[str, float]], blocks: int) -> dict[str, float]:
    """SM clocks per main-loop iteration of ``blocks`` resident blocks, per bound."""
    def total(c: str) -> float:
        return blocks * sum(w.get(c, 0.0) for w in per_warp)

    warps = blocks * len(per_warp)
    fma_pipe = sum(total(c) for c in FP32_PIPE) + total("imad")
    return {
        "issue": total("total") / min(spec.schedulers, warps),
        "warp": max(w["total"] for w in per_warp),
        # a warp issues in order and waits for its operands: its iteration takes at least that replay
        "latency": max(w.get(LATENCY_KEY, 0.0) for w in per_warp),
        # IMAD shares the FMA pipe with float32 work; on GPUs with 128 float32 lanes only half of them (the
        # "heavy" half) take integer multiply-adds.
        "fma pipe": max(fma_pipe * 32 / spec.fp32_lanes, total("imad") * 32 / spec.int_lanes),
        "alu pipe": total("int") * 32 / spec.int_lanes,
        "mufu pipe": (total("mufu") + total("conv")) * 32 / spec.mufu_lanes,
        "shared memory": total("smem_wavefronts"),
        # mma.sync's m16n8k16 is 2048 multiply-adds; a wgmma's are counted per warp (counts.py: "hgmma_fma")
        "tensor pipe": (total("hmma") * 16 * 8 * 16 + total("hgmma_fma")) / spec.tensor_fma if spec.tensor_fma
        else 0.0,
    }


def model_kernel(kernel: str, cfg: FlashAttentionConfig, dtype: str, variant: str, cc: tuple[int, int],
                 sass_text: str, py_func: Callable, log: str) -> ModelRecord:
    """The model record of one compiled specialisation (``sass_text``: nvdisasm output with line info)."""
    from numba_flash.cuda.compile_check import parse_resources

    spec = gpu_spec(cc)
    res = parse_resources(log)
    fn = kernel_function(parse(sass_text, keep_file=py_func.__code__.co_filename), py_func.__name__)
    per_warp = dynamic_counts(fn, loop_counts(py_func, cfg.threads))
    # The assembler reports static shared memory only; a kernel past 48 KiB takes its tiles dynamically
    # (smem.py), and those bytes limit the blocks per SM just the same.
    smem = res["smem"] + cfg.dynamic_smem_bytes()
    occ = occupancy(spec, cfg.threads, res["registers"], smem)
    blocks = max(occ.blocks_per_sm, 1)
    cycles = _cycles(spec, per_warp, blocks)
    bound = max(cycles, key=lambda k: cycles[k])
    tensor = sum(w.get("hmma", 0.0) + w.get("hgmma", 0.0) for w in per_warp) > 0
    peak = spec.tensor_fma if tensor else spec.fp32_lanes
    if tensor and REGISTRY[kernel].kind == "tf32":
        peak *= TF32_PEAK_FRACTION
    area = cfg.block_m * cfg.block_n * blocks                      # score elements per iteration of the SM
    executed = PRODUCTS[kernel] * area * cfg.head_dim_bucket       # multiply-adds
    useful = executed   # a single kernel's products all count; the backward pair's are priced in combine_backward
    ceiling = min(1.0, useful / (cycles[bound] * peak)) if occ.launchable else 0.0
    per_iter = {c: sum(w.get(c, 0.0) for w in per_warp) for c in per_warp[0] if c != LATENCY_KEY}
    smem_bytes_moved = per_iter["smem_wavefronts"] * spec.smem_bytes_per_clock
    ffma_thread = per_iter.get("ffma", 0.0) * 32
    return ModelRecord(
        kernel=kernel, dtype=dtype, cc=f"{cc[0]}.{cc[1]}", head_dim=cfg.head_dim_bucket, variant=variant,
        unit=("tensor_tf32" if REGISTRY[kernel].kind == "tf32" else "tensor") if tensor else "simt_fp32",
        ceiling=round(ceiling, 4), bound=bound,
        registers=res["registers"], spills=res["spill_stores"] + res["spill_loads"], smem_bytes=smem,
        threads=cfg.threads, tiles=f"{cfg.block_m}x{cfg.block_n}", blocks_per_sm=occ.blocks_per_sm,
        warps_per_sm=occ.warps_per_sm,
        ffma_share=round(per_iter.get("ffma", 0.0) / per_iter["total"], 4),
        flop_per_smem_byte=round(2 * executed / blocks / smem_bytes_moved, 3) if smem_bytes_moved else 0.0,
        ffma_per_useful=round(ffma_thread / (executed / blocks), 4) if not tensor else 0.0,
        bounds={k: round(v, 1) for k, v in cycles.items()},
        per_iteration={k: round(v, 1) for k, v in per_iter.items()},
        cycles_per_score=cycles[bound] / (area * cfg.head_dim_bucket) if occ.launchable else float("inf"),
    )


def combine_backward(dkdv: ModelRecord, dq: ModelRecord) -> ModelRecord:
    """The backward pass as a whole: the contract's five products per score element over the clocks of both
    kernels (the delta pre-pass reads O(S * D) and is left out)."""
    spec = gpu_spec(tuple(int(x) for x in dkdv.cc.split(".")))
    peak = spec.tensor_fma if dkdv.unit == "tensor" else spec.fp32_lanes
    cps = dkdv.cycles_per_score + dq.cycles_per_score
    ceiling = min(1.0, USEFUL_BACKWARD_PRODUCTS / (cps * peak)) if cps != float("inf") else 0.0
    worse = dkdv if dkdv.ceiling <= dq.ceiling else dq
    return ModelRecord(
        kernel=pair_name(dkdv.kernel), dtype=dkdv.dtype, cc=dkdv.cc, head_dim=dkdv.head_dim, variant=dkdv.variant,
        unit=dkdv.unit, ceiling=round(ceiling, 4), bound=f"{worse.kernel}: {worse.bound}",
        registers=max(dkdv.registers, dq.registers), spills=dkdv.spills + dq.spills,
        smem_bytes=max(dkdv.smem_bytes, dq.smem_bytes), threads=dkdv.threads,
        tiles=f"{dkdv.tiles} + {dq.tiles}", blocks_per_sm=min(dkdv.blocks_per_sm, dq.blocks_per_sm),
        warps_per_sm=min(dkdv.warps_per_sm, dq.warps_per_sm),
        ffma_share=round((dkdv.ffma_share + dq.ffma_share) / 2, 4),
        flop_per_smem_byte=round(min(dkdv.flop_per_smem_byte, dq.flop_per_smem_byte), 3),
        ffma_per_useful=round((dkdv.ffma_per_useful * 4 + dq.ffma_per_useful * 3) / 5, 4),
        cycles_per_score=cps,
    )


# ---- driving it: which specialisations, caching, output ----

@functools.lru_cache(maxsize=None)
def _source_key() -> str:
    """Once per process: changes whenever anything that shapes the SASS or the model changes: every source of this
    package (line numbers included: the model reads SASS by line) and the compiler versions (the compile table's,
    and the disassembler)."""
    from numba_flash.cuda.compile_check.table import TOOLCHAIN, toolchain_versions

    h = hashlib.sha256()
    cuda = Path(__file__).resolve().parents[1]
    for path in sorted(cuda.rglob("*.py")):
        h.update(path.relative_to(cuda).as_posix().encode() + path.read_bytes())
    h.update(json.dumps(toolchain_versions(TOOLCHAIN + ("nvidia-cuda-nvdisasm",))).encode())
    return h.hexdigest()[:20]


def cache_dir() -> str:
    base = os.environ.get("NUMBA_FLASH_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "numba-flash")
    return os.path.join(base, "perf_model")


def model_specialisation(kernel: str, dtype: str, head_dim: int, variant: str,
                         ccs: Iterable[tuple[int, int]], use_cache: bool = True,
                         cfg: FlashAttentionConfig | None = None) -> list[ModelRecord]:
    """Model one (kernel, dtype, head-dim bucket, variant) for each compute capability in ``ccs``: lowered to PTX
    once per tile config (for the lowest cc that has it, as a driver would JIT it on newer GPUs), assembled for
    each. The picker's config per cc (its shared-memory limit differs: ``config.smem_limit_for``), or ``cfg`` for
    every cc (to try a config before putting it in the table)."""
    from numba_flash.cuda.compile_check import kernel_ptx, python_kernel

    ccs = sorted(tuple(cc) for cc in ccs)
    tag = "" if cfg is None else f"-{cfg.block_m}x{cfg.block_n}x{cfg.threads}"
    path = os.path.join(cache_dir(), f"{_source_key()}-{kernel}-{dtype}-{head_dim}-{variant}{tag}-"
                        + "_".join(f"{a}{b}" for a, b in ccs) + ".json")
    if use_cache and os.path.exists(path):
        with open(path) as f:
            return [ModelRecord(**r) for r in json.load(f)]
    flags = VARIANTS[variant]
    by_config: dict[FlashAttentionConfig, list[tuple[int, int]]] = {}
    for cc in ccs:
        picked = cfg or tile_config_for(head_dim, dtype, cc, smem_limit_for(cc), kernel, override=TileOverride())
        by_config.setdefault(picked, []).append(cc)
    records = []
    # the target each GPU assembles the kernel for: sm_90a for the wgmma kernels (compile_check.targets)
    spec = REGISTRY[kernel]
    for picked, group in by_config.items():
        py_func = python_kernel(kernel, picked, dtype, flags)
        ptx = kernel_ptx(kernel, picked, dtype, kernel_target(spec, group[0]), flags, lineinfo=True)
        for cc in group:
            cubin, log = link(ptx, kernel_target(spec, cc), lineinfo=True)
            try:
                records.append(model_kernel(kernel, picked, dtype, variant, cc, disassemble(cubin), py_func, log))
            except ValueError as exc:
                raise ValueError(f"{kernel} {dtype} D={head_dim} {variant} sm_{cc[0]}{cc[1]}: {exc}") from None
    records.sort(key=lambda r: tuple(int(x) for x in r.cc.split(".")))
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump([r.as_json() for r in records], f)
        os.replace(tmp, path)   # atomic: a concurrent reader never sees half a file
    return records


def pair_name(dkdv: str) -> str:
    """The name of the backward pair whose dK/dV kernel is ``dkdv`` (``BACKWARD_PAIRS``)."""
    return next(pair for pair, kind in BACKWARD_PAIRS.items() if kind == REGISTRY[dkdv].kind)


def pair_kernels(pair: str) -> tuple[str, str]:
    """The (dK/dV, dQ) kernels of a backward pair (``BACKWARD_PAIRS``)."""
    return kernel_name("dkdv", BACKWARD_PAIRS[pair]), kernel_name("dq", BACKWARD_PAIRS[pair])


def run_model(kernels: Iterable[str] = (kernel_name("forward"), "backward"), dtypes: Iterable[str] = KERNEL_DTYPES,
              head_dims: Iterable[int] = HEAD_DIM_BUCKETS, variants: Iterable[str] = tuple(VARIANTS),
              ccs: Iterable[tuple[int, int]] = DEFAULT_CCS, use_cache: bool = True,
              progress: Callable[[str], None] | None = None) -> list[ModelRecord]:
    """Model records for every combination. ``kernels`` may name 'backward' (both backward kernels and their
    combination) or the single kernels; bfloat16 is modelled only on compute capabilities that offer it."""
    from numba_flash.cuda.host.config import TC_DTYPES, TC_MIN_COMPUTE_CAPABILITY, dtype_supported_on

    wanted = []
    for k in kernels:
        if k in BACKWARD_PAIRS:
            wanted.extend([*pair_kernels(k), k])
        else:
            wanted.append(k)
    records: list[ModelRecord] = []
    for dtype in dtypes:
        cc_ok = [cc for cc in ccs if dtype_supported_on(dtype, cc)]
        if not cc_ok:
            continue
        # The tensor-core kernels exist for float16 and bfloat16 from sm_80 on.
        cc_tc = [cc for cc in cc_ok if tuple(cc) >= TC_MIN_COMPUTE_CAPABILITY] if dtype in TC_DTYPES else []
        for head_dim in head_dims:
            for variant in variants:
                done: dict[str, list[ModelRecord]] = {}
                for kernel in wanted:
                    if kernel in BACKWARD_PAIRS:
                        parts = pair_kernels(kernel)
                        for k in parts:
                            if k not in done:
                                done[k] = _model_or_none(k, dtype, head_dim, variant, cc_ok, cc_tc, use_cache)
                        done[kernel] = [combine_backward(a, b) for a, b in zip(done[parts[0]], done[parts[1]])]
                    elif kernel not in done:
                        done[kernel] = _model_or_none(kernel, dtype, head_dim, variant, cc_ok, cc_tc, use_cache)
                    if progress:
                        progress(f"{kernel} {dtype} D={head_dim} {variant}")
                for kernel in wanted:
                    records.extend(done[kernel])
    return records


def _model_or_none(kernel: str, dtype: str, head_dim: int, variant: str, cc_ok: list, cc_tc: list,
                   use_cache: bool) -> list[ModelRecord]:
    """``model_specialisation`` for the compute capabilities the kernel exists on; [] where it does not (a
    tensor-core kernel for float32 or before sm_80, the tensor-core kernels past their head dims, the SIMT ones
    where ``config.head_dim_reason`` says they are not offered)."""
    from numba_flash.cuda.host.config import TC_MIN_COMPUTE_CAPABILITY, head_dim_reason

    spec = REGISTRY[kernel]
    if spec.kind == "tf32":   # float32 that allows TF32, from sm_80 on
        ccs = [cc for cc in cc_ok if tuple(cc) >= TC_MIN_COMPUTE_CAPABILITY]
        if dtype != "float32" or head_dim > spec.max_head_dim or not ccs:
            return []
        return model_specialisation(kernel, dtype, head_dim, variant, ccs, use_cache)
    if spec.kind == "mma":
        if head_dim > spec.max_head_dim:
            return []
        return model_specialisation(kernel, dtype, head_dim, variant, cc_tc, use_cache) if cc_tc else []
    if spec.kind == "wgmma":   # compute capability 9.0 only, head dims 64 and 128 (plan.wgmma_reason)
        ccs = [cc for cc in cc_tc if kernel_target(spec, cc) is not None]
        if not ccs or head_dim not in spec.tiles:
            return []
        return model_specialisation(kernel, dtype, head_dim, variant, ccs, use_cache)
    cc_ok = [cc for cc in cc_ok if not head_dim_reason(head_dim, kernel, smem_limit_for(cc))]
    return model_specialisation(kernel, dtype, head_dim, variant, cc_ok, use_cache) if cc_ok else []


def format_table(records: list[ModelRecord]) -> str:
    head = (f"{'kernel':<14}{'dtype':<9}{'cc':>4}{'D':>5} {'variant':<8}{'tiles':<14}{'regs':>5}{'smem':>7}"
            f"{'blk/SM':>7}{'warps/SM':>9}{'FFMA%':>7}{'FLOP/B':>7}{'ceiling':>9}  bound")
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(f"{r.kernel:<14}{r.dtype:<9}{r.cc:>4}{r.head_dim:>5} {r.variant:<8}{r.tiles:<14}"
                     f"{r.registers:>5}{r.smem_bytes:>7}{r.blocks_per_sm:>7}{r.warps_per_sm:>9}"
                     f"{100 * r.ffma_share:>6.1f}%"
                     f"{r.flop_per_smem_byte:>7.2f}{100 * r.ceiling:>8.1f}%  {r.bound}")
    lines.append("ceiling: modelled upper bound on useful FLOP/s as a fraction of the float32 CUDA-core peak "
                 "(tensor-core peak for HMMA kernels: the TF32 one for the TF32 kernel); not a measurement.")
    return "\n".join(lines)


def format_markdown(records: list[ModelRecord]) -> str:
    """One row per (kernel, dtype, D, variant) with each compute capability's ceiling, registers and warps per SM
    side by side: the table BENCHMARKS.md carries."""
    ccs = sorted({r.cc for r in records}, key=lambda c: tuple(int(x) for x in c.split(".")))
    rows: dict[tuple[str, str, int, str], dict[str, ModelRecord]] = {}
    for r in records:
        rows.setdefault((r.kernel, r.dtype, r.head_dim, r.variant), {})[r.cc] = r
    head = "| kernel | dtype | D | variant | tiles | " + " | ".join(
        f"sm_{c.replace('.', '')} ceiling (model) | regs, warps/SM, FFMA % | bound" for c in ccs) + " |"
    lines = [head, "|" + "---|" * (5 + 3 * len(ccs))]
    for (kernel, dtype, d, variant), by_cc in rows.items():
        cells = []
        for c in ccs:
            r = by_cc.get(c)
            cells += ([f"{100 * r.ceiling:.1f}%", f"{r.registers}, {r.warps_per_sm}, {100 * r.ffma_share:.1f}",
                       r.bound] if r else ["-", "-", "-"])
        # Tiles may differ per GPU (their shared-memory limits differ: config.smem_limit_for); then each is named.
        per_cc = {c: r.tiles for c, r in by_cc.items()}
        tiles = (next(iter(per_cc.values())) if len(set(per_cc.values())) == 1
                 else ", ".join(f"{t} (sm_{c.replace('.', '')})" for c, t in per_cc.items()))
        lines.append(f"| {kernel} | {dtype} | {d} | {variant} | {tiles} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cc(text: str) -> tuple[int, int]:
    major, _, minor = text.replace("sm_", "").replace("sm", "").partition(".")
    if not minor and len(major) >= 2:
        major, minor = major[:-1], major[-1]
    cc = (int(major), int(minor or 0))
    gpu_spec(cc)
    return cc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m numba_flash.cuda.perf_model",
                                     description="Static performance model of the CUDA kernels (SASS instruction "
                                                 "counts and occupancy; no GPU needed). Figures are upper bounds.")
    parser.add_argument("--json", action="store_true", help="print the records as JSON")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table, GPUs side by side")
    parser.add_argument("--kernel", nargs="+", default=[kernel_name("forward"), "backward"],
                        choices=list(dict.fromkeys([kernel_name("forward"), *BACKWARD_PAIRS, *MODEL_KERNELS])))
    parser.add_argument("--dtype", nargs="+", default=list(KERNEL_DTYPES), choices=list(KERNEL_DTYPES))
    parser.add_argument("--head-dim", nargs="+", type=int, default=list(HEAD_DIM_BUCKETS),
                        choices=list(HEAD_DIM_BUCKETS))
    parser.add_argument("--variant", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--cc", nargs="+", type=_cc, default=list(DEFAULT_CCS),
                        help=f"compute capabilities, e.g. 8.0 9.0 (known: "
                             f"{', '.join(f'{a}.{b}' for a, b in GPUS if (a, b) >= (7, 5))})")
    parser.add_argument("--no-cache", action="store_true", help="recompute instead of reading the disk cache")
    args = parser.parse_args(argv)
    if any(cc < (7, 5) for cc in args.cc):
        parser.error("compute capability 7.0 needs the CUDA 12 toolchain (the 'cuda12' extra); "
                     "this model runs on CUDA 13, which supports 7.5 and newer")

    bar = None
    if sys.stderr.isatty():
        try:
            from tqdm.auto import tqdm

            total = len(args.dtype) * len(args.head_dim) * len(args.variant) * sum(
                3 if k in BACKWARD_PAIRS else 1 for k in args.kernel)
            bar = tqdm(total=total, desc="perf model", unit="kernel", file=sys.stderr)
        except ImportError:
            pass

    def progress(what: str) -> None:
        if bar is not None:
            bar.set_postfix_str(what, refresh=False)
            bar.update(1)

    records = run_model(args.kernel, args.dtype, args.head_dim, args.variant, args.cc, not args.no_cache, progress)
    if bar is not None:
        bar.close()
    if args.json:
        json.dump([r.as_json() for r in records], sys.stdout, indent=1)
        print()
    elif args.markdown:
        print(format_markdown(records))
    else:
        print(format_table(records))
    return 0

