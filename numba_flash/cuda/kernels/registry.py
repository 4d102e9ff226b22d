"""Every kernel, by name: its ``KernelSpec`` (spec.py), the one place a kernel's name is written, beside its
tiles, its shared-memory words and what else the host and the tooling need to know of it. A new kernel is its file
in kernels/ (with ``build(cfg, variant)``) and one entry here. Importing this imports no ``numba.cuda``: a kernel's
file is imported when the kernel is first built."""

from __future__ import annotations

from typing import Any

from numba_flash.cuda.kernels.layout import padded_stride, transposed_stride
from numba_flash.cuda.kernels.spec import AuxKernel, KernelSpec


def _ceil_half(elements: int) -> int:
    """float32 words of ``elements`` 16-bit values."""
    return -(-elements // 2)


def _forward_words(cfg: Any) -> int:
    bm, bn, db = cfg.block_m, cfg.block_n, cfg.head_dim_bucket
    k_t, v = db * transposed_stride(bn), bn * db   # Q^T, one K^T-then-V buffer, P^T, row max/sum/rescale
    return db * transposed_stride(bm) + max(k_t, v) + bn * bm + 3 * bm


def _score_parts(cfg: Any) -> int:
    return cfg.score_split if cfg.score_split > 1 else 0


def _dkdv_words(cfg: Any) -> int:
    bm, bn, ld = cfg.block_m, cfg.block_n, padded_stride(cfg.head_dim_bucket)
    # K, V, Q and dO tiles; P and dS, query-major, and their parts; each query row's max and log2 sum
    return 2 * (bn + bm) * ld + 2 * (1 + _score_parts(cfg)) * bm * padded_stride(bn) + 2 * bm


def _dq_words(cfg: Any) -> int:
    bm, bn, ld = cfg.block_m, cfg.block_n, padded_stride(cfg.head_dim_bucket)
    # Q, dO, K and V tiles; dS, dropout's factors and the parts, key-major
    return 2 * (bm + bn) * ld + 2 * (1 + _score_parts(cfg)) * bn * padded_stride(bm)


def _decode_words(cfg: Any) -> int:
    bm, bn, db = cfg.block_m, cfg.block_n, cfg.head_dim_bucket
    ld, ldp = db + 1, bn + 1   # Q, accumulator, one K-then-V tile, P, a word per thread, 4 per row, 2 per key
    return bm * ld + bm * db + bn * ld + bm * ldp + cfg.threads + 4 * bm + 2 * bn


def _tc_forward_words(cfg: Any) -> int:
    bm, bn, db = cfg.block_m, cfg.block_n, cfg.head_dim_bucket
    # 16-bit K, then V sharing Q's rows (or Q apart when it stays in shared memory, past D = 128)
    return _ceil_half((bn + max(bm, bn)) * db if cfg.q_in_registers else (bm + 2 * bn) * db)


def _wgmma_forward_words(cfg: Any) -> int:
    return _ceil_half((cfg.block_m + 2 * cfg.block_n) * cfg.head_dim_bucket)   # 16-bit Q, K and V tiles


def _tc_dkdv_words(cfg: Any) -> int:
    bm, bn, db = cfg.block_m, cfg.block_n, cfg.head_dim_bucket
    return _ceil_half((2 * bm + 2 * bn) * db) + 2 * bm   # 16-bit K, V, Q, dO tiles; each query's lse and delta


def _tc_dq_words(cfg: Any) -> int:
    bm, bn, db = cfg.block_m, cfg.block_n, cfg.head_dim_bucket
    return _ceil_half((bm + 2 * bn) * db)   # 16-bit K and V tiles, and Q's then dO's then dQ's


def _tf32_forward_words(cfg: Any) -> int:
    return 2 * cfg.block_n * (cfg.head_dim_bucket + 4)   # float32 K and V tiles, rows padded by 4 (ROW_PAD there)


# ``tiles``: the preferred (block_m, block_n, threads) per head-dim bucket, chosen to fill most of 48 KiB while keeping
# each thread's accumulators at or under 64 registers. Big buckets get narrow key tiles: the float32 Q (or dO) tile
# has to stay resident, and it alone is a little over block_m * D * 4 bytes. The forward at D = 64 and 128 runs 64
# threads, not 128: a thread then owns 8 x 8 accumulators (not 8 x 4) and an 8 x 4 or 4 x 4 score block (not 4 x 4
# or 4 x 2), so it reads 0.25 shared-memory words per multiply-add of P V (not 0.375) and 0.375 or 0.5 of Q K^T
# (not 0.5 or 0.75); shared-memory bandwidth is what bounds it on sm_90 otherwise (performance model). Tiles big
# enough to give 128 threads such blocks do not fit 48 KiB. The backward kernels keep Q, dO, K and V resident
# (row-major, padded) and from D = 64 on run 64 threads too: 32 x 32 tiles give each thread a 4 x 4 score block and
# an 8 x 4 block of each of dK, dV (or of dQ); at D = 128 and 256 only 16 x 16 and 8 x 8 tiles fit 48 KiB.
# ``wide_tiles``: past 48 KiB (dynamic shared memory, smem.py; sm_80 on, config.smem_limit_for), best first: the first that fits
# the device's limit wins over ``tiles``. Only D = 256, where 48 KiB held the tiles to 32 x 8 (forward) and 8 x 8
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
SPECS: tuple[KernelSpec, ...] = (
    KernelSpec(
        name="forward", role="forward", kind="simt", module="forward", smem_words=_forward_words, products=2,
        tail=("row_stats",),
        tiles={16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 64), 128: (32, 32, 64), 256: (32, 8, 128)},
        wide_tiles={256: ((32, 32, 128),), 512: ((32, 32, 256), (16, 16, 128)),
                    576: ((32, 32, 256), (16, 16, 128))}),
    KernelSpec(
        name="backward_dkdv", role="dkdv", kind="simt", module="backward_dkdv", smem_words=_dkdv_words, products=4,
        tail=("dbias", "row_stats"), dbias_sum="per_key",
        tiles={16: (32, 64, 128), 32: (32, 64, 128), 64: (32, 32, 64), 128: (16, 16, 64), 256: (8, 8, 64)},
        wide_tiles={256: ((16, 32, 256), (16, 16, 128)), 512: ((16, 8, 128), (16, 4, 64)),
                    576: ((16, 8, 128), (16, 2, 32))}),
    KernelSpec(
        name="backward_dq", role="dq", kind="simt", module="backward_dq", smem_words=_dq_words, products=3,
        tail=("dbias", "base", "row_stats"), dbias_sum="per_row",
        tiles={16: (64, 32, 128), 32: (64, 32, 128), 64: (32, 32, 64), 128: (16, 16, 64), 256: (8, 8, 64)},
        wide_tiles={256: ((32, 32, 256), (32, 16, 128), (16, 16, 128)), 512: ((16, 8, 128), (8, 8, 64)),
                    576: ((16, 8, 128), (8, 8, 64))}),
    # Decoding (decode.py): block_m is query rows of one kv head's group (Hq / Hkv heads x Sq rows, 1 to 8 in a
    # typical decoding step), so it stays small; block_n keys of K or V in one shared buffer, as long as 48 KiB
    # allows, so that each barrier-separated step of the tile loop moves a good piece of the cache.
    KernelSpec(
        name="decode", role="decode", kind="simt", module="decode", smem_words=_decode_words,
        tiles={16: (16, 64, 128), 32: (16, 64, 128), 64: (16, 64, 128), 128: (16, 32, 128), 256: (8, 16, 128),
               512: (8, 4, 128), 576: (8, 4, 128)}),
    # Tensor cores: 4 warps of 16 query rows, 16-bit tiles, Q sharing V's buffer until its fragments are in
    # registers (D <= 128). Key tiles timed on an H200 (2026-11-28, tools/gpu_tile_sweep.py, float16, S = 4096;
    # BENCHMARKS.md): at D = 64, 32 keys (126 registers: 4 blocks an SM, not 2) take 1-6% less GPU time than 64;
    # at D = 128, 64 keys took 6-8% less than 32 on plain and causal calls, but with every switch on (window,
    # softcap, ALiBi, dropout: the compile check's worst case) they spill up to 320 bytes, so 32 it stays. Blocks
    # of 8 warps were slower at both. At D = 256, Q's fragments would take 64 registers next to 128 accumulators,
    # so Q stays in shared memory beside 16-key K and V tiles: 48 KiB. D = 16 and 32 keep the model's choice.
    # A warp may own two 16-row fragments (fragments=(1, 2): threads = 32 * block_m / 32), so that each K and V
    # fragment it loads feeds two mma (issue 45); Q then stays in registers only while 2 x D <= 128
    # (config.q_in_registers), and the words here follow.
    KernelSpec(
        name="tc_forward", role="forward", kind="mma", module="tc_forward", smem_words=_tc_forward_words,
        products=2, bits=True, dtypes=("float16", "bfloat16"), max_head_dim=256, fragments=(1, 2),
        tiles={16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 128), 128: (64, 32, 128), 256: (64, 16, 128)}),
    # dK/dV: warps own 16 keys each (block_n = 16 x warps), block_m queries per step; K and V stay in shared
    # memory for the whole loop beside the step's Q and dO.
    KernelSpec(
        name="tc_backward_dkdv", role="dkdv", kind="mma", module="tc_dkdv", smem_words=_tc_dkdv_words,
        products=4, bits=True, dtypes=("float16", "bfloat16"), max_head_dim=128, warp_rows="block_n",
        tiles={16: (32, 64, 128), 32: (32, 64, 128), 64: (32, 64, 128), 128: (16, 64, 128)}),
    # The tensor-core dQ kernel keeps Q's and dO's fragments in registers beside dQ's accumulators and three
    # arrays of scores per key tile (S, dP, softcap's factor), so key tiles stay at 32 or less (64 spilled at
    # D = 32); K and V tiles in shared memory. D = 256 stays on the SIMT backward (plan.tensor_core_reason).
    KernelSpec(
        name="tc_backward_dq", role="dq", kind="mma", module="tc_dq", smem_words=_tc_dq_words,
        products=3, bits=True, dtypes=("float16", "bfloat16"), max_head_dim=128,
        tiles={16: (64, 32, 128), 32: (64, 32, 128), 64: (64, 32, 128), 128: (64, 16, 128)}),
    # Hopper (sm_90a): one warpgroup of 4 warps per 64 query rows, Q K^T and P V on wgmma from 16-bit tiles in
    # shared memory (tc_forward.py's WGMMA path), the softmax as the mma.sync kernel's. Not warp-specialised yet,
    # and not timed: the picker offers it only where asked for (plan.py, issue 46).
    KernelSpec(
        name="wgmma_forward", role="forward", kind="wgmma", module="tc_forward", smem_words=_wgmma_forward_words,
        products=2, bits=True, dtypes=("float16", "bfloat16"), max_head_dim=128, min_compute_capability=(9, 0),
        tiles={64: (64, 64, 128), 128: (64, 64, 128)}),
    # TF32: 4 warps of 16 query rows as above; float32 K and V tiles, 17 KiB at D = 64 and 33 KiB at D = 128 with
    # 32 keys (64 keys at D = 64 would leave no room for the mods' 16 KiB of staged values). Chosen by shared
    # memory, registers (compile check) and the performance model, not timed.
    KernelSpec(
        name="tf32_forward", role="forward", kind="tf32", module="tf32_forward", smem_words=_tf32_forward_words,
        products=2, dtypes=("float32",), tail=("kv_slots",), max_head_dim=128,
        tiles={16: (64, 64, 128), 32: (64, 64, 128), 64: (64, 32, 128), 128: (64, 32, 128)}),
)
REGISTRY: dict[str, KernelSpec] = {spec.name: spec for spec in SPECS}

#: The kernels without a tile config. Their threads restate the kernels' own constants (backward_dkdv.py:
#: DELTA_THREADS and DBIAS_SUM_THREADS; decode.py: MERGE_THREADS) so that this imports no numba.cuda.
AUX_KERNELS: dict[str, AuxKernel] = {aux.name: aux for aux in (
    AuxKernel(name="backward_delta", role="delta", module="backward_dkdv", factory="make_delta_kernel", threads=128),
    AuxKernel(name="decode_merge", role="merge", module="decode", factory="make_split_merge_kernel", threads=64),
    AuxKernel(name="dbias_sum", role="bias_grad_sum", module="backward_dkdv", factory="make_dbias_sum_kernel",
              threads=128, takes_bf16=False),
)}


def kernel_spec(name: str) -> KernelSpec:
    """The spec of the tiled kernel called ``name`` (a tile config's ``kernel``)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"kernel: expected one of {sorted(REGISTRY)}, got {name!r}") from None


def find(role: str, kind: str = "simt") -> KernelSpec:
    """The registered kernel of ``role`` ("forward", "dkdv", "dq", "decode") and ``kind`` (spec.KINDS)."""
    for spec in SPECS:
        if spec.role == role and spec.kind == kind:
            return spec
    raise ValueError(f"no {kind} kernel of role {role!r} is registered")


def kernel_name(role: str, kind: str = "simt") -> str:
    """The name of ``find(role, kind)``."""
    return find(role, kind).name


def names(kind: str | None = None, role: str | None = None) -> tuple[str, ...]:
    """The registered kernels' names, in the registry's order, of ``kind`` and ``role`` where given."""
    return tuple(spec.name for spec in SPECS
                 if (kind is None or spec.kind == kind) and (role is None or spec.role == role))
