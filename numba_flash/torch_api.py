"""``flash_attn_func``: attention on torch tensors, with autograd, on whichever backend the registry picks; and the
package's torch faces in one place (``flash_attn_varlen_func`` from ``torch_varlen``, ``flash_attn_with_kvcache``
from ``torch_kvcache``, their shared checks in ``torch_common``).

Forward and backward are two ops registered with ``torch.library.custom_op`` (``numba_flash::flash_fwd`` and
``numba_flash::flash_bwd``) with fake implementations, so ``torch.compile`` sees them as opaque nodes with known
output shapes instead of tracing into Numba. ``FlashAttnFunc`` (``torch.autograd.Function``) ties the pair together;
the ops send their work through ``numba_flash.backend_registry.get("flash")``, so ``loss.backward()`` runs on the
same backend choice as the forward.

This module imports torch at import time; ``numba_flash`` imports it only when one of the functions is first used.
Annotations are evaluated (no ``from __future__ import annotations``) because ``custom_op`` reads them as its schema.
"""

import dataclasses
from typing import Any, Optional

import torch
from numba_flash.arguments import checked_arguments
from numba_flash import backend_registry, chosen_backends, dense_plans
from numba_flash.call_signature import copied_with, forward_signature
from numba_flash.errors import BackendDeclined
from numba_flash.torch_common import (SEEDS, check_flash_attn_extras, check_tensors, lse_dtype, no_double_backward,
                                      owned_output, owned_pair)
# The packed and KV-cache faces live in modules of their own; importing them here registers their ops whenever
# numba_flash hands out any of the three functions.
from numba_flash.torch_eager import any_requires_grad, runs_eagerly
from numba_flash.torch_kvcache import flash_attn_with_kvcache
from numba_flash.torch_varlen import FlashAttnVarlenFunc, flash_attn_varlen_func
from numba_flash.validation import check_precision, validate_forward

__all__ = ["flash_attn_func", "FlashAttnFunc", "flash_attn_varlen_func", "FlashAttnVarlenFunc",
           "flash_attn_with_kvcache"]


def _q_heads_seq(q: torch.Tensor, layout: str) -> tuple[int, int]:
    return (q.shape[2], q.shape[1]) if layout == "bshd" else (q.shape[1], q.shape[2])


def _flash_fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
              window_left: int, window_right: int, softcap: float, layout: str, backend: Optional[str],
              alibi_slopes: Optional[torch.Tensor] = None, attn_bias: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, dropout_seed: int = 0,
              precision: str = "ieee") -> tuple[torch.Tensor, torch.Tensor]:
    """Forward through the registry. Returns out (shaped like q with v's head dim, q's dtype, contiguous) and lse
    (B, Hq, Sq) float32 (float64 for float64 inputs), contiguous. ``dropout_seed`` as ``seed_for_op`` gives it."""
    out, lse = backend_registry.get("flash").forward(
        q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=(window_left, window_right),
        softcap=softcap, layout=layout, return_lse=True, backend=backend, alibi_slopes=alibi_slopes,
        attn_bias=attn_bias, dropout_p=dropout_p, dropout_seed=dropout_seed % SEEDS, precision=precision)
    return owned_pair(out, lse, q, k, v)


flash_fwd = torch.library.custom_op("numba_flash::flash_fwd", mutates_args=())(_flash_fwd_impl)


@flash_fwd.register_fake
def _flash_fwd_fake(q, k, v, causal, softmax_scale, window_left, window_right, softcap, layout, backend,
                    alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=0, precision="ieee"):
    hq, sq = _q_heads_seq(q, layout)
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[0], hq, sq), dtype=lse_dtype(q.dtype), device=q.device)
    return out, lse


def _flash_bwd_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
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
        dropout_seed=dropout_seed % SEEDS)
    inputs = (dout, q, k, v, out, lse) + (() if attn_bias is None else (attn_bias,))
    dq, dk, dv = (owned_output(g, q, q.dtype, inputs) for g in grads[:3])
    dbias = owned_output(grads[3], attn_bias, attn_bias.dtype, inputs) if return_dbias else q.new_empty((0,))
    return dq, dk, dv, dbias


flash_bwd = torch.library.custom_op("numba_flash::flash_bwd", mutates_args=())(_flash_bwd_impl)


@flash_bwd.register_fake
def _flash_bwd_fake(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap, layout,
                    backend, alibi_slopes=None, attn_bias=None, return_dbias=False, dropout_p=0.0, dropout_seed=0):
    dbias = torch.empty(attn_bias.shape, dtype=attn_bias.dtype, device=q.device) if return_dbias else \
        q.new_empty((0,))
    return tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v)) + (dbias,)


flash_bwd.register_autograd(no_double_backward("the backward of flash_attn_func"))


class FlashAttnFunc(torch.autograd.Function):
    """Autograd glue over ``flash_fwd`` / ``flash_bwd``. Always returns ``(out, lse)``; lse has no gradient.
    ``attn_bias`` gets a gradient when it requires one."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_left, window_right, softcap, layout, backend,
                alibi_slopes=None, attn_bias=None, dropout_p=0.0, dropout_seed=0, precision="ieee", call=None):
        args = (q, k, v, causal, softmax_scale, window_left, window_right, softcap, layout, backend, alibi_slopes,
                attn_bias, dropout_p, dropout_seed, precision)
        found = _forward_validated(call, backend, q, k, v) if call is not None and _eager(q, k, v) else None
        out, lse = found if found is not None else torch.ops.numba_flash.flash_fwd(*args)
        ctx.eager = found is not None
        ctx.signature = call.signature if found is not None else None   # a plain call's, for the backward
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
        dout = dout.contiguous()
        args = (dout, q, k, v, out, lse, *ctx.params, attn_bias, return_dbias, *ctx.dropout)
        # The op's dispatch costs ~140 us a call on the CPU; eager calls need none of what it does (see _eager),
        # but create_graph=True (grad mode on here) needs the op's autograd entry, which refuses a second derivative.
        eager = ctx.eager and not torch.is_grad_enabled() and _eager(dout, q, k, v)
        found = None
        if eager and ctx.signature is not None and not return_dbias:
            found = _backward_of_plain_call(ctx.signature, ctx.params, ctx.dropout, dout, q, k, v, out, lse)
        if found is not None:
            dq, dk, dv = found
            dbias = None
        else:
            run = _flash_bwd_impl if eager else torch.ops.numba_flash.flash_bwd
            dq, dk, dv, dbias = run(*args)
        return (dq, dk, dv) + (None,) * 8 + (dbias if return_dbias else None, None, None, None, None)


def _eager(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a call may skip the custom ops' dispatcher and run their implementation directly
    (``torch_eager.runs_eagerly``). The ops stay what torch.compile and opcheck see."""
    return runs_eagerly(*tensors)


def _forward_validated(call: Any, backend: Optional[str], q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """``flash_fwd``'s work for a call ``flash_attn_func`` validated already (checks run once per call): out and
    lse as the op returns them, or None when the chosen backend declines (the op then runs it, and picks again).
    ``call``: the ``_Validated`` pair; the backend is ranked once per call signature."""
    be = backend_registry.get("flash").select_kept(call.call, backend, call.signature)
    try:
        out, lse = be.forward(call.call)
    except BackendDeclined:
        chosen_backends.clear()   # the choice kept for this signature is out of date
        return None
    return owned_pair(out, lse, q, k, v)


def _backward_of_plain_call(signature: tuple, params: tuple, dropout: tuple[float, int], dout: torch.Tensor,
                            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                            lse: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``flash_bwd``'s dq, dk, dv (shaped like q, k, v) for a plain call (one with a ``call_signature`` signature:
    no ALiBi, bias, mods or dropout) whose forward ran eagerly, or None where the op's implementation must run.

    ``validate_backward`` checks q, k, v and the options as the forward did (remembered per signature: the same
    call) and then dout, out and lse. out and lse are the forward's own, saved (autograd refuses them if they were
    modified in place); dout is autograd's gradient of out, contiguous: its shape, dtype and device are checked here
    and any surprise goes the full way. The backend is ranked once per signature, as the forward's is."""
    if (type(dout) is not torch.Tensor or dout.shape != out.shape or dout.dtype != out.dtype
            or dout.device != out.device or dout.is_neg() or dout.is_conj()):
        return None
    causal, scale, left, right, softcap, layout, backend, _ = params
    base = validate_forward(q, k, v, causal=causal, softmax_scale=scale, window_size=(left, right), softcap=softcap,
                            layout=layout, dropout_p=dropout[0], dropout_seed=dropout[1] % SEEDS)
    call = copied_with(base, dout=dout, out=out, lse=lse)   # validate_backward's call for these dout, out, lse
    be = backend_registry.get("flash").select_kept(call, backend, (signature, "backward"))
    try:
        grads = be.backward(call)
    except BackendDeclined:
        chosen_backends.clear()   # the choice kept for this signature is out of date
        return None
    inputs = (dout, q, k, v, out, lse)
    return tuple(owned_output(g, q, q.dtype, inputs) for g in grads[:3])


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
    key = _plain_key(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                     return_attn_probs, layout, backend, attn_bias, bias_mod, mask_mod, score_mod, score_mod_grad,
                     block_mask, dropout_seed, precision)
    if (plan := dense_plans.kept(key)) is not None:
        # A call of a signature seen before (numba_flash.dense_plans): the checks passed for it, and its plan runs it.
        out, lse = owned_pair(*plan.step(q, k, v), q, k, v)
        return (out, lse) if return_lse else out
    # Plain Python values: checking them costs no graph break under torch.compile, so they are checked always.
    dropout_p, seed = check_flash_attn_extras(dropout_p, dropout_seed, alibi_slopes, deterministic,
                                              return_attn_probs, alibi_ok=True)
    precision = check_precision(precision)
    if not torch.compiler.is_compiling():
        # Fail fast, naming the argument, before autograd records anything. Under torch.compile the ops validate
        # when they run, and this Python-level check would only cost graph breaks.
        # The ops' own arguments (window_size as a tuple of ints, the seed the ops take), so that the call is the
        # one the forward runs (passed on: validated once) and its checks are remembered per signature.
        call = _validated_call(q, k, v, causal=causal, softmax_scale=softmax_scale,
                               window_size=tuple(int(w) for w in window_size), softcap=softcap, layout=layout,
                               return_lse=True, alibi_slopes=alibi_slopes, attn_bias=attn_bias, bias_mod=bias_mod,
                               mask_mod=mask_mod, score_mod=score_mod, block_mask=block_mask, dropout_p=dropout_p,
                               dropout_seed=seed % SEEDS if dropout_p else None, precision=precision)
        backend = _backend_for_both_halves(call.call, backend, attn_bias)
    else:
        call = None
    scale = None if softmax_scale is None else float(softmax_scale)
    left, right = (int(w) for w in window_size)
    mods = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad,
                block_mask=block_mask)
    if any(m is not None for m in mods.values()):
        params = dict(causal=bool(causal), softmax_scale=scale, window_size=(left, right), softcap=float(softcap),
                      layout=layout, backend=backend, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                      dropout_seed=seed % SEEDS, precision=precision)
        out, lse = _forward_with_mods(q, k, v, attn_bias, params, mods)
    elif (call is not None and not (torch.is_grad_enabled() and any_requires_grad(q, k, v, alibi_slopes, attn_bias))
          and _eager(q, k, v, alibi_slopes, attn_bias)
          and (found := _forward_validated(call, backend, q, k, v)) is not None):
        # No autograd graph to record and nothing that needs the op: FlashAttnFunc.apply would record nothing and
        # run this same work (its forward's eager branch); apply alone costs ~10 us a call here.
        out, lse = found
        if key is not None:   # a call without one builds no plan arguments each time
            dense_plans.keep_new(key, backend_registry.get("flash"), q, k, v, dict(
                causal=causal, softmax_scale=scale, window_size=(left, right), softcap=softcap, layout=layout,
                return_lse=True, backend=backend, deterministic=deterministic, precision=precision))
    else:
        out, lse = FlashAttnFunc.apply(q, k, v, bool(causal), scale, left, right, float(softcap), layout, backend,
                                       alibi_slopes, attn_bias, dropout_p, seed, precision, call)
    return (out, lse) if return_lse else out


def _plain_key(q: Any, k: Any, v: Any, dropout_p: Any, softmax_scale: Any, causal: Any, window_size: Any,
               softcap: Any, alibi_slopes: Any, deterministic: Any, return_attn_probs: Any, layout: Any, backend: Any,
               attn_bias: Any, bias_mod: Any, mask_mod: Any, score_mod: Any, score_mod_grad: Any, block_mask: Any,
               dropout_seed: Any, precision: Any) -> Optional[tuple]:
    """``dense_plans.plain_key`` of a flash_attn_func call that could run on a kept plan: no ALiBi, bias, mods or
    dropout, no autograd graph to record, nothing that needs the op (``_eager``), a backend named by a str or
    None. None for any other call (and under torch.compile)."""
    if (alibi_slopes is not None or attn_bias is not None or bias_mod is not None or mask_mod is not None
            or score_mod is not None or score_mod_grad is not None or block_mask is not None
            or type(dropout_p) not in (int, float) or dropout_p != 0 or not (backend is None or type(backend) is str)):
        return None
    if not _eager(q, k, v) or (torch.is_grad_enabled() and any_requires_grad(q, k, v)):
        return None
    forced = backend_registry.get("flash").forced_backend(backend)
    return dense_plans.plain_key(forced, q, k, v, window_size, (dropout_p, softmax_scale, causal, softcap,
                                                                deterministic, return_attn_probs, layout,
                                                                dropout_seed, precision))


@dataclasses.dataclass(frozen=True)
class _Validated:
    """A call flash_attn_func checked: the ``AttentionCall`` and its ``call_signature`` signature (None: none)."""

    call: Any
    signature: Optional[tuple]


_NO_SIGNATURE_PARTS = dict(cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None)


def _validated_call(q: Any, k: Any, v: Any, **options: Any) -> _Validated:
    """flash_attn_func's first step: q, k, v must be tensors, and the call must keep the contract
    (``validate_forward``'s checks and errors). Returns the ``AttentionCall`` with its signature."""
    check_tensors("flash_attn_func", q, k, v)
    call = validate_forward(q, k, v, **options)
    return _Validated(call, forward_signature(dict(options, q=q, k=k, v=v, **_NO_SIGNATURE_PARTS)))


def _backend_for_both_halves(call: Any, backend: Optional[str], attn_bias: Any) -> Optional[str]:
    """The backend the forward and the backward must share, named now; None lets the registry choose per call."""
    if backend is None:
        # A backend forced with backend_registry.use() lives in a context variable of this thread, and autograd
        # may run the backward on a thread of its own (one per GPU): name it now so both halves use it.
        backend = backend_registry.get("flash").forced_backend()
    if backend is None and attn_bias is not None and attn_bias.requires_grad and torch.is_grad_enabled():
        # The backward will need dbias, which not every backend that runs the forward computes: choose now,
        # for both halves, one that does (or say now, not after the forward, that none will).
        backend = backend_registry.get("flash").select(dataclasses.replace(call, return_dbias=True), None).name
    return backend


def _forward_with_mods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Any, params: dict,
                       mods: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A call with user mods: through ``torch_mods``' autograd.Function (the custom ops' schemas cannot hold
    functions). Returns (out, lse) as ``FlashAttnFunc`` does."""
    from numba_flash.torch_mods import flash_attn_with_mods

    return flash_attn_with_mods(q, k, v, attn_bias, params, mods)
