"""The tile picker of the CUDA kernels: each kernel's preferred tiles per head-dim bucket (its registry entry's),
the fallbacks that fit less shared memory, and the user's override (``tile_config_override``). ``config.py`` says
what a tile config is.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace
from typing import Iterator

from numba_flash.errors import AttentionInputError
from numba_flash.cuda.host.config import (COMPUTE_CAPABILITIES, HEAD_DIM_BUCKETS, KERNEL_DTYPES, KERNELS,
                                          MAX_ACCUMULATORS_PER_THREAD, STATIC_SMEM_LIMIT, WIDE_HEAD_DIM_BUCKETS,
                                          WIDE_MAX_ACCUMULATORS_PER_THREAD, FlashAttentionConfig, dtype_supported_on,
                                          head_dim_bucket, head_dim_reason, smem_limit_for)
from numba_flash.cuda.kernels.registry import find, kernel_spec

# Each kernel's preferred tiles, within 48 KiB (``tiles``) and past it (``wide_tiles``), are its registry entry's
# (kernels/registry.py says why each is what it is).

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
    False to keep the float32 SIMT kernels, None to let the backend choose (tensor cores wherever they apply).
    ``wgmma``: True to run float16/bfloat16 forwards on Hopper's wgmma kernel (compute capability 9.0), which
    the backend does not choose by itself until a GPU has timed it."""

    block_m: int | None = None
    block_n: int | None = None
    threads: int | None = None
    tensor_cores: bool | None = None
    wgmma: bool | None = None

    def apply(self, cfg: FlashAttentionConfig) -> FlashAttentionConfig:
        return replace(cfg, **{k: v for k, v in (("block_m", self.block_m), ("block_n", self.block_n),
                                                    ("threads", self.threads)) if v is not None})


_override: contextvars.ContextVar[TileOverride | None] = contextvars.ContextVar("numba_flash_cuda_tiles",
                                                                               default=None)


@contextlib.contextmanager
def tile_config_override(block_m: int | None = None, block_n: int | None = None, threads: int | None = None,
                         tensor_cores: bool | None = None, wgmma: bool | None = None) -> Iterator[TileOverride]:
    """Use these tile sizes for every CUDA kernel launched inside the block. Sizes are powers of two; a config
    that does not fit shared memory raises ``AttentionInputError`` at the call that would use it.
    ``tensor_cores=False`` keeps float16/bfloat16 calls on the float32 SIMT kernels; ``True`` requires the
    tensor-core kernels (``AttentionInputError`` for a call they cannot serve). ``wgmma=True`` runs float16 and
    bfloat16 forwards on the Hopper wgmma kernel (``AttentionInputError`` where it cannot serve: another GPU than
    compute capability 9.0, a head dim outside 64..128)."""
    for name, v in (("block_m", block_m), ("block_n", block_n), ("threads", threads)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1 or v & (v - 1)):
            raise AttentionInputError(f"{name}: expected a power of two >= 1, got {v!r}")
    for name, flag in (("tensor_cores", tensor_cores), ("wgmma", wgmma)):
        if flag is not None and not isinstance(flag, bool):
            raise AttentionInputError(f"{name}: expected True, False or None, got {flag!r}")
    token = _override.set(TileOverride(block_m, block_n, threads, tensor_cores, wgmma))
    try:
        yield _override.get()
    finally:
        _override.reset(token)


def active_override() -> TileOverride | None:
    return _override.get()


def tile_config_for(head_dim: int, dtype: str = "float32", compute_capability: tuple[int, int] = (9, 0),
                    smem_limit: int = STATIC_SMEM_LIMIT, kernel: str | None = None,
                    override: TileOverride | None = None) -> FlashAttentionConfig:
    """The tile config of ``kernel`` for a head dim, dtype and device.

    ``override`` (else the active ``tile_config_override``) replaces the picked sizes; an override that does not
    fit raises ``AttentionInputError``. Without one: with ``smem_limit`` above 48 KiB (``smem_limit_for(cc)``, the
    device's opt-in), the first of the kernel's ``wide_tiles`` that fits it; else its preferred ``tiles`` of the
    head-dim bucket if they fit ``smem_limit``, else the first fallback that does. ``kernel``: a registered kernel's
    name (kernels/registry.py; ValueError for another; the SIMT forward by default). ``dtype`` and
    ``compute_capability`` do not change the choice today (tiles are float32 in shared memory; the limit carries
    the device's part) but are part of the signature so that a tuned table can depend on them.
    """
    spec = kernel_spec(kernel) if kernel is not None else find("forward")
    kernel = spec.name
    bucket = head_dim_bucket(head_dim)
    if bucket > spec.max_head_dim:
        raise AttentionInputError(f"head dim {head_dim}: the {kernel} kernel takes D <= {spec.max_head_dim}")
    if bucket in WIDE_HEAD_DIM_BUCKETS and spec.dynamic_smem:
        why = head_dim_reason(head_dim, kernel, smem_limit)
        if why:
            raise AttentionInputError(why)
        bm, bn, nt = spec.wide_tiles[bucket][-1]   # the smallest; the loop below takes the first fit
    else:
        bm, bn, nt = spec.tiles[bucket]
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
    for bm, bn, nt in spec.wide_tiles.get(bucket, ()) if smem_limit > STATIC_SMEM_LIMIT else ():
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
