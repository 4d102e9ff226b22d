"""The tile picker of the CUDA kernels: each kernel's preferred tiles per head-dim bucket, the fallbacks that fit
less shared memory, and the user's override (``tile_config_override``). ``config.py`` says what a tile config is.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Iterator

from numba_flash.errors import AttentionInputError
from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, DYNAMIC_SMEM_KERNELS, HEAD_DIM_BUCKETS, KERNEL_DTYPES,
                                          KERNELS, MAX_ACCUMULATORS_PER_THREAD, STATIC_SMEM_LIMIT, TC_KERNELS,
                                          TC_MAX_HEAD_DIM, TF32_KERNELS, TF32_MAX_HEAD_DIM, WIDE_HEAD_DIM_BUCKETS,
                                          WIDE_MAX_ACCUMULATORS_PER_THREAD, FlashAttentionConfig, dtype_supported_on,
                                          head_dim_bucket, head_dim_reason, smem_limit_for)

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
    # D = 32); K and V tiles in shared memory. D = 256 stays on the SIMT backward (plan.tensor_core_reason).
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
