"""Tile configurations of the CUDA kernels: what each kernel keeps in shared memory, and the picker.

Every kernel stages its tiles in float32 shared memory (float16 and bfloat16 inputs are widened on load, so one
config serves every dtype), and reads four consecutive words per 128-bit load, so every row keeps a multiple of 4
words, padded by 4 (``padded_stride``): the forward keeps Q and K transposed (d-major), the backward kernels keep
every tile row-major and read along the head dim (see backward.py). Static
shared memory is limited to 48 KiB per block on every NVIDIA GPU numba-cuda targets; past it the SIMT kernels take
one dynamic buffer, which needs a per-kernel attribute numba does not set (smem.py sets it), up to the device's
opt-in limit (``smem_limit_for``). The picker uses that only where the performance model says a bigger tile pays
(``_PREFERRED_DYNAMIC``: D = 256, sm_80 on), and head dims past 256 need it (``WIDE_HEAD_DIM_BUCKETS``).

Users can override tile sizes for a block of code::

    with numba_flash.cuda.tile_config_override(block_m=32, block_n=32):
        out = backend_registry.get("flash", backend="cuda").forward(q, k, v)

or for one backend instance: ``CudaBackend(config=TileOverride(block_m=32, block_n=32))``. An override that does
not fit shared memory (or cannot be split over its threads) raises ``AttentionInputError`` when a call uses it.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Iterator

from numba_flash.errors import AttentionInputError

#: Head dims are padded up to one of these (a compile-time constant of each kernel): D of q and k, and Dv of v
#: (a kernel is built for the bucket of max(D, Dv)). 512 is Gemma's, 576 MLA's (with Dv = 512).
HEAD_DIM_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 576)
#: Buckets whose SIMT forward and backward tiles fit only past 48 KiB of shared memory: even 8 x 8 tiles of Q, K, V
#: and dO rows take 64 KiB at D = 512, so those kernels run there from compute capability 8.0 on (dynamic shared
#: memory, smem.py); the decode kernel, whose query tile is a few rows, fits 48 KiB everywhere.
WIDE_HEAD_DIM_BUCKETS: tuple[int, ...] = (512, 576)
WIDE_HEAD_DIM_MIN_COMPUTE_CAPABILITY = (8, 0)
#: Accumulators a thread may keep at the wide buckets, checked free of spills by the compile check (the forward and
#: the dK/dV kernel at 576 keep 2 x 36: 576 splits over 16 threads into whole 4-column runs of 36 columns, not 32).
WIDE_MAX_ACCUMULATORS_PER_THREAD = 72
#: Kernels with a tile config. The delta pre-pass of the backward and the split merge of decoding have none (a
#: fixed number of threads per row).
KERNELS: tuple[str, ...] = ("forward", "backward_dkdv", "backward_dq", "decode")
#: The tensor-core kernels (mma.sync, float16 and bfloat16 on compute capability >= 8.0; see tc_forward.py): one warp
#: owns 16 query rows, threads = 32 * block_m / 16, and tiles stay 16-bit in shared memory.
TC_KERNELS: tuple[str, ...] = ("tc_forward", "tc_backward_dkdv", "tc_backward_dq")
#: The tensor-core backward holds dK's and dV's accumulators for 16 keys in one warp's registers, D per thread:
#: past D = 128 that cannot fit, and the SIMT backward serves.
TC_BACKWARD_MAX_HEAD_DIM = 128
#: The tensor-core forward's largest bucket; past it float16 and bfloat16 run on the SIMT kernels.
TC_MAX_HEAD_DIM = 256
#: The TF32 tensor-core forward (tf32_forward.py): float32 inputs on mma.sync's TF32 products, for calls that allow
#: it (``precision="tf32"``), compute capability >= 8.0 as the others. Q's fragments stay in registers beside the
#: output's accumulators (D / 2 words each per thread), so D <= 128; past it, and for the backward, float32 runs on
#: the SIMT kernels.
TF32_KERNELS: tuple[str, ...] = ("tf32_forward",)
TF32_MAX_HEAD_DIM = 128
#: Past this bucket attn_bias's reads beside Q's fragments and the accumulators spill the TF32 kernel's registers
#: (compile check: 36-72 bytes at D = 128): such calls run on the SIMT kernel.
TF32_BIAS_MAX_HEAD_DIM = 64
#: Dtypes and the lowest compute capability the tensor-core kernels are built for.
TC_DTYPES: tuple[str, ...] = ("float16", "bfloat16")
TC_MIN_COMPUTE_CAPABILITY = (8, 0)
#: Dtypes the kernels are built for.
KERNEL_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
#: Element type of the arrays the kernels are launched with, per dtype. numba has no bfloat16 arrays, so bfloat16
#: data travels as int16 bit patterns that the kernels widen to float32 (see dtypes.py).
STORAGE_DTYPES: dict[str, str] = {"float32": "float32", "float16": "float16", "bfloat16": "int16"}
#: Lowest compute capability a dtype is offered on: the contract keeps bfloat16 to GPUs with native bfloat16
#: (sm_80 on), although the kernels themselves only shift and round its bits.
MIN_COMPUTE_CAPABILITY: dict[str, tuple[int, int]] = {"bfloat16": (8, 0)}
#: Compute capabilities the compile check builds for with the CUDA 13 toolchain (T4, A100, A10/RTX 30, L4/RTX 40,
#: H100). CUDA 13 dropped 7.0 (V100): ``python -m numba_flash.cuda.compile_check --cc 7.0`` needs the CUDA 12
#: toolchain of the ``cuda12`` extra.
COMPUTE_CAPABILITIES: tuple[tuple[int, int], ...] = ((7, 5), (8, 0), (8, 6), (8, 9), (9, 0))
#: Compute capabilities a real GPU may run the kernels on (what the backend accepts).
SUPPORTED_COMPUTE_CAPABILITIES: tuple[tuple[int, int], ...] = ((7, 0),) + COMPUTE_CAPABILITIES
STATIC_SMEM_LIMIT = 48 * 1024
#: Kernels that can take their shared memory dynamically, past 48 KiB (smem.py): the SIMT forward and backward.
DYNAMIC_SMEM_KERNELS: tuple[str, ...] = ("forward", "backward_dkdv", "backward_dq")
#: Upper bound on float32 accumulators one thread keeps in registers; above it ptxas starts spilling at D = 256.
MAX_ACCUMULATORS_PER_THREAD = 64
_FLOAT = 4
#: Extra words per row of a transposed (D x rows) tile: a multiple of 4 keeps rows 16-byte aligned for 128-bit
#: loads, and 4 makes the stride 4 times an odd number (see ``transposed_stride``).
TRANSPOSED_PAD = 4

# Preferred (block_m, block_n, threads) per kernel and head-dim bucket, chosen to fill most of 48 KiB while keeping
# each thread's accumulators at or under 64 registers. Big buckets get narrow key tiles: the float32 Q (or dO) tile
# has to stay resident, and it alone is a little over block_m * D * 4 bytes. The forward at D = 64 and 128 runs 64
# threads, not 128: a thread then owns 8 x 8 accumulators (not 8 x 4) and an 8 x 4 or 4 x 4 score block (not 4 x 4
# or 4 x 2), so it reads 0.25 shared-memory words per multiply-add of P V (not 0.375) and 0.375 or 0.5 of Q K^T
# (not 0.5 or 0.75); shared-memory bandwidth is what bounds it on sm_90 otherwise (performance model). Tiles big
# enough to give 128 threads such blocks do not fit 48 KiB. The backward kernels keep Q, dO, K and V resident
# (row-major, padded) and from D = 64 on run 64 threads too: 32 x 32 tiles give each thread a 4 x 4 score block and
# an 8 x 4 block of each of dK, dV (or of dQ); at D = 128 and 256 only 16 x 16 and 8 x 8 tiles fit 48 KiB.
_PREFERRED: dict[str, dict[int, tuple[int, int, int]]] = {
    "forward": {16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 64), 128: (32, 32, 64), 256: (32, 8, 128)},
    "backward_dkdv": {16: (32, 64, 128), 32: (32, 64, 128), 64: (32, 32, 64), 128: (16, 16, 64),
                      256: (8, 8, 64)},
    "backward_dq": {16: (64, 32, 128), 32: (64, 32, 128), 64: (32, 32, 64), 128: (16, 16, 64),
                    256: (8, 8, 64)},
    # Decoding (decode.py): block_m is query rows of one kv head's group (Hq / Hkv heads x Sq rows, 1 to 8 in a
    # typical decoding step), so it stays small; block_n keys of K or V in one shared buffer, as long as 48 KiB
    # allows, so that each barrier-separated step of the tile loop moves a good piece of the cache.
    "decode": {16: (16, 64, 128), 32: (16, 64, 128), 64: (16, 64, 128), 128: (16, 32, 128), 256: (8, 16, 128),
               512: (8, 4, 128), 576: (8, 4, 128)},
    # Tensor cores: 4 warps of 16 query rows, 16-bit tiles, Q sharing V's buffer until its fragments are in
    # registers (D <= 128). Key tiles timed on an H200 (2026-11-28, tools/gpu_tile_sweep.py, float16, S = 4096;
    # BENCHMARKS.md): at D = 64, 32 keys (126 registers: 4 blocks an SM, not 2) take 1-6% less GPU time than 64;
    # at D = 128, 64 keys took 6-8% less than 32 on plain and causal calls, but with every switch on (window,
    # softcap, ALiBi, dropout: the compile check's worst case) they spill up to 320 bytes, so 32 it stays. Blocks
    # of 8 warps were slower at both. At D = 256, Q's fragments would take 64 registers next to 128 accumulators,
    # so Q stays in shared memory beside 16-key K and V tiles: 48 KiB. D = 16 and 32 keep the model's choice.
    "tc_forward": {16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 128), 128: (64, 32, 128),
                   256: (64, 16, 128)},
    # The tensor-core dQ kernel keeps Q's and dO's fragments in registers beside dQ's accumulators and three
    # arrays of scores per key tile (S, dP, softcap's factor), so key tiles stay at 32 or less (64 spilled at
    # D = 32); K and V tiles in shared memory. D = 256 stays on the SIMT backward (launch.tensor_core_reason).
    "tc_backward_dq": {16: (64, 32, 128), 32: (64, 32, 128), 64: (64, 32, 128), 128: (64, 16, 128)},
    # dK/dV: warps own 16 keys each (block_n = 16 x warps), block_m queries per step; K and V stay in shared
    # memory for the whole loop beside the step's Q and dO.
    "tc_backward_dkdv": {16: (32, 64, 128), 32: (32, 64, 128), 64: (32, 64, 128), 128: (16, 64, 128)},
    # TF32: 4 warps of 16 query rows as above; float32 K and V tiles, 17 KiB at D = 64 and 33 KiB at D = 128 with
    # 32 keys (64 keys at D = 64 would leave no room for the mods' 16 KiB of staged values). Chosen by shared
    # memory, registers (compile check) and the performance model, not timed.
    "tf32_forward": {16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 128), 128: (64, 32, 128)},
}
# Past 48 KiB (dynamic shared memory, smem.py; sm_80 on, config.smem_limit_for), best first: the first that fits
# the device's limit wins over _PREFERRED. Only D = 256, where 48 KiB held the tiles to 32 x 8 (forward) and 8 x 8
# (backward), whose loads fed too few multiply-adds; chosen with the performance model (float32, plain; ceilings
# sm_90 / sm_80, was 27.1% / 54.3% forward, 40.9% / 71.2% dK/dV, 36.6% / 67.3% dQ). Forward: 32 x 32 / 128,
# 76 KiB, 46.2% / 82.6% (64 x 32 / 256 models 47.7% / 88.6% but holds one block per SM, and its 64-row query
# tiles halve the blocks of a short sequence). dK/dV: 16 x 32 / 256, 138 KiB, 51.4% / 89.7% (one block of 8 warps
# per SM); 16 x 16 / 128, 87.5 KiB, 45.2% / 82.6%, where 99 KiB is the limit (sm_86, sm_89). dQ: 32 x 32 / 256,
# 175 KiB, 51.3% (sm_90 only: 8 warps per SM where 32 x 16 / 128 models 51.6% with 4); 32 x 16 / 128, 120 KiB,
# 87.4% on sm_80; 16 x 16 / 128, 87.5 KiB, within 99 KiB: 44.8% on sm_86 (8 x 8: 39.3%; 16 x 16 / 64 would be
# 23.2%, one block of 2 warps per SM). On sm_86 and sm_89 the forward models 46.4% (was 27.1%) and dK/dV 46.0%
# (was 42.1%). Every one keeps 64 accumulators a thread.
# D = 512 and 576 (WIDE_HEAD_DIM_BUCKETS) have only these: the first for sm_80 and sm_90, the last within the
# 99 KiB of sm_86 and sm_89. Chosen with the performance model (float32, plain; ceilings sm_80 / sm_86 / sm_90,
# bounds, not measurements) among the tiles that compile without spills or stack in every dtype: forward 512
# 32 x 32 / 256 (148 KiB) 75.6% / - / 37.8%, 16 x 16 / 128 (81 KiB) 52.8% / 26.4% / 26.4%; forward 576 32 x 32 /
# 256 (166 KiB, sm_90) 31.3%, 16 x 16 / 128 (91 KiB) 46.2% / 23.1% / 23.1%; dK/dV 512 16 x 8 / 128 (114 KiB)
# 73.7% / - / 37.6%, 16 x 4 / 64 (89 KiB) - / 14.3% / -; dQ 512 16 x 8 / 128 (118 KiB) 79.0% / - / 43.5%, 8 x 8 /
# 64 (73 KiB) 68.4% / 17.9% / 34.5%; dK/dV 576 16 x 8 / 128 (126 KiB) 58.5% / - / 29.2%, 16 x 2 / 32 (86 KiB, the
# only one within 99 KiB: 16 x 4 / 64 is 128 bytes over) - / 4.2% / -; dQ 576 16 x 8 / 128 (130 KiB) 77.1% / - / 41.2%,
# 8 x 8 / 64 (81 KiB) - / 17.4% / -. Q, K, V and dO rows of 516 (580) words stay resident, so the backward's tiles
# are narrow and its score products split in 16 parts over the head dim (config.score_split).
_PREFERRED_DYNAMIC: dict[str, dict[int, tuple[tuple[int, int, int], ...]]] = {
    "forward": {256: ((32, 32, 128),), 512: ((32, 32, 256), (16, 16, 128)), 576: ((32, 32, 256), (16, 16, 128))},
    "backward_dkdv": {256: ((16, 32, 256), (16, 16, 128)), 512: ((16, 8, 128), (16, 4, 64)),
                      576: ((16, 8, 128), (16, 2, 32))},
    "backward_dq": {256: ((32, 32, 256), (32, 16, 128), (16, 16, 128)), 512: ((16, 8, 128), (8, 8, 64)),
                    576: ((16, 8, 128), (8, 8, 64))},
}

# Fallbacks, best first, for devices with less shared memory than 48 KiB (or callers that ask for a lower limit).
_CANDIDATES: tuple[tuple[int, int, int], ...] = (
    (64, 64, 128), (64, 32, 128), (32, 64, 128), (32, 32, 128), (64, 16, 128), (32, 16, 128), (16, 32, 128),
    (16, 16, 128), (32, 8, 128), (16, 8, 128), (8, 16, 128), (8, 8, 64), (8, 8, 32),
)

# Tensor-core fallbacks, best first (a warp's accumulators are its 16 rows' whatever the tile: only smem limits).
_TC_CANDIDATES: tuple[tuple[int, int, int], ...] = ((64, 32, 128), (32, 32, 64), (32, 16, 64), (16, 16, 32))


def smem_limit_for(compute_capability: tuple[int, int]) -> int:
    """Shared memory per block the picker may plan for on ``compute_capability``: the opt-in limit from sm_80 on
    (gpus.py: 163 KiB on sm_80, 99 KiB on sm_86 and sm_89, 227 KiB on sm_90), which the SIMT kernels reach through
    dynamic shared memory (smem.py); 48 KiB on sm_7x, which keep the static path (the T4's 64 KiB would buy no
    bigger D = 256 tile, and the compile matrix stays as it was there). At launch, the device's own opt-in limit
    can lower it further (launch.configs_for)."""
    from .gpus import GPUS

    cc = tuple(compute_capability)
    if cc < (8, 0) or cc not in GPUS:
        return STATIC_SMEM_LIMIT
    return GPUS[cc].max_smem_per_block


def storage_dtype(dtype: str) -> str:
    """The element type of the kernels' arrays for ``dtype`` ('int16' bit patterns for 'bfloat16')."""
    try:
        return STORAGE_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype: expected one of {KERNEL_DTYPES}, got {dtype!r}") from None


def dtype_supported_on(dtype: str, compute_capability: tuple[int, int]) -> bool:
    """Whether the kernels are offered for ``dtype`` on a device of ``compute_capability``."""
    return dtype in KERNEL_DTYPES and tuple(compute_capability) >= MIN_COMPUTE_CAPABILITY.get(dtype, (0, 0))


def head_dim_bucket(head_dim: int) -> int:
    """The smallest bucket >= ``head_dim`` (1 <= head_dim <= 576)."""
    for b in HEAD_DIM_BUCKETS:
        if head_dim <= b:
            return b
    raise AttentionInputError(f"q: expected head dim D between 1 and {HEAD_DIM_BUCKETS[-1]}, got D={head_dim}")


def head_dim_reason(head_dim: int, kernel: str, smem_limit: int) -> str | None:
    """Why the SIMT ``kernel`` is not offered for ``head_dim`` (1 to 576) on a device that allows ``smem_limit``
    bytes of shared memory a block; None when it is."""
    bucket = head_dim_bucket(head_dim)
    if bucket not in WIDE_HEAD_DIM_BUCKETS or kernel not in DYNAMIC_SMEM_KERNELS:
        return None
    if smem_limit <= STATIC_SMEM_LIMIT:
        need = WIDE_HEAD_DIM_MIN_COMPUTE_CAPABILITY
        return (f"head dim {head_dim} > 256: its tiles need more than 48 KiB of shared memory per block (compute "
                f"capability >= {need[0]}.{need[1]})")
    return None


def padded_stride(words: int) -> int:
    """Stride, in words, of a shared-memory row holding ``words`` values that threads read 4 at a time.

    4 words of padding make the stride 4 times an odd number once ``words`` is a multiple of 32, so 8 threads
    reading 16 bytes each from 8 consecutive rows at one column touch 8 different 16-byte pieces of the banks (no
    conflict). Rows of 8 stay unpadded: padding them would grow them by half, the margin that keeps D = 256 under
    48 KiB."""
    return words + TRANSPOSED_PAD if words >= 16 else words


def transposed_stride(rows: int) -> int:
    """Row stride, in words, of the transposed (D x rows) shared copy of a (rows x D) tile.

    A stride that is a multiple of 32 makes one warp's fetch cover 32 rows of a single column, one 4-byte read per
    input row; 4 words of padding let it cover 4 rows x 8 columns, 32 bytes per row (``padded_stride``)."""
    return padded_stride(rows)


def _whole_runs(share: int) -> bool:
    return share <= 4 or share % 4 == 0


def thread_grid(rows: int, cols: int, threads: int) -> tuple[int, int] | None:
    """Split a ``rows x cols`` product tile over ``threads`` threads as a ``(tr, tc)`` grid, each thread owning
    ``rows // tr`` rows and ``cols // tc`` columns (strided or contiguous, as the kernel lays them out). The most
    square per-thread block wins: it needs the fewest shared-memory loads per multiply-add. None when no split
    divides evenly. A thread's rows and columns come in runs of up to 4 (one 128-bit load), so a share of more
    than 4 is a whole number of runs: 576 columns split 16 ways (36 each), not 64 ways (9)."""
    best, best_cost = None, None
    tc = 1
    while tc <= threads:
        tr = threads // tc
        if (tr * tc == threads and rows % tr == 0 and cols % tc == 0
                and _whole_runs(rows // tr) and _whole_runs(cols // tc)):
            cost = rows // tr + cols // tc
            if best_cost is None or cost < best_cost or (cost == best_cost and tc > best[1]):
                best, best_cost = (tr, tc), cost
        tc *= 2
    return best


@dataclass(frozen=True)
class FlashAttentionConfig:
    """Tile sizes of one kernel. All sizes are compile-time constants of the kernel built from this config.

    kernel: 'forward' (one block per query tile), 'backward_dkdv' (one block per key tile), 'backward_dq',
    'decode' (one block per batch, kv head, split of the keys and tile of the group's query rows).
    block_m: query rows per tile; block_n: key rows per tile; threads: threads per block;
    head_dim_bucket: the head dim the kernel is compiled for (inputs with a smaller D are zero-padded in smem).
    """

    kernel: str
    block_m: int
    block_n: int
    threads: int
    head_dim_bucket: int

    # Thread grids of the products each kernel computes (see thread_grid).
    @property
    def score_split(self) -> int:
        """Parts the backward kernels cut the head dim of their score products (S, dP) into, each computed by its
        own group of threads over the whole tile and summed through shared memory; 1 for the other kernels. A thread's
        share of a tile too small for 4 x 4 blocks reads 4 words per 4 multiply-adds or worse (2 x 2 blocks at
        D = 128, 1 x 1 at D = 256); split in ``s`` parts it owns an ``s`` times bigger block over ``D / s`` columns,
        at the price of writing and re-reading the tile ``s`` times."""
        scores, nt, db = self.block_m * self.block_n, self.threads, self.head_dim_bucket
        split = 1
        if self.kernel in ("backward_dkdv", "backward_dq"):
            # Parts stay a multiple of 4 columns (one 128-bit load): 576 = 16 x 36 splits in at most 16.
            while (scores * split < 16 * nt and db // (2 * split) >= 8 and (db // (2 * split)) % 4 == 0
                   and 2 * split <= nt):
                split *= 2
        return split

    @property
    def score_grid(self) -> tuple[int, int] | None:
        """(block_m x block_n) scores / probabilities / dP, over the threads of one part of ``score_split``."""
        return thread_grid(self.block_m, self.block_n, self.threads // self.score_split)

    @property
    def accumulator_split(self) -> int:
        """Groups the dQ kernel splits each key tile's keys between, each group keeping a whole dQ partial (summed
        once, after the last tile, through the K tile's buffer); 1 for the other kernels. A thread's 8 x 4 block
        reads 3 shared words per 32 multiply-adds, an 8 x 8 one 4 per 64. Two groups where a thread would own 32
        accumulators and the K buffer holds a partial."""
        bm, bn, db, nt = self.block_m, self.block_n, self.head_dim_bucket, self.threads
        if (self.kernel == "backward_dq" and bm * db == 32 * nt and bn % 2 == 0 and nt % 2 == 0
                and bm * db <= bn * padded_stride(db)):
            return 2
        return 1

    @property
    def out_grid(self) -> tuple[int, int] | None:
        """(block_m x D) output accumulator (forward) or dQ accumulator, over the threads of one group of
        ``accumulator_split``."""
        return thread_grid(self.block_m, self.head_dim_bucket, self.threads // self.accumulator_split)

    @property
    def kv_grid(self) -> tuple[int, int] | None:
        """(block_n x D) dK and dV accumulators (backward_dkdv)."""
        return thread_grid(self.block_n, self.head_dim_bucket, self.threads)

    @property
    def tensor_cores(self) -> bool:
        """Whether this is a tensor-core kernel (one warp per 16 query rows; 16-bit tiles, or TF32 ones)."""
        return self.kernel in TC_KERNELS + TF32_KERNELS

    @property
    def q_in_registers(self) -> bool:
        """Tensor-core forward: Q's fragments stay in registers for the whole key loop (else in shared memory)."""
        return self.head_dim_bucket <= 128

    def smem_floats(self) -> int:
        """float32 words of static shared memory the kernel declares (tensor-core tiles: half as many bytes per
        element, rounded up)."""
        bm, bn, db = self.block_m, self.block_n, self.head_dim_bucket
        if self.kernel == "tc_backward_dq":   # 16-bit K and V tiles, and Q's then dO's then dQ's
            return -(-(bm + 2 * bn) * db // 2)
        if self.kernel == "tc_backward_dkdv":   # 16-bit K, V, Q, dO tiles and each query's lse and delta
            return -(-(2 * bm + 2 * bn) * db // 2) + 2 * bm
        if self.kernel == "tf32_forward":   # float32 K and V tiles, rows padded by 4 (tf32_forward.ROW_PAD)
            return 2 * bn * (db + 4)
        if self.tensor_cores:    # 16-bit elements: K, then V sharing Q's rows (or Q apart when it stays there)
            elements = (bn + max(bm, bn)) * db if self.q_in_registers else (bm + 2 * bn) * db
            return -(-elements // 2)
        if self.kernel == "forward":      # Q^T, one K^T-then-V buffer, P^T, row max/sum/rescale
            k_t, v = db * transposed_stride(bn), bn * db
            return db * transposed_stride(bm) + max(k_t, v) + bn * bm + 3 * bm
        ld, split = padded_stride(db), self.score_split
        parts = split if split > 1 else 0
        if self.kernel == "backward_dkdv":  # K, V, Q and dO tiles; P and dS, query-major, and their parts
            return 2 * (bn + bm) * ld + 2 * (1 + parts) * bm * padded_stride(bn)
        if self.kernel == "backward_dq":  # Q, dO, K and V tiles; dS, dropout's factors and the parts, key-major
            return 2 * (bm + bn) * ld + 2 * (1 + parts) * bn * padded_stride(bm)
        if self.kernel == "decode":  # Q, accumulator, one K-then-V tile, P, a word per thread, 4 per row, 2 per key
            ld, ldp = db + 1, bn + 1
            return bm * ld + bm * db + bn * ld + bm * ldp + self.threads + 4 * bm + 2 * bn
        raise ValueError(f"unknown kernel {self.kernel!r}")

    def smem_bytes(self) -> int:
        return self.smem_floats() * _FLOAT

    @property
    def dynamic_smem(self) -> bool:
        """Whether the kernel takes its shared memory as one dynamic buffer (more than the 48 KiB a block may
        declare statically; launched with the opt-in attribute, smem.py)."""
        return self.kernel in DYNAMIC_SMEM_KERNELS and self.smem_bytes() > STATIC_SMEM_LIMIT

    def dynamic_smem_bytes(self) -> int:
        """Bytes of dynamic shared memory to launch the kernel with: 0 for a kernel whose arrays are static."""
        return self.smem_bytes() if self.dynamic_smem else 0

    def accumulators_per_thread(self) -> int:
        """float32 accumulators each thread keeps in registers across the whole loop."""
        if self.kernel == "backward_dkdv" or self.tensor_cores and "dkdv" in self.kernel:
            return 2 * self.block_n * self.head_dim_bucket // self.threads
        if self.kernel == "decode":   # its accumulators live in shared memory (decode.py says why)
            return 0
        return self.block_m * self.head_dim_bucket * self.accumulator_split // self.threads

    def problems(self, smem_limit: int = STATIC_SMEM_LIMIT) -> list[str]:
        """Why this config cannot be compiled or run; empty when it can."""
        why = []
        for name, v in (("block_m", self.block_m), ("block_n", self.block_n), ("threads", self.threads)):
            if v < 1 or v & (v - 1):
                why.append(f"{name} must be a power of two >= 1, got {v}")
        if why:
            return why
        if self.threads > 1024:
            why.append(f"threads must be at most 1024, got {self.threads}")
        if self.kernel not in DYNAMIC_SMEM_KERNELS:   # static arrays only
            smem_limit = min(smem_limit, STATIC_SMEM_LIMIT)
        if self.smem_bytes() > smem_limit:
            why.append(f"needs {self.smem_bytes()} bytes of shared memory for head-dim bucket "
                       f"{self.head_dim_bucket}, more than the {smem_limit} a block may use")
        if self.tensor_cores:
            # One warp per 16 query rows (per 16 keys in the dK/dV kernel), and 16-wide mma k-steps on the other side.
            owned, other = ("block_n", "block_m") if self.kernel == "tc_backward_dkdv" else ("block_m", "block_n")
            rows, cols = getattr(self, owned), getattr(self, other)
            if rows < 16:
                why.append(f"tensor-core kernels run one warp per 16 rows of {owned}: {owned} must be at least 16, "
                           f"got {rows}")
            elif self.threads != 32 * (rows // 16):
                why.append(f"tensor-core kernels run one warp per 16 rows of {owned}: {owned}={rows} needs "
                           f"{32 * (rows // 16)} threads, got {self.threads}")
            if cols < 16:
                why.append(f"{other} must be at least 16 (one mma k-step), got {cols}")
            return why
        if self.kernel == "decode":
            # Each query row's softmax is shared by threads // block_m threads; the products are strided loops
            # that need no grid.
            if self.threads < self.block_m:
                why.append(f"threads must be at least block_m ({self.block_m}) for the decode kernel, got "
                           f"{self.threads}")
            if self.block_n < 4:   # its products run in steps of 4 keys
                why.append(f"block_n must be at least 4 for the decode kernel, got {self.block_n}")
            return why
        if self.kernel in ("backward_dkdv", "backward_dq") and self.block_m * self.block_n < self.threads:
            # Each thread sums the score parts of at least one (query, key) pair.
            why.append(f"block_m x block_n ({self.block_m} x {self.block_n}) must be at least threads "
                       f"({self.threads}) in the {self.kernel} kernel")
        grids = [("block_m x block_n", self.score_grid)]
        if self.kernel == "backward_dkdv":
            grids.append(("block_n x D", self.kv_grid))
        else:
            grids.append(("block_m x D", self.out_grid))
        for what, grid in grids:
            if grid is None:
                why.append(f"{self.threads} threads cannot split the {what} tile evenly")
        return why


@dataclass(frozen=True)
class TileOverride:
    """Tile sizes a user wants instead of the picker's; None keeps the picker's value. Applies to every kernel.
    ``tensor_cores``: True to require the tensor-core kernels (float16/bfloat16 on compute capability >= 8.0),
    False to keep the float32 SIMT kernels, None to let the backend choose (tensor cores wherever they apply)."""

    block_m: int | None = None
    block_n: int | None = None
    threads: int | None = None
    tensor_cores: bool | None = None

    def apply(self, cfg: FlashAttentionConfig) -> FlashAttentionConfig:
        return replace(cfg, **{k: v for k, v in (("block_m", self.block_m), ("block_n", self.block_n),
                                                    ("threads", self.threads)) if v is not None})


_override: contextvars.ContextVar[TileOverride | None] = contextvars.ContextVar("numba_flash_cuda_tiles",
                                                                               default=None)


@contextlib.contextmanager
def tile_config_override(block_m: int | None = None, block_n: int | None = None, threads: int | None = None,
                         tensor_cores: bool | None = None) -> Iterator[TileOverride]:
    """Use these tile sizes for every CUDA kernel launched inside the block. Sizes are powers of two; a config
    that does not fit shared memory raises ``AttentionInputError`` at the call that would use it.
    ``tensor_cores=False`` keeps float16/bfloat16 calls on the float32 SIMT kernels; ``True`` requires the
    tensor-core kernels (``AttentionInputError`` for a call they cannot serve)."""
    for name, v in (("block_m", block_m), ("block_n", block_n), ("threads", threads)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise AttentionInputError(f"{name}: expected a power of two >= 1, got {v!r}")
    if tensor_cores is not None and not isinstance(tensor_cores, bool):
        raise AttentionInputError(f"tensor_cores: expected True, False or None, got {tensor_cores!r}")
    token = _override.set(TileOverride(block_m, block_n, threads, tensor_cores))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


def active_override() -> TileOverride | None:
    return _override.get()


def tile_config_for(head_dim: int, dtype: str = "float32", compute_capability: tuple[int, int] = (9, 0),
                    smem_limit: int = STATIC_SMEM_LIMIT, kernel: str = "forward",
                    override: TileOverride | None = None) -> FlashAttentionConfig:
    """The tile config of ``kernel`` for a head dim, dtype and device.

    ``override`` (else the active ``tile_config_override``) replaces the picked sizes; an override that does not
    fit raises ``AttentionInputError``. Without one: with ``smem_limit`` above 48 KiB (``smem_limit_for(cc)``, the
    device's opt-in), the first ``_PREFERRED_DYNAMIC`` config that fits it; else the preferred config of the
    head-dim bucket if it fits ``smem_limit``, else the first fallback that does. ``dtype`` and
    ``compute_capability`` do not change the choice today (tiles are float32 in shared memory; the limit carries
    the device's part) but are part of the signature so that a tuned table can depend on them.
    """
    if kernel not in KERNELS + TC_KERNELS + TF32_KERNELS:
        raise ValueError(f"kernel: expected one of {KERNELS + TC_KERNELS + TF32_KERNELS}, got {kernel!r}")
    bucket = head_dim_bucket(head_dim)
    if kernel in TC_KERNELS and bucket > TC_MAX_HEAD_DIM:
        raise AttentionInputError(f"head dim {head_dim}: the tensor-core kernels take D <= {TC_MAX_HEAD_DIM}")
    if kernel in TF32_KERNELS and bucket > TF32_MAX_HEAD_DIM:
        raise AttentionInputError(f"head dim {head_dim}: the TF32 kernel takes D <= {TF32_MAX_HEAD_DIM}")
    if bucket in WIDE_HEAD_DIM_BUCKETS and kernel in DYNAMIC_SMEM_KERNELS:
        why = head_dim_reason(head_dim, kernel, smem_limit)
        if why:
            raise AttentionInputError(why)
        bm, bn, nt = _PREFERRED_DYNAMIC[kernel][bucket][-1]   # the smallest; the loop below takes the first fit
    else:
        bm, bn, nt = _PREFERRED[kernel][bucket]
    cfg = FlashAttentionConfig(kernel, bm, bn, nt, bucket)
    override = override if override is not None else active_override()
    # An override that names no tile size (``TileOverride()``, or only ``tensor_cores``) leaves the choice to the
    # picker; one that does applies to the 48 KiB preferred config, as it always has.
    if override is not None and (override.block_m, override.block_n, override.threads) != (None, None, None):
        cfg = override.apply(cfg)
        why = cfg.problems(smem_limit)
        if why:
            raise AttentionInputError(f"tile override {override}: {kernel} kernel, head dim {head_dim}: "
                                      + "; ".join(why))
        return cfg
    max_accumulators = (WIDE_MAX_ACCUMULATORS_PER_THREAD if bucket in WIDE_HEAD_DIM_BUCKETS
                        else MAX_ACCUMULATORS_PER_THREAD)
    for bm, bn, nt in _PREFERRED_DYNAMIC.get(kernel, {}).get(bucket, ()) if smem_limit > STATIC_SMEM_LIMIT else ():
        big = FlashAttentionConfig(kernel, bm, bn, nt, bucket)
        if not big.problems(smem_limit) and big.accumulators_per_thread() <= max_accumulators:
            return big
    if not cfg.problems(smem_limit):
        return cfg
    for bm, bn, nt in _TC_CANDIDATES if cfg.tensor_cores else _CANDIDATES:
        cand = FlashAttentionConfig(kernel, bm, bn, nt, bucket)
        if not cand.problems(smem_limit) and (
                cand.tensor_cores or cand.accumulators_per_thread() <= MAX_ACCUMULATORS_PER_THREAD):
            return cand
    raise AttentionInputError(f"no {kernel} tile config for head dim {head_dim} fits {smem_limit} bytes of "
                              "shared memory")


def all_tile_configs(ccs: tuple[tuple[int, int], ...] = COMPUTE_CAPABILITIES,
                     ) -> list[tuple[tuple[int, int], str, FlashAttentionConfig]]:
    """Every (compute capability, dtype, config) the picker produces with no override, for the compile check.
    Head dims are bucketed, so one representative per bucket covers every head dim from 1 to 576; dtypes a
    compute capability is not offered (``MIN_COMPUTE_CAPABILITY``) are left out for it."""
    seen = []
    for cc in ccs:
        for dtype in KERNEL_DTYPES:
            if not dtype_supported_on(dtype, cc):
                continue
            for kernel in KERNELS:
                for bucket in HEAD_DIM_BUCKETS:
                    if head_dim_reason(bucket, kernel, smem_limit_for(cc)):
                        continue   # not offered there
                    cfg = tile_config_for(bucket, dtype, cc, smem_limit_for(cc), kernel, override=TileOverride())
                    entry = (cc, dtype, cfg)
                    if entry not in seen:
                        seen.append(entry)
    return seen
