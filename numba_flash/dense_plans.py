"""Plans kept for ``flash_attn_func``'s plain calls, so that a loop of them (decode steps without a cache, layers,
evaluation) is checked in full once per signature and each later call runs its kept ``AttentionPlan``: no
argument checks, no ranking of backends, straight to the backend that serves it.

A call's key holds everything the face's checks read of a plain call (no ALiBi, attn_bias, mods or dropout):

* the backend the call is forced to (its ``backend=``, else ``use()`` or ``NUMBA_FLASH_BACKEND``:
  ``Dispatcher.forced_backend``);
* q, k and v by ``call_signature.array_signature`` (exact type, shape, strides, dtype, device);
* every other argument by its exact type and value (``bool``, ``int``, ``float``, ``str`` or ``None``;
  ``window_size`` a tuple of two ints).

A call with anything else has no key and is checked in full, as before. Only a call that passed the checks and ran
keeps a plan, made of the same arguments (``Dispatcher.plan``), so a later call of its key would pass the same
checks and derive the same call: the plan runs it with the call's own arrays in place. A plan never holds its first
call's tensors (``AttentionPlan.drop_planned_arrays``). The registry drops the plans when a backend is registered or
removed; a backend that declines while a plan runs is replaced there, as the registry would.

``store`` holds at most ``MAX_PLANS``, least recently used dropped first (``plan_cache.PlanCache``: ``clear()``,
``set_enabled(False)`` to check every call in full, ``kept_count()``). Imports neither torch nor numba.
"""

from __future__ import annotations

from typing import Any

from .errors import AttentionInputError, NoBackendError
from .plan import AttentionPlan
from .plan_cache import PlanCache, exact_key

MAX_PLANS = 64   # a model's layers share a few shapes; more than this is another workload
store = PlanCache(MAX_PLANS)   # the plans, by key


def plain_key(forced: str | None, q: Any, k: Any, v: Any, window_size: Any, values: tuple) -> tuple | None:
    """The key of a plain call (the module says what it holds), or None when it has none.

    forced: the backend the call is forced to, or None; q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)
    (or their "bhsd" forms) as given; window_size as given; values: every other argument of the call as given
    (the face's own order; the same order every call)."""
    if q is None or k is None or v is None:
        return None
    return exact_key(("flash_attn_func", forced), (q, k, v), window_size, values)


def kept(key: tuple | None) -> AttentionPlan | None:
    """The plan kept for ``key``, or None (no key, none kept, or the store turned off)."""
    return store.cached(key)


def keep_new(key: tuple | None, dispatcher: Any, q: Any, k: Any, v: Any, options: dict[str, Any]) -> None:
    """Keep a plan for ``key`` of the call that just ran: ``dispatcher.plan(q, k, v, **options)`` (options:
    ``Dispatcher.plan``'s keywords, the backend the forced one), holding none of q, k, v. Nothing is kept for a call
    a plan refuses or no backend serves (each later call then goes the full way, and says so where it did)."""
    if key is None or not store.enabled:
        return
    try:
        plan = dispatcher.plan(q, k, v, **options)
    except (AttentionInputError, NoBackendError):
        return
    plan.drop_planned_arrays()
    store.keep(key, plan)


__all__ = ["MAX_PLANS", "store", "plain_key", "kept", "keep_new"]
