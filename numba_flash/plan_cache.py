"""A bounded store of plans kept by key, least recently used dropped first, shared by the faces that run a loop's
calls on kept plans (``kvcache_plans`` for ``with_kvcache``, ``dense_plans`` for ``flash_attn_func``), and the
exact keys of plain calls (``exact_key``).

A lock guards each store (decode loops and training steps may run in several threads). ``set_enabled(False)``
turns a store off: nothing is kept or read, every call is checked in full; the plans kept stay for when it is on
again. The registry clears every store when a backend is registered or removed, as that may change a plan's choice.

Imports neither torch nor numba.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from .call_signature import array_signature

_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})


def exact_key(scope: tuple, arrays: tuple, window_size: Any, values: tuple) -> tuple | None:
    """A key that holds everything a call's checks read, for calls whose arguments are all plain; None otherwise.

    scope: who asks, the op and the backend the call is forced to; arrays: the call's arrays as given, each by
    ``call_signature.array_signature`` (exact type, shape, strides, dtype, device; None stays None, an array kind
    without a signature means no key); window_size as given (a tuple of two ints, else no key); values: every
    other argument as given, each by its exact type and value (``bool``, ``int``, ``float``, ``str`` or ``None``,
    else no key), in the same order every call."""
    if type(window_size) is not tuple or len(window_size) != 2:
        return None
    types = tuple(map(type, values)) + (type(window_size[0]), type(window_size[1]))
    if types[-1] is not int or types[-2] is not int or not _PLAIN_TYPES.issuperset(types):
        return None
    signatures = []
    for x in arrays:
        signature = None if x is None else array_signature(x)
        if signature is None and x is not None:
            return None
        signatures.append(signature)
    return scope, tuple(signatures), types, values, window_size


class PlanCache:
    """At most ``max_plans`` plans by hashable key (a key of None is never kept nor found)."""

    def __init__(self, max_plans: int) -> None:
        self.max_plans = max_plans
        self._lock = threading.Lock()
        self._plans: OrderedDict[tuple, Any] = OrderedDict()
        self._enabled = True

    @property
    def enabled(self) -> bool:
        return self._enabled

    def cached(self, key: tuple | None) -> Any:
        """The plan kept for ``key``, or None (no key, none kept, or the store turned off)."""
        if key is None or not self._enabled:
            return None
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
        return plan

    def keep(self, key: tuple | None, plan: Any) -> None:
        """Keep ``plan`` for ``key`` (nothing for None or with the store off), dropping the least recently used."""
        if key is None or not self._enabled:
            return
        with self._lock:
            self._plans[key] = plan
            self._plans.move_to_end(key)
            while len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)

    def set_enabled(self, enabled: bool) -> bool:
        """Turn the store on or off; returns the previous setting."""
        with self._lock:
            previous, self._enabled = self._enabled, bool(enabled)
        return previous

    def clear(self) -> None:
        """Drop every kept plan."""
        with self._lock:
            self._plans.clear()

    def kept_count(self) -> int:
        """How many plans are kept now (at most ``max_plans``)."""
        return len(self._plans)


__all__ = ["PlanCache"]
