"""Rotary position embedding (RoPE) as ``flash_attn_with_kvcache`` applies it to q and to the keys it appends.

The first ``rotary_dim`` features of each head are rotated in pairs by the angle of the token's position; the rest
pass through. ``cos`` and ``sin`` are tables ``(seqlen_ro, rotary_dim / 2)``: row p holds the cosines and sines of
position p's angles. Two pairings exist:

* interleaved (GPT-J, flash-attn's default ``rotary_interleaved=True``): features ``(2i, 2i + 1)`` form pair i;
* not interleaved (GPT-NeoX): features ``(i, i + rotary_dim / 2)`` form pair i.

Pair ``(x1, x2)`` becomes ``(x1 cos - x2 sin, x1 sin + x2 cos)``. The function below is written with operations
numpy arrays and torch tensors share (slicing, fancy indexing, arithmetic), so the CPU and torch backends use the
same code; it computes in whatever floating dtype it is given. The float64 reference formulates the rotation
independently, as a complex multiplication.
"""

from __future__ import annotations

from typing import Any


def rotary_positions(cache_seqlens: Any, seqlen: int, sequential: bool, arange: Any) -> Any:
    """Positions ``(B, seqlen)`` of new tokens: token t of batch b is at ``cache_seqlens[b] + t``, or at
    ``cache_seqlens[b]`` for every t when not ``sequential`` (flash-attn rotates a non-causal, non-local query
    block as if all of it sat at the first new position). ``cache_seqlens`` (B,) int64 and ``arange(n)`` of the
    caller's array kind."""
    offsets = arange(seqlen) if sequential else arange(seqlen) * 0
    return cache_seqlens[:, None] + offsets[None, :]


def apply_rotary(x: Any, cos: Any, sin: Any, positions: Any, interleaved: bool) -> Any:
    """A rotated copy of ``x``; ``x`` itself is not modified.

    x: (B, S, H, D) floating (numpy or torch, the compute dtype); cos, sin: (seqlen_ro, rotary_dim / 2) of the same
    kind and dtype, rotary_dim <= D; positions: (B, S) integer, each < seqlen_ro. Returns (B, S, H, D) like x.
    """
    half = cos.shape[1]
    c = cos[positions][:, :, None, :]  # (B, S, 1, half): the same angle for every head
    s = sin[positions][:, :, None, :]
    out = x.clone() if hasattr(x, "clone") else x.copy()
    if interleaved:
        first, second = slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    else:
        first, second = slice(0, half), slice(half, 2 * half)
    x1, x2 = x[..., first], x[..., second]
    out[..., first] = x1 * c - x2 * s
    out[..., second] = x1 * s + x2 * c
    return out
