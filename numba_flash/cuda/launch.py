"""Host side of the CUDA kernels: pick the tile config, build (or fetch) the kernel, compute the grid, launch.

Every function here takes numba device arrays already viewed as (B, S, H, D) (any strides) and writes into
outputs the caller allocated; ``backends.cuda`` deals with array kinds, layouts and streams. bfloat16 data comes
as int16 device arrays of its bit patterns (``config.storage_dtype``), with ``dtype="bfloat16"``.

``flash_forward`` and ``flash_backward`` pick a config and have ``selfcheck`` vouch for it (on a real GPU the first
launch of each specialisation checks it against the reference, and a config that fails is replaced by one that
passes); the ``launch_*`` functions launch one kernel with a given config, for them and for the self-check.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from . import selfcheck
from .backward import DELTA_ROWS_PER_BLOCK, make_delta_kernel, make_dkdv_kernel, make_dq_kernel
from .config import STATIC_SMEM_LIMIT, FlashAttentionConfig, TileOverride, storage_dtype, tile_config_for
from .forward import make_forward_kernel
from .masks import LOG2E
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


def alibi_arg(slopes: Any, stream: Any = 0) -> Any:
    """ALiBi slopes (B, Hq) (host, any float dtype) as the kernels take them: a float32 device array in log2 units
    (times log2(e), as the scores are); None stays None."""
    from numba import cuda

    if slopes is None:
        return None
    return cuda.to_device(np.ascontiguousarray(np.asarray(slopes, np.float64) * LOG2E, np.float32), stream=stream)


def _flags(window_left: int, window_right: int, softcap: float) -> tuple[bool, bool, bool]:
    """(has_left, has_right, softcap): the mask and softcap switches the kernels are compiled for."""
    return window_left >= 0, window_right >= 0, softcap > 0


def _slopes_arg(slopes: Any, lse: Any) -> Any:
    """The kernels' ``slopes`` argument: the ALiBi slopes, or without them any (B, Hq) float32 device array (a
    view of lse, never read), so that every variant has one signature."""
    return lse[:, :, 0] if slopes is None else slopes


def dropout_arg(dropout_p: float, seed: int, batch0: int = 0) -> tuple | None:
    """Dropout as the launch functions take it: None for p = 0, else (seed_lo, seed_hi, threshold, scale, batch0)
    (``numba_flash.dropout``; batch0 is the batch index of the call's first row, a packed sequence's index)."""
    if not dropout_p:
        return None
    from numba_flash.dropout import dropout_scale, dropout_threshold, split_seed

    return (*split_seed(seed), dropout_threshold(dropout_p), dropout_scale(dropout_p), int(batch0))


def _dropout_args(dropout: tuple | None) -> tuple:
    """The kernels' five dropout scalars (zeros, never read, without dropout)."""
    lo, hi, threshold, scale, batch0 = dropout if dropout is not None else (0, 0, 0, 0.0, 0)
    return np.uint64(lo), np.uint64(hi), np.uint64(threshold), np.float32(scale), int(batch0)


@functools.lru_cache(maxsize=None)
def _no_bias(device: int) -> Any:
    """A (1, 1, 1, 1) float32 array on GPU ``device``: the ``bias`` argument of kernels built without attn_bias,
    never read. One per GPU, not one per launch: an allocation per launch, and the free numba owes it later (which
    waits for the GPU), would sit on every plain call's path."""
    from numba import cuda

    return cuda.device_array((1, 1, 1, 1), np.float32)


def _bias_arg(bias: Any) -> Any:
    """The kernels' ``bias`` argument: attn_bias, or without it the current GPU's placeholder."""
    return _no_bias(selfcheck.current_device()) if bias is None else bias


def launch_forward(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float, bf16: bool, alibi: Any = None,
                   bias: Any = None, dropout: tuple | None = None, stream: Any = 0) -> None:
    """Launch the forward kernel of ``cfg`` as it is, no self-check. Arrays as for ``flash_forward``."""
    kernel = make_forward_kernel(cfg, *_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                 bias is not None, dropout is not None)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = _multipliers(softmax_scale, softcap)
    grid = (math.ceil(sq / cfg.block_m), hq, batch)
    kernel[grid, cfg.threads, stream](q, k, v, out, lse, sq, sk, d, hq // hkv, window_left, window_right,
                                      qmult, capmult, _slopes_arg(alibi, lse), _bias_arg(bias),
                                      *_dropout_args(dropout))


def launch_delta(dout: Any, out: Any, delta: Any, *, bf16: bool, stream: Any = 0) -> None:
    """Launch the backward's delta pre-pass: delta (B, Hq, Sq) = rowsum(dout * out), dout and out (B, Sq, Hq, D)."""
    batch, sq, hq, d = dout.shape
    rows = batch * hq * sq
    blocks = math.ceil(rows / DELTA_ROWS_PER_BLOCK)   # a warp per row
    make_delta_kernel(bf16)[blocks, 32 * DELTA_ROWS_PER_BLOCK, stream](dout, out, delta, sq, hq, d, rows)


def launch_dkdv(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dk: Any,
                dv: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
                alibi: Any = None, bias: Any = None, dropout: tuple | None = None, stream: Any = 0) -> None:
    """Launch the dK/dV kernel of ``cfg`` as it is, no self-check. Arrays as for ``flash_backward``."""
    kernel = make_dkdv_kernel(cfg, *_flags(window_left, window_right, softcap), bf16, alibi is not None,
                              bias is not None, dropout is not None)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = _multipliers(softmax_scale, softcap)
    grid = (math.ceil(sk / cfg.block_n), hkv, batch)
    kernel[grid, cfg.threads, stream](q, k, v, dout, lse, delta, dk, dv, sq, sk, d, hq // hkv, window_left,
                                      window_right, qmult, capmult, np.float32(softmax_scale),
                                      _slopes_arg(alibi, lse), _bias_arg(bias), *_dropout_args(dropout))


def launch_dq(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dq: Any, *,
              softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
              alibi: Any = None, bias: Any = None, dropout: tuple | None = None, stream: Any = 0) -> None:
    """Launch the dQ kernel of ``cfg`` as it is, no self-check. Arrays as for ``flash_backward``."""
    kernel = make_dq_kernel(cfg, *_flags(window_left, window_right, softcap), bf16, alibi is not None,
                            bias is not None, dropout is not None)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = _multipliers(softmax_scale, softcap)
    grid = (math.ceil(sq / cfg.block_m), hq, batch)
    kernel[grid, cfg.threads, stream](q, k, v, dout, lse, delta, dq, sq, sk, d, hq // hkv, window_left,
                                      window_right, qmult, capmult, np.float32(softmax_scale),
                                      _slopes_arg(alibi, lse), _bias_arg(bias), *_dropout_args(dropout))


def flash_forward(q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, dtype: str, alibi: Any = None, bias: Any = None,
                  dropout: tuple | None = None, override: TileOverride | None = None, stream: Any = 0) -> None:
    """Launch the forward kernel.

    q, out: (B, Sq, Hq, D); k, v: (B, Sk, Hkv, D); device arrays of ``storage_dtype(dtype)`` (float32, float16,
    or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 device array. alibi: None or the ALiBi slopes
    times log2(e), a (B, Hq) float32 device array (``alibi_arg``). bias: None or attn_bias, a float32 device array
    of 4 dimensions, each of the full size (B, Hq, Sq, Sk) or 1, any strides. dropout: None or ``dropout_arg``'s
    tuple. Writes out and lse.
    Raises ``selfcheck.SelfCheckFailed`` (a ``BackendDeclined``), having written nothing, when no forward config
    passes its self-check on this GPU.
    """
    _check_storage(dtype, q=q, k=k, v=v, out=out)
    install_from_env()   # under the simulator with NUMBA_FLASH_SIMCHECK=1, check this and every later launch
    picked = configs_for(q.shape[3], dtype, override)["forward"]
    flags = _flags(window_left, window_right, softcap)
    cfg = selfcheck.choose(picked, *flags, dtype, like=dict(q=q, k=k, v=v, out=out, lse=lse, bias=bias),
                           alibi=alibi is not None, bias=bias is not None, dropout=dropout is not None)
    launch_forward(cfg, q, k, v, out, lse, softmax_scale=softmax_scale, window_left=window_left,
                   window_right=window_right, softcap=softcap, bf16=dtype == "bfloat16", alibi=alibi, bias=bias,
                   dropout=dropout, stream=stream)


def flash_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
                   delta: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                   dtype: str, alibi: Any = None, bias: Any = None, dropout: tuple | None = None,
                   override: TileOverride | None = None, stream: Any = 0) -> None:
    """Launch the three backward kernels: delta pre-pass, dK/dV over key tiles, dQ over query tiles.

    dout, q, out, dq: (B, Sq, Hq, D); k, v, dk, dv: (B, Sk, Hkv, D); device arrays of ``storage_dtype(dtype)``
    (float32, float16, or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 as the forward wrote it;
    delta: (B, Hq, Sq) float32 scratch; alibi, bias and dropout as for ``flash_forward``. Raises
    ``selfcheck.SelfCheckFailed``, having written nothing, when no config of one of the two tiled kernels passes its
    self-check on this GPU.
    """
    _check_storage(dtype, dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
    install_from_env()   # as in flash_forward
    picked = configs_for(q.shape[3], dtype, override, ("backward_dkdv", "backward_dq"))
    flags = _flags(window_left, window_right, softcap)
    like = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv, delta=delta, bias=bias)
    # Both kernels are vouched for before either runs, so that a refusal leaves every output untouched.
    variant = dict(alibi=alibi is not None, bias=bias is not None, dropout=dropout is not None)
    dkdv_cfg = selfcheck.choose(picked["backward_dkdv"], *flags, dtype, like=like, **variant)
    dq_cfg = selfcheck.choose(picked["backward_dq"], *flags, dtype, like=like, **variant)
    bf16 = dtype == "bfloat16"
    kw = dict(softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
              bf16=bf16, alibi=alibi, bias=bias, dropout=dropout, stream=stream)
    launch_delta(dout, out, delta, bf16=bf16, stream=stream)
    launch_dkdv(dkdv_cfg, q, k, v, dout, lse, delta, dk, dv, **kw)
    launch_dq(dq_cfg, q, k, v, dout, lse, delta, dq, **kw)
