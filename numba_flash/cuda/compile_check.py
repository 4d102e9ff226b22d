"""Compile every CUDA kernel specialisation with the real compiler, no GPU needed, and report its resources.

``numba.cuda.compile_ptx`` types and lowers a kernel to PTX for a compute capability (this is what catches typing
errors: the simulator runs kernels as plain Python); nvJitLink (cuda-bindings) then assembles the PTX to SASS and
its verbose log gives registers, spills, stack and shared memory per kernel.

    python -m numba_flash.cuda.compile_check       # prints the table, exit status 1 if any kernel is bad
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from typing import Any

from .config import COMPUTE_CAPABILITIES, STATIC_SMEM_LIMIT, FlashAttentionConfig, all_tile_configs, storage_dtype
from .gpus import Occupancy, gpu_spec, occupancy

#: Threads per block of the delta pre-pass (launch.py launches it with this many).
DELTA_THREADS = 128


@dataclass(frozen=True)
class KernelResources:
    kernel: str
    cc: tuple[int, int]
    dtype: str
    config: FlashAttentionConfig | None
    registers: int
    spill_stores: int
    spill_loads: int
    stack: int
    lmem: int
    smem: int
    f64_instructions: int

    @property
    def threads(self) -> int:
        return self.config.threads if self.config else DELTA_THREADS

    @property
    def occupancy(self) -> Occupancy:
        """Blocks per SM on this compute capability; zero means the launch would fail with "too many resources
        requested for launch"."""
        return occupancy(gpu_spec(self.cc), self.threads, self.registers, self.smem)

    def problems(self, smem_limit: int = STATIC_SMEM_LIMIT) -> list[str]:
        why = []
        occ = self.occupancy
        if not occ.launchable:
            why.append(f"cannot launch on sm_{self.cc[0]}{self.cc[1]}: {occ.limited_by}")
        if self.spill_stores or self.spill_loads or self.lmem or self.stack:
            why.append(f"local memory: {self.spill_stores} B spill stores, {self.spill_loads} B spill loads, "
                       f"{self.stack} B stack, {self.lmem} B lmem")
        if self.smem > smem_limit:
            why.append(f"{self.smem} B shared memory > {smem_limit}")
        if self.registers > 255:
            why.append(f"{self.registers} registers")
        if self.f64_instructions:
            why.append(f"{self.f64_instructions} float64 instructions (a float literal leaked into the math)")
        return why


def kernel_signature(kernel: str, dtype: str) -> Any:
    """The numba signature the backend launches ``kernel`` with: any-stride arrays ('A' layout, which also covers
    contiguous inputs) of the dtype's storage type (int16 for bfloat16), int64 sizes, float32 multipliers, and last
    the (B, Hq) float32 ALiBi slopes, the 4-dimensional float32 attn_bias and dropout's scalars."""
    from numba import types

    x = types.Array(getattr(types, storage_dtype(dtype)), 4, "A")
    rows = types.Array(types.float32, 3, "A")
    slopes = types.Array(types.float32, 2, "A")
    bias = types.Array(types.float32, 4, "A")
    u64 = types.uint64
    i64, f32 = types.int64, types.float32
    variants = (slopes, bias, u64, u64, u64, f32, i64)   # ALiBi, attn_bias, dropout's five scalars
    if kernel == "forward":
        return types.void(x, x, x, x, rows, i64, i64, i64, i64, i64, i64, f32, f32, *variants)
    if kernel == "backward_dkdv":
        return types.void(x, x, x, x, rows, rows, x, x, i64, i64, i64, i64, i64, i64, f32, f32, f32, *variants)
    if kernel == "backward_dq":
        return types.void(x, x, x, x, rows, rows, x, i64, i64, i64, i64, i64, i64, f32, f32, f32, *variants)
    if kernel == "backward_delta":
        return types.void(x, x, rows, i64, i64, i64, i64)
    raise ValueError(kernel)


def python_kernel(kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
                  flags: tuple[bool, ...] = (True,) * 6) -> Any:
    """The Python function of one kernel specialisation; ``flags`` are (has_left, has_right, softcap[, alibi[,
    attn_bias[, dropout]]]), those left out off. The compile check builds every flag on: the variant with the most live
    values, so the worst case for registers."""
    from .backward import make_delta_kernel, make_dkdv_kernel, make_dq_kernel
    from .forward import make_forward_kernel

    if kernel == "backward_delta":
        return make_delta_kernel(dtype == "bfloat16").py_func
    factory = {"forward": make_forward_kernel, "backward_dkdv": make_dkdv_kernel, "backward_dq": make_dq_kernel}
    return factory[kernel](cfg, *flags[:3], dtype == "bfloat16", *flags[3:]).py_func


def _int(pattern: str, log: str) -> int:
    found = re.findall(pattern, log)
    return max((int(x) for x in found), default=0)


def kernel_ptx(kernel: str, cfg: FlashAttentionConfig | None, dtype: str, cc: tuple[int, int],
               flags: tuple[bool, ...] = (True,) * 6, lineinfo: bool = False) -> str:
    """PTX of one kernel specialisation for compute capability ``cc`` (types and lowers it: typing errors show).
    ``lineinfo`` adds source-line directives (for the performance model), with inlined helpers' lines in their own
    files (``lineinfo.helper_lines_in_their_files``); the code is the same."""
    import contextlib

    from numba import cuda

    from .lineinfo import helper_lines_in_their_files

    with helper_lines_in_their_files() if lineinfo else contextlib.nullcontext():
        ptx, _ = cuda.compile_ptx(python_kernel(kernel, cfg, dtype, flags), kernel_signature(kernel, dtype),
                                  cc=cc, lineinfo=lineinfo)
    return ptx


def parse_resources(log: str) -> dict[str, int]:
    """Registers, spill bytes, stack, local and shared memory from nvJitLink's verbose log."""
    return {
        "registers": _int(r"used (\d+) registers", log),
        "spill_stores": _int(r"(\d+) bytes spill stores", log),
        "spill_loads": _int(r"(\d+) bytes spill loads", log),
        "stack": _int(r"(\d+) bytes stack frame", log) or _int(r"(\d+) stack", log),
        "lmem": _int(r"(\d+) bytes lmem", log),
        "smem": _int(r"(\d+) bytes smem", log),
    }


def assemble(ptx: str, kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
             cc: tuple[int, int]) -> KernelResources:
    """Assemble PTX to SASS for ``cc`` with nvJitLink and read the kernel's resources from its log."""
    from .sass import link

    _, log = link(ptx, cc)
    f64 = sum(1 for line in ptx.splitlines() if re.search(r"\.f64\b", line) and not line.lstrip().startswith("//"))
    return KernelResources(kernel=kernel, cc=cc, dtype=dtype, config=cfg, f64_instructions=f64,
                           **parse_resources(log))


def compile_kernel(kernel: str, cfg: FlashAttentionConfig | None, dtype: str,
                   cc: tuple[int, int]) -> KernelResources:
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


def check_all(progress: Any = None, ccs: tuple[tuple[int, int], ...] | None = None) -> list[KernelResources]:
    """Every (compute capability, dtype, tile config) the picker produces, plus the delta pre-pass; bfloat16 only
    for compute capabilities it is offered on (``config.MIN_COMPUTE_CAPABILITY``). ``ccs`` narrows the targets
    (default: ``config.COMPUTE_CAPABILITIES``); one the toolchain cannot build for raises ValueError saying why.

    numba lowers each specialisation to PTX once, for the lowest compute capability that has that config (that
    is most of the time: numba's front end is the slow part); nvJitLink then assembles that PTX for every target
    that uses the config, which is how a driver runs sm_75 PTX on an sm_90 GPU.
    """
    ccs = tuple(ccs) if ccs else COMPUTE_CAPABILITIES
    missing = [cc for cc in ccs if cc not in toolchain_ccs()]
    if missing:
        raise ValueError(f"compute capability {', '.join(f'{a}.{b}' for a, b in missing)}: the installed CUDA "
                         "toolchain cannot assemble for it (CUDA 13 dropped 7.0; install the 'cuda12' extra, "
                         "numba-cuda[cu12], in a separate environment)")
    configs = all_tile_configs(ccs)
    targets: dict[tuple[str, str, FlashAttentionConfig | None], list[tuple[int, int]]] = {}
    for cc, dtype, cfg in configs:
        targets.setdefault((cfg.kernel, dtype, cfg), []).append(cc)
    for cc in sorted({cc for cc, _, _ in configs}):
        for dtype in sorted({dt for c, dt, _ in configs if c == cc}):
            targets.setdefault(("backward_delta", dtype, None), []).append(cc)
    results = []
    for (kernel, dtype, cfg), target_ccs in targets.items():
        target_ccs = sorted(target_ccs)
        ptx = kernel_ptx(kernel, cfg, dtype, target_ccs[0])
        for cc in target_ccs:
            results.append(assemble(ptx, kernel, cfg, dtype, cc))
            if progress:
                progress(results[-1])
    return results


def format_table(results: list[KernelResources]) -> str:
    head = (f"{'kernel':<15}{'cc':>5} {'D':>4} {'dtype':<9}{'tiles (m x n / thr)':<20}{'regs':>5}"
            f"{'spill':>7}{'smem':>7}{'blocks/SM':>10}  problems")
    lines = [head, "-" * len(head)]
    for r in results:
        cfg = r.config
        tiles = f"{cfg.block_m} x {cfg.block_n} / {cfg.threads}" if cfg else "1 row / warp"
        bucket = str(cfg.head_dim_bucket) if cfg else "any"
        lines.append(f"{r.kernel:<15}{r.cc[0]}.{r.cc[1]:<3} {bucket:>4} {r.dtype:<9}{tiles:<20}{r.registers:>5}"
                     f"{r.spill_stores + r.spill_loads:>7}{r.smem:>7}{r.occupancy.blocks_per_sm:>10}  "
                     f"{'; '.join(r.problems()) or 'ok'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m numba_flash.cuda.compile_check",
                                     description="Compile every CUDA kernel specialisation to SASS (no GPU needed) "
                                                 "and report registers, spills, shared memory and occupancy.")
    parser.add_argument("--cc", nargs="+", default=None, help="compute capabilities, e.g. 7.5 9.0 (default: "
                        + " ".join(f"{a}.{b}" for a, b in COMPUTE_CAPABILITIES) + ")")
    args = parser.parse_args(argv)
    ccs = None
    if args.cc:
        try:
            ccs = tuple(tuple(int(x) for x in c.split(".")) for c in args.cc)
        except ValueError:
            parser.error(f"--cc: expected versions like 8.0, got {args.cc}")
    try:
        results = check_all(ccs=ccs)
    except ValueError as exc:
        print(f"compile_check: {exc}", file=sys.stderr)
        return 2
    print(format_table(results))
    return 1 if any(r.problems() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
