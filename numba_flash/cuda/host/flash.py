"""The CUDA backend's entry points: each picks the kernels and tile configs for a call, has the self-check vouch
for them (on a real GPU the first launch of each specialisation is checked against the reference, and a config
that fails is replaced by one that passes), and launches them (``launch.py``, ``launch_dbias.py``,
``launch_decode.py``). Arrays as in ``launch.py``: numba device arrays viewed as (B, S, H, D), any strides,
bfloat16 as int16 bits.
"""

from __future__ import annotations

from typing import Any, Callable

from numba_flash.cuda import selfcheck
from numba_flash.cuda.device.user_mods import NO_MODS, CudaMods
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.host.devices import configs_for
from numba_flash.cuda.host import launch
from numba_flash.cuda.host.launch import async_copy_ok, check_storage, copied_arrays, dq_dbias_mode, kernel_flags
from numba_flash.cuda.host.plan import backward_kernels, forward_kernel
from numba_flash.cuda.kernels.registry import kernel_name, kernel_spec
from numba_flash.cuda.host.launch_dbias import dbias_targets, dq_per_shared_slice, launch_dbias_sum
from numba_flash.cuda.host.picker import TileOverride
from numba_flash.cuda.simcheck import install_from_env


def flash_forward(q: Any, k: Any, v: Any, out: Any, lse: Any, *, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, dtype: str, alibi: Any = None, bias: Any = None,
                  dropout: tuple | None = None, mods: CudaMods = NO_MODS, block_mask: Any = None,
                  override: TileOverride | None = None, packed: tuple | None = None, stream: Any = 0,
                  precision: str = "ieee", stats_alloc: Callable[[tuple[int, ...]], Any] | None = None) -> Any:
    """Launch the forward kernel.

    q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); out: (B, Sq, Hq, Dv) (D up to 576, Dv up to 512;
    past 256 on the SIMT kernels); device arrays of ``storage_dtype(dtype)`` (float32, float16,
    or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 device array. alibi: None or the ALiBi slopes
    times log2(e), a (B, Hq) float32 device array (``alibi_arg``). bias: None or attn_bias, a float32 device array
    of 4 dimensions, each of the full size (B, Hq, Sq, Sk) or 1, any strides. dropout: None or ``dropout_arg``'s
    tuple. mods: the user's mods as device functions (``user_mods.cuda_mods``); block_mask: None or the
    ``numba_flash.BlockMask`` of mods' mask_mod, whose EMPTY tiles are skipped and FULL ones run without mask_mod
    (block_tiles.py). precision: "tf32" lets float32 run on the TF32 kernel (``plan.forward_kernel``). packed: None,
    or packed sequences' (cu_seqlens_q, cu_seqlens_k) int host arrays (B + 1,), with q, k, v, out their packed
    arrays as a batch of one ((1, total, H, D), lse (1, Hq, total_q)): one launch over every sequence's tiles
    (sequences.py). Writes out and lse. ``stats_alloc``: None, or ``stats_alloc(shape)`` giving a float32
    C-contiguous device array of that shape: on the SIMT kernel, the forward then fills one (2, *lse.shape) with
    the row statistics (kernels/spec.py) and returns it, for ``flash_backward``'s ``row_stats``; None otherwise.
    The self-check
    vouches for the kernels without mods (the mods only change which scores go in); a mod that numba-cuda cannot
    compile raises AttentionInputError naming it.
    Raises ``selfcheck.SelfCheckFailed`` (a ``BackendDeclined``), having written nothing, when no forward config
    passes its self-check on this GPU.
    """
    check_storage(dtype, q=q, k=k, v=v, out=out)
    install_from_env()   # under the simulator with NUMBA_FLASH_SIMCHECK=1, check this and every later launch
    d, dv = q.shape[3], v.shape[3]
    kernel = forward_kernel(dtype, d, override, head_dim_v=dv, precision=precision, bias=bias is not None,
                            staged_mods=mods is not None and mods.stages_tile)
    picked = configs_for(max(d, dv), dtype, override, (kernel,))[kernel]
    flags = kernel_flags(window_left, window_right, softcap)
    copies = not picked.tensor_cores or async_copy_ok(*copied_arrays(kernel_spec(kernel), dict(q=q, k=k, v=v)))
    cfg = selfcheck.choose(picked, *flags, dtype, like=dict(q=q, k=k, v=v, out=out, lse=lse, bias=bias),
                           alibi=alibi is not None, bias=bias is not None, dropout=dropout is not None,
                           async_copy=copies, varlen=packed is not None)
    keeps = stats_alloc is not None and "row_stats" in kernel_spec(kernel).tail
    row_stats = stats_alloc((2, *(int(n) for n in lse.shape))) if keeps else None
    launch.launch_forward(cfg, q, k, v, out, lse, softmax_scale=softmax_scale, window_left=window_left,
                          window_right=window_right, softcap=softcap, bf16=dtype == "bfloat16", alibi=alibi,
                          bias=bias, dropout=dropout, mods=mods, block_mask=block_mask, packed=packed, stream=stream,
                          row_stats=row_stats)
    return row_stats


def flash_backward(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dq: Any, dk: Any, dv: Any,
                   delta: Any, *, softmax_scale: float, window_left: int, window_right: int, softcap: float,
                   dtype: str, alibi: Any = None, bias: Any = None, dropout: tuple | None = None,
                   mods: CudaMods = NO_MODS, block_mask: Any = None, override: TileOverride | None = None,
                   packed: tuple | None = None, dbias: Any = None, stream: Any = 0, row_stats: Any = None) -> None:
    """Launch the three backward kernels: delta pre-pass, dK/dV over key tiles, dQ over query tiles.

    q, dq: (B, Sq, Hq, D); dout, out: (B, Sq, Hq, Dv); k, dk: (B, Sk, Hkv, D); v, dv: (B, Sk, Hkv, Dv); device
    arrays of ``storage_dtype(dtype)``
    (float32, float16, or int16 bfloat16 bits), any strides. lse: (B, Hq, Sq) float32 as the forward wrote it;
    delta: (B, Hq, Sq) float32 scratch; alibi, bias, dropout, mods, block_mask and packed as for ``flash_forward``
    (packed: each of the three kernels launches once for every sequence). dbias: None, or a float32 device array
    of zeros shaped like bias, (B or 1, Hq or 1, Sq or 1, Sk or 1), into which attn_bias's gradient is summed, on
    the SIMT kernels and the same on every run: a bias with every row and key takes each pair's from the dQ
    kernel (once per batch entry, in order, when the batch shares it; once per query head when the heads do); one
    broadcast over the rows takes each key's sum from the dK/dV kernel, one broadcast over the keys each row's
    from the dQ kernel, both into (B, Hq, ...) scratch that ``launch_dbias_sum`` then sums into dbias. row_stats:
    None, or what ``flash_forward`` returned with this lse: the SIMT kernels read it (not the tensor-core ones, nor a
    launch per slice of a shared bias's gradient). Raises
    ``selfcheck.SelfCheckFailed``, having written nothing, when no config of one of the two tiled kernels passes its
    self-check on this GPU.
    """
    check_storage(dtype, dout=dout, q=q, k=k, v=v, out=out, dq=dq, dk=dk, dv=dv)
    install_from_env()   # as in flash_forward
    d, d_v = q.shape[3], v.shape[3]
    dkdv_kernel, dq_kernel = backward_kernels(dtype, d, override, head_dim_v=d_v, dbias=dbias is not None)
    tc = kernel_spec(dkdv_kernel).tensor_cores
    sums, dkdv_dbias, dq_dbias = dbias_targets(dbias, q, k, stream)
    picked = configs_for(max(d, d_v), dtype, override, (dkdv_kernel, dq_kernel))
    flags = kernel_flags(window_left, window_right, softcap)
    like = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv, delta=delta, bias=bias)
    # Both kernels are vouched for before either runs, so that a refusal leaves every output untouched.
    copies = not tc or async_copy_ok(*copied_arrays(kernel_spec(dkdv_kernel), dict(q=q, k=k, v=v, dout=dout)))
    variant = dict(alibi=alibi is not None, bias=bias is not None, dropout=dropout is not None, async_copy=copies,
                   varlen=packed is not None)
    dkdv_cfg = selfcheck.choose(picked[dkdv_kernel], *flags, dtype, like=like,
                                dbias="" if dkdv_dbias is None else "per_key", **variant)
    dq_cfg = selfcheck.choose(picked[dq_kernel], *flags, dtype, like=like,
                              dbias="" if dq_dbias is None else dq_dbias_mode(dq_dbias, k.shape[1]), **variant)
    bf16 = dtype == "bfloat16"
    kw = dict(softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
              bf16=bf16, alibi=alibi, bias=bias, dropout=dropout, mods=mods, block_mask=block_mask, stream=stream)
    parts = dq_cfg.score_split   # delta summed as dP is (the dK/dV kernel's default tiles split alike)
    launch.launch_delta(dout, out, delta, bf16=bf16, stream=stream, parts=parts,
                        width=dq_cfg.head_dim_bucket // parts)

    def stats_of(name: str) -> Any:   # the SIMT kernels read the row statistics, the tensor-core ones do not
        return row_stats if "row_stats" in kernel_spec(name).tail else None

    launch.launch_dkdv(dkdv_cfg, q, k, v, dout, lse, delta, dk, dv, packed=packed, dbias=dkdv_dbias,
                       row_stats=stats_of(dkdv_kernel), **kw)
    shared_batch = dq_dbias is not None and dq_dbias.shape[0] == 1 and q.shape[0] > 1
    shared_head = dq_dbias is not None and dq_dbias.shape[1] == 1 and q.shape[2] > 1
    if shared_batch or shared_head:
        dq_per_shared_slice(dq_cfg, q, k, v, dout, lse, delta, dq, dq_dbias, shared_batch, shared_head, kw)
    else:
        launch.launch_dq(dq_cfg, q, k, v, dout, lse, delta, dq, packed=packed, dbias=dq_dbias,
                         row_stats=stats_of(dq_kernel), **kw)
    if sums is not None:
        launch_dbias_sum(sums, dbias, stream)


def decode_config(head_dim: int, dtype: str, *, window_left: int, window_right: int, softcap: float,
                  alibi: bool, override: TileOverride | None = None,
                  like: dict[str, Any] | None = None) -> FlashAttentionConfig:
    """The decode kernel's tile config for this device, vouched for by ``selfcheck`` (run here, on its first use,
    with arrays laid out like ``like``'s). Raises ``selfcheck.SelfCheckFailed`` when no config passes, and
    AttentionInputError for a bad tile override."""
    install_from_env()   # under the simulator with NUMBA_FLASH_SIMCHECK=1, check this and every later launch
    name = kernel_name("decode")
    picked = configs_for(head_dim, dtype, override, (name,))[name]
    return selfcheck.choose(picked, *kernel_flags(window_left, window_right, softcap), dtype, like=like, alibi=alibi)
