"""Validated calls remembered per signature, so that a loop of calls (decode steps, layers, training steps) pays
for the contract's checks once per signature instead of once per call.

A signature is everything the checks of a plain dense call look at: each array's exact type, shape, strides, dtype
and device (torch tensors only when strided, not nested and with no lazy negation or conjugation bit), and every
option as an exact plain Python value (``bool``, ``int``, ``float``, ``str``, ``None``). Two calls with one
signature pass or fail the checks alike and derive the same ``AttentionCall`` but for the arrays themselves, so the
second one only puts its own arrays into a copy of the first's. (No validated field depends on strides; they are
in the signature all the same, so that nothing a later check might read is left out.) Calls with anything else
(alibi slopes, attn_bias, mods, packed sequences, dropout, numpy masked arrays, other array kinds, option values of
other types) have no signature and are checked in full every time; a call that fails its checks is never
remembered.

Imports neither torch nor numba; ``validation`` uses it.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

MAX_SIGNATURES = 256   # calls of a process rarely have more; past it the memo starts again
_memo: dict[tuple, dict[str, Any]] = {}
_PLAIN_NUMBERS = (int, float)


def array_signature(x: Any) -> tuple | None:
    """The facts of array ``x`` the checks read, as a hashable tuple: a plain ``np.ndarray`` or a torch tensor;
    None for anything else (a masked array's mask is content, not signature)."""
    if type(x) is np.ndarray:
        return (np.ndarray, x.shape, x.strides, x.dtype)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor) or x.is_nested or x.layout is not torch.strided:
        return None
    if x.is_neg() or x.is_conj():   # validation hands on a resolved copy of such a tensor, not the tensor
        return None
    return (type(x), x.shape, x.stride(), x.dtype, x.device)


_UNUSED = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes", "attn_bias", "bias_mod",
           "mask_mod", "score_mod", "block_mask")


def forward_signature(arguments: dict[str, Any]) -> tuple | None:
    """The signature of a forward call, or None when it has none (see the module's docstring).

    arguments: ``validate_forward``'s arguments by name, as given: q, k, v, the options (causal, softmax_scale,
    window_size, softcap, layout, return_lse, dropout_p, dropout_seed, precision) and those a plain call leaves None
    (cu_seqlens, max_seqlen, alibi_slopes, attn_bias, the mods)."""
    for name in _UNUSED:
        if arguments[name] is not None:
            return None
    causal, scale, window, softcap, layout, return_lse, dropout_p, dropout_seed, precision = options = (
        arguments["causal"], arguments["softmax_scale"], arguments["window_size"], arguments["softcap"],
        arguments["layout"], arguments["return_lse"], arguments["dropout_p"], arguments["dropout_seed"],
        arguments["precision"])
    if type(causal) is not bool or type(return_lse) is not bool or type(precision) is not str:
        return None
    if not (scale is None or type(scale) in _PLAIN_NUMBERS) or type(softcap) not in _PLAIN_NUMBERS:
        return None
    if type(window) is not tuple or len(window) != 2 or type(window[0]) is not int or type(window[1]) is not int:
        return None
    if not (layout is None or type(layout) is str) or type(dropout_p) not in _PLAIN_NUMBERS or dropout_p != 0:
        return None
    if not (dropout_seed is None or type(dropout_seed) is int):
        return None
    arrays = (array_signature(arguments["q"]), array_signature(arguments["k"]), array_signature(arguments["v"]))
    if arrays[0] is None or arrays[1] is None or arrays[2] is None:
        return None
    return arrays + options


def recalled(signature: tuple | None, cls: type, q: Any, k: Any, v: Any) -> Any:
    """The call validated before with ``signature``, as a new ``cls`` (``validation.AttentionCall``) holding the
    arrays q, k, v of this call (and a fresh ``extra``); None when there is none."""
    fields = None if signature is None else _memo.get(signature)
    if fields is None:
        return None
    call = object.__new__(cls)   # a frozen dataclass: its fields are set as __init__ would, without re-deriving
    call.__dict__.update(fields, q=q, k=k, v=v, extra={})
    return call


def copied_with(call: Any, **fields: Any) -> Any:
    """A copy of validated call ``call`` (a frozen ``validation.AttentionCall``) with ``fields`` in place of its
    own, and a fresh ``extra``, made as ``recalled`` makes one: without ``dataclasses.replace``'s re-run of
    ``__init__`` (about 7 us for its 30 fields). For fields that need no re-derivation, e.g. a backward's dout,
    out and lse put into the forward's call; the caller vouches for them."""
    copy = object.__new__(type(call))
    copy.__dict__.update(call.__dict__, extra={}, **fields)
    return copy


def remember(signature: tuple | None, fields: dict[str, Any], given: tuple[Any, Any, Any]) -> None:
    """Keep a validated call's fields for ``signature`` (nothing for None). ``given``: q, k, v as the caller gave
    them; a call whose checks put other arrays in their place (a converted copy) is not kept, since ``recalled``
    hands on the caller's own arrays."""
    if signature is None or any(fields[name] is not x for name, x in zip("qkv", given)):
        return
    if len(_memo) >= MAX_SIGNATURES:
        _memo.clear()
    _memo[signature] = dict(fields)


def remembered_count() -> int:
    """How many signatures are remembered now (at most ``MAX_SIGNATURES``)."""
    return len(_memo)


def forget_all() -> None:
    """Drop every remembered call (tests; a process needs no reason to)."""
    _memo.clear()


__all__ = ["array_signature", "forward_signature", "recalled", "copied_with", "remember", "remembered_count",
           "forget_all", "MAX_SIGNATURES"]
