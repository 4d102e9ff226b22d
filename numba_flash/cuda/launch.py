"""Host side of the CUDA kernels: pick the tile config, build (or fetch) the kernel, compute the grid, launch.

Every function here takes numba device arrays already viewed as (B, S, H, D) (any strides) and writes into
outputs the caller allocated; ``backends.cuda`` deals with array kinds, layouts and streams. bfloat16 data comes
as int16 device arrays of its bit patterns (``config.storage_dtype``), with ``dtype="bfloat16"``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .backward import make_delta_kernel, make_dkdv_kernel, make_dq_kernel
from .config import STATIC_SMEM_LIMIT, FlashAttentionConfig, TileOverride, storage_dtype, tile_config_for
from .forward import LOG2E, make_forward_kernel
from .simcheck import install_from_env


def compute_capability() -> tuple[int, int]:
    """The current device's compute capability; (9, 0) under the simulator or when it cannot be read."""
    from numba import config, cuda

    # The simulator's device claims 5.2, which describes no hardware: it runs whatever the kernels do.
    if config.ENABLE_CUDASIM:
        return (9, 0)
    try:
        cc = tuple(cuda.get_current_device().compute_capability)
        return (int(cc[0]), int(cc[1]))
    except Exception:  # the picker does not depend on cc today, so a guess is harmless
        return (9, 0)


def configs_for(head_dim: int, dtype: str, override: TileOverride | None = None,
                kernels: tuple[str, ...] = ("forward",)) -> dict[str, FlashAttentionConfig]:
    """Tile configs of ``kernels`` for this device; a bad override raises AttentionInputError."""
    cc = compute_capability()
    return {kern: tile_config_for(head_dim, dtype, cc, STATIC_SMEM_LIMIT, kern, override) for kern in kernels}


def _check_storage(dtype: str, **arrays: Any) -> None:
    """Raise unless every array holds ``dtype``'s storage type: a kernel would read bfloat16 bits in a float array,
    or floats in an int16 one, as numbers without complaint."""
    want = storage_dtype(dtype)
    for name, arr in arrays.items():
        if str(arr.dtype) != want:
            raise ValueError(f"{name}: expected {want} device array for dtype {dtype}, got {arr.dtype}")


def _multipliers(softmax_scale: float, softcap: float) -> tuple[np.float32, np.float32]:
    """What Q is multiplied by on load, and what tanh is multiplied by, so that scores come out in log2 units:
    ``s2 = log2(e) * s``."""
    if softcap > 0:
        return np.float32(softmax_scale / softcap), np.float32(softcap * LOG2E)
    return np.float32(softmax_scale * LOG2E), np.float32(0.0)


def flash_forward(q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, dtype: str, override: TileOverride | None = None,
                  stream: Any = 0) -> None:
    """Launch the forward kernel.

    q, out: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); device arrays of ``storage_dtype(dtype)`` (float32, float16,
    or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 device array. Writes out and lse.
    """
    _check_storage(dtype, q=q, k=k, v=v, out=out)
    install_from_env()   # under the simulator with NUMBA_FLASH_SIMCHECK=1, check this and every later launch
    bf16 = dtype == "bfloat16"
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfg = configs_for(d, dtype, override)["forward"]
    kernel = make_forward_kernel(cfg, window_left >= 0, window_right >= 0, softcap > 0, bf16)
    qmult, capmult = _multipliers(softmax_scale, softcap)
    grid = (math.ceil(sq / cfg.block_m), hq, batch)
    kernel[grid, cfg.threads, stream](q, k, v, out, lse, sq, sk, d, hq // hkv, window_left, window_right,
                                      qmult, capmult)


def flash_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
                   delta: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                   dtype: str, override: TileOverride | None = None, stream: Any = 0) -> None:
    """Launch the three backward kernels: delta pre-pass, dK/dV over key tiles, dQ over query tiles.

    dout, q, out, dq: (B, Sq, Hq, D); k, v, dk, dv: (B, Sk, Hkv, D); device arrays of ``storage_dtype(dtype)``
    (float32, float16, or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 as the forward wrote it;
    delta: (B, Hq, Sq) float32 scratch.
    """
    _check_storage(dtype, dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
    install_from_env()   # as in flash_forward
    bf16 = dtype == "bfloat16"
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    cfgs = configs_for(d, dtype, override, ("backward_dkdv", "backward_dq"))
    flags = (window_left >= 0, window_right >= 0, softcap > 0, bf16)
    qmult, capmult = _multipliers(softmax_scale, softcap)
    scale = np.float32(softmax_scale)

    rows = batch * hq * sq
    threads = 128
    make_delta_kernel(bf16)[math.ceil(rows / threads), threads, stream](dout, out, delta, sq, hq, d, rows)

    cfg = cfgs["backward_dkdv"]
    grid = (math.ceil(sk / cfg.block_n), hkv, batch)
    make_dkdv_kernel(cfg, *flags)[grid, cfg.threads, stream](
        q, k, v, dout, lse, delta, dk, dv, sq, sk, d, hq // hkv, window_left, window_right, qmult, capmult, scale)

    cfg = cfgs["backward_dq"]
    grid = (math.ceil(sq / cfg.block_m), hq, batch)
    make_dq_kernel(cfg, *flags)[grid, cfg.threads, stream](
        q, k, v, dout, lse, delta, dq, sq, sk, d, hq // hkv, window_left, window_right, qmult, capmult, scale)
