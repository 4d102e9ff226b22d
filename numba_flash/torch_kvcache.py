"""``flash_attn_with_kvcache``: decoding with a KV cache on torch tensors, flash-attn's face, forward only.

One custom op, ``numba_flash::flash_kvcache``, declares the two caches it writes, so that ``torch.compile`` knows
about the append; the work goes through ``numba_flash.backend_registry.get("flash").with_kvcache``. An eager call
that needs no autograd skips the op's dispatch (``numba_flash.torch_eager``) and bumps the caches' version counters
itself, as the op's ``mutates_args`` has torch do.
Annotations are evaluated (no ``from __future__ import annotations``) because ``custom_op`` reads them as its schema.
"""

import inspect
from typing import Any, Optional

import numpy as np
import torch

from numba_flash import backend_registry, kvcache_plans
from numba_flash.arguments import checked_arguments
from numba_flash.arrays import to_numpy
from numba_flash.plan_kvcache import KVCACHE_OPTIONS
from numba_flash.plan_cache import exact_key
from numba_flash.torch_common import check_tensors, lse_dtype, owned_pair
from numba_flash.torch_eager import any_requires_grad, bump_versions, runs_eagerly


# Decoding with a KV cache. Forward only (as in flash-attn); one op that declares the two caches it writes.

def _flash_kvcache_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                        v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor],
                        rotary_sin: Optional[torch.Tensor], cache_seqlens: Optional[torch.Tensor],
                        cache_batch_idx: Optional[torch.Tensor], cache_leftpad: Optional[torch.Tensor],
                        block_table: Optional[torch.Tensor], softmax_scale: Optional[float], causal: bool,
                        window_left: int, window_right: int, softcap: float, rotary_interleaved: bool,
                        alibi_slopes: Optional[torch.Tensor], num_splits: int,
                        backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_kvcache`` through the registry; returns out (like q, contiguous) and lse (B, Hq, Sq) float32."""
    out, lse = backend_registry.get("flash").with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
        num_splits, True, backend=backend)
    return owned_pair(out, lse, q, k_cache, v_cache, k, v)


flash_kvcache = torch.library.custom_op("numba_flash::flash_kvcache",
                                        mutates_args=("k_cache", "v_cache"))(_flash_kvcache_impl)


@flash_kvcache.register_fake
def _flash_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                        rotary_interleaved, alibi_slopes, num_splits, backend):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=lse_dtype(q.dtype))


class _KVCacheNoBackward(torch.autograd.Function):
    """Passes flash_attn_with_kvcache's results through; a backward through them raises in our words. (The op
    writes the caches in place, so torch takes no autograd formula for it.)"""

    @staticmethod
    def forward(ctx, out, lse):
        out, lse = out.view_as(out), lse.view_as(lse)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("numba_flash: flash_attn_with_kvcache does not support backward (as in flash-attn: it "
                           "serves decoding, and writes the caches in place); for gradients, attend with "
                           "flash_attn_func over the cached keys")


# The registry's with_kvcache without its checked_arguments wrapper (3 us a step): the face's own wrapper has
# looked at the same values (masked arrays refused by name), and every argument goes on positionally.
_with_kvcache = inspect.unwrap(backend_registry.Dispatcher.with_kvcache)


def _face_options(arguments: dict[str, Any]) -> dict[str, Any]:
    """``validate_kvcache``'s keywords from ``flash_attn_with_kvcache``'s arguments (its lse flag has its own name)."""
    return {name: arguments["return_softmax_lse" if name == "return_lse" else name] for name in KVCACHE_OPTIONS}


@checked_arguments
def flash_attn_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: Optional[torch.Tensor] = None,
    v: Optional[torch.Tensor] = None,
    rotary_cos: Optional[torch.Tensor] = None,
    rotary_sin: Optional[torch.Tensor] = None,
    cache_seqlens: Any = None,
    cache_batch_idx: Optional[torch.Tensor] = None,
    cache_leftpad: Optional[torch.Tensor] = None,
    block_table: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Optional[torch.Tensor] = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    *,
    backend: Optional[str] = None,
):
    """Decoding with a KV cache on torch tensors, flash-attn's ``flash_attn_with_kvcache`` with its arguments in
    its order: appends ``k``/``v`` to the caches in place at ``cache_seqlens`` (rotating them, and q, when rotary
    tables are given), then attends each sequence's query block to its cached keys. Not differentiable.

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim).
        k_cache, v_cache: (batch_size_cache, seqlen_cache, nheads_k, headdim), or with ``block_table`` a paged
            cache (num_blocks, page_block_size, nheads_k, headdim). q's dtype and device. Written in place.
        k, v: (batch_size, seqlen_new, nheads_k, headdim) or None: new keys and values to append.
        rotary_cos, rotary_sin: (seqlen_ro, rotary_dim / 2) or None; need k and v. The new keys are rotated at
            their cache positions ``cache_seqlens[b] + t``; q at the same positions when causal or local, else all
            of q at ``cache_seqlens[b]``. ``rotary_interleaved`` pairs features (0, 1), (2, 3), ... (GPT-J) when
            True, else (i, i + rotary_dim / 2) (GPT-NeoX).
        cache_seqlens: int or (batch_size,) int32: keys in each sequence's cache before the append (default: the
            whole cache).
        cache_batch_idx: (batch_size,) int32 or None: the cache row of each sequence (default b).
        cache_leftpad: (batch_size,) int32 or None: the first cache position each sequence attends to.
        block_table: (batch_size, max_num_blocks_per_seq) int32 or None: the pages of a paged cache.
        softmax_scale, causal, window_size, softcap: as in ``flash_attn_func``; the mask is aligned to the
            bottom-right corner of each sequence's (seqlen_q, keys attended) block.
        alibi_slopes: (nheads,) or (batch_size, nheads) float32 or None: adds ``-slope * |i + Sk_b - seqlen_q - j|``
            to the score of query i and key j, j counted from the first key attended (``cache_leftpad``) and Sk_b
            the keys sequence b attends to, after softcap (flash-attn's ALiBi).
        num_splits: split the keys into this many parts merged by lse (flash-decoding); 0 chooses from the work
            and the machine's parallelism.
        return_softmax_lse: also return the log-sum-exp.
        backend: keyword-only; force one backend.

    Returns:
        out: (batch_size, seqlen_q, nheads, headdim), q's dtype and device.
        softmax_lse [only if return_softmax_lse]: (batch_size, nheads, seqlen_q) float32.

    Raises ``numba_flash.AttentionInputError`` before anything is written when an argument breaks the contract
    (a cache too short for the append, a block index out of range, a rotary table of the wrong shape, ...).
    """
    check_tensors("flash_attn_with_kvcache", q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    op = backend_registry.get("flash")
    if backend is None:
        backend = op.forced_backend()
    tensors = [x for x in (q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                           cache_leftpad, block_table, alibi_slopes) if isinstance(x, torch.Tensor)]
    if runs_eagerly(*tensors) and not any_requires_grad(*tensors):
        # Nothing needs the op here (torch_eager): the registry checks the arguments as given, as the face's own
        # check would (the same validate_kvcache, word for word, nothing written when it refuses), and runs the
        # call once, on a kept plan for a signature seen before; a plain call's plan is kept by the face's own
        # key too, and later calls of it go straight to that plan's step checks.
        key = None
        if (rotary_cos is None and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
                and block_table is None and alibi_slopes is None and (backend is None or type(backend) is str)):
            key = exact_key(("flash_attn_with_kvcache", backend), (q, k_cache, v_cache, k, v), window_size,
                            (softmax_scale, causal, softcap, rotary_interleaved, num_splits))
        plan = kvcache_plans.face_plan(key)
        if plan is not None:
            out, lse = plan.step(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, signatures_known=True)
        else:
            out, lse = _with_kvcache(op, q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                     cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                                     softcap, rotary_interleaved, alibi_slopes, num_splits, True, backend=backend)
            if key is not None:   # a call without one (rotary, paged, ...) builds no arguments for it each step
                kvcache_plans.keep_for_face(key, op, backend, {"q": q, "k_cache": k_cache, "v_cache": v_cache,
                                                               "k": k, "v": v},
                                            dict(_face_options(locals()), return_lse=True))
        bump_versions(k_cache, v_cache)   # what the op's mutates_args has torch do
        out, lse = owned_pair(out, lse, q, k_cache, v_cache, k, v)
        return (out, lse) if return_softmax_lse else out
    if not torch.compiler.is_compiling():
        # Fail fast, before the op's schema turns the arguments into ints and tensors (as flash_attn_func does):
        # in full for a call of a new signature, with a kept plan's step checks for one seen before (the op then
        # runs its own kept plan: numba_flash.kvcache_plans).
        kvcache_plans.check_with_plans(op, backend, {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v},
                                       _face_options(locals()))
        if isinstance(cache_seqlens, (int, np.integer)):
            # The op's schema takes a tensor; an int is every sequence's length.
            cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
        # The schema takes tensors; host index arrays (already checked) become tensors on q's device, like it.
        cache_seqlens, cache_batch_idx, cache_leftpad, block_table = (
            x if x is None or isinstance(x, torch.Tensor) else
            torch.from_numpy(np.ascontiguousarray(to_numpy(x))).to(q.device)
            for x in (cache_seqlens, cache_batch_idx, cache_leftpad, block_table))
    scale = None if softmax_scale is None else float(softmax_scale)
    out, lse = flash_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, scale, causal, int(window_size[0]), int(window_size[1]),
                             softcap, rotary_interleaved, alibi_slopes, int(num_splits), backend)
    if out.requires_grad:   # torch's own words at backward() would name a missing formula, not the reason
        out, lse = _KVCacheNoBackward.apply(out, lse)
    return (out, lse) if return_softmax_lse else out


__all__ = ["flash_attn_with_kvcache", "flash_kvcache"]
