"""Plans kept for ``with_kvcache`` calls, so that a decode loop through ``op.with_kvcache`` or
``flash_attn_with_kvcache`` is checked in full once and each later step pays only for ``KVCachePlan``'s step
checks (the array signatures, and the rules that follow ``cache_seqlens``).

A call's key is everything ``validate_kvcache`` reads but ``cache_seqlens`` (and the block table's values), which a
plan checks each step anyway:

* q, k_cache, v_cache, k, v and block_table by ``call_signature.array_signature`` (exact type, shape, strides, dtype,
  device);
* cache_batch_idx, cache_leftpad and alibi_slopes by signature and values (a plan reads their values once), for
  host arrays only (numpy, CPU tensors): reading a device array's values would cost a copy a step;
* rotary_cos / rotary_sin by signature and identity: a plan attends with the table it was made with, and keeps it
  alive, so no other object can take its id while the plan is kept;
* every other option by its exact value and type (``bool``, ``int``, ``float``, ``None``, a tuple of two ints);
* the op and the backend a call is forced to (``Dispatcher.forced_backend``: ``use()``, ``NUMBA_FLASH_BACKEND``).

A call with anything else (an array kind without a signature, a device index array, a list for window_size, a
numpy bool, ...) has no key and is checked in full, as before. The first call of a key is checked in full and runs
as it always did; only then is its plan kept (a call that fails is never kept). A plan is run only on a call of its
own key, so the step's arrays have the planned signatures and its other arguments the planned values: the full
checks would pass them and derive the same call, and run would go to the backend it chose. The registry clears the
plans when a backend is registered or removed, as that may change the choice.

At most ``MAX_PLANS``, least recently used dropped first, in a ``plan_cache.PlanCache`` (a lock guards it: decode
loops in several threads). ``set_enabled(False)`` turns the cache off (every call checked in full), ``clear()``
empties it.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .call_signature import array_signature
from .errors import NoBackendError
from .kvcache import KVCacheCall, validate_kvcache
from .plan_cache import PlanCache
from .plan_kvcache import KVCachePlan, holds_given, kvcache_options

MAX_PLANS = 32   # a model's decode loop needs one per (layer shape, batch); more than that is another workload
_cache = PlanCache(MAX_PLANS)
# The same plans by a face's own key (``plan_cache.exact_key`` of its plain calls: no dicts to build, one
# signature per array), so that a face's decode step goes straight to its plan (``face_plan``).
_face = PlanCache(MAX_PLANS)

_BY_VALUE = ("cache_batch_idx", "cache_leftpad", "alibi_slopes")
_BY_IDENTITY = ("rotary_cos", "rotary_sin")
_NEW = ("k", "v")
_OPTIONAL = _NEW + ("block_table",) + _BY_VALUE + _BY_IDENTITY   # the key's parts after the plain ones, in order
_NUMBERS = (int, float)


def _values_key(x: Any) -> tuple | None:
    """A host array's signature and bytes; None for other kinds (their values would be a device copy away)."""
    signature = array_signature(x)
    if signature is None:
        return None
    if type(x) is np.ndarray:
        return signature, x.tobytes()
    if x.device.type != "cpu":
        return None
    try:
        return signature, x.numpy().tobytes()
    except (TypeError, RuntimeError):   # a dtype numpy lacks (bfloat16): checked in full instead
        return None


def _options_key(options: dict[str, Any]) -> tuple | None:
    """The plain options as exact (type, value) pairs; None when one is of another type."""
    scale, causal, window, softcap = (options["softmax_scale"], options["causal"], options["window_size"],
                                      options["softcap"])
    interleaved, splits, lse = options["rotary_interleaved"], options["num_splits"], options["return_lse"]
    if type(causal) is not bool or type(interleaved) is not bool or type(lse) is not bool or type(splits) is not int:
        return None
    if not (scale is None or type(scale) in _NUMBERS) or type(softcap) not in _NUMBERS:
        return None
    if type(window) is not tuple or len(window) != 2 or type(window[0]) is not int or type(window[1]) is not int:
        return None
    # the types too: 1 == 1.0 == True as keys, and a plan should not hand on a value of another type than given
    return (type(scale), scale, causal, window, type(softcap), softcap, interleaved, splits, lse)


def plan_key(scope: tuple, arrays: dict[str, Any], options: dict[str, Any]) -> tuple | None:
    """The key of a ``with_kvcache`` call (the module says what it holds), or None when it has none.

    scope: who asks and the forced backend, e.g. ("run", "flash", None); arrays: q (B, Sq, Hq, D), k_cache,
    v_cache (B_cache, capacity, Hkv, D) or paged, k, v (B, S_new, Hkv, D) or None, by name; options:
    ``make_kvcache_plan``'s keywords (rotary_cos ... return_lse) by name."""
    plain = _options_key(options)
    given = tuple(array_signature(arrays[name]) for name in ("q", "k_cache", "v_cache"))
    if plain is None or None in given:
        return None
    parts: list[Any] = [scope, plain, given]
    for name in _OPTIONAL:
        x = arrays[name] if name in _NEW else options[name]
        if x is None:
            parts.append(None)
            continue
        part = _values_key(x) if name in _BY_VALUE else array_signature(x)
        if part is None:
            return None
        parts.append((id(x), part) if name in _BY_IDENTITY else part)
    return tuple(parts)


def cached(key: tuple | None) -> KVCachePlan | None:
    """The plan kept for ``key``, or None (no key, none kept, or the cache turned off)."""
    return _cache.cached(key)


def keep(key: tuple | None, plan: KVCachePlan) -> None:
    """Keep ``plan`` for ``key`` (nothing for None or with the cache off), dropping the least recently used."""
    _cache.keep(key, plan)


def _lookup(scope: tuple, arrays: dict[str, Any],
            options: dict[str, Any]) -> tuple[tuple | None, KVCachePlan | None, KVCacheCall | None]:
    """(key, the plan kept for it, None), or (key, None, the call checked in full) when there is none."""
    key = plan_key(scope, arrays, options)
    plan = cached(key)
    if plan is not None:
        return key, plan, None
    return key, None, validate_kvcache(*arrays.values(), **kvcache_options(options))


def _keep_new(key: tuple | None, dispatcher: Any, forced: str | None, arrays: dict[str, Any],
              options: dict[str, Any], kv: KVCacheCall) -> None:
    """Keep a plan of checked call ``kv`` for ``key``, unless the checks handed on a copy of an array (a plan runs
    on the step's own arrays) or no backend serves it (the call says so where it always did)."""
    if key is None or not _cache.enabled or not all(holds_given(kv, n, x) for n, x in arrays.items() if x is not None):
        return
    try:
        plan = KVCachePlan(dispatcher, arrays, dict(options, backend=forced), validated=kv)
    except NoBackendError:
        return
    plan.drop_planned_arrays()   # kept for calls to come: it must not hold this call's caches alive
    keep(key, plan)


def run_with_plans(dispatcher: Any, forced: str | None, arrays: dict[str, Any], options: dict[str, Any],
                   run_checked: Callable[[KVCacheCall], Any]) -> Any:
    """``Dispatcher.with_kvcache``'s result: a kept plan's step for a call of a known key, else
    ``run_checked(validate_kvcache(...))`` (the full checks and the dispatcher's own run), keeping a plan after.
    arrays: q, k_cache, v_cache, k, v by name (shapes in ``plan_key``); options: the call's keywords by name."""
    key, plan, kv = _lookup(("run", dispatcher.op, forced), arrays, options)
    if plan is not None:
        return plan.step(*arrays.values(), cache_seqlens=options["cache_seqlens"], block_table=options["block_table"],
                         signatures_known=True)
    result = run_checked(kv)
    _keep_new(key, dispatcher, forced, arrays, options, kv)
    return result


def check_with_plans(dispatcher: Any, forced: str | None, arrays: dict[str, Any], options: dict[str, Any]) -> None:
    """AttentionInputError naming the argument, as ``validate_kvcache`` raises it, unless the call is valid: a kept
    plan's step checks for a call of a known key, else the full checks (keeping a plan). Runs and writes nothing.
    Arguments as ``run_with_plans`` takes them."""
    key, plan, kv = _lookup(("check", dispatcher.op, forced), arrays, options)
    if plan is not None:
        plan.check_step(*arrays.values(), cache_seqlens=options["cache_seqlens"],
                        block_table=options["block_table"], signatures_known=True)
    else:
        _keep_new(key, dispatcher, forced, arrays, options, kv)


def face_plan(face_key: tuple | None) -> KVCachePlan | None:
    """The plan kept for a face's key (``keep_for_face``), or None."""
    return _face.cached(face_key)


def keep_for_face(face_key: tuple | None, dispatcher: Any, forced: str | None, arrays: dict[str, Any],
                  options: dict[str, Any]) -> None:
    """After a face's call ran through ``run_with_plans``: keep the plan that call kept (for its full key: the
    dispatcher's op, ``forced``, arrays and options as ``run_with_plans`` took them) for ``face_key`` too. The
    face's key must hold what the full key holds of such a call; nothing is kept for a call that kept no plan."""
    if face_key is None or not _face.enabled:
        return
    plan = cached(plan_key(("run", dispatcher.op, forced), arrays, options))
    if plan is not None:
        _face.keep(face_key, plan)


def set_enabled(enabled: bool) -> bool:
    """Turn the cache on or off (off: every call checked in full, nothing kept or read; the plans kept stay for
    when it is on again); returns the previous setting."""
    _face.set_enabled(enabled)
    return _cache.set_enabled(enabled)


def clear() -> None:
    """Drop every kept plan (the registry calls it when the backends change)."""
    _face.clear()
    _cache.clear()


def kept_count() -> int:
    """How many plans are kept now (at most ``MAX_PLANS``)."""
    return _cache.kept_count()


__all__ = ["MAX_PLANS", "plan_key", "cached", "keep", "run_with_plans", "check_with_plans", "face_plan",
           "keep_for_face", "set_enabled", "clear", "kept_count"]
