"""``flash_attn_func``, ``flash_attn_varlen_func`` (packed sequences) and ``flash_attn_with_kvcache`` (decoding):
attention on torch tensors, with autograd for the first two, on whichever backend the registry picks.

Forward and backward are two ops registered with ``torch.library.custom_op`` (``numba_flash::flash_fwd`` and
``numba_flash::flash_bwd``; ``flash_varlen_fwd`` and ``flash_varlen_bwd`` for packed sequences) with fake
implementations, so ``torch.compile`` sees them as opaque nodes with known output shapes instead of tracing into
Numba. ``FlashAttnFunc`` and ``FlashAttnVarlenFunc`` (``torch.autograd.Function``) tie each pair together; the ops
send their work through ``numba_flash.backend_registry.get("flash")``, so ``loss.backward()`` runs on the same
backend choice as the forward.

This module imports torch at import time; ``numba_flash`` imports it only when one of the two functions is first used.
Annotations are evaluated (no ``from __future__ import annotations``) because ``custom_op`` reads them as its schema.
"""

import dataclasses
from typing import Any, Optional

import numpy as np
import torch

from numba_flash.arguments import checked_arguments
from numba_flash import backend_registry
from numba_flash.errors import AttentionInputError, bad_arg, short_repr
from numba_flash.kvcache import validate_kvcache
from numba_flash.validation import (check_deterministic, check_dropout, check_precision, is_finite_real,
                                    validate_forward)

__all__ = ["flash_attn_func", "FlashAttnFunc", "flash_attn_varlen_func", "FlashAttnVarlenFunc",
           "flash_attn_with_kvcache"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _owned(t, like: torch.Tensor, dtype: torch.dtype, inputs: tuple) -> torch.Tensor:
    """``t`` as a fresh contiguous tensor of ``dtype`` on ``like``'s device, as the fake implementations promise.

    A custom op's outputs must not share memory with its inputs; a backend that returns an input unchanged (or a
    view of one) would break that, so such an output is cloned."""
    t = torch.as_tensor(t)
    if t.device != like.device or t.dtype != dtype:
        t = t.to(device=like.device, dtype=dtype)
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if any(x.untyped_storage().data_ptr() == ptr for x in inputs):
        t = t.clone()
    return t


def _q_heads_seq(q: torch.Tensor, layout: str) -> tuple[int, int]:
    return (q.shape[2], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[2])


@torch.library.custom_op("numba_flash::flash_fwd", mutates_args=())
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
              window_left: int, window_right: int, softcap: float, layout: str, backend: Optional[str],
              alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, dropout_seed: int = 0,
              precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward through the registry. Returns out (shaped like q with v's head dim, q's dtype, contiguous) and lse
    (B, Hq, Sq) float32 (float64 for float64 inputs), contiguous. ``dropout_seed`` as ``_seed_for_op`` gives it."""
    out, lse = backend_registry.get("flash").forward(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, layout=layout, return_lse=True, backend=backend, alibi_slopes=alibi_slopes,
        attn_bias=attn_bias, dropout_p=dropout_p, dropout_seed=dropout_seed % _SEEDS, precision=precision)
    return _owned(out, q, q.dtype, (q, k, v)), _owned(lse, q, _lse_dtype(q.dtype), (q, k, v))


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, softcap, layout, backend,
                    alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=0, precision="ieee"):
    hq, sq = _q_heads_seq(q, layout)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], hq, sq), dtype=_lse_dtype(q.dtype), device=q.device)
    return out, lse


@torch.library.custom_op("numba_flash::flash_bwd", mutates_args=())
def flash_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
              softcap: float, layout: str, backend: Optional[str],
              alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
              return_dbias: bool = False, dropout_p: float = 0.0,
              dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward through the registry. Returns dq, dk, dv shaped like q, k, v, q's dtype, contiguous, and dbias:
    shaped like attn_bias in its dtype with ``return_dbias``, else an empty tensor (a custom op's outputs are
    fixed in number)."""
    grads = backend_registry.get("flash").backward(
        dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, layout=layout, backend=backend,
        alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_dbias=return_dbias, dropout_p=dropout_p,
        dropout_seed=dropout_seed % _SEEDS)
    inputs = (dout, q, k, v, out, lse) + (() if attn_bias is None else (attn_bias,))
    dq, dk, dv = (_owned(g, q, q.dtype, inputs) for g in grads[:3])
    dbias = _owned(grads[3], attn_bias, attn_bias.dtype, inputs) if return_dbias else q.new_empty((0,))
    return dq, dk, dv, dbias


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap, layout,
                    backend, alibi_slopes=None, attn_bias=None, return_dbias=False, dropout_p=0.0, dropout_seed=0):
    dbias = torch.empty(attn_bias.shape, dtype=attn_bias.dtype, device=q.device) if return_dbias else \
        q.new_empty((0,))
    return tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v)) + (dbias,)


def _no_double_backward(what: str):
    """An autograd formula for a backward op that raises a clear error, for a second derivative asked through it
    (``create_graph=True`` and a gradient of the gradients): torch's own words name no formula, not the reason."""
    def backward(ctx, *grads):
        raise RuntimeError(f"numba_flash: {what} is not differentiable (no double backward: the gradients of "
                           "flash_attn_func and flash_attn_varlen_func have no gradient of their own)")
    return backward


flash_bwd.register_autograd(_no_double_backward("the backward of flash_attn_func"))


class FlashAttnFunc(torch.autograd.Function):
    """Autograd glue over ``flash_fwd`` / ``flash_bwd``. Always returns ``(out, lse)``; lse has no gradient.
    ``attn_bias`` gets a gradient when it requires one."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_left, window_right, softcap, layout, backend,
                alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=0, precision="ieee"):
        out, lse = torch.ops.numba_flash.flash_fwd(q, k, v, causal, softmax_scale, window_left, window_right,
                                                   softcap, layout, backend, alibi_slopes, attn_bias, dropout_p,
                                                   dropout_seed, precision)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias)
        ctx.params = (causal, softmax_scale, window_left, window_right, softcap, layout, backend, alibi_slopes)
        # the seed is kept, not the mask: the backward makes the same mask again from it
        ctx.dropout = (dropout_p, dropout_seed)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, attn_bias = ctx.saved_tensors
        return_dbias = attn_bias is not None and ctx.needs_input_grad[11]
        # Gradients arriving from a sum() or an expand() are broadcast views (stride 0); one contiguous copy of
        # dout, the size of q, spares every backend that case.
        dq, dk, dv, dbias = torch.ops.numba_flash.flash_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.params,
                                                            attn_bias, return_dbias, *ctx.dropout)
        return (dq, dk, dv) + (None,) * 8 + (dbias if return_dbias else None, None, None, None)


def _check_tensors(function: str, q: Any, k: Any, v: Any) -> None:
    """numpy and other arrays pass validate_forward but cannot carry gradients; the registry's op.forward takes
    them, and the error says so."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise AttentionInputError(
                f"{name}: expected a torch.Tensor ({function} is the autograd entry point; use "
                f"backend_registry.get('flash').forward for other arrays), got {type(x).__name__}")


def _check_flash_attn_extras(dropout_p: Any, dropout_seed: Any, alibi_slopes: Any, deterministic: Any,
                             return_attn_probs: Any, alibi_ok: bool = False) -> tuple[float, int]:
    """flash-attn's arguments for features this library has not built yet: accepted in their place (so that code
    written for flash-attn calls in unchanged), refused with a clear error when they ask for the feature.
    ``alibi_ok``: the caller takes ALiBi slopes (validated with the tensors).

    Returns ``(dropout_p, seed)`` for the ops: with dropout and no ``dropout_seed``, a seed drawn from torch's
    default generator (so ``torch.manual_seed`` makes it reproducible), as a signed int64 (``_seed_for_op``)."""
    if dropout_seed is None and is_finite_real(dropout_p) and float(dropout_p) > 0.0:
        dropout_seed = int(torch.randint(-(1 << 63), (1 << 63) - 1, ())) % _SEEDS
    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    if alibi_slopes is not None and not alibi_ok:
        got = f"shape {tuple(alibi_slopes.shape)}" if hasattr(alibi_slopes, "shape") else short_repr(alibi_slopes)
        raise bad_arg("alibi_slopes", "None (ALiBi is not implemented here yet)", got)
    check_deterministic(deterministic)
    if not isinstance(return_attn_probs, (bool, np.bool_)):
        raise bad_arg("return_attn_probs", "a bool", short_repr(return_attn_probs))
    if return_attn_probs:
        raise bad_arg("return_attn_probs",
                      "False (returning the attention probabilities is not implemented yet; return_lse=True gives the "
                      "log-sum-exp)", "True")
    return dropout_p, _seed_for_op(dropout_seed)


_SEEDS = 1 << 64


def _seed_for_op(seed: int) -> int:
    """A seed in [0, 2**64) as the signed int64 a custom op's ``int`` holds (the same 64 bits); the ops take it
    back with ``% 2**64``."""
    return seed - _SEEDS if seed >= _SEEDS // 2 else seed


@checked_arguments
def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    layout: str = "bshd",
    return_lse: bool = False,
    backend: Optional[str] = None,
    attn_bias: Optional[torch.Tensor] = None,
    bias_mod: Any = None,
    mask_mod: Any = None,
    score_mod: Any = None,
    score_mod_grad: Any = None,
    block_mask: Any = None,
    dropout_seed: Optional[int] = None,
    precision: str = "ieee",
):
    """Exact attention on torch tensors, differentiable, computed by the backend the registry picks.

    The positional arguments and their defaults are flash-attn's ``flash_attn_func``, in its order, so code written
    for flash-attn runs unchanged with ``from numba_flash import flash_attn_func``. ``layout``, ``return_lse``,
    ``backend``, ``attn_bias``, the mods, ``dropout_seed`` and ``precision`` are this library's and keyword-only.

    Grouped-query / multi-query attention is supported by passing K and V with fewer heads than Q: query head h
    reads key/value head ``h // (Hq // Hkv)``. Causal masking and the sliding window are aligned to the bottom-right
    corner of the score matrix (FlashAttention >= 2.1): query i may see key j iff
    ``i + Sk - Sq - window_size[0] <= j <= i + Sk - Sq + window_size[1]``. With causal=True, Sq = 2 and Sk = 5
    (1 = seen)::

        1 1 1 1 0
        1 1 1 1 1

    Arguments:
        q: (batch_size, seqlen_q, nheads, headdim) for layout "bshd", (batch_size, nheads, seqlen_q, headdim) for
            "bhsd"; float16, bfloat16, float32 or float64; any device the chosen backend serves; any strides.
        k: (batch_size, seqlen_k, nheads_k, headdim) for "bshd", (batch_size, nheads_k, seqlen_k, headdim) for
            "bhsd"; nheads % nheads_k == 0; q's dtype and device.
        v: shaped like k, except that its head dim may differ (up to 512; q and k up to 576) on backends that
            support it (the torch path today).
        dropout_p: float in [0, 1). Dropout on the attention probabilities after the softmax: each is kept with
            probability 1 - p and scaled by 1 / (1 - p), else 0, by the mask ``numba_flash.dropout_mask`` gives
            for the seed. Runs on the cpu and torch ("rocm") backends; cuda says it does not support it yet.
        softmax_scale: float > 0. Scaling of q k^T before the softmax; default 1 / sqrt(headdim).
        causal: bool. Mask keys after the query's bottom-right-aligned diagonal (same as window_size[1] = 0).
        window_size: (left, right). Sliding-window attention; -1 means unbounded on that side.
        softcap: float >= 0. If > 0, scores become softcap * tanh(scores / softcap); 0 disables it.
        alibi_slopes: None, or (nheads,) or (batch_size, nheads) float32 slopes: adds
            ``-slope * |i + seqlen_k - seqlen_q - j|`` to the scores (flash-attn's ALiBi). No gradient.
        deterministic: bool, accepted either way: every backend's backward is already deterministic (no atomic
            adds; each gradient element is summed by one thread in a fixed order), so two runs give bitwise equal
            gradients, with dropout too (the backward makes the forward's mask again from the seed).
        return_attn_probs: must be False: returning the probabilities is not implemented yet (True raises
            AttentionInputError); return_lse=True gives the log-sum-exp.
        layout: keyword-only. "bshd" (FlashAttention's) or "bhsd" (PyTorch SDPA's).
        return_lse: keyword-only bool. Also return the log-sum-exp of each query row (for testing, or for merging
            partial results with ``numba_flash.merge_attention_states``).
        backend: keyword-only str or None. Force one backend ("cuda", "rocm", "cpu", ...); None lets the registry
            choose.
        attn_bias: keyword-only, None or a tensor broadcastable to (batch_size, nheads, seqlen_q, seqlen_k),
            float32 or q's dtype, on q's device: added to the scores after softcap; -inf hides a key. When it
            requires grad, autograd gives it dbias (summed over the dimensions it was broadcast along).
        bias_mod, mask_mod, score_mod, score_mod_grad, block_mask: keyword-only user mods, plain Python functions
            numba compiles (see ``numba_flash.mods``); score_mod needs score_mod_grad for the backward. A call
            with mods runs through an autograd.Function rather than the custom ops (whose schemas cannot hold
            functions): eager mode only, a graph break under torch.compile.
        dropout_seed: keyword-only int in [0, 2**64) or None. The dropout mask's seed (the same seed gives the same
            mask on every backend); None draws one from torch's default generator when dropout_p > 0, kept for
            the backward.
        precision: keyword-only, "ieee" (the default) or "tf32": float32 inputs' forward may run on TF32 tensor
            cores (the cuda backend, compute capability >= 8.0, D <= 128; README "TF32"); elsewhere, and for the
            backward, float32 is computed in float32.

    Returns:
        out: shaped like q but with v's head dim, q's dtype and device, contiguous. Rows that see no key are 0.
        lse [only if return_lse]: (batch_size, nheads, seqlen_q), float32 (float64 for float64 inputs): the natural
            log of the sum of exp(score) over the visible keys; +inf for a row that sees no key. Not differentiable.

    Raises ``numba_flash.AttentionInputError`` for arguments that break the contract or ask for a feature not
    implemented yet, and ``numba_flash.NoBackendError`` when no backend can serve the call.
    """
    # Plain Python values: checking them costs no graph break under torch.compile, so they are checked always.
    dropout_p, seed = _check_flash_attn_extras(dropout_p, dropout_seed, alibi_slopes, deterministic,
                                               return_attn_probs, alibi_ok=True)
    precision = check_precision(precision)
    if not torch.compiler.is_compiling():
        # Fail fast, naming the argument, before autograd records anything. Under torch.compile the ops validate
        # when they run, and this Python-level check would only cost graph breaks.
        _check_tensors("flash_attn_func", q, k, v)
        call = validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                softcap=softcap, layout=layout, return_lse=return_lse, alibi_slopes=alibi_slopes,
                                attn_bias=attn_bias, bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod,
                                block_mask=block_mask)
        if backend is None:
            # A backend forced with backend_registry.use() lives in a context variable of this thread, and autograd
            # may run the backward on a thread of its own (one per GPU): name it now so both halves use it.
            backend = backend_registry.get("flash").forced_backend()
        if backend is None and attn_bias is not None and attn_bias.requires_grad and torch.is_grad_enabled():
            # The backward will need dbias, which not every backend that runs the forward computes: choose now,
            # for both halves, one that does (or say now, not after the forward, that none will).
            backend = backend_registry.get("flash").select(dataclasses.replace(call, return_dbias=True), None).name
    scale = None if softmax_scale is None else float(softmax_scale)
    left, right = (int(w) for w in window_size)
    mods = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad,
                block_mask=block_mask)
    if any(m is not None for m in mods.values()):
        from numba_flash.torch_mods import flash_attn_with_mods

        params = dict(causal=bool(causal), softmax_scale=scale, window_size=(left, right), softcap=float(softcap),
                      layout=layout, backend=backend, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                      dropout_seed=seed % _SEEDS, precision=precision)
        out, lse = flash_attn_with_mods(q, k, v, attn_bias, params, mods)
    else:
        out, lse = FlashAttnFunc.apply(q, k, v, bool(causal), scale, left, right, float(softcap), layout, backend,
                                       alibi_slopes, attn_bias, dropout_p, seed, precision)
    return (out, lse) if return_lse else out


# Packed sequences (layout "thd"). Ops of their own rather than more arguments on flash_fwd / flash_bwd: their
# schemas, fake implementations and lse shape differ, and the dense ops keep the schema torch.compile has cached.

@torch.library.custom_op("numba_flash::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                     causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
                     softcap: float, backend: Optional[str], alibi_slopes: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, dropout_seed: int = 0,
                     precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward through the registry. Returns out (total_q, Hq, D), q's dtype, and lse (Hq, total_q) float32
    (float64 for float64 inputs), both contiguous."""
    out, lse = backend_registry.get("flash").forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, layout="thd", return_lse=True, backend=backend,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed % _SEEDS, precision=precision)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    return _owned(out, q, q.dtype, inputs), _owned(lse, q, _lse_dtype(q.dtype), inputs)


@flash_varlen_fwd.register_fake
def _flash_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left, window_right, softcap, backend, alibi_slopes=None, dropout_p=0.0,
                           dropout_seed=0, precision="ieee"):
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q.dtype), device=q.device)
    return out, lse


@torch.library.custom_op("numba_flash::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool,
                     softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                     backend: Optional[str], alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                     dropout_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed backward through the registry. Returns dq, dk, dv shaped like q, k, v, q's dtype, contiguous."""
    dq, dk, dv = backend_registry.get("flash").backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, layout="thd", backend=backend,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed % _SEEDS)
    inputs = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    return tuple(_owned(g, q, q.dtype, inputs) for g in (dq, dk, dv))


@flash_varlen_bwd.register_fake
def _flash_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           softmax_scale, window_left, window_right, softcap, backend, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=0):
    return tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))


flash_varlen_bwd.register_autograd(_no_double_backward("the backward of flash_attn_varlen_func"))


class FlashAttnVarlenFunc(torch.autograd.Function):
    """Autograd glue over ``flash_varlen_fwd`` / ``flash_varlen_bwd``. Returns ``(out, lse)``; lse has no gradient,
    and neither have the cumulative lengths."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window_left, window_right, softcap, backend, alibi_slopes=None, dropout_p=0.0, dropout_seed=0,
                precision="ieee"):
        out, lse = torch.ops.numba_flash.flash_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, causal, softmax_scale, window_left,
                                                          window_right, softcap, backend, alibi_slopes, dropout_p,
                                                          dropout_seed, precision)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap, backend,
                      alibi_slopes, dropout_p, dropout_seed)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        # as in FlashAttnFunc: a broadcast dout (from a sum()) becomes one contiguous copy
        dq, dk, dv = torch.ops.numba_flash.flash_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q,
                                                            cu_seqlens_k, *ctx.params)
        return (dq, dk, dv) + (None,) * 14


@checked_arguments
def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[torch.Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    return_lse: bool = False,
    backend: Optional[str] = None,
    dropout_seed: Optional[int] = None,
    precision: str = "ieee",
):
    """Exact attention over packed sequences on torch tensors, differentiable, on the backend the registry picks.

    The positional arguments and their defaults are flash-attn's ``flash_attn_varlen_func``, in its order. Sequence
    b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of
    k and v, and attends only within itself. Causal masking and the window are aligned to the bottom-right corner
    of each sequence's own block: query i of sequence b may see its key j iff
    ``i + Sk_b - Sq_b - window_size[0] <= j <= i + Sk_b - Sq_b + window_size[1]``. With causal=True, sequences of
    (Sq, Sk) = (2, 3) and (3, 2) packed one after the other (1 = seen)::

        1 1 0 . .
        1 1 1 . .
        . . . 0 0
        . . . 1 0
        . . . 1 1

    Arguments:
        q: (total_q, nheads, headdim); float16, bfloat16, float32 or float64; any device the backend serves.
        k, v: (total_k, nheads_k, headdim), nheads % nheads_k == 0 (grouped-query attention); q's dtype and device.
        cu_seqlens_q, cu_seqlens_k: (batch_size + 1,) int32 (int64 is accepted too), the prefix sums of the
            sequence lengths: start at 0, non-decreasing, end at total_q / total_k. A sequence may be empty; one
            with no keys gives its rows out 0 and lse +inf. Read on the host; never modified.
        max_seqlen_q, max_seqlen_k: int >= every sequence's length on that side (an upper bound, as in flash-attn),
            or None.
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs: as
            in ``flash_attn_func`` (alibi_slopes (nheads,) or (batch_size, nheads), one row per sequence, with each
            sequence's own distances; return_attn_probs=True is refused until it is implemented). Dropout keys
            sequence b's mask by b, with rows and keys counted within the sequence.
        return_lse: keyword-only bool. Also return the log-sum-exp of each query row.
        backend: keyword-only str or None. Force one backend ("cuda", "rocm", "cpu", ...).
        dropout_seed: keyword-only int in [0, 2**64) or None, as in ``flash_attn_func``.
        precision: keyword-only, "ieee" or "tf32", as in ``flash_attn_func``.

    Returns:
        out: (total_q, nheads, headdim), q's dtype and device, contiguous.
        lse [only if return_lse]: (nheads, total_q), float32 (float64 for float64 inputs); +inf for a row that sees
            no key. Not differentiable.

    Raises ``numba_flash.AttentionInputError`` for arguments that break the contract, and
    ``numba_flash.NoBackendError`` when no backend can serve the call.
    """
    dropout_p, seed = _check_flash_attn_extras(dropout_p, dropout_seed, alibi_slopes, deterministic,
                                               return_attn_probs, alibi_ok=True)
    precision = check_precision(precision)
    if not torch.compiler.is_compiling():
        _check_tensors("flash_attn_varlen_func", q, k, v)
        validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                         softcap=softcap, layout="thd", return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         alibi_slopes=alibi_slopes)
        # The ops' schema takes tensors; a numpy prefix sum (already checked) becomes one without a copy.
        cu_seqlens_q, cu_seqlens_k = (c if isinstance(c, torch.Tensor) else torch.from_numpy(np.asarray(c))
                                      for c in (cu_seqlens_q, cu_seqlens_k))
        if backend is None:
            backend = backend_registry.get("flash").forced_backend()   # see flash_attn_func
    scale = None if softmax_scale is None else float(softmax_scale)
    mq, mk = (None if m is None else int(m) for m in (max_seqlen_q, max_seqlen_k))
    left, right = (int(w) for w in window_size)
    out, lse = FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk, bool(causal), scale, left,
                                         right, float(softcap), backend, alibi_slopes, dropout_p, seed, precision)
    return (out, lse) if return_lse else out


# Decoding with a KV cache. Forward only (as in flash-attn); one op that declares the two caches it writes.

@torch.library.custom_op("numba_flash::flash_kvcache", mutates_args=("k_cache", "v_cache"))
def flash_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k: Optional[torch.Tensor],
                  v: Optional[torch.Tensor], rotary_cos: Optional[torch.Tensor], rotary_sin: Optional[torch.Tensor],
                  cache_seqlens: Optional[torch.Tensor], cache_batch_idx: Optional[torch.Tensor],
                  cache_leftpad: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                  softmax_scale: Optional[float], causal: bool, window_left: int, window_right: int, softcap: float,
                  rotary_interleaved: bool, alibi_slopes: Optional[torch.Tensor], num_splits: int,
                  backend: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """``with_kvcache`` through the registry; returns out (like q, contiguous) and lse (B, Hq, Sq) float32."""
    out, lse = backend_registry.get("flash").with_kvcache(
        q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx, cache_leftpad,
        block_table, softmax_scale, causal, (window_left, window_right), softcap, rotary_interleaved, alibi_slopes,
        num_splits, True, backend=backend)
    inputs = tuple(x for x in (q, k_cache, v_cache, k, v) if x is not None)
    return _owned(out, q, q.dtype, inputs), _owned(lse, q, _lse_dtype(q.dtype), inputs)


@flash_kvcache.register_fake
def _flash_kvcache_fake(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                        cache_leftpad, block_table, softmax_scale, causal, window_left, window_right, softcap,
                        rotary_interleaved, alibi_slopes, num_splits, backend):
    batch, seqlen_q, nheads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, nheads, seqlen_q), dtype=_lse_dtype(q.dtype))


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
    _check_tensors("flash_attn_with_kvcache", q, k_cache, v_cache)
    if not torch.compiler.is_compiling():
        # Fail fast, before the op's schema turns the arguments into ints and tensors (as flash_attn_func does).
        validate_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                         cache_leftpad, block_table, softmax_scale, causal, window_size, softcap, rotary_interleaved,
                         alibi_slopes, num_splits, return_softmax_lse)
        if isinstance(cache_seqlens, (int, np.integer)):
            # The op's schema takes a tensor; an int is every sequence's length.
            cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    if backend is None:
        backend = backend_registry.get("flash").forced_backend()
    scale = None if softmax_scale is None else float(softmax_scale)
    out, lse = flash_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, block_table, scale, causal, int(window_size[0]), int(window_size[1]),
                             softcap, rotary_interleaved, alibi_slopes, int(num_splits), backend)
    return (out, lse) if return_softmax_lse else out
