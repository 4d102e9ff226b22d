"""Host side of attn_bias's gradient on the CUDA kernels: which kernel computes which sums, and the launches that
sum over the axes a bias broadcasts (flash.flash_backward calls these).

Every sum is in a fixed order, so the gradient has the same bits on every run (no atomics): a pair's gradient
is added by one thread of one launch at a time, a bias shared by the batch or the heads takes one dQ launch per
slice, in order, and the per-row and per-key sums go through scratch of every batch entry and query head.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numba_flash.cuda.kernels.backward_dkdv import DBIAS_SUM_THREADS, make_dbias_sum_kernel
from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.host import launch


def launch_dbias_sum(src: Any, dst: Any, stream: Any = 0) -> None:
    """Add into ``dst`` (the caller's attn_bias gradient, float32, 4 dimensions of src's size or 1) the sums of
    ``src`` (the kernels' per-row or per-key sums, (B, Hq, Sq or 1, Sk or 1) float32) over dst's broadcast axes."""
    blocks = math.ceil(dst.size / DBIAS_SUM_THREADS)
    if blocks:
        make_dbias_sum_kernel()[blocks, DBIAS_SUM_THREADS, stream](src, dst)


def dbias_targets(dbias: Any, q: Any, k: Any, stream: Any) -> tuple[Any, Any, Any]:
    """(sums, dK/dV's dbias, dQ's dbias) for the caller's gradient ``dbias``: a bias with every row and key goes
    to the dQ kernel as it is; one broadcast over the rows (and not the keys) to the dK/dV kernel's per-key sums,
    one broadcast over the keys to the dQ kernel's per-row sums, both into ``sums``, zeros of every batch entry
    and query head, which ``launch_dbias_sum`` reduces."""
    from numba import cuda

    batch, sq, hq, _ = q.shape
    sk = k.shape[1]
    if dbias is None or tuple(dbias.shape[2:]) == (sq, sk):
        return None, None, dbias
    per_key = dbias.shape[2] == 1 and dbias.shape[3] == sk
    sums = cuda.to_device(np.zeros((batch, hq, 1, sk) if per_key else (batch, hq, sq, 1), np.float32), stream=stream)
    return (sums, sums, None) if per_key else (sums, None, sums)


def dq_per_shared_slice(cfg: FlashAttentionConfig, q: Any, k: Any, v: Any, dout: Any, lse: Any, delta: Any,
                        dq: Any, dbias: Any, shared_batch: bool, shared_head: bool, kw: dict[str, Any]) -> None:
    """The dQ kernel once per batch entry (a bias shared by the batch) and per query head (shared by the heads),
    in order: every launch adds into the same gradient, so the sum needs no atomics and is the same on every run.
    A launch sees its slice as batch entry 0 and head 0 of a smaller call (its kv head sliced out, group 1), and is
    told the call's indices of them (``base``), which the user's mods, the BlockMask and dropout's mask take."""

    batch, _, hq, _ = q.shape
    group = hq // k.shape[2]
    alibi, bias = kw["alibi"], kw["bias"]
    for b in range(batch) if shared_batch else (None,):
        bs = slice(None) if b is None else slice(b, b + 1)
        for h in range(hq) if shared_head else (None,):
            hs = slice(None) if h is None else slice(h, h + 1)
            ks = slice(None) if h is None else slice(h // group, h // group + 1)
            one = dict(kw, alibi=None if alibi is None else alibi[bs, hs],
                       bias=bias if bias is None else bias[bs if bias.shape[0] > 1 else slice(None),
                                                           hs if bias.shape[1] > 1 else slice(None)])
            launch.launch_dq(cfg, q[bs, :, hs], k[bs, :, ks], v[bs, :, ks], dout[bs, :, hs], lse[bs, hs], delta[bs, hs],
                      dq[bs, :, hs], dbias=dbias, base=(b or 0, h or 0), **one)
