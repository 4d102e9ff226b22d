"""What each NVIDIA GPU generation the kernels target offers a block: registers, shared memory, warps, pipes, peaks.

One representative data-centre GPU per compute capability supplies the clock and SM count (a peak in TFLOP/s is
2 x lanes x SMs x clock); everything the launch check and the static performance model need per SM is a property
of the compute capability itself. Sources, all public: the CUDA C++ Programming Guide ("Compute Capabilities": technical specifications per
compute capability; "Arithmetic Instructions": throughput per SM per clock), and NVIDIA's whitepapers and
datasheets for the V100, T4, A100, A10, L4 and H100 (SM counts, boost clocks, dense tensor-core peaks).

Nothing here needs a GPU or imports numba.cuda.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Registers are allocated per warp in units of this many (all compute capabilities 7.0 to 9.0).
REGISTER_ALLOCATION_UNIT = 256
#: Shared memory the driver reserves per resident block (compute capability 8.0 and later; 0 before).
RESERVED_SMEM_PER_BLOCK = 1024
#: Static shared memory any block may declare; above it a kernel needs the opt-in dynamic-shared-memory attribute.
STATIC_SMEM_LIMIT = 48 * 1024


@dataclass(frozen=True)
class GpuSpec:
    """Per-SM resources and throughputs of one compute capability, plus a representative GPU's size and clock.

    Throughputs are results per clock per SM (the programming guide's unit): ``fp32_lanes`` for float32
    add/multiply/fused multiply-add, ``int_lanes`` for 32-bit integer add/compare/logic and multiply-add,
    ``mufu_lanes`` for the special-function unit (exp2, log2, reciprocal, tanh), ``tensor_fma`` dense float16
    multiply-adds with float32 accumulation on the tensor cores (0: none that mma.sync can use).
    """

    cc: tuple[int, int]
    example: str             # the GPU the clock and SM count are taken from
    sms: int
    boost_mhz: int
    fp32_lanes: int
    int_lanes: int
    mufu_lanes: int
    tensor_fma: int
    schedulers: int          # warp schedulers per SM, each issuing one instruction per clock
    max_warps_per_sm: int
    max_blocks_per_sm: int
    registers_per_sm: int
    max_registers_per_thread: int
    smem_per_sm: int         # bytes of shared memory an SM can give its resident blocks
    max_smem_per_block: int  # bytes a block may use with the opt-in attribute
    smem_bytes_per_clock: int = 128   # 32 banks x 4 bytes: one "wavefront" per clock
    max_threads_per_block: int = 1024

    @property
    def name(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def reserved_smem_per_block(self) -> int:
        return RESERVED_SMEM_PER_BLOCK if self.cc >= (8, 0) else 0


GPUS: dict[tuple[int, int], GpuSpec] = {
    spec.cc: spec for spec in (
        GpuSpec((7, 0), "V100 SXM2", 80, 1530, 64, 64, 16, 512, 4, 64, 32, 65536, 255, 96 * 1024, 96 * 1024),
        GpuSpec((7, 5), "T4", 40, 1590, 64, 64, 16, 512, 4, 32, 16, 65536, 255, 64 * 1024, 64 * 1024),
        GpuSpec((8, 0), "A100 SXM4", 108, 1410, 64, 64, 16, 1024, 4, 64, 32, 65536, 255, 164 * 1024,
                163 * 1024),
        GpuSpec((8, 6), "A10", 72, 1695, 128, 64, 16, 512, 4, 48, 16, 65536, 255, 100 * 1024, 99 * 1024),
        GpuSpec((8, 9), "L4", 58, 2040, 128, 64, 16, 512, 4, 48, 24, 65536, 255, 100 * 1024, 99 * 1024),
        # H100's dense float16 peak (989 TFLOP/s) is reached by wgmma; mma.sync, which is what Numba can emit,
        # measures at roughly two thirds of it in public microbenchmarks. The model reports against the full peak.
        GpuSpec((9, 0), "H100 SXM5", 132, 1830, 128, 64, 16, 2048, 4, 64, 32, 65536, 255, 228 * 1024,
                227 * 1024),
    )
}


def gpu_spec(cc: tuple[int, int]) -> GpuSpec:
    """The spec of compute capability ``cc``; ValueError for one not in ``GPUS``."""
    try:
        return GPUS[tuple(cc)]
    except KeyError:
        known = ", ".join(f"{a}.{b}" for a, b in GPUS)
        raise ValueError(f"compute capability: expected one of {known}, got {cc[0]}.{cc[1]}") from None


@dataclass(frozen=True)
class Occupancy:
    """How many blocks of a kernel an SM holds at once, and what limits it."""

    blocks_per_sm: int
    warps_per_sm: int
    limited_by: str   # 'registers', 'shared memory', 'warps', 'blocks', or why it cannot launch at all

    @property
    def launchable(self) -> bool:
        return self.blocks_per_sm > 0


def occupancy(spec: GpuSpec, threads: int, registers: int, smem_bytes: int) -> Occupancy:
    """Resident blocks per SM for a kernel using ``registers`` per thread and ``smem_bytes`` of shared memory per
    block, launched with ``threads`` threads per block (the occupancy calculator's rules). Zero blocks, with the
    reason in ``limited_by``, when one block does not fit an SM: that launch fails with "too many resources
    requested for launch" on a real GPU."""
    warps = -(-threads // 32)
    if threads > spec.max_threads_per_block:
        return Occupancy(0, 0, f"{threads} threads > {spec.max_threads_per_block} per block")
    if registers > spec.max_registers_per_thread:
        return Occupancy(0, 0, f"{registers} registers > {spec.max_registers_per_thread} per thread")
    regs_per_warp = -(-max(registers, 1) * 32 // REGISTER_ALLOCATION_UNIT) * REGISTER_ALLOCATION_UNIT
    smem_per_block = smem_bytes + spec.reserved_smem_per_block()
    if smem_bytes > spec.max_smem_per_block or smem_per_block > spec.smem_per_sm:
        return Occupancy(0, 0, f"{smem_bytes} B shared memory > {spec.max_smem_per_block} per block")
    limits = {
        "blocks": spec.max_blocks_per_sm,
        "warps": spec.max_warps_per_sm // warps,
        "registers": spec.registers_per_sm // (regs_per_warp * warps),
        "shared memory": spec.smem_per_sm // smem_per_block if smem_bytes else spec.max_blocks_per_sm,
    }
    limited_by = min(limits, key=lambda k: limits[k])
    blocks = limits[limited_by]
    if blocks == 0:
        return Occupancy(0, 0, f"{registers} registers x {threads} threads > {spec.registers_per_sm} per SM")
    return Occupancy(blocks, blocks * warps, limited_by)
