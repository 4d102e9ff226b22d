"""What the torch faces (``torch_api``, ``torch_varlen``, ``torch_kvcache``) share: the checks of flash-attn's
arguments that this library takes in its place, the dropout seed as a custom op carries it, and the rule that an
op's outputs are tensors of its own.

Imports torch at import time; ``numba_flash`` imports it only when a torch face is first used.
"""

from typing import Any, Optional

import numpy as np
import torch

from numba_flash.errors import AttentionInputError, bad_arg, short_repr
from numba_flash.validation import check_deterministic, check_dropout, is_finite_real


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def owned_output(t, like: torch.Tensor, dtype: torch.dtype, inputs: tuple,
                 input_storages: Optional[frozenset] = None) -> torch.Tensor:
    """``t`` as a fresh contiguous tensor of ``dtype`` on ``like``'s device, as the fake implementations promise.

    A custom op's outputs must not share memory with its inputs; a backend that returns an input unchanged (or a
    view of one) would break that, so such an output is cloned. ``input_storages``: ``storage_pointers(inputs)``,
    for a caller with several outputs of one call (each pointer costs 0.2-0.3 us)."""
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t)
    if t.device != like.device or t.dtype != dtype:
        t = t.to(device=like.device, dtype=dtype)
    t = t.contiguous()
    if input_storages is None:
        input_storages = storage_pointers(inputs)
    if t.untyped_storage().data_ptr() in input_storages:
        t = t.clone()
    return t


def owned_pair(out: Any, lse: Any, q: torch.Tensor,
               *inputs: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward op's outputs as its fake promises them: out like q (q's dtype), lse float32 (float64 for float64
    q), both fresh and contiguous on q's device; q and ``inputs`` (None entries skipped) are the tensors they must
    not share memory with."""
    given = tuple(x for x in (q,) + inputs if x is not None)
    storages = storage_pointers(given)
    return (owned_output(out, q, q.dtype, given, storages),
            owned_output(lse, q, lse_dtype(q.dtype), given, storages))


def storage_pointers(inputs: tuple) -> frozenset:
    """The data pointers of the storages of ``inputs`` (tensors), as ``owned_output`` compares them."""
    return frozenset(x.untyped_storage().data_ptr() for x in inputs)


def no_double_backward(what: str):
    """An autograd formula for a backward op that raises a clear error, for a second derivative asked through it
    (``create_graph=True`` and a gradient of the gradients): torch's own words name no formula, not the reason."""
    def backward(ctx, *grads):
        raise RuntimeError(f"numba_flash: {what} is not differentiable (no double backward: the gradients of "
                           "flash_attn_func and flash_attn_varlen_func have no gradient of their own)")
    return backward


def check_tensors(function: str, q: Any, k: Any, v: Any, names: tuple[str, str, str] = ("q", "k", "v")) -> None:
    """numpy and other arrays pass validate_forward but cannot carry gradients; the registry's op.forward takes
    them, and the error says so, naming the argument (``names``: the function's for q, k, v)."""
    for name, x in zip(names, (q, k, v)):
        if not isinstance(x, torch.Tensor):
            raise AttentionInputError(
                f"{name}: expected a torch.Tensor ({function} is the autograd entry point; use "
                f"backend_registry.get('flash').forward for other arrays), got {type(x).__name__}")


def check_flash_attn_extras(dropout_p: Any, dropout_seed: Any, alibi_slopes: Any, deterministic: Any,
                            return_attn_probs: Any, alibi_ok: bool = False) -> tuple[float, int]:
    """flash-attn's arguments for features this library has not built yet: accepted in their place (so that code
    written for flash-attn calls in unchanged), refused with a clear error when they ask for the feature.
    ``alibi_ok``: the caller takes ALiBi slopes (validated with the tensors).

    Returns ``(dropout_p, seed)`` for the ops: with dropout and no ``dropout_seed``, a seed drawn from torch's
    default generator (so ``torch.manual_seed`` makes it reproducible), as a signed int64 (``seed_for_op``)."""
    if dropout_seed is None and is_finite_real(dropout_p) and float(dropout_p) > 0.0:
        dropout_seed = int(torch.randint(-(1 << 63), (1 << 63) - 1, ())) % SEEDS
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
    return dropout_p, seed_for_op(dropout_seed)


SEEDS = 1 << 64


def seed_for_op(seed: int) -> int:
    """A seed in [0, 2**64) as the signed int64 a custom op's ``int`` holds (the same 64 bits); the ops take it
    back with ``% 2**64``."""
    return seed - SEEDS if seed >= SEEDS // 2 else seed


__all__ = ["lse_dtype", "owned_output", "owned_pair", "storage_pointers", "no_double_backward", "check_tensors",
           "check_flash_attn_extras", "SEEDS", "seed_for_op"]
