"""``flash_attn_varlen_func``: attention over packed sequences (layout "thd") on torch tensors, with autograd.

Forward and backward are the custom ops ``numba_flash::flash_varlen_fwd`` and ``flash_varlen_bwd`` with fake
implementations (see ``torch_api`` for why), tied together by ``FlashAttnVarlenFunc``; the work goes through
``numba_flash.backend_registry.get("flash")``. Annotations are evaluated (no ``from __future__ import
annotations``) because ``custom_op`` reads them as its schema.
"""

from typing import Optional

import numpy as np
import torch

from numba_flash import backend_registry
from numba_flash.arguments import checked_arguments
from numba_flash.paged_keys import PagedKeys, check_paged_keys
from numba_flash.torch_common import (SEEDS, check_flash_attn_extras, check_tensors, lse_dtype, no_double_backward,
                                      owned_output)
from numba_flash.validation import check_precision, validate_forward


# Packed sequences (layout "thd"). Ops of their own rather than more arguments on flash_fwd / flash_bwd: their
# schemas, fake implementations and lse shape differ, and the dense ops keep the schema torch.compile has cached.

@torch.library.custom_op("numba_flash::flash_varlen_fwd", mutates_args=())
def flash_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
                     causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
                     softcap: float, backend: Optional[str], alibi_slopes: Optional[torch.Tensor] = None,
                     dropout_p: float = 0.0, dropout_seed: int = 0,
                     precision: str = "ieee",
                     block_table: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward through the registry. Returns out (total_q, Hq, D), q's dtype, and lse (Hq, total_q) float32
    (float64 for float64 inputs), both contiguous. With block_table (B, max_blocks) int32, k and v are paged caches
    (num_blocks, page_size, Hkv, D)."""
    out, lse = backend_registry.get("flash").forward(
        q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, layout="thd", return_lse=True, backend=backend,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed % SEEDS, precision=precision,
        block_table=block_table)
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k)
    return owned_output(out, q, q.dtype, inputs), owned_output(lse, q, lse_dtype(q.dtype), inputs)


@flash_varlen_fwd.register_fake
def _flash_varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                           window_left, window_right, softcap, backend, alibi_slopes=None, dropout_p=0.0,
                           dropout_seed=0, precision="ieee", block_table=None):
    out = torch.empty(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype), device=q.device)
    return out, lse


@torch.library.custom_op("numba_flash::flash_varlen_bwd", mutates_args=())
def flash_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], causal: bool,
                     softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                     backend: Optional[str], alibi_slopes: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                     dropout_seed: int = 0,
                     block_table: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed backward through the registry. Returns dq, dk, dv shaped like q, k, v (paged k and v with
    block_table: 0 in the rows no sequence reads), q's dtype, contiguous."""
    dq, dk, dv = backend_registry.get("flash").backward(
        dout, q, k, v, out, lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, causal=causal, softmax_scale=softmax_scale,
        window_size=(window_left, window_right), softcap=softcap, layout="thd", backend=backend,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed % SEEDS, block_table=block_table)
    inputs = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    return tuple(owned_output(g, q, q.dtype, inputs) for g in (dq, dk, dv))


@flash_varlen_bwd.register_fake
def _flash_varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                           softmax_scale, window_left, window_right, softcap, backend, alibi_slopes=None,
                           dropout_p=0.0, dropout_seed=0, block_table=None):
    return tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))


flash_varlen_bwd.register_autograd(no_double_backward("the backward of flash_attn_varlen_func"))


class FlashAttnVarlenFunc(torch.autograd.Function):
    """Autograd glue over ``flash_varlen_fwd`` / ``flash_varlen_bwd``. Returns ``(out, lse)``; lse has no gradient,
    and neither have the cumulative lengths and the block table. With paged k and v, their gradients are paged too
    (the backward op scatters them), so the gather stays inside the ops and torch.compile sees opaque nodes."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                window_left, window_right, softcap, backend, alibi_slopes=None, dropout_p=0.0, dropout_seed=0,
                precision="ieee", block_table=None):
        out, lse = torch.ops.numba_flash.flash_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                          max_seqlen_k, causal, softmax_scale, window_left,
                                                          window_right, softcap, backend, alibi_slopes, dropout_p,
                                                          dropout_seed, precision, block_table)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap, backend,
                      alibi_slopes, dropout_p, dropout_seed, block_table)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        # as in FlashAttnFunc: a broadcast dout (from a sum()) becomes one contiguous copy
        dq, dk, dv = torch.ops.numba_flash.flash_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q,
                                                            cu_seqlens_k, *ctx.params)
        return (dq, dk, dv) + (None,) * 15


def _packed_stand_ins(paged: Optional[PagedKeys], k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """k and v as the face's checks see them: themselves, or for paged caches views shaped like the packed keys
    (total_k, Hkv, D) with rows of stride 0. The checks read only shapes, dtypes and devices; the gather itself
    runs once, inside the op."""
    if paged is None:
        return k, v
    total_k = len(paged.blocks)
    return tuple(x.as_strided((total_k,) + tuple(x.shape[2:]), (0,) + tuple(x.stride()[2:])) for x in (k, v))


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
    block_table: Optional[torch.Tensor] = None,
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
        block_table: (batch_size, max_num_blocks_per_seq) int32 (int64 accepted), or None: paged keys (flash-attn's
            paged prefill). k and v are then paged caches (num_blocks, page_block_size, nheads_k, headdim), and
            sequence b's keys are the first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` rows of its pages in table
            order: its key j is ``k[block_table[b, j // page_block_size], j % page_block_size]``. Any
            page_block_size >= 1 is accepted (flash-attn asks for a multiple of 256, a constraint of its kernels'
            tiles; here the pages are gathered into the packed layout once per call, so the kernels never see
            them). Gradients of k and v are paged like them: each row a sequence reads gets its key's gradient,
            every other row 0. Entries past the pages a sequence uses are never read. Read on the host.
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
    dropout_p, seed = check_flash_attn_extras(dropout_p, dropout_seed, alibi_slopes, deterministic,
                                              return_attn_probs, alibi_ok=True)
    precision = check_precision(precision)
    if not torch.compiler.is_compiling():
        check_tensors("flash_attn_varlen_func", q, k, v)
        paged = None if block_table is None else check_paged_keys(k, v, block_table, cu_seqlens_k)
        validate_forward(q, *_packed_stand_ins(paged, k, v), causal=causal, softmax_scale=softmax_scale,
                         window_size=window_size, softcap=softcap, layout="thd", return_lse=return_lse,
                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                         max_seqlen_k=max_seqlen_k, alibi_slopes=alibi_slopes)
        # The ops' schema takes tensors; a numpy prefix sum (already checked) becomes one without a copy.
        # (a copy where its strides are negative, which torch tensors cannot have)
        cu_seqlens_q, cu_seqlens_k, block_table = (
            c if c is None or isinstance(c, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(c))
            for c in (cu_seqlens_q, cu_seqlens_k, block_table))
        if backend is None:
            backend = backend_registry.get("flash").forced_backend()   # see flash_attn_func
    scale = None if softmax_scale is None else float(softmax_scale)
    mq, mk = (None if m is None else int(m) for m in (max_seqlen_q, max_seqlen_k))
    left, right = (int(w) for w in window_size)
    out, lse = FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, mq, mk, bool(causal), scale, left,
                                         right, float(softcap), backend, alibi_slopes, dropout_p, seed, precision,
                                         block_table)
    return (out, lse) if return_lse else out


__all__ = ["flash_attn_varlen_func", "FlashAttnVarlenFunc", "flash_varlen_fwd", "flash_varlen_bwd"]
