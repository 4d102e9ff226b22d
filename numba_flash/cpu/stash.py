"""The forward's row statistics (each row's max and 1 / sum), kept by the lse they produced so that the backward
given that lse skips a stats-only pass over the scores, and the rule for an lse that is not these keys' own
(ring attention, split-KV training).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

STASH_MAX_BYTES = 64 << 20
_stash: "OrderedDict[tuple, tuple[np.ndarray, np.ndarray, np.ndarray]]" = OrderedDict()
_stash_lock = threading.Lock()
stats_passes = 0  # backward calls that had to recompute the statistics (for tests)


def _stash_key(lse: np.ndarray, tag: bytes | None) -> tuple:
    return (lse.__array_interface__["data"][0], lse.shape, lse.strides, lse.dtype.str, tag)


def stash_stats(lse: np.ndarray, row_max: np.ndarray, row_inv: np.ndarray, tag: bytes | None = None) -> None:
    """Keep a forward's row max and 1 / sum (B, Hq, statistics rows) with a copy of the lse (B, Hq, Sq) they gave,
    the most recent first, within ``STASH_MAX_BYTES``. ``tag``: where the statistics rows of packed sequences lie
    (``schedule.Sequences.stash_tag``), None for a dense call; only a backward with the same tag finds them."""
    entry = (np.array(lse, copy=True), row_max, row_inv)
    size = sum(a.nbytes for a in entry)
    if size > STASH_MAX_BYTES:
        return
    key = _stash_key(lse, tag)
    with _stash_lock:
        _stash[key] = entry
        _stash.move_to_end(key, last=False)
        while sum(a.nbytes for e in _stash.values() for a in e) > STASH_MAX_BYTES:
            _stash.popitem(last=True)


def stashed_stats(lse: np.ndarray, tag: bytes | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Copies of the row statistics of the forward that wrote ``lse``, if it is bit for bit what that forward
    wrote; else None. Safe whatever the caller did in between: statistics whose lse equals the given one bit for bit
    give P = exp(score - max) / sum = exp(score - lse) up to lse's own rounding, so at worst they are what
    recomputing P from lse would give, never another call's softmax."""
    with _stash_lock:
        entry = _stash.get(_stash_key(lse, tag))
    if entry is None:
        return None
    kept, row_max, row_inv = entry
    bits = np.uint64 if kept.dtype.itemsize == 8 else np.uint32   # the key holds lse's shape and dtype
    if not np.array_equal(kept.view(bits), np.ascontiguousarray(lse).view(bits)):
        return None
    return row_max.copy(), row_inv.copy()


def defer_to_caller_lse(lse: np.ndarray, row_max: np.ndarray, row_inv: np.ndarray) -> bool:
    """Where the caller's lse (B, Hq, Sq) is not these keys' own, make P = exp(score - lse) instead of the
    recomputed statistics, in place on row_max and row_inv (B, Hq, Sq).

    The caller's lse says which softmax the gradient is of. Normally it is the forward's own over these keys, and
    the recomputed max and sum give that P with one rounding. Ring attention and split-KV training pass the lse of a
    softmax over more keys than this call holds (one block's share of the gradient); its P is exp(score - lse).
    A row takes the caller's lse when it differs from the local one by more than rounding (8 ulp), is NaN (a row
    poisoned elsewhere), or is +inf while the row sees keys here. Returns whether any row took it."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        given = lse.astype(np.float64)
        local = row_max.astype(np.float64) - np.log(row_inv.astype(np.float64))
        tolerance = 8 * np.finfo(lse.dtype).eps * np.maximum(1.0, np.abs(given))
        other = ~(np.abs(local - given) <= tolerance) & ~(np.isposinf(given) & np.isposinf(local))
    if not other.any():
        return False
    row_max[other] = given[other]
    row_inv[other] = 1.0
    return True
