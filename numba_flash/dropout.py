"""Dropout's random numbers: Philox4x32-10, counter-based, keyed by (seed, b, h, i, j), the same on every backend.

A counter-based generator (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the one cuRAND
and flash-attn use) is a pure function of a counter and a key, so the mask of any (batch, head, query row, key)
can be computed where and when it is needed: each tile of a kernel makes its own part, and the backward makes the
forward's mask again instead of storing an Sq x Sk array. Ten rounds is Random123's default, the one its authors
found "crush-resistant" with a safety margin (7 already pass BigCrush).

The mapping, which every backend must follow bit for bit:

* key = (seed mod 2**32, seed >> 32) for a seed in [0, 2**64);
* counter = (j >> 2, i, h, b): j the key index, i the query row, h the query head, b the batch index (for packed
  sequences, the sequence index, and i, j counted from the start of that sequence);
* the random word of (b, h, i, j) is word ``j & 3`` of ``philox4x32_10(counter, key)``: one Philox call serves
  four neighbouring keys, so a kernel that walks j four at a time pays a quarter of the cost;
* key j is kept iff ``word < threshold``, ``threshold = dropout_threshold(p) = floor((1 - p) * 2**32)`` with
  ``1 - p`` rounded to float64 first (an integer in (0, 2**32]; p = 0 keeps everything), so a key is kept with
  probability ``threshold / 2**32``, which is 1 - p to within 2**-32; kept probabilities are multiplied by
  ``1 / (1 - p)`` (``dropout_scale``), dropped ones become 0.

One function body, ``philox4x32_10``, serves three places: numba ``njit`` code (``dropout_word`` and
``dropout_keep`` are ``@njit(inline="always")``-friendly functions of plain integers), numba.cuda device code (the
same Python source compiled with ``cuda.jit(device=True)``: only uint64 ``+ * ^ & >>`` on values below 2**33, no
numpy calls and no Python objects), and numpy arrays of uint64 (the same source run by the interpreter, elementwise;
``dropout_mask`` uses it). Every value stays below 2**64, so no operation wraps and numpy has nothing to warn about.
Torch has no uint32 arithmetic on every device and its int64 product of two 32-bit words can overflow, so
``philox4x32_10_torch`` is the same rounds on int64 tensors with the 32 x 32 -> 64 product made of 16-bit halves.
Tests check all of them against Random123's published known-answer vectors and against each other.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from .errors import bad_arg
from .validation import check_dropout

# Random123's constants (philox.h): the multipliers and the Weyl key increments (golden ratio and sqrt(3) - 1).
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_TWO32 = 4294967296  # 2**32


def philox4x32_10(c0: Any, c1: Any, c2: Any, c3: Any, k0: Any, k1: Any) -> tuple[Any, Any, Any, Any]:
    """Philox4x32 with 10 rounds: counter (c0, c1, c2, c3) and key (k0, k1), 32-bit words held in uint64 values
    (numpy uint64 scalars or arrays, or numba uint64). Returns the four output words, uint64 below 2**32.

    Self-contained (it calls nothing) so that numba can compile it for the CPU or as a CUDA device function."""
    for r in range(PHILOX_ROUNDS):
        if r > 0:   # Random123 bumps the key before every round but the first
            k0 = (k0 + PHILOX_W0) & _MASK32
            k1 = (k1 + PHILOX_W1) & _MASK32
        p0 = PHILOX_M0 * c0   # < 2**64: a 32 x 32 -> 64-bit product, its hi and lo words below
        p1 = PHILOX_M1 * c2
        c0, c1, c2, c3 = (p1 >> _SHIFT32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> _SHIFT32) ^ c3 ^ k1, p0 & _MASK32
    return c0, c1, c2, c3


def compile_with(jit: Any) -> tuple[Any, Any, Any]:
    """``(philox4x32_10, dropout_word, dropout_keep)`` compiled with the decorator ``jit``:
    ``njit(inline="always")`` for CPU kernels (this module's own ``dropout_word`` / ``dropout_keep``), or
    ``cuda.jit(device=True, inline=True)`` for CUDA kernels. Both use one body, so they agree bit for bit.

    ``dropout_word(seed_lo, seed_hi, b, h, i, j)`` -> uint64 random word below 2**32 of batch b, query head h,
    query row i, key j (any integer arguments; ``seed_lo, seed_hi = split_seed(seed)``);
    ``dropout_keep(seed_lo, seed_hi, threshold, b, h, i, j)`` -> True where that key is kept
    (``threshold = dropout_threshold(p)``)."""
    philox = jit(philox4x32_10)

    def word(seed_lo: Any, seed_hi: Any, b: Any, h: Any, i: Any, j: Any) -> Any:
        u = np.uint64
        jj = u(j)
        r0, r1, r2, r3 = philox(jj >> u(2), u(i), u(h), u(b), u(seed_lo), u(seed_hi))
        lane = jj & u(3)
        if lane == u(0):
            return r0
        if lane == u(1):
            return r1
        if lane == u(2):
            return r2
        return r3

    word_jit = jit(word)

    def keep(seed_lo: Any, seed_hi: Any, threshold: Any, b: Any, h: Any, i: Any, j: Any) -> bool:
        return word_jit(seed_lo, seed_hi, b, h, i, j) < np.uint64(threshold)

    return philox, word_jit, jit(keep)


philox4x32_10_jit, dropout_word, dropout_keep = compile_with(njit(inline="always"))


def split_seed(seed: int) -> tuple[int, int]:
    """(key word 0, key word 1) of a seed in [0, 2**64): its low and high 32 bits."""
    seed = int(seed)
    return seed & 0xFFFFFFFF, seed >> 32


def dropout_threshold(p: float) -> int:
    """``floor((1 - p) * 2**32)`` with 1 - p rounded to float64: a key is kept iff its word is below it."""
    return int((1.0 - float(p)) * _TWO32)


def dropout_scale(p: float) -> float:
    """What a kept probability is multiplied by: ``1 / (1 - p)``."""
    return 1.0 / (1.0 - float(p))


def dropout_words(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int) -> np.ndarray:
    """uint64 array (B, H, Sq, Sk) of every random word, computed with numpy from the same function body."""
    lo, hi = (np.uint64(w) for w in split_seed(seed))
    b, h, i, j = np.meshgrid(*(np.arange(n, dtype=np.uint64) for n in (batch, nheads, seqlen_q, seqlen_k)),
                             indexing="ij", sparse=True)
    words = philox4x32_10(j >> np.uint64(2), i, h, b, lo, hi)
    lane = np.broadcast_to((j & np.uint64(3)).astype(np.intp), (batch, nheads, seqlen_q, seqlen_k))
    return np.choose(lane, [np.broadcast_to(w, lane.shape) for w in words])


def dropout_mask(seed: int, batch: int, nheads: int, seqlen_q: int, seqlen_k: int, dropout_p: float) -> np.ndarray:
    """The keep mask every backend applies: bool (batch, nheads, seqlen_q, seqlen_k), True where the probability
    of query row i for key j in (batch b, query head h) is kept (and scaled by 1 / (1 - dropout_p)), False where it
    is dropped. ``seed`` in [0, 2**64); ``dropout_p`` in [0, 1). For packed sequences, sequence b's mask is
    ``dropout_mask(seed, b + 1, ...)[b]`` with i and j counted within the sequence. Memory: one byte per element
    plus temporaries of eight; meant for tests and small problems."""
    dropout_p, seed = check_dropout(dropout_p, seed)
    for name, n in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 0:
            raise bad_arg(name, "an int >= 0", repr(n))
    return dropout_words(seed, batch, nheads, seqlen_q, seqlen_k) < np.uint64(dropout_threshold(dropout_p))


# ---- torch: int64 tensors holding 32-bit words ----

def _mulhilo_torch(m: int, x: Any) -> tuple[Any, Any]:
    """(hi, lo) words of the 64-bit product of the constant ``m`` and the 32-bit words in ``x`` (int64 tensor),
    from 16-bit halves so that no int64 product overflows."""
    m_lo, m_hi = m & 0xFFFF, m >> 16
    x_lo, x_hi = x & 0xFFFF, x >> 16
    ll, lh, hl, hh = x_lo * m_lo, x_lo * m_hi, x_hi * m_lo, x_hi * m_hi   # each < 2**32
    mid = (ll >> 16) + (lh & 0xFFFF) + (hl & 0xFFFF)                    # < 3 * 2**16
    lo = (ll & 0xFFFF) | ((mid & 0xFFFF) << 16)
    hi = hh + (lh >> 16) + (hl >> 16) + (mid >> 16)
    return hi & 0xFFFFFFFF, lo


def philox4x32_10_torch(c0: Any, c1: Any, c2: Any, c3: Any, k0: int, k1: int) -> tuple[Any, Any, Any, Any]:
    """``philox4x32_10`` on int64 tensors (any device; broadcastable shapes) holding 32-bit words; the key words
    are Python ints. Returns four int64 tensors of words below 2**32."""
    m0, m1, w0, w1 = (int(x) for x in (PHILOX_M0, PHILOX_M1, PHILOX_W0, PHILOX_W1))
    for r in range(PHILOX_ROUNDS):
        if r:
            k0, k1 = (k0 + w0) & 0xFFFFFFFF, (k1 + w1) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo_torch(m0, c0)
        hi1, lo1 = _mulhilo_torch(m1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def dropout_words_torch(seed: int, b: Any, h: Any, i: Any, j: Any) -> Any:
    """int64 tensor of the random words of (b, h, i, j), four broadcastable int64 tensors of indices on one
    device; the result has their broadcast shape."""
    import torch

    lo, hi = split_seed(seed)
    words = philox4x32_10_torch(j >> 2, i, h, b, lo, hi)
    shape = torch.broadcast_shapes(*(x.shape for x in (b, h, i, j)))
    lane = (j & 3).expand(shape)
    out = words[3].expand(shape).clone()
    for w in range(3):
        out = torch.where(lane == w, words[w], out)
    return out


def dropout_keep_torch(seed: int, threshold: int, b: Any, h: Any, i: Any, j: Any) -> Any:
    """bool tensor: True where (b, h, i, j) is kept; arguments as for ``dropout_words_torch``."""
    return dropout_words_torch(seed, b, h, i, j) < threshold


__all__ = ["philox4x32_10", "philox4x32_10_jit", "philox4x32_10_torch", "dropout_word", "dropout_keep",
           "dropout_words", "dropout_words_torch", "dropout_keep_torch", "dropout_mask", "dropout_threshold",
           "dropout_scale", "split_seed", "compile_with"]
