"""KV-cache decoding (``with_kvcache``) on any backend, from pieces the backend already has: rotary and the in-place
append are array slicing and arithmetic that numpy arrays and torch tensors share, and the attention over each
sequence's cached keys runs the backend's dense forward on views of the cache, split along the keys
(flash-decoding) and merged by lse.

A backend calls ``prepare`` (rotary on q and the new keys, computed in its compute dtype), then ``append`` (the only
write to a caller's array), then ``forward`` with its dense ``run`` function, as ``backends.varlen`` does for packed
sequences. A backend with a kernel of its own for the attention (the CPU's and the CUDA backend's decode kernels)
calls only the first two; the torch path (rocm) is the one that runs ``forward``.

The split arithmetic: the keys ``[a, e)`` of a sequence with ``Sk`` keys form a dense call with ``Sk' = e - a``
keys; it keeps every row's visible keys exactly when the right bound grows by ``Sk - e`` (a causal block sees more
of the keys left of the end) and the left bound shrinks by as much. A left bound that would become negative cannot
be written as a window, so a sequence with a bounded left window is not split; its work is already bounded by the
window, and the keys left of row 0's window are skipped. Nor is a sequence with ALiBi: a part's dense call would
measure its distances from the part's own end, not the sequence's.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from typing import Any, Callable

import numpy as np

from numba_flash.append_target import apart_from
from numba_flash.arrays import host_tensor_view, is_host_float_tensor, is_torch_tensor, to_numpy
from numba_flash import kvcache as kvcache_call
from numba_flash.kvcache import KVCacheCall
from numba_flash.merge import merge_attention_states
from numba_flash.rotary import apply_rotary, rotary_positions
from numba_flash.semantics import clamp_window_bound


def choose_num_splits(kv: KVCacheCall, workers: int) -> int:
    """The caller's ``num_splits``, or for 0 ``numba_flash.kvcache.choose_num_splits`` for ``workers`` (threads, or
    SMs on a GPU)."""
    longest = int(kv.seqlens_k.max())
    return kv.num_splits or kvcache_call.choose_num_splits(kv.batch, kv.nheads_kv, longest, workers)


def prepare(kv: KVCacheCall, q: Any, k_new: Any, cos: Any, sin: Any, arange: Callable[[int], Any],
            seqlens: Any) -> tuple[Any, Any]:
    """q and the new keys, rotated when the call has rotary tables; all arrays in the backend's compute dtype.
    ``seqlens`` is ``kv.cache_seqlens`` as the backend's integer array, ``arange`` its ``arange``."""
    if kv.rotary_cos is None:
        return q, k_new
    q_pos = rotary_positions(seqlens, kv.seqlen_q, kv.causal or kv.local, arange)
    k_pos = rotary_positions(seqlens, kv.seqlen_new, True, arange)
    return (apply_rotary(q, cos, sin, q_pos, kv.rotary_interleaved),
            apply_rotary(k_new, cos, sin, k_pos, kv.rotary_interleaved))


def _slots(kv: KVCacheCall, b: int, p0: int, p1: int) -> list[tuple[Any, slice, slice]]:
    """Where logical keys ``[p0, p1)`` of sequence b live: (cache row or block, positions there, positions within
    ``[p0, p1)``), one piece per page touched (one piece in all when the cache is not paged)."""
    if not kv.paged:
        return [(int(kv.cache_rows[b]), slice(p0, p1), slice(0, p1 - p0))]
    pieces, p = [], p0
    while p < p1:
        block, offset = int(kv.block_table[b, p // kv.page_size]), p % kv.page_size
        n = min(kv.page_size - offset, p1 - p)
        pieces.append((block, slice(offset, offset + n), slice(p - p0, p - p0 + n)))
        p += n
    return pieces


def append(kv: KVCacheCall, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any) -> None:
    """Write the new keys and values into the caches at ``cache_seqlens``. k_new, v_new: (B, S_new, Hkv, D) arrays
    the caches accept in an assignment (the caches' kind; numpy casts on assignment, torch callers cast first).
    New keys or values that share memory with a cache are copied first, so the append lands as given."""
    k_new, v_new = (apart_from(x, k_cache, v_cache) for x in (k_new, v_new))
    for b in range(kv.batch):
        p0 = int(kv.cache_seqlens[b])
        for where, there, here in _slots(kv, b, p0, p0 + kv.seqlen_new):
            k_cache[where, there] = k_new[b, here]
            v_cache[where, there] = v_new[b, here]


def _numpy_view(cache: Any, compute: Any) -> np.ndarray | None:
    """A numpy view of a plain torch CPU cache of float32 or float64 into which values of numpy dtype ``compute``
    are assigned without rounding (the same bits torch's assignment writes), else None. numpy's assignment costs a
    microsecond where torch's indexing costs five."""
    if not is_host_float_tensor(cache):
        return None
    view = host_tensor_view(cache)
    # float32 or float64 values into float64, float32 into float32: no rounding
    return view if view.dtype == compute or view.dtype == np.float64 else None


def _host_cache(cache: Any) -> Any:
    """The caller's host cache as an array written in place: a torch tensor detached (the same memory, and no
    complaint from autograd about a leaf written in place), a DLPack exporter through its numpy view."""
    if is_torch_tensor(cache):
        return cache.detach()
    return cache if isinstance(cache, np.ndarray) else to_numpy(cache)


def _host_values(cache: Any, values: np.ndarray) -> Any:
    """``values`` as an assignment into ``cache`` takes them: numpy casts on assignment, torch needs a tensor of
    the cache's dtype (bfloat16 included)."""
    if is_torch_tensor(cache):
        import torch

        return torch.from_numpy(values).to(cache.dtype)
    return values


def bump_cache_versions(kv: KVCacheCall) -> None:
    """What torch's own assignment does after an append into torch caches through numpy views: bump their version
    counters, so that autograd sees the caches written in place (the checks refused an inference tensor outside
    inference mode, whose counter torch would not let this bump)."""
    # the caches are torch tensors, so torch is imported (an import statement costs a microsecond a step)
    sys.modules["torch"].autograd.graph.increment_version((kv.k_cache, kv.v_cache))


def cache_views(kv: KVCacheCall, compute: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """Numpy views (B_cache, capacity, Hkv, D) of both caches where they are plain float32 / float64 torch CPU
    tensors that take values of numpy dtype ``compute`` without rounding, else None. The same memory: read after
    ``rotate_and_append_host(kv, compute, views)``, they hold the new keys."""
    k_view, v_view = _numpy_view(kv.k_cache, compute), _numpy_view(kv.v_cache, compute)
    return None if k_view is None or v_view is None else (k_view, v_view)


def rotate_and_append_host(kv: KVCacheCall, compute: Any,
                           views: tuple[np.ndarray, np.ndarray] | None | bool = False) -> np.ndarray:
    """Rotary and the append for host arrays (numpy, torch CPU tensors, host DLPack), computed in numpy's
    ``compute`` dtype. Returns q (B, Sq, Hq, D) rotated, a numpy array of ``compute``. ``views``: what
    ``cache_views(kv, compute)`` returned, for a caller that asked already (by default asked here): the caches
    are written through them when given."""
    def host(x: Any) -> np.ndarray:
        a = host_tensor_view(x) if is_host_float_tensor(x) else to_numpy(x)
        return a if a.dtype == compute else a.astype(compute)

    q = host(kv.q)
    k_new = host(kv.k_new) if kv.seqlen_new else None
    cos, sin = (None, None) if kv.rotary_cos is None else (host(kv.rotary_cos), host(kv.rotary_sin))
    q, k_new = prepare(kv, q, k_new, cos, sin, np.arange, kv.cache_seqlens)
    if not kv.seqlen_new:
        return q
    if views is False:
        views = cache_views(kv, compute)
    if views is not None:
        append(kv, *views, k_new, host(kv.v_new))
        bump_cache_versions(kv)
    else:
        append(kv, _host_cache(kv.k_cache), _host_cache(kv.v_cache), _host_values(kv.k_cache, k_new),
               _host_values(kv.v_cache, host(kv.v_new)))
    return q


def rotate_and_append_torch(kv: KVCacheCall, q: Any, k_cache: Any, v_cache: Any, k_new: Any, v_new: Any) -> Any:
    """Rotary and the append with torch on the tensors' device; q, the caches and the new keys are plain tensors
    (the caller's, detached). Rotary runs in float32 (float64 for float64). Returns q rotated, in q's dtype, as
    flash-attn's kernels read it after rotary."""
    import torch

    if kv.rotary_cos is not None:
        cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
        dev = q.device
        cos, sin = (torch.as_tensor(to_numpy(x) if not is_torch_tensor(x) else x).to(device=dev, dtype=cdt)
                    for x in (kv.rotary_cos, kv.rotary_sin))
        q_r, k_new = prepare(kv, q.to(cdt), k_new.to(cdt), cos, sin, lambda n: torch.arange(n, device=dev),
                             torch.tensor(kv.cache_seqlens.tolist(), device=dev))
        q = q_r.to(q.dtype)
    if kv.seqlen_new:
        append(kv, k_cache, v_cache, k_new.to(k_cache.dtype), v_new.to(v_cache.dtype))
    return q


def keys_of(kv: KVCacheCall, cache: Any, b: int, gather: Callable[[Any, list[int]], Any]) -> Any:
    """Sequence b's attended keys ``(Sk_b, Hkv, D)``: a view of the cache row, or, paged, the pages gathered by
    ``gather(cache, blocks) -> (len(blocks) * page_size, Hkv, D)`` and sliced."""
    p0, p1 = int(kv.key_start[b]), int(kv.key_end[b])
    if not kv.paged:
        return cache[int(kv.cache_rows[b]), p0:p1]
    first, last = p0 // kv.page_size, -(-p1 // kv.page_size)
    blocks = [int(x) for x in kv.block_table[b, first:last]]
    offset = first * kv.page_size
    return gather(cache, blocks)[p0 - offset:p1 - offset]


def cache_keys(kv: KVCacheCall, k_cache: Any, v_cache: Any,
               gather: Callable[[Any, list[int]], Any]) -> Callable[[int], tuple[Any, Any]]:
    """The ``keys`` argument of ``forward`` for caches the backend's ``run`` reads as they are."""
    return lambda b: (keys_of(kv, k_cache, b, gather), keys_of(kv, v_cache, b, gather))


def key_parts(kv: KVCacheCall, seqlen_k: int, num_splits: int) -> list[tuple[int, int, int, int]]:
    """The dense calls sequence b's keys ``[0, seqlen_k)`` are cut into: ``(a, e, left, right)`` with the window
    bounds of the part's own call (see the module docstring)."""
    left, right = kv.window_for(seqlen_k)
    if left >= 0:
        first = max(0, seqlen_k - kv.seqlen_q - left)
        return [(first, seqlen_k, left, right)]
    if kv.alibi is not None:
        return [(0, seqlen_k, left, right)]
    n = max(1, min(num_splits, seqlen_k))
    bounds = [seqlen_k * i // n for i in range(n + 1)]
    parts = []
    for a, e in zip(bounds[:-1], bounds[1:]):
        r = right if right < 0 else clamp_window_bound(right + seqlen_k - e, kv.seqlen_q, e - a)
        parts.append((a, e, -1, r))
    return parts


def _assign(out_b: Any, lse_b: Any, out: Any, lse: Any) -> None:
    out_b[...] = out
    lse_b[...] = lse


def forward(kv: KVCacheCall, run: Callable[..., None], q: Any, out: Any, lse: Any, num_splits: int, *,
            keys: Callable[[int], tuple[Any, Any]], empty_like: Callable[[Any], Any],
            merge: Callable[..., tuple[Any, Any]] = merge_attention_states,
            store: Callable[[Any, Any, Any, Any], None] = _assign,
            lead_axis: Callable[[Any], Any] = lambda x: x[None],
            fill: Callable[[Any, float], None] = lambda x, value: x.__setitem__(Ellipsis, value)) -> None:
    """Attention of each sequence over its cached keys, written into out (B, Sq, Hq, D) and lse (B, Hq, Sq).

    q: (B, Sq, Hq, D), rotated, in the dtype ``run`` takes; out and lse: the backend's arrays. ``keys(b)`` gives
    sequence b's keys and values ``(Sk_b, Hkv, D)`` after the append (``cache_keys`` for caches ``run`` reads
    directly). ``run(call, q, k, v, out, lse)`` is the backend's dense forward on (1, S, H, D) views. A sequence of
    one part is computed in place; the parts of a split one go to ``empty_like`` temporaries, are combined with
    ``merge`` (``merge_attention_states``'s signature) and written with ``store(out_b, lse_b, out, lse)``.
    """
    base = kv.dense_call()
    for b in range(kv.batch):
        seqlen_k = int(kv.seqlens_k[b])
        if seqlen_k == 0:
            fill(out[b], 0.0)
            fill(lse[b], math.inf)
            continue
        k_b, v_b = keys(b)
        q_b, out_b, lse_b = lead_axis(q[b]), lead_axis(out[b]), lead_axis(lse[b])
        parts = key_parts(kv, seqlen_k, num_splits)
        alibi = None if kv.alibi is None else kv.alibi[b:b + 1]
        merged = None
        for a, e, left, right in parts:
            k_part, v_part = lead_axis(k_b[a:e]), lead_axis(v_b[a:e])
            call = dataclasses.replace(base, q=q_b, k=k_part, v=v_part, batch=1, seqlen_k=e - a, causal=False,
                                       window_left=left, window_right=right, alibi=alibi, extra={})
            if len(parts) == 1:
                run(call, q_b, k_part, v_part, out_b, lse_b)
                break
            out_part, lse_part = empty_like(out_b), empty_like(lse_b)
            run(call, q_b, k_part, v_part, out_part, lse_part)
            merged = (out_part, lse_part) if merged is None else merge(*merged, out_part, lse_part)
        if merged is not None:
            store(out_b, lse_b, *merged)
