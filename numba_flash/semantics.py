"""The masking rules of the contract, in one place, shared by the reference, the kernels' host code and the tests.

Causal masking is aligned to the bottom-right corner (FlashAttention >= 2.1): with ``offset = Sk - Sq``, query row
``i`` may see key ``j`` iff ``i + offset - left <= j <= i + offset + right``, where a bound of -1 means unbounded and
``causal=True`` sets ``right = 0``.
"""

from __future__ import annotations

import math

import numpy as np

UNBOUNDED = -1


def effective_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """The (left, right) window that a call really uses: ``causal`` forces ``right = 0``."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def key_range(i: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys that query row ``i`` may see (empty when ``lo >= hi``)."""
    centre = i + seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, centre - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
    return lo, max(lo, hi)


def visible_mask(seqlen_q: int, seqlen_k: int, left: int, right: int) -> np.ndarray:
    """Boolean ``(Sq, Sk)`` mask, True where query i may see key j. For references and tests only: it is S x S."""
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def visible_pairs(seqlen_q: int, seqlen_k: int, left: int, right: int) -> int:
    """Number of (query, key) pairs the mask lets through, without building the mask."""
    total = 0
    for i in range(seqlen_q):
        lo, hi = key_range(i, seqlen_q, seqlen_k, left, right)
        total += hi - lo
    return total


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, head_dim: int,
                    causal: bool = False, mode: str = "fwd") -> float:
    """FLOP count used in every report: forward ``4*B*H*Sq*Sk*D``, halved when causal with Sq == Sk;
    ``mode="bwd"`` is 2.5x the forward and ``"fwd_bwd"`` 3.5x (the contract's convention)."""
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * head_dim
    if causal and seqlen_q == seqlen_k:
        flops /= 2
    return flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]
