"""Plans for decode loops: ``with_kvcache`` checked once, with its backend chosen, and each decoding step paying
only for what changes from step to step (FlashInfer's plan / run convention, as ``numba_flash.plan`` for forward).

    op = backend_registry.get("flash")
    plan = op.plan_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)   # checks, writes nothing
    for q, k, v in steps:
        out = plan.run(q, k_cache, v_cache, k, v, cache_seqlens=lens)   # appends k, v at lens, as with_kvcache does
        lens += k.shape[1]

What a plan fixes: every argument of ``Dispatcher.with_kvcache`` but the arrays and ``cache_seqlens``, and the
backend (a ``use()`` block or ``NUMBA_FLASH_BACKEND`` is read once, at plan time). ``cache_batch_idx`` and
``cache_leftpad`` are read at plan time: their values are part of the plan. ``block_table`` too, unless a step
gives one of the planned shape (a paged plan's table may grow as sequences get pages). ``rotary_cos`` /
``rotary_sin`` and ``alibi_slopes`` are the planned arrays themselves.

What ``run`` checks each step, before anything is written (a refused step leaves the caches as they were):

* q, k_cache, v_cache, and k, v when planned with new keys, each have the planned signature
  (``call_signature.array_signature``'s facts: exact type, shape, strides, dtype, device), or
  ``AttentionInputError`` names the argument with the planned facts and those that came (``plan.check_planned``);
* what no signature holds: the caches are writable and apart from each other (``kvcache.check_append_caches``;
  the overlap test only for cache addresses other than the last step's, as the same signatures at the same
  addresses lie in the same places);
* ``cache_seqlens``, with the rules ``validate_kvcache`` applies (``kvcache.cache_lengths``: (B,) int32 / int64 or
  an int, each >= 0, room for the new keys in the capacity), then those that depend on it: ``cache_leftpad`` within
  it, the pages used named in the block table and none written twice, rotary tables long enough.

Then the planned ``KVCacheCall`` with the step's arrays and lengths in place (a copy of its fields) goes to the
planned backend's ``with_kvcache``, which appends and attends exactly as ``op.with_kvcache`` would.
"""

from __future__ import annotations

from typing import Any

from .append_target import first_address
from .arguments import checked_arguments
from .errors import bad_arg
from .kvcache import (KVCacheCall, cache_lengths, check_append_caches, check_pages_used, check_rotary_rows,
                      host_ints, key_starts, validate_kvcache)
from .plan import PlannedCall, check_planned, planned_signature

# validate_kvcache's arguments after q, k_cache, v_cache, k, v, in its order.
KVCACHE_OPTIONS = ("rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "block_table",
                   "softmax_scale", "causal", "window_size", "softcap", "rotary_interleaved", "alibi_slopes",
                   "num_splits", "return_lse")
_HELD = {"q": "q", "k_cache": "k_cache", "v_cache": "v_cache", "k": "k_new", "v": "v_new"}


def kvcache_options(options: dict[str, Any]) -> dict[str, Any]:
    """``validate_kvcache``'s keywords (``KVCACHE_OPTIONS``) taken from ``options``."""
    return {n: options[n] for n in KVCACHE_OPTIONS}


def holds_given(kv: KVCacheCall, name: str, x: Any) -> bool:
    """Whether validated call ``kv`` holds the caller's array ``x`` as argument ``name`` (q, k_cache, v_cache, k,
    v) itself, not a copy the checks converted it into (a plan, which runs on a step's own arrays, needs that)."""
    return getattr(kv, _HELD[name]) is x


class KVCachePlan:
    """A ``with_kvcache`` call checked once, with its backend chosen; ``Dispatcher.plan_kvcache`` makes one.
    ``run(q, k_cache, v_cache, k, v, cache_seqlens=...)`` runs one decoding step (the module says what a plan fixes
    and what each step checks)."""

    def __init__(self, dispatcher: Any, arrays: dict[str, Any], options: dict[str, Any],
                 validated: KVCacheCall | None = None) -> None:
        """``arrays``: q, k_cache, v_cache, k, v by name; ``options``: ``make_kvcache_plan``'s keywords;
        ``validated``: ``validate_kvcache``'s result for exactly these (the plan cache of ``with_kvcache`` has it
        already), else the checks run here."""
        kv = validated if validated is not None else validate_kvcache(*arrays.values(), **kvcache_options(options))
        self._signatures: dict[str, tuple] = {}
        for name, x in arrays.items():
            if x is None:
                continue
            self._signatures[name] = planned_signature(name, x)
            if not holds_given(kv, name, x):   # a converted copy, which a step's array would not be
                raise bad_arg(name, "an array the checks take as it is (a plan runs on the caller's arrays)",
                              "one they convert into a copy; op.with_kvcache serves it")
        self._kv = kv
        # The last pair of cache addresses found apart: the plan-time caches, when the checks tested them (k given).
        self._apart: tuple[int | None, int | None] = (
            (first_address(kv.k_cache), first_address(kv.v_cache)) if kv.k_new is not None else (None, None))
        self._fields = dict(kv.__dict__)
        self._leftpad = options["cache_leftpad"] is not None
        self._num_blocks = int(kv.k_cache.shape[0])
        self._seqlen_ro = 0 if kv.rotary_cos is None else int(kv.rotary_cos.shape[0])
        self._q_span = kv.seqlen_q if (kv.causal or kv.local) else 1
        self._planned = PlannedCall(dispatcher, kv.dense_call(), options["backend"], "with_kvcache")

    def drop_planned_arrays(self) -> None:
        """Let go of the arrays given at plan time (q, the caches, k, v), which no step reads (each step brings
        its own): a plan kept for later calls (``numba_flash.kvcache_plans``) must not keep a cache alive that
        its caller has released. ``call`` then holds None in their place."""
        gone = dict(q=None, k_cache=None, v_cache=None, k_new=None, v_new=None)
        kv = object.__new__(KVCacheCall)   # frozen: a copy with those fields set, as check_step makes its steps
        kv.__dict__.update(self._kv.__dict__, **gone)
        self._kv = kv
        self._fields.update(gone)
        planned = self._planned
        call = object.__new__(type(planned.call))
        call.__dict__.update(planned.call.__dict__, q=None, k=None, v=None, extra={"kvcache": kv})
        planned.call, planned.fields = call, dict(call.__dict__)

    @property
    def backend(self) -> str:
        """The name of the backend that runs this plan's steps."""
        return self._planned.chosen.name

    @property
    def call(self) -> KVCacheCall:
        """The validated call of plan time (its arrays and ``cache_seqlens``)."""
        return self._kv

    def _step_lengths(self, cache_seqlens: Any, block_table: Any) -> tuple[Any, Any]:
        """(cache_seqlens, block_table) of a step as host int64 arrays, checked as ``validate_kvcache`` checks them."""
        kv = self._kv
        table = kv.block_table
        if block_table is not None:
            if table is None:
                raise bad_arg("block_table", "None in a plan of an unpaged cache", "an array")
            table = host_ints("block_table", block_table, table.shape, "(B, max_blocks), the planned shape")
        seqlens = cache_lengths(cache_seqlens, kv.batch, kv.capacity, kv.seqlen_new)
        if self._leftpad:
            key_starts(kv.key_start, kv.batch, seqlens)
        if table is not None:
            check_pages_used(table, self._num_blocks, kv.page_size, seqlens, kv.seqlen_new)
        if self._seqlen_ro:
            check_rotary_rows(self._seqlen_ro, self._q_span, seqlens, kv.seqlen_new)
        return seqlens, table

    def check_step(self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *,
                   cache_seqlens: Any = None, block_table: Any = None,
                   signatures_known: bool = False) -> KVCacheCall:
        """The checks ``run`` makes of a step (arguments as ``run`` takes them), without running it: the step's
        ``KVCacheCall`` (the planned one with the step's arrays and lengths in place), or AttentionInputError
        naming the argument. Nothing is written either way. ``signatures_known``: the caller found the arrays'
        signatures equal to the planned ones already (``kvcache_plans``, whose key holds them), so they are not
        compared again."""
        planned = self._signatures
        if not signatures_known:
            check_planned("q", q, planned["q"])
            check_planned("k_cache", k_cache, planned["k_cache"])
            check_planned("v_cache", v_cache, planned["v_cache"])
        kv = self._kv
        if "k" in planned:
            if not signatures_known:
                check_planned("k", k, planned["k"])
                check_planned("v", v, planned["v"])
            # The overlap test once per pair of cache layouts: the signatures are the planned ones, so the same
            # two addresses are the same two layouts, and the same answer (a new cache pair is tested anew).
            addresses = first_address(k_cache), first_address(v_cache)
            known = None not in addresses and addresses == self._apart
            check_append_caches(k_cache, v_cache, kv.kind, kv.device, known_apart=known)
            self._apart = addresses
        elif k is not None or v is not None:
            raise bad_arg("k" if k is not None else "v", "None, as planned (a plan without new keys; one that "
                          "appends needs a plan of its own)", "an array")
        seqlens, table = self._step_lengths(cache_seqlens, block_table)
        # dataclasses.replace would run __init__ again (9 us a step); the fields are the validated ones but these,
        # set as plan.PlannedCall sets a frozen call's.
        step = object.__new__(KVCacheCall)
        step.__dict__.update(self._fields, q=q, k_cache=k_cache, v_cache=v_cache, k_new=k, v_new=v,
                             cache_seqlens=seqlens, block_table=table)
        return step

    def step(self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any = None,
             block_table: Any = None, signatures_known: bool = False) -> Any:
        """``run`` without its check of the arguments' names and masks, for callers that made it already (the
        plan cache of ``Dispatcher.with_kvcache``, whose own arguments were checked so); ``signatures_known`` as
        ``check_step`` takes it."""
        call = self.check_step(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
                               signatures_known=signatures_known)
        prepared = self._planned.prepared_step()   # the chosen backend's runner of the steps, if it has one
        if prepared is not None:
            out, lse = prepared(call)
        else:
            out, lse = self._planned.run_call(call.dense_call_like(self._planned.call))
        return (out, lse) if self._kv.return_lse else out

    def run(self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *, cache_seqlens: Any = None,
            block_table: Any = None) -> Any:
        """One decoding step: what ``op.with_kvcache`` with the planned arguments returns for these, and the same
        append into the caches (the only input modified; nothing written when the step is refused).

        q: (B, Sq, Hq, D); k_cache, v_cache: (B_cache, capacity, Hkv, D), or paged (num_blocks, page_size, Hkv, D);
        k, v: (B, S_new, Hkv, D), given exactly when they were at plan time; all of the planned signatures
        (type, shape, strides, dtype float16, bfloat16, float32 or float64, device). ``cache_seqlens``: (B,) int32
        or int64, or an int, the keys each sequence holds before this step's append (None: the whole capacity, as
        with_kvcache reads it). ``block_table``: (B, max_blocks) int32 of the planned shape, or None for the
        planned table. Returns out (B, Sq, Hq, D) like q, and when planned with ``return_lse`` also lse
        (B, Hq, Sq) float32. AttentionInputError naming the argument for an array of another signature or a
        length the caches cannot hold.
        """
        return self.step(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table)

    run = checked_arguments(run)   # an unknown keyword named with the closest one; masked arrays refused by name

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name} {tuple(s[1])}" for name, s in self._signatures.items())
        return f"<KVCachePlan backend={self.backend!r} {shapes}: {self._planned.call.describe()}>"


def make_kvcache_plan(self: Any, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, *,
                      rotary_cos: Any = None, rotary_sin: Any = None, cache_seqlens: Any = None,
                      cache_batch_idx: Any = None, cache_leftpad: Any = None, block_table: Any = None,
                      softmax_scale: float | None = None, causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                      softcap: float = 0.0, rotary_interleaved: bool = True, alibi_slopes: Any = None,
                      num_splits: int = 0, return_lse: bool = False, backend: str | None = None) -> KVCachePlan:
    """``Dispatcher.plan_kvcache``: check a ``with_kvcache`` call once and choose its backend, for a decode loop.
    Writes nothing: each ``run`` is one step, appending as ``with_kvcache`` does.

    Takes ``Dispatcher.with_kvcache``'s arguments (keywords after v), checked as it checks them (the same
    AttentionInputError for a bad one), with the arrays of one step: q (B, Sq, Hq, D); k_cache, v_cache
    (B_cache, capacity, Hkv, D), or (num_blocks, page_size, Hkv, D) with ``block_table`` (B, max_blocks) int32;
    k, v (B, S_new, Hkv, D) or None; float16, bfloat16, float32 or float64, one dtype; numpy arrays or strided
    torch tensors. cache_seqlens: (B,) int32 or an int; cache_batch_idx, cache_leftpad (B,) int32; alibi_slopes
    (Hq,) or (B, Hq) float32; rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2) like q.

    Returns a ``KVCachePlan``: ``plan.run(q, k_cache, v_cache, k, v, cache_seqlens=...)`` returns what
    ``with_kvcache`` would, for arrays of the planned signatures, and refuses others naming the argument.
    """
    options = dict(locals())
    dispatcher = options.pop("self")
    arrays = {name: options.pop(name) for name in ("q", "k_cache", "v_cache", "k", "v")}
    return KVCachePlan(dispatcher, arrays, options)


make_kvcache_plan.__qualname__ = "Dispatcher.plan_kvcache"   # bound as that method: an unknown keyword names it
make_kvcache_plan = checked_arguments(make_kvcache_plan)

__all__ = ["KVCachePlan", "KVCACHE_OPTIONS", "holds_given", "kvcache_options", "make_kvcache_plan"]
