"""The masking rules of the contract, in one place, shared by the reference, the kernels' host code and the tests.

Causal masking is aligned to the bottom-right corner (FlashAttention >= 2.1): with ``offset = Sk - Sq``, query row
``i`` may see key ``j`` iff ``i + offset - left <= j <= i + offset + right``, where a bound of -1 means unbounded and
``causal=True`` sets ``right = 0``.
"""

from __future__ import annotations

import math

import numpy as np

UNBOUNDED = -1
LOG2E = 1.4426950408889634


def effective_window(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """The (left, right) window that a call really uses: ``causal`` forces ``right = 0``."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    return left, right


def clamp_window_bound(bound: int, seqlen_q: int, seqlen_k: int) -> int:
    """``bound`` (a left or right window size) capped at ``Sq + Sk``, which already lets every row see every key
    on that side: the same mask, with every index computed from it inside int64 (``window_size=(-1, sys.maxsize)``
    overflowed the kernels' key-range arithmetic into an empty range)."""
    return bound if bound < 0 else min(int(bound), seqlen_q + seqlen_k)


def key_range(i: int, seqlen_q: int, seqlen_k: int, left: int, right: int) -> tuple[int, int]:
    """Half-open range ``[lo, hi)`` of keys that query row ``i`` may see (empty when ``lo >= hi``)."""
    left, right = clamp_window_bound(left, seqlen_q, seqlen_k), clamp_window_bound(right, seqlen_q, seqlen_k)
    centre = i + seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, centre - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
    return lo, max(lo, hi)


def visible_mask(seqlen_q: int, seqlen_k: int, left: int, right: int) -> np.ndarray:
    """Boolean ``(Sq, Sk)`` mask, True where query i may see key j. For references and tests only: it is S x S."""
    left, right = clamp_window_bound(left, seqlen_q, seqlen_k), clamp_window_bound(right, seqlen_q, seqlen_k)
    i = np.arange(seqlen_q)[:, None] + (seqlen_k - seqlen_q)
    j = np.arange(seqlen_k)[None, :]
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def packed_visible_mask(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray, left: int, right: int) -> np.ndarray:
    """Boolean ``(total_q, total_k)`` mask of packed sequences (layout "thd"), True where packed row r may see
    packed key c: both in the same sequence b, and the rule above holding for their positions within it, with
    sequence b's own offset ``Sk_b - Sq_b``. For references and tests only: it is total x total.

    Built from each row's and key's sequence number rather than from ``visible_mask`` blocks, so that it is an
    independent statement of the rule. ``cu_seqlens_*`` are (B + 1,) prefix sums, as validation accepts them.
    """
    cu_q, cu_k = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    len_q, len_k = np.diff(cu_q), np.diff(cu_k)
    seq_q = np.repeat(np.arange(len(len_q)), len_q)
    seq_k = np.repeat(np.arange(len(len_k)), len_k)
    # Capped like clamp_window_bound, with the totals: window_size=(sys.maxsize, 0) must not overflow int64 here.
    cap = int(cu_q[-1] + cu_k[-1])
    left, right = (w if w < 0 else min(int(w), cap) for w in (left, right))
    centre = (np.arange(len(seq_q)) - cu_q[seq_q] + (len_k - len_q)[seq_q])[:, None]
    j = (np.arange(len(seq_k)) - cu_k[seq_k])[None, :]
    mask = seq_q[:, None] == seq_k[None, :]
    if left >= 0:
        mask &= j >= centre - left
    if right >= 0:
        mask &= j <= centre + right
    return mask


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def compute_dtype_name(dtype: str) -> str:
    """The precision a backend computes in for inputs of ``dtype``: float64 for float64, float32 for the rest."""
    return "float64" if dtype == "float64" else "float32"


def effective_softcap(softcap: float, compute: str = "float32") -> float:
    """The softcap the kernels apply, computing in ``compute`` ("float32" or "float64"), for a validated
    ``softcap >= 0`` (0: off). What values outside the compute dtype's range mean:

    * Too large: above ``max / log2(e)`` (2.4e38 in float32) the kernels' base-2 cap ``softcap * log2(e)`` is no
      longer a number, and the cap is the identity anyway: ``softcap * tanh(s / softcap)`` differs from ``s`` by a
      relative ``(s / softcap)**2 / 3``, below float32 rounding for every ``|s| < 5e34``. Such a softcap is off
      (0.0), the limit softcap -> infinity. (Kept, it made every score ``inf * tanh(0) = nan`` or 0.)
    * Too small: every capped score lies within ``+-softcap``, and below ``2**-(mantissa bits + 3)`` (2**-27 in
      float32) that is already so close to 0 that ``exp`` of any difference of two scores rounds to exactly 1:
      the forward is the plain mean of the visible values, whatever smaller value the softcap has. The kernels
      run such a softcap as ``2**-27``, which keeps ``1 / softcap`` and ``scale / softcap`` finite (at 1e-40 they
      overflowed float32 and ``inf - inf`` made scores NaN). The gradients with respect to q and k, which carry
      ``1 - tanh(s / softcap)**2``, are then 0 for every ``|s| > 1e-7`` rather than ``> 10 * softcap``: they
      differ from the exact ones only for scores within 1e-7 of 0, and agree where a score is exactly 0.

    The float64 reference applies the softcap as given; it agrees with these to within the tests' tolerances.
    """
    if softcap <= 0:
        return 0.0
    info = np.finfo(compute)
    if softcap > float(info.max) / LOG2E:
        return 0.0
    return max(float(softcap), 2.0 ** -(info.nmant + 4))


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
