"""Tile configurations of the CUDA kernels: what each kernel keeps in shared memory, and the picker.

Every kernel stages its tiles in float32 shared memory (float16 and bfloat16 inputs are widened on load, so one
config serves every dtype), and reads four consecutive words per 128-bit load, so every row keeps a multiple of 4
words, padded by 4 (``padded_stride``): the forward keeps Q and K transposed (d-major), the backward kernels keep
every tile row-major and read along the head dim (see backward.py). Static
shared memory is limited to 48 KiB per block on every NVIDIA GPU numba-cuda targets; past it the SIMT kernels take
one dynamic buffer, which needs a per-kernel attribute numba does not set (smem.py sets it), up to the device's
opt-in limit (``smem_limit_for``). The picker uses that only where the performance model says a bigger tile pays
(the kernels' ``wide_tiles`` in kernels/registry.py: D = 256, sm_80 on), and head dims past 256 need it
(``WIDE_HEAD_DIM_BUCKETS``).

Users can override tile sizes for a block of code::

    with numba_flash.cuda.tile_config_override(block_m=32, block_n=32):
        out = backend_registry.get("flash", backend="cuda").forward(q, k, v)

or for one backend instance: ``CudaBackend(config=TileOverride(block_m=32, block_n=32))``. An override that does
not fit shared memory (or cannot be split over its threads) raises ``AttentionInputError`` when a call uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from numba_flash.cuda.kernels import registry
from numba_flash.cuda.kernels.layout import padded_stride, thread_grid
from numba_flash.cuda.kernels.spec import KernelSpec
from numba_flash.errors import AttentionInputError

#: Head dims are padded up to one of these (a compile-time constant of each kernel): D of q and k, and Dv of v
#: (a kernel is built for the bucket of max(D, Dv)). 512 is Gemma's, 576 MLA's (with Dv = 512).
HEAD_DIM_BUCKETS: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 576)
#: Buckets whose SIMT forward and backward tiles fit only past 48 KiB of shared memory: even 8 x 8 tiles of Q, K, V
#: and dO rows take 64 KiB at D = 512, so those kernels run there from compute capability 8.0 on (dynamic shared
#: memory, smem.py); the decode kernel, whose query tile is a few rows, fits 48 KiB everywhere.
WIDE_HEAD_DIM_BUCKETS: tuple[int, ...] = (512, 576)
WIDE_HEAD_DIM_MIN_COMPUTE_CAPABILITY = (8, 0)
#: Parts each bucket's score dot products are summed in, in order, each part over D / parts consecutive columns
#: summed from 0: the SIMT forward sums its scores so, and the SIMT backward kernels' default tiles split their
#: score products so (``FlashAttentionConfig.score_split``). The three kernels then compute every score with the
#: same bits, so the backward can take the forward's row max and sum (the row statistics, ``row_stats`` in
#: kernels/spec.py): P of a row whose max dominates is exactly 1 whatever the scores' size.
SCORE_PARTS: dict[int, int] = {16: 1, 32: 1, 64: 1, 128: 4, 256: 4, 512: 16, 576: 16}
#: Accumulators a thread may keep at the wide buckets, checked free of spills by the compile check (the forward and
#: the dK/dV kernel at 576 keep 2 x 36: 576 splits over 16 threads into whole 4-column runs of 36 columns, not 32).
WIDE_MAX_ACCUMULATORS_PER_THREAD = 72
#: The SIMT kernels with a tile config (kernels/registry.py). The delta pre-pass of the backward and the split
#: merge of decoding have none (a fixed number of threads per row).
KERNELS: tuple[str, ...] = registry.names(kind="simt")
#: The tensor-core kernels (mma.sync, float16 and bfloat16 on compute capability >= 8.0; see tc_forward.py): one warp
#: owns 16 query rows (16 keys in dK/dV's), threads = 32 * rows / 16, and tiles stay 16-bit in shared memory.
TC_KERNELS: tuple[str, ...] = registry.names(kind="mma")
#: The tensor-core backward holds dK's and dV's accumulators for 16 keys in one warp's registers, D per thread:
#: past D = 128 that cannot fit, and the SIMT backward serves.
TC_BACKWARD_MAX_HEAD_DIM = registry.find("dkdv", "mma").max_head_dim
#: The tensor-core forward's largest bucket; past it float16 and bfloat16 run on the SIMT kernels.
TC_MAX_HEAD_DIM = registry.find("forward", "mma").max_head_dim
#: The TF32 tensor-core forward (tf32_forward.py): float32 inputs on mma.sync's TF32 products, for calls that allow
#: it (``precision="tf32"``), compute capability >= 8.0 as the others. Q's fragments stay in registers beside the
#: output's accumulators (D / 2 words each per thread), so D <= 128; past it, and for the backward, float32 runs on
#: the SIMT kernels.
TF32_KERNELS: tuple[str, ...] = registry.names(kind="tf32")
TF32_MAX_HEAD_DIM = registry.find("forward", "tf32").max_head_dim
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
DYNAMIC_SMEM_KERNELS: tuple[str, ...] = tuple(spec.name for spec in registry.SPECS if spec.dynamic_smem)
#: Upper bound on float32 accumulators one thread keeps in registers; above it ptxas starts spilling at D = 256.
MAX_ACCUMULATORS_PER_THREAD = 64
_FLOAT = 4


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


@dataclass(frozen=True)
class FlashAttentionConfig:
    """Tile sizes of one kernel. All sizes are compile-time constants of the kernel built from this config.

    kernel: the name of a registered kernel (kernels/registry.py; ``spec`` is its entry): a forward or dQ kernel
    runs one block per query tile, a dK/dV kernel one per key tile, the decode kernel one per batch, kv head, split
    of the keys and tile of the group's query rows.
    block_m: query rows per tile; block_n: key rows per tile; threads: threads per block;
    head_dim_bucket: the head dim the kernel is compiled for (inputs with a smaller D are zero-padded in smem).
    """

    kernel: str
    block_m: int
    block_n: int
    threads: int
    head_dim_bucket: int

    @property
    def spec(self) -> KernelSpec:
        """The registry entry of ``kernel`` (ValueError for a name that is not registered)."""
        return registry.kernel_spec(self.kernel)

    @property
    def simt_backward(self) -> bool:
        """Whether this is one of the SIMT backward kernels (dK/dV, dQ), which split their score products."""
        return self.spec.kind == "simt" and self.spec.role in ("dkdv", "dq")

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
        if self.simt_backward:
            # Parts stay a multiple of 4 columns (one 128-bit load): 576 = 16 x 36 splits in at most 16.
            while (scores * split < 16 * nt and db // (2 * split) >= 8 and (db // (2 * split)) % 4 == 0
                   and 2 * split <= nt):
                split *= 2
            # A tile that splits at all takes the bucket's parts where its threads allow, so that its scores are
            # summed as the forward's are (SCORE_PARTS): the same bits, which the row statistics need.
            parts = SCORE_PARTS[db]
            if split > 1 and parts <= nt // 2 and thread_grid(self.block_m, self.block_n, nt // parts) is not None:
                split = parts
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
        if (self.simt_backward and self.spec.role == "dq" and bm * db == 32 * nt and bn % 2 == 0 and nt % 2 == 0
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
        """(block_n x D) dK and dV accumulators (the SIMT dK/dV kernel)."""
        return thread_grid(self.block_n, self.head_dim_bucket, self.threads)

    @property
    def tensor_cores(self) -> bool:
        """Whether this is a tensor-core kernel (one warp per 16 query rows; 16-bit tiles, or TF32 ones)."""
        return self.spec.tensor_cores

    @property
    def fragments(self) -> int:
        """Tensor-core kernels: the 16-row fragments of ``spec.warp_rows`` each warp owns, ``rows / (16 * warps)``
        (the kernel's ``FRAGMENTS``); 1 for the SIMT kernels."""
        if not self.tensor_cores or self.threads < 32:
            return 1
        return max(1, getattr(self, self.spec.warp_rows) // (16 * (self.threads // 32)))

    @property
    def q_in_registers(self) -> bool:
        """Tensor-core forward: Q's fragments stay in registers for the whole key loop (else in shared memory):
        D / 2 words a fragment beside its D / 2 accumulators, so up to 128 columns of fragments a warp. wgmma reads
        Q from shared memory, so never there."""
        return self.spec.kind != "wgmma" and self.head_dim_bucket * self.fragments <= 128

    def smem_floats(self) -> int:
        """float32 words of static shared memory the kernel declares (tensor-core tiles: half as many bytes per
        element, rounded up): its registry entry's ``smem_words``."""
        return self.spec.smem_words(self)

    def smem_bytes(self) -> int:
        return self.smem_floats() * _FLOAT

    @property
    def dynamic_smem(self) -> bool:
        """Whether the kernel takes its shared memory as one dynamic buffer (more than the 48 KiB a block may
        declare statically; launched with the opt-in attribute, smem.py)."""
        return self.spec.dynamic_smem and self.smem_bytes() > STATIC_SMEM_LIMIT

    def dynamic_smem_bytes(self) -> int:
        """Bytes of dynamic shared memory to launch the kernel with: 0 for a kernel whose arrays are static."""
        return self.smem_bytes() if self.dynamic_smem else 0

    def accumulators_per_thread(self) -> int:
        """float32 accumulators each thread keeps in registers across the whole loop."""
        if self.spec.role == "dkdv":
            return 2 * self.block_n * self.head_dim_bucket // self.threads
        if self.spec.role == "decode":   # its accumulators live in shared memory (decode.py says why)
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
        if not self.spec.dynamic_smem:   # static arrays only
            smem_limit = min(smem_limit, STATIC_SMEM_LIMIT)
        if self.smem_bytes() > smem_limit:
            why.append(f"needs {self.smem_bytes()} bytes of shared memory for head-dim bucket "
                       f"{self.head_dim_bucket}, more than the {smem_limit} a block may use")
        if self.tensor_cores:
            # One warp per 16 query rows (per 16 keys in the dK/dV kernel), and 16-wide mma k-steps on the other side.
            owned = self.spec.warp_rows
            other = "block_m" if owned == "block_n" else "block_n"
            rows, cols = getattr(self, owned), getattr(self, other)
            # Each warp owns F of them, F one of the kernel's ``fragments``: threads = 32 * rows / (16 * F).
            threads = [32 * rows // (16 * f) for f in self.spec.fragments if rows >= 16 * f]
            if rows < 16:
                why.append(f"tensor-core kernels run one warp per 16 rows of {owned}: {owned} must be at least 16, "
                           f"got {rows}")
            elif self.threads not in threads:
                per = "16 rows" if self.spec.fragments == (1,) else \
                    " or ".join(str(16 * f) for f in self.spec.fragments) + " rows"
                why.append(f"tensor-core kernels run one warp per {per} of {owned}: {owned}={rows} needs "
                           f"{' or '.join(map(str, threads))} threads, got {self.threads}")
            if cols < 16:
                why.append(f"{other} must be at least 16 (one mma k-step), got {cols}")
            if self.spec.kind == "wgmma" and (rows % 64 or self.head_dim_bucket < 64):
                why.append(f"wgmma kernels run one warpgroup per 64 rows of {owned} on 128-byte tile rows: {owned} "
                           f"must be a multiple of 64 and the head-dim bucket at least 64, got {rows} and "
                           f"{self.head_dim_bucket}")
            return why
        if self.spec.role == "decode":
            # Each query row's softmax is shared by threads // block_m threads; the products are strided loops
            # that need no grid.
            if self.threads < self.block_m:
                why.append(f"threads must be at least block_m ({self.block_m}) for the decode kernel, got "
                           f"{self.threads}")
            if self.block_n < 4:   # its products run in steps of 4 keys
                why.append(f"block_n must be at least 4 for the decode kernel, got {self.block_n}")
            return why
        if self.simt_backward and self.block_m * self.block_n < self.threads:
            # Each thread sums the score parts of at least one (query, key) pair.
            why.append(f"block_m x block_n ({self.block_m} x {self.block_n}) must be at least threads "
                       f"({self.threads}) in the {self.kernel} kernel")
        grids = [("block_m x block_n", self.score_grid)]
        if self.spec.role == "dkdv":
            grids.append(("block_n x D", self.kv_grid))
        else:
            grids.append(("block_m x D", self.out_grid))
        for what, grid in grids:
            if grid is None:
                why.append(f"{self.threads} threads cannot split the {what} tile evenly")
        return why
