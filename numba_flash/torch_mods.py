"""``flash_attn_func`` with user mods (``numba_flash.mods``): autograd without a custom op.

``torch.library.custom_op`` schemas hold tensors and plain values, not Python functions, so a call with
``bias_mod``, ``mask_mod`` or ``score_mod`` goes through this ``torch.autograd.Function`` instead, which calls the
registry directly. It works in eager mode; under ``torch.compile`` it is a graph break. Imported by
``numba_flash.torch_api`` only.
"""

from typing import Any

import torch

from numba_flash import backend_registry
from numba_flash.errors import AttentionInputError


class FlashAttnModsFunc(torch.autograd.Function):
    """(out, lse) of attention with mods; gradients for q, k, v and, when it requires one, attn_bias.
    ``params`` holds the registry's keyword arguments (causal, softmax_scale, window_size, softcap, layout, backend,
    alibi_slopes), ``mods`` the mods and ``score_mod_grad``."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, params: dict, mods: dict):
        fwd_mods = {n: f for n, f in mods.items() if n != "score_mod_grad"}
        out, lse = backend_registry.get("flash").forward(q, k, v, return_lse=True, attn_bias=attn_bias, **params,
                                                         **fwd_mods)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias)
        ctx.params, ctx.mods = params, mods
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, attn_bias = ctx.saved_tensors
        if ctx.mods.get("score_mod") is not None and ctx.mods.get("score_mod_grad") is None:
            raise AttentionInputError("score_mod_grad: expected d score_mod / d score, a function (score, b, h, q_idx, "
                                      "kv_idx) -> float, passed to flash_attn_func with score_mod, for the "
                                      "backward; got None")
        return_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        grads = backend_registry.get("flash").backward(dout.contiguous(), q, k, v, out, lse, attn_bias=attn_bias,
                                                       return_dbias=return_dbias, **ctx.params, **ctx.mods)
        return grads[0], grads[1], grads[2], grads[3] if return_dbias else None, None, None


def flash_attn_with_mods(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: Any, params: dict,
                         mods: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``flash_attn_func``'s path for calls with mods; returns (out, lse)."""
    return FlashAttnModsFunc.apply(q, k, v, attn_bias, params, mods)


__all__ = ["FlashAttnModsFunc", "flash_attn_with_mods"]
