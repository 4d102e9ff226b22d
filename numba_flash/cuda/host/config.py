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

from dataclasses import dataclass

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


def smem_limit_for(compute_capability: tuple[int, int]) -> int:
    """Shared memory per block the picker may plan for on ``compute_capability``: the opt-in limit from sm_80 on
    (gpus.py: 163 KiB on sm_80, 99 KiB on sm_86 and sm_89, 227 KiB on sm_90), which the SIMT kernels reach through
    dynamic shared memory (smem.py); 48 KiB on sm_7x, which keep the static path (the T4's 64 KiB would buy no
    bigger D = 256 tile, and the compile matrix stays as it was there). At launch, the device's own opt-in limit
    can lower it further (devices.configs_for)."""
    from numba_flash.cuda.host.gpus import GPUS

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
