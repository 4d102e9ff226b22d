"""The decode kernel's self-check: ``selfcheck``'s scheme (its docstring says why and what it costs) for
``make_decode_kernel`` and the split merge, on a decoding problem instead of a dense one.

The input, random N(0, 1) data from ``selfcheck``'s fixed seed, makes every edge ragged: B = 2, Hq = 2, Hkv = 1
(GQA), D = head-dim bucket - 1, Sq = block_m / 2 + 1 (so the group's rows fill one row tile and spill into a second),
3 splits, sequences of ``2 * block_n + 5`` keys and of ``block_n + 1`` keys; the same keys once in a dense cache
read through ``cache_batch_idx`` and ``cache_leftpad`` and once in a paged cache with pages of 5 keys scattered
through ``block_table``. Masks, softcap and ALiBi as the dense check draws them. Bounds: the contract's, as for the
forward kernel (float32 out and every dtype's lse, max abs error <= max(1e-5, 4x textbook float32 attention's
error on the same keys); float16 / bfloat16 out, relative L2).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from numba_flash.cuda.selfcheck import FLOAT32_MAX_ABS, LOW_PRECISION_REL_L2, TEXTBOOK_FACTOR, Specialisation
from numba_flash.cuda.selfcheck.problem import (SEED, SOFTCAP, Problem, judge, max_abs, nan_device_like, rel_l2,
                                                textbook_float32, to_device_like, to_storage, widen)

NUM_SPLITS = 3
PAGE_SIZE = 5


def check_decode(spec: Specialisation, like: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(failures, measurements) of the decode kernel of ``spec`` on this GPU, dense and paged caches."""
    from numba import cuda

    from numba_flash.reference import attention_ref_kvcache

    from numba_flash.cuda.host.config import storage_dtype
    from numba_flash.cuda.host.launch import alibi_arg
    from numba_flash.cuda.host.launch_decode import launch_decode, launch_split_merge

    cfg = spec.cfg
    rng = np.random.default_rng(SEED)
    batch, hq, hkv, d = 2, 2, 1, max(1, cfg.head_dim_bucket - 1)
    sq = cfg.block_m // 2 + 1
    ends = np.array([2 * cfg.block_n + 5, cfg.block_n + 4], np.int64)
    starts = np.array([0, 3], np.int64)
    capacity = int(ends.max()) + 2

    def draw(*shape: int) -> tuple[np.ndarray, np.ndarray]:
        stored = to_storage(rng.standard_normal(shape).astype(np.float32), spec.dtype)
        return stored, widen(stored, spec.dtype)

    (q_s, q), (kc_s, kc), (vc_s, vc) = draw(batch, sq, hq, d), *(draw(batch + 1, capacity, hkv, d) for _ in "kv")
    rows = np.array([2, 0], np.int64)          # cache_batch_idx
    scale = 1.0 / math.sqrt(d)
    left = cfg.block_n + 3 if spec.has_left else -1
    right = 0 if spec.has_right else -1
    cap = SOFTCAP if spec.softcap else 0.0
    slopes = rng.uniform(0.05, 0.5, (batch, hq)) if spec.alibi else None

    ref_out, ref_lse, _, _ = attention_ref_kvcache(q, kc, vc, cache_seqlens=ends, cache_batch_idx=rows,
                                                   cache_leftpad=starts, softmax_scale=scale,
                                                   window_size=(left, right), softcap=cap, alibi_slopes=slopes)
    tb_out, tb_lse = np.zeros_like(q), np.zeros((batch, hq, sq), np.float32)
    for b in range(batch):
        keys, values = (c[rows[b], starts[b]:ends[b]][None] for c in (kc, vc))
        p = Problem(q=q[b:b + 1], k=keys, v=values, dout=q[b:b + 1], stored={}, scale=scale, window_left=left,
                     window_right=right, softcap=cap, slopes=None if slopes is None else slopes[b:b + 1],
                     bias=None, dropout_p=0.0)
        tb_out[b:b + 1], tb_lse[b:b + 1] = textbook_float32(p)
    out_bound = max(FLOAT32_MAX_ABS, TEXTBOOK_FACTOR * max_abs(tb_out, ref_out))
    lse_bound = max(FLOAT32_MAX_ABS, TEXTBOOK_FACTOR * max_abs(tb_lse, ref_lse))

    # The same keys paged: sequence b's logical page n in a block of its own, blocks shuffled.
    max_pages = -(-int(ends.max()) // PAGE_SIZE)
    table = rng.permutation(batch * max_pages).reshape(batch, max_pages)
    paged_k = np.zeros((batch * max_pages, PAGE_SIZE, hkv, d), kc_s.dtype)
    paged_v = np.zeros_like(paged_k)
    for b in range(batch):
        for pos in range(int(ends[b] - starts[b])):
            at = (table[b, pos // PAGE_SIZE], pos % PAGE_SIZE)
            paged_k[at], paged_v[at] = kc_s[rows[b], starts[b] + pos], vc_s[rows[b], starts[b] + pos]
    layouts = {"dense": (kc_s, vc_s, np.stack([rows, starts, ends], 1), np.zeros((1, 1)), 0),
               "paged": (paged_k, paged_v, np.stack([0 * rows, 0 * starts, ends - starts], 1), table, PAGE_SIZE)}

    store = storage_dtype(spec.dtype)
    q_dev = to_device_like(q_s, like.get("q"))
    measured = []
    for name, (k_host, v_host, seqinfo, block_table, page_size) in layouts.items():
        k_dev, v_dev = to_device_like(k_host, like.get("k_cache")), to_device_like(v_host, like.get("v_cache"))
        part_out = cuda.to_device(np.full((NUM_SPLITS, batch, hq, sq, d), np.nan, np.float32))
        part_lse = cuda.to_device(np.full((NUM_SPLITS, batch, hq, sq), np.nan, np.float32))
        out = nan_device_like(q.shape, store, like.get("out"))
        lse = cuda.to_device(np.full((batch, hq, sq), np.nan, np.float32))
        launch_decode(cfg, q_dev, k_dev, v_dev, cuda.to_device(seqinfo.astype(np.int32)),
                      cuda.to_device(block_table.astype(np.int32)), part_out, part_lse, page_size=page_size,
                      softmax_scale=scale, window_left=left, window_right=right, softcap=cap,
                      bf16=spec.dtype == "bfloat16", alibi=alibi_arg(slopes))
        launch_split_merge(part_out, part_lse, out, lse, bf16=spec.dtype == "bfloat16")
        got_out, got_lse = widen(out.copy_to_host(), spec.dtype), lse.copy_to_host()
        if spec.dtype == "float32":
            measured.append((f"{name} out", "max abs error", max_abs(got_out, ref_out), out_bound))
        else:
            measured.append((f"{name} out", "relative L2 error", rel_l2(got_out, ref_out),
                             LOW_PRECISION_REL_L2[spec.dtype]))
        measured.append((f"{name} lse", "max abs error", max_abs(got_lse, ref_lse), lse_bound))
    return judge(measured)
