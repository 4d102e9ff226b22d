"""The SIMT forward's row statistics, kept for the backward by the lse they came with.

The forward writes, beside lse, each row's max score (log2 units) and log2 of its sum of exponentials into a
(2, B, Hq, Sq) float32 device array (kernels/spec.py, ``row_stats``). The backward given that lse takes them
(``masks.row_softmax_terms``): its scores are the forward's bit for bit (``config.SCORE_PARTS``), so P of a row's
dominant score is exactly 1 however large the scores, where lse's round trip through natural units is off by an
ulp of the score (finding 5 of issue 47: dV wrong by 1.5% at scores of 1e5, by 5x at 1e7).

Kept by lse's address, shape, strides and device, the most recent first, within ``STASH_MAX_BYTES`` of device
memory. Nothing here has to be right for the result to be: the kernels use a row's statistics only where they give
that row's lse bit for bit, so statistics found for another lse at the same address (a freed and reused
allocation, an lse the caller changed in place) give at worst what lse alone gives.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

#: Device memory the kept statistics may hold, all calls together (4 bytes x 2 per row of lse).
STASH_MAX_BYTES = 64 << 20

_stash: "OrderedDict[tuple, tuple[Any, Any, int]]" = OrderedDict()
_lock = threading.Lock()


def _key(lse: Any) -> tuple | None:
    """lse's address, shape, strides (bytes) and device; None for what has no address (a lone dtype)."""
    if hasattr(lse, "data_ptr") and hasattr(lse, "stride"):   # torch
        return (int(lse.data_ptr()), tuple(lse.shape), tuple(int(s) * lse.element_size() for s in lse.stride()),
                str(lse.device))
    host = getattr(lse, "_ary", None)   # a simulator device array: numpy underneath
    if host is not None:
        lse = host
    interface = getattr(lse, "__array_interface__", None)
    if interface is not None:
        return (int(interface["data"][0]), tuple(lse.shape), tuple(lse.strides), "host")
    interface = getattr(lse, "__cuda_array_interface__", None)
    if interface is not None:   # its strides, None when C-contiguous
        strides = interface.get("strides")
        return (int(interface["data"][0]), tuple(interface["shape"]), None if strides is None else tuple(strides),
                "cuda")
    return None


def keep(lse: Any, stats: Any, owner: Any = None) -> None:
    """Keep ``stats``, the (2, ...) float32 device array the forward that gave ``lse`` (the caller's array, any
    kind) filled; ``owner``: what must stay alive for ``stats`` to (the torch tensor a numba view lies in)."""
    key = _key(lse)
    size = int(stats.size) * 4
    if key is None or size > STASH_MAX_BYTES:
        return
    with _lock:
        _stash[key] = (stats, owner, size)
        _stash.move_to_end(key, last=False)
        total = sum(entry[2] for entry in _stash.values())
        while total > STASH_MAX_BYTES:
            total -= _stash.popitem(last=True)[1][2]


def find(lse: Any, rows_shape: tuple[int, ...]) -> Any:
    """The statistics kept for ``lse`` (the caller's array), if they have the (2, *rows_shape) shape the kernels
    index them with (lse's rows as the kernels see them); else None."""
    key = _key(lse)
    if key is None:
        return None
    with _lock:
        entry = _stash.get(key)
    if entry is None or tuple(entry[0].shape) != (2, *rows_shape):
        return None
    return entry[0]


def clear() -> None:
    """Forget every kept statistic (tests; or to hand their device memory back)."""
    with _lock:
        _stash.clear()


__all__ = ["STASH_MAX_BYTES", "keep", "find", "clear"]
