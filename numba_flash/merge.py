"""Exact merge of two partial attentions over disjoint key sets, by their log-sum-exps.

If keys split into sets A and B, attention over A and B together is a convex combination of the two partial
outputs, each weighted by its share of the softmax denominator::

    lse = log(exp(lse_a) + exp(lse_b))
    out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b

This is what split-KV decoding and ring (context-parallel) attention do after the kernels. The lse conventions of
``numba_flash.reference`` carry over: a part whose lse is +inf saw no key and weighs nothing, and a NaN lse (a row
poisoned by a non-finite value) makes the merged row NaN.

numpy inputs are merged with numpy; torch tensors with torch on their own device, which is imported only then.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arguments import checked_arguments
from .arrays import array_kind, dtype_name
from .errors import bad_arg

__all__ = ["merge_attention_states"]

_OUT_DTYPES = {"numpy": ("float16", "float32", "float64"),
               "torch": ("float16", "bfloat16", "float32", "float64")}
_NAMES = ("out_a", "lse_a", "out_b", "lse_b")



def _lse_shape(out_shape: tuple[int, ...]) -> tuple[tuple[int, ...], str, str]:
    """(lse shape, out's dimension names, lse's dimension names) for an out shape of 3 or 4 dimensions."""
    if len(out_shape) == 4:
        b, s, h, _ = out_shape
        return (b, h, s), "(B, S, H, D)", "(B, H, S)"
    t, h, _ = out_shape
    return (h, t), "(T, H, D)", "(H, T)"


def _check(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[str, str]:
    """Raise AttentionInputError on the first broken rule; return (array kind, compute dtype name)."""
    arrays = dict(zip(_NAMES, (out_a, lse_a, out_b, lse_b)))
    kind = array_kind(out_a)
    if kind not in _OUT_DTYPES:
        got = kind if kind is not None else f"an object of type {type(out_a).__name__}"
        raise bad_arg("out_a", "a numpy array or a torch tensor", got)
    for name, x in arrays.items():
        other = array_kind(x)
        if other != kind:
            raise bad_arg(name, f"the same array kind as out_a ({kind})",
                          other if other is not None else f"an object of type {type(x).__name__}")
    if kind == "torch":
        import torch  # already imported by whoever made the tensor

        for name, x in arrays.items():
            if x.is_nested or x.layout != torch.strided:
                got = "a nested tensor" if x.is_nested else f"layout {x.layout}"
                raise bad_arg(name, "a dense (strided) tensor", got)
        dev = out_a.device
        for name, x in arrays.items():
            if x.device != dev:
                raise bad_arg(name, f"out_a's device ({dev})", f"device {x.device}")
    shape = tuple(int(s) for s in out_a.shape)
    if len(shape) not in (3, 4):
        raise bad_arg("out_a", "4 dimensions (B, S, H, D), or 3 (T, H, D) for packed sequences", f"shape {shape}")
    shape_b = tuple(int(s) for s in out_b.shape)
    if shape_b != shape:
        raise bad_arg("out_b", f"the shape of out_a {shape}", f"shape {shape_b}")
    want, out_dims, lse_dims = _lse_shape(shape)
    for name in ("lse_a", "lse_b"):
        got = tuple(int(s) for s in arrays[name].shape)
        if got != want:
            raise bad_arg(name, f"shape {lse_dims} = {want} for out of shape {out_dims} = {shape}", f"shape {got}")
    allowed = _OUT_DTYPES[kind]
    out_dt = dtype_name(out_a)
    if out_dt not in allowed:
        raise bad_arg("out_a", f"a floating dtype ({', '.join(allowed)})", f"dtype {out_dt}")
    if dtype_name(out_b) != out_dt:
        raise bad_arg("out_b", f"the dtype of out_a ({out_dt})", f"dtype {dtype_name(out_b)}")
    lse_dt = dtype_name(lse_a)
    if lse_dt not in allowed:
        raise bad_arg("lse_a", f"a floating dtype ({', '.join(allowed)})", f"dtype {lse_dt}")
    if dtype_name(lse_b) != lse_dt:
        raise bad_arg("lse_b", f"the dtype of lse_a ({lse_dt})", f"dtype {dtype_name(lse_b)}")
    # float16 / bfloat16 cannot hold exp(lse) ratios and weighted sums to the precision the parts carry.
    return kind, "float64" if "float64" in (out_dt, lse_dt) else "float32"


def _merge(xp: Any, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """The merge in the compute dtype, written once for numpy and torch (``xp`` is either module): the names used
    exist in both with the same meaning. Nothing is written into the inputs."""
    fin_a, fin_b = xp.isfinite(lse_a), xp.isfinite(lse_b)
    poisoned = xp.isnan(lse_a) | xp.isnan(lse_b)
    seen = fin_a | fin_b
    # Non-finite lses are replaced before any arithmetic so that no inf - inf appears: besides giving NaN, it
    # would give NaN gradients through torch.where's unused branch.
    la, lb = xp.where(fin_a, lse_a, 0.0), xp.where(fin_b, lse_b, 0.0)
    # Shift by the larger finite lse: the larger weight is exp(0) = 1, so nothing overflows and the sum is in [1, 2].
    top = xp.where(fin_a & fin_b, xp.maximum(la, lb), xp.where(fin_a, la, lb))
    w_a = xp.where(fin_a, xp.exp(la - top), 0.0)
    w_b = xp.where(fin_b, xp.exp(lb - top), 0.0)
    total = xp.where(seen, w_a + w_b, 1.0)
    lse = xp.where(poisoned, float("nan"), xp.where(seen, top + xp.log(total), float("inf")))

    def per_row(x: Any) -> Any:  # (B, H, S) -> (B, S, H, 1), (H, T) -> (T, H, 1): broadcast over out's head dim
        return xp.swapaxes(x, -1, -2)[..., None]

    # A part that saw no key is left out by selection rather than multiplied by 0, which a stray NaN in its
    # (meaningless) out row would survive; a NaN in the out of a part that did see keys still comes through.
    out = (xp.where(per_row(fin_a), per_row(w_a / total) * out_a, 0.0)
           + xp.where(per_row(fin_b), per_row(w_b / total) * out_b, 0.0))
    out = xp.where(per_row(poisoned), float("nan"), out)
    return out, lse


@checked_arguments
def merge_attention_states(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Attention over the union of two disjoint key sets, from each set's output and log-sum-exp.

    The merge is exact up to rounding: attention over keys A and B equals
    ``merge_attention_states(*attention(keys A), *attention(keys B))`` (and merging is associative, so any number
    of parts can be merged pairwise). It is the building block of split-KV decoding and of ring attention.

    Arguments (the four arrays all numpy arrays or all torch tensors on one device; never modified):
        out_a, out_b: (B, S, H, D) (layout "bshd"), or (T, H, D) for packed sequences (layout "thd"); one dtype,
            float16, float32 or float64 (also bfloat16 for torch tensors).
        lse_a, lse_b: (B, H, S) for 4-dimensional outs, (H, T) for 3-dimensional ones, as ``forward(...,
            return_lse=True)`` returns them; one floating dtype. +inf marks a row that saw no key of its part (its
            out row is ignored), NaN a row poisoned by a non-finite input.

    Returns:
        out: shaped like out_a, out_a's dtype, same kind and device. A row that sees no key in either part is 0;
            a row with a NaN lse in either part is NaN.
        lse: shaped like lse_a, float32 (float64 when the outs or lses are float64): the log-sum-exp over both
            parts; +inf where neither part saw a key, NaN where either is NaN.

    Computed in float32 at least (float64 for float64 inputs), shifted by the larger finite lse so nothing
    overflows. torch tensors are merged with torch operations on their own device, so autograd goes through the
    merge (a part with lse +inf gets gradient 0). Raises ``numba_flash.AttentionInputError`` for mismatched kinds, devices, shapes or dtypes.
    """
    kind, compute = _check(out_a, lse_a, out_b, lse_b)
    if kind == "numpy":
        parts = [np.asarray(x, dtype=compute) for x in (out_a, lse_a, out_b, lse_b)]
        # 0 * inf in a part's out gives NaN on purpose (a non-finite value is never hidden): no warning for it.
        with np.errstate(invalid="ignore", over="ignore"):
            out, lse = _merge(np, *parts)
        return out.astype(out_a.dtype, copy=False), lse
    import torch

    ct = torch.float64 if compute == "float64" else torch.float32
    out, lse = _merge(torch, *(x.to(ct) for x in (out_a, lse_a, out_b, lse_b)))
    return out.to(out_a.dtype), lse
