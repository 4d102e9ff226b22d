"""Host side of the CUDA kernels: which kernel a call runs on, building (or fetching) it, its grid, its launch.

Every function here takes numba device arrays already viewed as (B, S, H, D) (any strides) and writes into
outputs the caller allocated; ``backends.cuda`` deals with array kinds, layouts and streams. bfloat16 data comes
as int16 device arrays of its bit patterns (``config.storage_dtype``), with ``dtype="bfloat16"``.

The ``launch_*`` functions launch one kernel with a given config as it is, for the entry points (``flash.py``,
which pick a config and have the self-check vouch for it) and for the self-check itself. Decoding with a KV
cache: ``launch_decode.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Iterator

import numpy as np

from numba_flash.errors import AttentionInputError

from numba_flash.cuda.host import smem
from numba_flash.cuda.kernels.backward_dkdv import (DELTA_ROWS_PER_BLOCK, make_delta_kernel, make_dkdv_kernel,
                                                    make_dq_kernel)
from numba_flash.cuda.device.block_tiles import tiles_arg
from numba_flash.cuda.host.config import (STATIC_SMEM_LIMIT, TC_BACKWARD_MAX_HEAD_DIM, TC_DTYPES, TC_MAX_HEAD_DIM,
                                          TC_MIN_COMPUTE_CAPABILITY, TF32_BIAS_MAX_HEAD_DIM, TF32_MAX_HEAD_DIM,
                                          FlashAttentionConfig, storage_dtype)
from numba_flash.cuda.host.picker import TileOverride, active_override, tile_config_for
from numba_flash.cuda.kernels.forward import make_forward_kernel
from numba_flash.cuda.device.masks import LOG2E
from numba_flash.cuda.device.sequences import block_table, no_sequences
from numba_flash.cuda.host.devices import compute_capability, current_device
from numba_flash.cuda.kernels.tc_dkdv import make_tc_dkdv_kernel
from numba_flash.cuda.kernels.tc_dq import make_tc_dq_kernel
from numba_flash.cuda.kernels.tc_forward import make_tc_forward_kernel
from numba_flash.cuda.kernels.tf32_forward import make_tf32_forward_kernel
from numba_flash.cuda.device.user_mods import MOD_NAMES, NO_MODS, CudaMods


def _run(kernel: Any, grid: tuple[int, ...], cfg: FlashAttentionConfig, stream: Any, args: tuple) -> bool:
    """Launch ``kernel`` (built from ``cfg``) with the dynamic shared memory ``cfg`` needs; False, having launched
    nothing, when the device refused the opt-in past 48 KiB (smem.launch): the caller retries on the 48 KiB
    config, ``static_fallback(cfg)``."""
    return smem.launch(kernel, grid, cfg.threads, stream, cfg.dynamic_smem_bytes(), args)


def static_fallback(cfg: FlashAttentionConfig) -> FlashAttentionConfig:
    """The picker's config of ``cfg``'s kernel and head dim within 48 KiB of static shared memory."""
    return tile_config_for(cfg.head_dim_bucket, "float32", compute_capability(), STATIC_SMEM_LIMIT, cfg.kernel,
                           override=TileOverride())


def tensor_core_reason(dtype: str, head_dim: int, override: TileOverride | None = None,
                       cc: tuple[int, int] | None = None, backward: bool = False, dbias: bool = False,
                       head_dim_v: int | None = None) -> str | None:
    """Why a forward (or, with ``backward``, a backward; with ``dbias``, one that returns attn_bias's gradient)
    call runs on the float32 SIMT kernels rather than the tensor-core ones; None when it runs on tensor cores.
    ``head_dim_v``: v's head dim Dv when it differs from ``head_dim``. With ``override.tensor_cores`` True a reason
    is an ``AttentionInputError`` instead."""
    override, off = _override_in_force(override)
    if off:
        return off
    cc = compute_capability() if cc is None else cc
    reason = None
    if dtype not in TC_DTYPES:
        reason = f"{dtype} (the tensor-core kernels take float16 and bfloat16)"
    elif tuple(cc) < TC_MIN_COMPUTE_CAPABILITY:
        need = TC_MIN_COMPUTE_CAPABILITY
        reason = f"the tensor-core kernels need compute capability >= {need[0]}.{need[1]}, this GPU is {cc[0]}.{cc[1]}"
    elif max(head_dim, head_dim_v or 0) > TC_MAX_HEAD_DIM:
        reason = f"head dim {max(head_dim, head_dim_v or 0)} > {TC_MAX_HEAD_DIM} (the tensor-core kernels' largest)"
    elif backward and head_dim_v is not None and head_dim_v != head_dim:
        # The forward reads Dv from v's shape; the backward kernels' copies and stores take one head dim.
        reason = (f"v's head dim Dv={head_dim_v} differs from D={head_dim} (the tensor-core backward needs "
                  "Dv = D)")
    elif backward and dbias:
        reason = "attn_bias's gradient (return_dbias) is computed by the SIMT dQ kernel only"
    elif backward and head_dim > TC_BACKWARD_MAX_HEAD_DIM:
        reason = (f"head dim {head_dim} > {TC_BACKWARD_MAX_HEAD_DIM}: the tensor-core backward would hold more "
                  "accumulators than a thread has registers")
    else:
        kernels = ("tc_backward_dkdv", "tc_backward_dq") if backward else ("tc_forward",)
        reason = _override_misfit(override, kernels, head_dim, dtype, cc)
    if reason and override is not None and override.tensor_cores:
        raise AttentionInputError(f"tensor_cores=True: {reason}")
    return reason


def _override_in_force(override: TileOverride | None) -> tuple[TileOverride | None, str | None]:
    """The tile override that applies (``override``, else the active ``tile_config_override``) and, when it keeps
    every call off the tensor cores (``tensor_cores=False``), the reason to give."""
    override = override if override is not None else active_override()
    if override is not None and override.tensor_cores is False:
        return override, "tensor cores switched off by tile_config_override(tensor_cores=False)"
    return override, None


def _override_misfit(override: TileOverride | None, kernels: tuple[str, ...], head_dim: int, dtype: str,
                     cc: tuple[int, int]) -> str | None:
    """Why a tile override that names sizes does not fit ``kernels``; None when it fits or names none."""
    if override is None or (override.block_m, override.block_n, override.threads) == (None, None, None):
        return None
    why = []
    for kernel in kernels:
        cfg = override.apply(tile_config_for(head_dim, dtype, tuple(cc), kernel=kernel, override=TileOverride()))
        why += [f"{kernel}: {w}" for w in cfg.problems(STATIC_SMEM_LIMIT)]
    return f"the tile override {override} does not fit the tensor-core kernels: " + "; ".join(why) if why else None


def tf32_reason(head_dim: int, override: TileOverride | None = None, cc: tuple[int, int] | None = None,
                head_dim_v: int | None = None, bias: bool = False) -> str | None:
    """Why a float32 forward that allows TF32 (``precision="tf32"``) runs on the float32 SIMT kernel rather than
    the TF32 one (tf32_forward.py); None when it runs on TF32. ``head_dim_v``: v's head dim when it differs;
    ``bias``: the call has attn_bias. With ``override.tensor_cores`` True a reason is an ``AttentionInputError``
    instead, as in ``tensor_core_reason``."""
    override, off = _override_in_force(override)
    if off:
        return off
    cc = compute_capability() if cc is None else cc
    widest = max(head_dim, head_dim_v or 0)
    what = f"head dim {widest}" if widest == head_dim else f"v's head dim Dv={widest}"
    if tuple(cc) < TC_MIN_COMPUTE_CAPABILITY:
        need = TC_MIN_COMPUTE_CAPABILITY
        reason = f"TF32 needs compute capability >= {need[0]}.{need[1]}, this GPU is {cc[0]}.{cc[1]}"
    elif widest > TF32_MAX_HEAD_DIM:
        reason = f"{what} > {TF32_MAX_HEAD_DIM} (the TF32 kernel's largest)"
    elif bias and widest > TF32_BIAS_MAX_HEAD_DIM:
        reason = (f"attn_bias at {what} > {TF32_BIAS_MAX_HEAD_DIM} (its reads would spill the TF32 kernel's "
                  "registers)")
    else:
        reason = _override_misfit(override, ("tf32_forward",), head_dim, "float32", cc)
    if reason and override is not None and override.tensor_cores:
        raise AttentionInputError(f"tensor_cores=True: {reason}")
    return reason


def forward_kernel(dtype: str, head_dim: int, override: TileOverride | None = None,
                   cc: tuple[int, int] | None = None, head_dim_v: int | None = None, precision: str = "ieee",
                   bias: bool = False) -> str:
    """The forward kernel a call runs on: "tf32_forward" for float32 that allows TF32 where ``tf32_reason`` has
    none, "tc_forward" where ``tensor_core_reason`` has none, else "forward" (SIMT). With
    ``tile_config_override(tensor_cores=True)`` a float32 call that allows TF32 but cannot have it raises
    ``AttentionInputError``, as float16 does."""
    if dtype == "float32" and precision == "tf32":
        return "forward" if tf32_reason(head_dim, override, cc, head_dim_v, bias) else "tf32_forward"
    return "forward" if tensor_core_reason(dtype, head_dim, override, cc, head_dim_v=head_dim_v) else "tc_forward"


def _bits(arr: Any) -> Any:
    """A uint16 view of a float16 or int16 (bfloat16 bits) device array: the tensor-core kernels move bits."""
    return arr.view(np.uint16)


def slots(arr: Any) -> Any:
    """A uint16 view (B, S, H, 2D) of a float32 device array (B, S, H, D) with unit stride along D: two 16-bit
    slots per float, what the TF32 kernel's ``cp.async`` copies. Built on the same memory rather than with
    ``view``, which numba-cuda refuses for a change of item size unless the array is C-contiguous (a "bhsd" call's
    transposed view is not)."""
    from numba import config

    if config.ENABLE_CUDASIM:   # numpy underneath, whose view takes any array with a contiguous last axis
        return arr.view(np.uint16)
    from numba.cuda.cudadrv.devicearray import DeviceNDArray

    shape, strides = tuple(int(n) for n in arr.shape), tuple(int(st) for st in arr.strides)
    return DeviceNDArray(shape[:-1] + (2 * shape[-1],), strides[:-1] + (2,), np.uint16, stream=arr.stream,
                         gpu_data=arr.gpu_data)


def _data_pointer(arr: Any) -> int:
    host = getattr(arr, "_ary", None)          # a simulator array: numpy underneath
    if host is not None:
        return int(host.ctypes.data)
    return int(arr.__cuda_array_interface__["data"][0])


def async_copy_ok(*arrays: Any) -> bool:
    """Whether ``cp.async`` can copy 16-byte chunks of these (B, S, H, D) arrays: unit stride along D, and
    every row starting 16-byte aligned (the other strides and the data pointer multiples of 16 bytes)."""
    for arr in arrays:
        # tuple() first: the simulator's shape tuples take no negative index
        strides, shape = tuple(int(x) for x in arr.strides), tuple(int(x) for x in arr.shape)
        if strides[-1] != arr.dtype.itemsize and shape[-1] > 1:
            return False
        if any(st % 16 for st, n in zip(strides[:-1], shape[:-1]) if n > 1) or _data_pointer(arr) % 16:
            return False
    return True


def check_storage(dtype: str, **arrays: Any) -> None:
    """Raise unless every array holds ``dtype``'s storage type: a kernel would read bfloat16 bits in a float array,
    or floats in an int16 one, as numbers without complaint."""
    want = storage_dtype(dtype)
    for name, arr in arrays.items():
        if str(arr.dtype) != want:
            raise ValueError(f"{name}: expected {want} device array for dtype {dtype}, got {arr.dtype}")


def score_multipliers(softmax_scale: float, softcap: float) -> tuple[np.float32, np.float32]:
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


def kernel_flags(window_left: int, window_right: int, softcap: float) -> tuple[bool, bool, bool]:
    """(has_left, has_right, softcap): the mask and softcap switches the kernels are compiled for."""
    return window_left >= 0, window_right >= 0, softcap > 0


def slopes_arg(slopes: Any, lse: Any) -> Any:
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


@functools.lru_cache(maxsize=None)
def _no_bits(device: int) -> Any:
    """A (1, 1, 1, 1) uint16 array on GPU ``device``: the TF32 kernel's K and V slots where it copies without
    cp.async, never read (one per GPU, as ``_no_bias``)."""
    from numba import cuda

    return cuda.device_array((1, 1, 1, 1), np.uint16)


def _bias_arg(bias: Any) -> Any:
    """The kernels' ``bias`` argument: attn_bias, or without it the current GPU's placeholder."""
    return _no_bias(current_device()) if bias is None else bias


def _block_tiles(mods: CudaMods, block_mask: Any, cfg: FlashAttentionConfig, stream: Any) -> tuple[CudaMods, Any]:
    """The mods to build ``cfg``'s kernel with and its ``tiles`` argument: with a BlockMask (of the call's
    mask_mod), the table re-cut to ``cfg``'s tiles and ``block_tiles`` on; else the placeholder, and the mods as
    they are (so that a call without a BlockMask runs the kernel it always did)."""
    if block_mask is None or mods.mask_mod is None:
        return mods, tiles_arg(None, cfg.block_m, cfg.block_n, current_device())
    return (dataclasses.replace(mods, block_tiles=True),
            tiles_arg(block_mask, cfg.block_m, cfg.block_n, current_device(), stream))


def _blocks(packed: tuple | None, block: int, along: str, seqlen: int, batch: int,
            stream: Any) -> tuple[Any, int, int]:
    """The kernels' ``seqs`` argument and the grid's x and z: dense, the placeholder, ``ceil(seqlen / block)`` tiles
    and ``batch``; for packed sequences (``packed`` = (cu_seqlens_q, cu_seqlens_k) on the host), their block table
    for this config's ``block`` along ``along`` (sequences.py), its length, and 1."""
    from numba import cuda

    if packed is None:
        return no_sequences(current_device()), math.ceil(seqlen / block), batch
    table = block_table(*packed, block, along)
    return cuda.to_device(table, stream=stream), len(table), 1


def _varlen_kw(packed: tuple | None) -> dict[str, bool]:
    """The kernel factories' ``varlen`` switch, passed only when on: a dense call builds (and caches) the kernel it
    always did, under the same factory arguments."""
    return {} if packed is None else {"varlen": True}


@contextlib.contextmanager
def _compiling(mods: CudaMods) -> Iterator[None]:
    """Around a launch, which compiles the kernel on its first call: with mods, a failure to compile is the user's
    mod's (numba-cuda cannot type it, or its global arrays overflow the GPU's 64 KiB of constant memory), so it
    becomes an AttentionInputError naming the mods and numba's reason."""
    if not mods.any:
        yield
        return
    try:
        yield
    except AttentionInputError:
        raise
    except Exception as exc:
        from numba.core.errors import NumbaError

        text = str(exc)
        if not isinstance(exc, NumbaError) and "constant" not in text.lower() and "nvvm" not in text.lower():
            raise
        names = ", ".join(f"{n}={getattr(getattr(mods, n), '__name__', '?')}" for n in MOD_NAMES
                          if getattr(mods, n) is not None)
        reason = " ".join(line.strip() for line in text.strip().splitlines()[:6] if line.strip())
        raise AttentionInputError(
            f"{names}: expected mods that numba-cuda can compile into the CUDA kernels (global arrays they read go "
            f"to the GPU's 64 KiB of constant memory, one copy per read in a mod's source); compiling them "
            f"failed: {type(exc).__name__}: {reason}") from exc


def launch_forward(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float, bf16: bool, alibi: Any = None,
                   bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
                   block_mask: Any = None, packed: tuple | None = None, stream: Any = 0) -> None:
    """Launch the forward kernel of ``cfg`` (the SIMT one, or the tensor-core one for a ``tc_forward`` config) as
    it is, no self-check. Arrays as for ``flash_forward``."""
    mods, tiles = _block_tiles(mods, block_mask, cfg, stream)
    varlen = _varlen_kw(packed)
    tail = ()
    if cfg.kernel == "tf32_forward":
        copies = async_copy_ok(k, v)
        kernel = make_tf32_forward_kernel(cfg, *kernel_flags(window_left, window_right, softcap), alibi is not None,
                                          bias is not None, dropout is not None, copies, mods, **varlen)
        # K and V as 16-bit slots for cp.async (two per float), or placeholders the plain-load build never reads.
        tail = (slots(k), slots(v)) if copies else (_no_bits(current_device()),) * 2
    elif cfg.tensor_cores:
        kernel = make_tc_forward_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                        bias is not None, dropout is not None, async_copy_ok(q, k, v), mods, **varlen)
        q, k, v, out = (_bits(x) for x in (q, k, v, out))
    else:
        kernel = make_forward_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                     bias is not None, dropout is not None, mods, **varlen)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = score_multipliers(softmax_scale, softcap)
    seqs, blocks, grid_z = _blocks(packed, cfg.block_m, "q", sq, batch, stream)
    if blocks == 0:
        return
    args = (q, k, v, out, lse, sq, sk, d, hq // hkv, window_left, window_right, qmult, capmult,
            slopes_arg(alibi, lse), _bias_arg(bias), *_dropout_args(dropout), tiles, seqs, *tail)
    with _compiling(mods):
        launched = _run(kernel, (blocks, hq, grid_z), cfg, stream, args)
    if not launched:
        launch_forward(static_fallback(cfg), q, k, v, out, lse, softmax_scale=softmax_scale,
                       window_left=window_left, window_right=window_right, softcap=softcap, bf16=bf16, alibi=alibi,
                       bias=bias, dropout=dropout, mods=mods, block_mask=block_mask, packed=packed, stream=stream)


def launch_delta(dout: Any, out: Any, delta: Any, *, bf16: bool, stream: Any = 0) -> None:
    """Launch the backward's delta pre-pass: delta (B, Hq, Sq) = rowsum(dout * out), dout and out (B, Sq, Hq, Dv)."""
    batch, sq, hq, d = dout.shape
    rows = batch * hq * sq
    blocks = math.ceil(rows / DELTA_ROWS_PER_BLOCK)   # a warp per row
    make_delta_kernel(bf16)[blocks, 32 * DELTA_ROWS_PER_BLOCK, stream](dout, out, delta, sq, hq, d, rows)


def launch_dkdv(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dk: Any,
                dv: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
                alibi: Any = None, bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
                block_mask: Any = None, packed: tuple | None = None, dbias: Any = None, stream: Any = 0) -> None:
    """Launch the dK/dV kernel of ``cfg`` (the SIMT one, or the tensor-core one for a ``tc_backward_dkdv``
    config) as it is, no self-check. Arrays as for ``flash_backward``; ``dbias``: None, or (B, Hq, 1, Sk) float32
    zeros into which the SIMT kernel adds each key's gradient of a bias broadcast over the rows."""
    mods, tiles = _block_tiles(mods, block_mask, cfg, stream)
    switches = _varlen_kw(packed)   # the factory's keyword switches
    extra = () if cfg.tensor_cores else (_bias_arg(dbias),)   # the SIMT kernel's dbias (placeholder: not read)
    if dbias is not None:
        if cfg.tensor_cores:
            raise ValueError("dbias: the tensor-core dK/dV kernel does not compute attn_bias's gradient")
        switches = dict(switches, dbias="per_key")
    if cfg.tensor_cores:
        kernel = make_tc_dkdv_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                     bias is not None, dropout is not None, async_copy_ok(q, k, v, dout), mods,
                                     **switches)
        q, k, v, dout, dk, dv = (_bits(x) for x in (q, k, v, dout, dk, dv))
    else:
        kernel = make_dkdv_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                  bias is not None, dropout is not None, mods, **switches)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = score_multipliers(softmax_scale, softcap)
    seqs, blocks, grid_z = _blocks(packed, cfg.block_n, "k", sk, batch, stream)
    if blocks == 0:
        return
    args = (q, k, v, dout, lse, delta, dk, dv, sq, sk, d, hq // hkv, window_left, window_right, qmult, capmult,
            np.float32(softmax_scale), slopes_arg(alibi, lse), _bias_arg(bias), *_dropout_args(dropout), tiles,
            seqs, *extra)
    with _compiling(mods):
        launched = _run(kernel, (blocks, hkv, grid_z), cfg, stream, args)
    if not launched:
        launch_dkdv(static_fallback(cfg), q, k, v, dout, lse, delta, dk, dv, softmax_scale=softmax_scale,
                    window_left=window_left, window_right=window_right, softcap=softcap, bf16=bf16, alibi=alibi,
                    bias=bias, dropout=dropout, mods=mods, block_mask=block_mask, packed=packed, dbias=dbias,
                    stream=stream)


def dq_dbias_mode(dbias: Any, seqlen_k: int) -> str:
    """The dQ kernel's ``dbias`` switch for a gradient array: one key per row (a bias broadcast over the keys, and
    more than one key) takes the rows' sums, else each pair's gradient (with one key they are the same)."""
    return "per_row" if dbias.shape[3] == 1 < seqlen_k else "pairs"


def launch_dq(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dq: Any, *,
              softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
              alibi: Any = None, bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
              block_mask: Any = None, packed: tuple | None = None, dbias: Any = None,
              base: tuple[int, int] = (0, 0), stream: Any = 0) -> None:
    """Launch the dQ kernel of ``cfg`` (the SIMT one, or the tensor-core one for a ``tc_backward_dq`` config) as it
    is, no self-check. Arrays as for ``flash_backward``; attn_bias's gradient is added into ``dbias`` (SIMT only):
    each pair's when it has every key, (B or 1, Hq, Sq, Sk), or each row's sum over the keys into (B, Hq, Sq, 1).
    ``base``: the call's (batch entry, query head) of the arrays' first, for a launch of one slice of a call: the
    user's mods, the BlockMask and dropout's mask see the call's indices."""
    mods, tiles = _block_tiles(mods, block_mask, cfg, stream)
    varlen = _varlen_kw(packed)   # the factory's keyword switches
    extra = () if cfg.tensor_cores else (_bias_arg(dbias), int(base[0]), int(base[1]))   # the SIMT kernel's
    if tuple(base) != (0, 0) and cfg.tensor_cores:
        raise ValueError("base: the tensor-core dQ kernel runs whole calls only")
    if dbias is not None:
        if cfg.tensor_cores:
            raise ValueError("dbias: the tensor-core dQ kernel does not compute attn_bias's gradient")
        varlen = dict(varlen, dbias=dq_dbias_mode(dbias, k.shape[1]))
    if cfg.tensor_cores:
        kernel = make_tc_dq_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                   bias is not None, dropout is not None, async_copy_ok(q, k, v, dout), mods, **varlen)
        q, k, v, dout, dq = (_bits(x) for x in (q, k, v, dout, dq))
    else:
        kernel = make_dq_kernel(cfg, *kernel_flags(window_left, window_right, softcap), bf16, alibi is not None,
                                bias is not None, dropout is not None, mods, **varlen)
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    qmult, capmult = score_multipliers(softmax_scale, softcap)
    seqs, blocks, grid_z = _blocks(packed, cfg.block_m, "q", sq, batch, stream)
    if blocks == 0:
        return
    args = (q, k, v, dout, lse, delta, dq, sq, sk, d, hq // hkv, window_left, window_right, qmult, capmult,
            np.float32(softmax_scale), slopes_arg(alibi, lse), _bias_arg(bias), *_dropout_args(dropout), tiles,
            seqs, *extra)
    with _compiling(mods):
        launched = _run(kernel, (blocks, hq, grid_z), cfg, stream, args)
    if not launched:
        launch_dq(static_fallback(cfg), q, k, v, dout, lse, delta, dq, softmax_scale=softmax_scale,
                  window_left=window_left, window_right=window_right, softcap=softcap, bf16=bf16, alibi=alibi,
                  bias=bias, dropout=dropout, mods=mods, block_mask=block_mask, packed=packed, dbias=dbias,
                  base=base, stream=stream)
