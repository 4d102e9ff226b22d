"""Host side of the KV-cache decode kernels: pick the config, launch the decode kernel and the merge of its splits.

Decoding picks its config first (``decode_config``: the self-check runs before the caller appends to the cache, so
that a refusal leaves the cache untouched) and launches with it (``flash_decode``). Arrays as in ``launch``: numba
device arrays, any strides, bfloat16 as int16 bits.
"""

from __future__ import annotations

import math
from typing import Any

from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.host.kernel_cache import disk_cached
from numba_flash.cuda.kernels.decode import MERGE_THREADS, make_split_merge_kernel
from numba_flash.cuda.kernels.registry import AUX_KERNELS
from numba_flash.cuda.kernels.variant import Variant
from numba_flash.cuda.host.launch import check_storage, kernel_flags, score_multipliers, slopes_arg

#: The split merge's registry name, which its disk-cache entries carry.
MERGE_NAME = next(aux.name for aux in AUX_KERNELS.values() if aux.role == "merge")


def launch_decode(cfg: FlashAttentionConfig, q: Any, k_cache: Any, v_cache: Any, seqinfo: Any, block_table: Any,
                  part_out: Any, part_lse: Any, *, page_size: int, softmax_scale: float, window_left: int,
                  window_right: int, softcap: float, bf16: bool, alibi: Any = None, stream: Any = 0) -> None:
    """Launch the decode kernel of ``cfg`` as it is, no self-check: every split's partial output. Arrays as for
    ``flash_decode``; part_out (num_splits, B, Hq, Sq, D) and part_lse (num_splits, B, Hq, Sq) float32."""
    has_left, has_right, has_softcap = kernel_flags(window_left, window_right, softcap)
    # async_copy off, as for every SIMT kernel (launch.py): the disk cache's key is the variant's repr
    variant = Variant(has_left=has_left, has_right=has_right, softcap=has_softcap, bf16=bf16, alibi=alibi is not None,
                      async_copy=False)
    kernel = disk_cached(cfg.spec.build(cfg, variant), cfg.kernel, cfg, variant)   # compiled once per machine
    num_splits, batch, hq, sq, d = part_out.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    qmult, capmult = score_multipliers(softmax_scale, softcap)
    grid = (num_splits * math.ceil(group * sq / cfg.block_m), hkv, batch)
    kernel[grid, cfg.threads, stream](q, k_cache, v_cache, seqinfo, block_table, part_out, part_lse, sq, group, d,
                                      page_size, num_splits, window_left, window_right, qmult, capmult,
                                      slopes_arg(alibi, part_lse[0]))


def launch_split_merge(part_out: Any, part_lse: Any, out: Any, lse: Any, *, bf16: bool, stream: Any = 0) -> None:
    """Launch the merge of the decode kernel's splits into out (B, Sq, Hq, D) and lse (B, Hq, Sq)."""
    _, batch, hq, sq, _ = part_out.shape
    kernel = disk_cached(make_split_merge_kernel(bf16), MERGE_NAME, bf16)
    kernel[batch * hq * sq, MERGE_THREADS, stream](part_out, part_lse, out, lse)


def flash_decode(cfg: FlashAttentionConfig, q: Any, k_cache: Any, v_cache: Any, seqinfo: Any, block_table: Any,
                 out: Any, lse: Any, part_out: Any, part_lse: Any, *, page_size: int, softmax_scale: float,
                 window_left: int, window_right: int, softcap: float, dtype: str, alibi: Any = None,
                 stream: Any = 0) -> None:
    """Attention of a decoding step over a KV cache: the decode kernel over (batch, kv head, split), then the
    merge of the splits. Two launches whatever the batch, the page layout or the number of splits.

    q, out: (B, Sq, Hq, D); k_cache, v_cache: (B_cache, S_cache, Hkv, D), or paged (num_blocks, page_size, Hkv,
    D); device arrays of ``storage_dtype(dtype)``, any strides. seqinfo (B, 3) int32: cache row, first and
    one-past-last key position of each sequence; block_table (B, max_blocks) int32, or any (1, 1) int32 array when
    ``page_size`` is 0. lse (B, Hq, Sq) float32. part_out (num_splits, B, Hq, Sq, D) and part_lse (num_splits, B,
    Hq, Sq) float32 scratch; their first dimension is the number of splits. window_left/right: -1 or a bound at
    most Sq + Sk; alibi: None or ``alibi_arg``'s (B, Hq) array. ``cfg``: from ``decode_config``.
    """
    check_storage(dtype, q=q, k_cache=k_cache, v_cache=v_cache, out=out)
    bf16 = dtype == "bfloat16"
    launch_decode(cfg, q, k_cache, v_cache, seqinfo, block_table, part_out, part_lse, page_size=page_size,
                  softmax_scale=softmax_scale, window_left=window_left, window_right=window_right, softcap=softcap,
                  bf16=bf16, alibi=alibi, stream=stream)
    launch_split_merge(part_out, part_lse, out, lse, bf16=bf16, stream=stream)
