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

from numba_flash.cuda.device.block_tiles import tiles_arg
from numba_flash.cuda.device.masks import LOG2E
from numba_flash.cuda.device.sequences import block_table, no_sequences
from numba_flash.cuda.device.user_mods import MOD_NAMES, NO_MODS, CudaMods
from numba_flash.cuda.host import smem
from numba_flash.cuda.host.config import STATIC_SMEM_LIMIT, FlashAttentionConfig, storage_dtype
from numba_flash.cuda.host.devices import compute_capability, current_device
from numba_flash.cuda.host.kernel_cache import disk_cached
from numba_flash.cuda.host.mod_failures import named_mod_failures
from numba_flash.cuda.host.picker import TileOverride, tile_config_for
from numba_flash.cuda.kernels.backward_dkdv import DELTA_THREADS, make_delta_kernel
from numba_flash.cuda.kernels.registry import AUX_KERNELS, kernel_spec
from numba_flash.cuda.kernels.spec import ROLE_ARRAYS, ROLE_TILES, ROW_ARRAYS, KernelSpec
from numba_flash.cuda.kernels.variant import Variant

#: The delta pre-pass's registry name, which its disk-cache entries carry.
DELTA_NAME = next(aux.name for aux in AUX_KERNELS.values() if aux.role == "delta")


def _run(kernel: Any, grid: tuple[int, ...], cfg: FlashAttentionConfig, stream: Any, args: tuple) -> bool:
    """Launch ``kernel`` (built from ``cfg``) with the dynamic shared memory ``cfg`` needs; False, having launched
    nothing, when the device refused the opt-in past 48 KiB (smem.launch): the caller retries on the 48 KiB
    config, ``static_fallback(cfg)``."""
    return smem.launch(kernel, grid, cfg.threads, stream, cfg.dynamic_smem_bytes(), args)


def static_fallback(cfg: FlashAttentionConfig) -> FlashAttentionConfig:
    """The picker's config of ``cfg``'s kernel and head dim within 48 KiB of static shared memory."""
    return tile_config_for(cfg.head_dim_bucket, "float32", compute_capability(), STATIC_SMEM_LIMIT, cfg.kernel,
                           override=TileOverride())


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


@dataclasses.dataclass(frozen=True)
class _Scalars:
    """A tiled launch's scalar arguments, as the call gives them (``TiledLaunch`` turns them into the kernels')."""

    softmax_scale: float
    window_left: int
    window_right: int
    softcap: float
    bf16: bool
    alibi: Any = None
    bias: Any = None
    dropout: tuple | None = None
    mods: CudaMods = NO_MODS
    block_mask: Any = None
    packed: tuple | None = None
    dbias: Any = None
    base: tuple[int, int] = (0, 0)
    stream: Any = 0
    row_stats: Any = None


def copied_arrays(spec: KernelSpec, arrays: dict[str, Any]) -> tuple[Any, ...]:
    """The arrays among ``arrays`` (by name, ``spec.ROLE_ARRAYS``) that ``spec``'s tensor-core kernel stages in
    shared memory with cp.async when their layout allows it (``async_copy_ok``): the TF32 kernel copies K and V
    only, the 16-bit ones every (B, S, H, D) input."""
    names = ("k", "v") if "kv_slots" in spec.tail else ("q", "k", "v", "dout")
    return tuple(arrays[n] for n in names if n in arrays)


def _variant(spec: KernelSpec, arrays: dict[str, Any], c: _Scalars, dbias_mode: str) -> Variant:
    """The variant ``spec``'s kernel is built for on this call (the BlockMask's switch is set by ``_launch``)."""
    left, right, cap = kernel_flags(c.window_left, c.window_right, c.softcap)
    return Variant(has_left=left, has_right=right, softcap=cap, bf16=c.bf16, alibi=c.alibi is not None,
                   bias=c.bias is not None, dropout=c.dropout is not None,
                   async_copy=spec.tensor_cores and async_copy_ok(*copied_arrays(spec, arrays)), mods=c.mods,
                   varlen=c.packed is not None, dbias=dbias_mode)


def _tail(spec: KernelSpec, arrays: dict[str, Any], variant: Variant, c: _Scalars) -> tuple:
    """The arguments ``spec``'s kernel takes past the common list (spec.TAIL_ARGS)."""
    tail: tuple = ()
    for name in spec.tail:
        if name == "kv_slots":   # K and V as 16-bit slots for cp.async (two per float); placeholders otherwise
            tail += ((slots(arrays["k"]), slots(arrays["v"])) if variant.async_copy
                     else (_no_bits(current_device()),) * 2)
        elif name == "dbias":
            tail += (_bias_arg(c.dbias),)
        elif name == "base":
            tail += (int(c.base[0]), int(c.base[1]))
        elif name == "row_stats":   # the forward writes them, the backward reads them, where the switch is 1
            tail += (_bias_arg(c.row_stats), int(c.row_stats is not None))
        else:
            raise ValueError(f"{spec.name}: unknown tail argument {name!r}")
    return tail


def _launch(cfg: FlashAttentionConfig, arrays: dict[str, Any], c: _Scalars, dbias_mode: str = "") -> None:
    """Launch the tiled kernel of ``cfg`` (its spec says which arrays, grid and tail it takes) as it is, no
    self-check; where the device refuses shared memory past 48 KiB, again on the 48 KiB config."""
    spec = kernel_spec(cfg.kernel)
    if c.dbias is not None and "dbias" not in spec.tail:
        raise ValueError(f"dbias: the {spec.name} kernel does not compute attn_bias's gradient")
    if tuple(c.base) != (0, 0) and "base" not in spec.tail:
        raise ValueError(f"base: the {spec.name} kernel runs whole calls only")
    if c.row_stats is not None and "row_stats" not in spec.tail:
        raise ValueError(f"row_stats: the {spec.name} kernel keeps no row statistics")
    variant = _variant(spec, arrays, c, dbias_mode)
    mods, tiles = _block_tiles(c.mods, c.block_mask, cfg, c.stream)
    variant = dataclasses.replace(variant, mods=mods)
    kernel = disk_cached(spec.build(cfg, variant), spec.name, cfg, variant)   # compiled once per machine
    tail = _tail(spec, arrays, variant, c)
    args = tuple(_bits(arrays[n]) if spec.bits and n not in ROW_ARRAYS else arrays[n]
                 for n in ROLE_ARRAYS[spec.role])
    q, k = arrays["q"], arrays["k"]
    batch, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    along = ROLE_TILES[spec.role]
    block, seqlen = (cfg.block_m, sq) if along == "q" else (cfg.block_n, sk)
    seqs, blocks, grid_z = _blocks(c.packed, block, along, seqlen, batch, c.stream)
    if blocks == 0:
        return
    qmult, capmult = score_multipliers(c.softmax_scale, c.softcap)
    scale = () if spec.role == "forward" else (np.float32(c.softmax_scale),)
    args += (sq, sk, d, hq // hkv, c.window_left, c.window_right, qmult, capmult, *scale,
             slopes_arg(c.alibi, arrays["lse"]), _bias_arg(c.bias), *_dropout_args(c.dropout), tiles, seqs, *tail)
    with _compiling(c.mods), named_mod_failures(c.mods, spec.name,
                                                functools.partial(_tile_of, along, block, seqlen, c.packed)):
        launched = _run(kernel, (blocks, hq if along == "q" else hkv, grid_z), cfg, c.stream, args)
    if not launched:
        _launch(static_fallback(cfg), arrays, c, dbias_mode)


def _tile_of(along: str, block: int, seqlen: int, packed: tuple | None, ctaid: tuple[int, ...]) -> str:
    """What block ``ctaid`` of a tiled launch covers (``_launch``'s grid: tiles along ``along``, heads, batch), for
    an error message; packed sequences' blocks are entries of a block table, named by index only."""
    x, y, z = ctaid
    if packed is not None:
        return f"entry {x} of the block table, head {y}"
    rows = "queries" if along == "q" else "keys"
    head = "h" if along == "q" else "kv head"
    return f"{rows} {x * block}..{min(x * block + block, seqlen) - 1} of b={z}, {head}={y}"


def launch_forward(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float, bf16: bool, alibi: Any = None,
                   bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
                   block_mask: Any = None, packed: tuple | None = None, stream: Any = 0,
                   row_stats: Any = None) -> None:
    """Launch the forward kernel of ``cfg`` (the SIMT one, or the tensor-core or TF32 one for such a config) as
    it is, no self-check. Arrays as for ``flash.flash_forward``; ``row_stats``: None, or a (2, B, Hq, Sq) float32
    C-contiguous device array (lse's rows) the SIMT kernel fills with each row's max score and log2 of its sum
    (``spec.TAIL_ARGS``)."""
    _launch(cfg, dict(q=q, k=k, v=v, out=out, lse=lse),
            _Scalars(softmax_scale, window_left, window_right, softcap, bf16, alibi, bias, dropout, mods, block_mask,
                     packed, stream=stream, row_stats=row_stats))


def launch_delta(dout: Any, out: Any, delta: Any, *, bf16: bool, stream: Any = 0, parts: int = 1,
                 width: int | None = None) -> None:
    """Launch the backward's delta pre-pass: delta (B, Hq, Sq) = rowsum(dout * out), dout and out (B, Sq, Hq, Dv),
    summed in ``parts`` parts of ``width`` columns (default: the whole row), as the SIMT backward kernels of the call
    sum dP (``cfg.score_split`` parts of the bucket): make_delta_kernel."""
    batch, sq, hq, d = dout.shape
    rows = batch * hq * sq
    width = d if width is None else width
    blocks = math.ceil(rows / (DELTA_THREADS // parts))   # a thread per row and part
    kernel = disk_cached(make_delta_kernel(bf16), DELTA_NAME, bf16)
    kernel[blocks, DELTA_THREADS, stream](dout, out, delta, sq, hq, d, rows, parts, width)


def launch_dkdv(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dk: Any,
                dv: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
                alibi: Any = None, bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
                block_mask: Any = None, packed: tuple | None = None, dbias: Any = None, stream: Any = 0,
                row_stats: Any = None) -> None:
    """Launch the dK/dV kernel of ``cfg`` (the SIMT one, or the tensor-core one for a ``tc_backward_dkdv``
    config) as it is, no self-check. Arrays as for ``flash.flash_backward``; ``dbias``: None, or (B, Hq, 1, Sk)
    float32 zeros into which the SIMT kernel adds each key's gradient of a bias broadcast over the rows;
    ``row_stats``: None, or the forward's (``launch_forward``), read by the SIMT kernel."""
    _launch(cfg, dict(q=q, k=k, v=v, dout=dout, lse=lse, delta=delta, dk=dk, dv=dv),
            _Scalars(softmax_scale, window_left, window_right, softcap, bf16, alibi, bias, dropout, mods, block_mask,
                     packed, dbias, stream=stream, row_stats=row_stats), "" if dbias is None else "per_key")


def dq_dbias_mode(dbias: Any, seqlen_k: int) -> str:
    """The dQ kernel's ``dbias`` switch for a gradient array: one key per row (a bias broadcast over the keys, and
    more than one key) takes the rows' sums, else each pair's gradient (with one key they are the same)."""
    return "per_row" if dbias.shape[3] == 1 < seqlen_k else "pairs"


def launch_dq(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any, dq: Any, *,
              softmax_scale: float, window_left: int, window_right: int, softcap: float, bf16: bool,
              alibi: Any = None, bias: Any = None, dropout: tuple | None = None, mods: CudaMods = NO_MODS,
              block_mask: Any = None, packed: tuple | None = None, dbias: Any = None,
              base: tuple[int, int] = (0, 0), stream: Any = 0, row_stats: Any = None) -> None:
    """Launch the dQ kernel of ``cfg`` (the SIMT one, or the tensor-core one for a ``tc_backward_dq`` config) as it
    is, no self-check. Arrays as for ``flash.flash_backward``; attn_bias's gradient is added into ``dbias`` (SIMT
    only): each pair's when it has every key, (B or 1, Hq, Sq, Sk), or each row's sum over the keys into (B, Hq,
    Sq, 1). ``base``: the call's (batch entry, query head) of the arrays' first, for a launch of one slice of a
    call: the user's mods, the BlockMask and dropout's mask see the call's indices. ``row_stats``: as for
    ``launch_dkdv``."""
    _launch(cfg, dict(q=q, k=k, v=v, dout=dout, lse=lse, delta=delta, dq=dq),
            _Scalars(softmax_scale, window_left, window_right, softcap, bf16, alibi, bias, dropout, mods, block_mask,
                     packed, dbias, base, stream, row_stats),
            "" if dbias is None else dq_dbias_mode(dbias, k.shape[1]))
