"""The backend chosen for a call signature, kept so that a loop of plain calls (decode steps, layers, training
steps) ranks the backends once per signature instead of asking every backend for its reasons on every call.

A key is (op, the backend the call is forced to or None, the call's ``call_signature`` signature): the signature
holds everything the backends' reasons read of a plain dense call (array kinds, shapes, strides, dtypes, devices,
every option), so two calls of one key get the same reasons. The rest of what the choice depends on is the set of
backends registered and what a backend learns while running (a first-use self-check that fails and declines): the
registry calls ``clear()`` when a backend is registered or removed, and when a backend declines a call. A call with
no signature (None) is never kept. At most ``MAX_KEPT``; past it the cache starts again.

Imports neither torch nor numba; ``backend_registry`` uses it.
"""

from __future__ import annotations

import threading
from typing import Any

MAX_KEPT = 256
_lock = threading.Lock()
_chosen: dict[tuple, Any] = {}


def kept(op: str, forced: str | None, signature: tuple | None) -> Any:
    """The backend kept for a call of ``signature`` (``call_signature.forward_signature``) to ``op`` forced to
    ``forced`` (None: the registry's choice), or None (no signature, or none kept)."""
    if signature is None:
        return None
    return _chosen.get((op, forced, signature))


def keep(op: str, forced: str | None, signature: tuple | None, backend: Any) -> None:
    """Keep ``backend`` (a ``Backend`` that ``Dispatcher.select`` chose) for the key; nothing for no signature."""
    if signature is None:
        return
    with _lock:
        if len(_chosen) >= MAX_KEPT:
            _chosen.clear()
        _chosen[(op, forced, signature)] = backend


def clear() -> None:
    """Forget every choice (the registry calls it when the backends change or one declines a call)."""
    with _lock:
        _chosen.clear()


def kept_count() -> int:
    """How many choices are kept now (at most ``MAX_KEPT``)."""
    return len(_chosen)


__all__ = ["MAX_KEPT", "kept", "keep", "clear", "kept_count"]
