"""Ops by name, backends per op, and the dispatcher that picks one per call.

    from numba_flash import backend_registry      # also importable as backends.backend_registry
    op = backend_registry.get("flash")
    out = op.forward(q, k, v, causal=True)
    print(op.explain(q, k, v, causal=True))

Backends are registered as ``"module:Class"`` strings and imported on first use, so registering one (or importing
this module) never imports torch or numba.cuda. Third-party backends register through the entry-point group
``numba_flash.backends`` (name = backend name, value = ``"module:Class"``, the class listing its ops in ``OPS``).

Choosing: a backend named by ``backend=`` on the call, else on ``get``, else by ``backend_registry.use(...)``,
else by the environment variable ``NUMBA_FLASH_BACKEND``, is forced: it serves the call or ``NoBackendError`` says
why not. Otherwise the first backend by priority with no reasons against the call is taken; when there is none, a
backend that steps in as the last resort (``Backend.last_resort_reasons``: the torch path, for torch tensors on a
GPU that the GPU's own backend cannot serve) takes it, and explain() says so. A backend that finds
out only while running that it cannot serve the call (the CUDA backend's first-use self-check) raises
``BackendDeclined``; the call then goes to the next backend, as if the reasons had been known up front. Each
decision is logged at DEBUG on the ``numba_flash`` logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import logging
import os
import threading
from typing import Any, Iterator

from numba_flash import chosen_backends, dense_plans, kvcache_plans
from numba_flash.arguments import checked_arguments
from numba_flash.errors import AttentionInputError, BackendDeclined, NoBackendError
from numba_flash.explanation import Candidate, Explanation
from numba_flash.paged_keys import gather_paged_keys
from numba_flash.plan import make_plan
from numba_flash.plan_kvcache import make_kvcache_plan
from numba_flash.validation import (AttentionCall, check_deterministic, check_precision, validate_backward,
                                    validate_forward)

from numba_flash.backends.base import Backend

ENTRY_POINT_GROUP = "numba_flash.backends"
ENV_VAR = "NUMBA_FLASH_BACKEND"

logger = logging.getLogger("numba_flash")

_BUILTIN = {
    "cuda": "numba_flash.backends.cuda:CudaBackend",
    "rocm": "numba_flash.backends.rocm:RocmBackend",
    "cpu": "numba_flash.backends.cpu:CpuBackend",
}

_lock = threading.RLock()
_targets: dict[str, dict[str, Any]] = {"flash": dict(_BUILTIN)}   # op -> backend name -> target
_instances: dict[tuple[str, str], Backend] = {}
_entry_points_loaded = False
_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("numba_flash_forced_backend", default=None)


def _forget_choices() -> None:
    """Drop every backend choice kept (the kept plans' and the signatures'): each was made among the backends
    registered then."""
    kvcache_plans.clear()
    dense_plans.store.clear()
    chosen_backends.clear()


def register(op: str, name: str, target: str | type | Backend, *, replace: bool = False) -> None:
    """Register ``target`` (a ``"module:Class"`` string, a Backend subclass or instance) as backend ``name`` of
    ``op``. A string is imported only when the backend is first used."""
    with _lock:
        backends = _targets.setdefault(op, {})
        if name in backends and not replace:
            raise ValueError(f"backend {name!r} is already registered for op {op!r} (pass replace=True)")
        backends[name] = target
        _instances.pop((op, name), None)
    _forget_choices()


def unregister(op: str, name: str) -> None:
    with _lock:
        _targets.get(op, {}).pop(name, None)
        _instances.pop((op, name), None)
    _forget_choices()


def _load_entry_points(refresh: bool = False) -> None:
    global _entry_points_loaded
    if _entry_points_loaded and not refresh:
        return
    from importlib.metadata import entry_points

    with _lock:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            # The ops a third-party class serves are known only once it is imported; park it under every op and
            # let _instance() drop it where its OPS do not list the op.
            for backends in _targets.values():
                backends.setdefault(ep.name, ep.value)
            _targets.setdefault("*", {}).setdefault(ep.name, ep.value)
        _entry_points_loaded = True
    _forget_choices()


class _Unloadable(Backend):
    """Stands in for a backend whose module failed to import, so one broken plugin cannot break dispatch: it is
    listed with the import error as its reason and never chosen."""

    def __init__(self, name: str, error: BaseException):
        self.name = name
        self.error = f"failed to load: {type(error).__name__}: {error}"
        self.OPS = tuple(_targets)

    def unavailable_reasons(self, forced: bool = False) -> list[str]:
        return [self.error]


def _resolve(name: str, target: Any) -> Backend:
    if isinstance(target, Backend):
        return target
    try:
        if isinstance(target, str):
            module, _, attr = target.partition(":")
            target = getattr(importlib.import_module(module), attr)
        return target()
    except Exception as exc:  # a broken third-party module must not take the registry down
        logger.warning("numba_flash backend %r could not be loaded: %s", name, exc)
        return _Unloadable(name, exc)


def _instance(op: str, name: str) -> Backend | None:
    key = (op, name)
    with _lock:
        if key not in _instances:
            targets = _targets.get(op, {})
            if name not in targets and name in _targets.get("*", {}):
                targets = _targets["*"]
            if name not in targets:
                return None
            be = _resolve(name, targets[name])
            if not be.name:
                be.name = name
            if op not in be.OPS:
                return None
            _instances[key] = be
        return _instances[key]


def refresh_entry_points() -> None:
    """Read the ``numba_flash.backends`` entry points again (after installing a plugin in a running process)."""
    _load_entry_points(refresh=True)


def _known_op(op: str) -> None:
    """KeyError naming the registered ops unless ``op`` is one (entry points read first)."""
    _load_entry_points()
    if op not in _targets:
        raise KeyError(f"unknown op {op!r}; registered ops: {', '.join(sorted(k for k in _targets if k != '*'))}")


def backends(op: str) -> list[Backend]:
    """Every backend registered for ``op``, highest priority first; KeyError for an op nobody registered."""
    _known_op(op)
    names = list(_targets[op])
    found = [be for be in (_instance(op, n) for n in names) if be is not None]
    return sorted(found, key=lambda be: -be.PRIORITY)


def names(op: str) -> list[str]:
    return [be.name for be in backends(op)]


def available(op: str) -> list[str]:
    """Backends of ``op`` that this machine can run without being forced, highest priority first."""
    return [be.name for be in backends(op) if not be.unavailable_reasons(forced=False)]


@contextlib.contextmanager
def use(backend: str | None) -> Iterator[None]:
    """Force ``backend`` for every call made inside the block (like ``torch.nn.attention.sdpa_kernel``)."""
    token = _forced.set(backend)
    try:
        yield
    finally:
        _forced.reset(token)


def get(op: str, backend: str | None = None) -> "Dispatcher":
    """The dispatcher of ``op``; ``backend`` forces one backend for every call made through it.
    AttentionInputError for a ``backend`` nobody registered: refused here, where it is named, rather than at the
    first call. A registered one this machine cannot run is accepted (its call says why it cannot)."""
    _known_op(op)
    if backend is not None:
        # Registered keys count, not only the backends' own names: one backend class may be registered under
        # several keys (a CudaBackend with small tiles as "cuda_small_tiles", say).
        registered = list(dict.fromkeys(list(_targets.get(op, {})) + names(op)))
        if backend not in registered and _instance(op, backend) is None:
            from numba_flash.arguments import closest

            near = closest(str(backend), registered)
            hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
            raise AttentionInputError(f"backend: expected one of the registered backends of {op!r} "
                                      f"({', '.join(registered)}), got {backend!r}{hint}")
    return Dispatcher(op, backend)


class Dispatcher:
    """Validates each call, picks a backend for it and runs it. Get one with ``backend_registry.get(op)``."""

    def __init__(self, op: str, backend: str | None = None):
        self.op = op
        self.backend = backend

    def forced_backend(self, backend: str | None = None) -> str | None:
        """The name of the backend a call through this dispatcher is forced to, or None when the registry may
        choose: ``backend`` (the call's own ``backend=``), else this dispatcher's, else one set with ``use()`` in
        this thread's context, else the environment variable ``NUMBA_FLASH_BACKEND``.

        Callers that hand work to another thread (autograd may run the backward on a thread of its own) read it
        once and pass it on, since ``use()``'s choice lives in a context variable of the calling thread."""
        if backend is not None and not isinstance(backend, str):
            raise AttentionInputError(f"backend: expected a backend's name (str) or None, got {backend!r} of type "
                                      f"{type(backend).__name__}")
        for choice in (backend, self.backend, _forced.get(), os.environ.get(ENV_VAR) or None):
            if choice:
                return choice
        return None

    def _rank(self, call: AttentionCall, backend: str | None,
              declined: dict[str, list[str]] | None = None) -> tuple[Backend | None, dict[str, list[str]], str | None]:
        declined = declined or {}

        def reasons_of(be: Backend, forced: bool) -> list[str]:
            # A backend that declined this call while running is out of it, whatever it says now.
            return declined.get(be.name) or be.not_supported_reasons(call, forced=forced)

        forced = self.forced_backend(backend)
        if forced is not None:
            be = _instance(self.op, forced)
            if be is None:
                from numba_flash.arguments import closest

                from_env = not (backend or self.backend or _forced.get())
                source = f", named by the environment variable {ENV_VAR}" if from_env else ""
                near = closest(forced, names(self.op))
                hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
                raise NoBackendError(self.op, {forced: [f"no such backend (registered: {', '.join(names(self.op))})"
                                                        f"{source}{hint}"]}, forced=forced)
            reasons = reasons_of(be, True)
            return (None if reasons else be), {forced: reasons}, forced
        chosen, table = None, {}
        ranked = backends(self.op)
        for be in ranked:
            reasons = reasons_of(be, False)
            table[be.name] = reasons
            if chosen is None and not reasons:
                chosen = be
        if chosen is None:   # nobody serves it as asked: a backend that steps in as the last resort, if one does
            chosen = next((be for be in ranked if be.name not in declined
                           and be.last_resort_reasons(call) == []), None)
        return chosen, table, None

    def _served_if_named(self, call: AttentionCall, table: dict[str, list[str]],
                         declined: dict[str, list[str]] | None) -> tuple[str, ...]:
        """Backends that turned ``call`` down only because nobody named them (the torch path takes numpy arrays
        and CPU tensors when forced): the hint a NoBackendError gives."""
        names_ = []
        for name in table:
            be = _instance(self.op, name)
            if be is not None and name not in (declined or {}) and not be.not_supported_reasons(call, forced=True):
                names_.append(name)
        return tuple(names_)

    def select(self, call: AttentionCall, backend: str | None = None,
               declined: dict[str, list[str]] | None = None) -> Backend:
        """The backend that will serve ``call``, or ``NoBackendError`` listing every backend's reasons.
        ``declined`` maps backends that already declined this call to their reasons."""
        chosen, table, forced = self._rank(call, backend, declined)
        if chosen is None:
            raise NoBackendError(self.op, table, forced=forced,
                                 if_named=() if forced else self._served_if_named(call, table, declined))
        if logger.isEnabledFor(logging.DEBUG):
            passed = "; ".join(f"{n}: {', '.join(r)}" for n, r in table.items() if r and n != chosen.name)
            logger.debug("%s: %s -> %s%s%s", self.op, call.describe(), chosen.name,
                         " (forced)" if forced else " (last resort)" if table.get(chosen.name) else "",
                         f"; passed over {passed}" if passed else "")
        return chosen

    def select_kept(self, call: AttentionCall, backend: str | None, signature: tuple | None) -> Backend:
        """``select(call, backend)``, ranked once per call signature (``numba_flash.chosen_backends``; the registry
        forgets the choices when the backends change or one declines). ``signature``: the call's
        ``call_signature.forward_signature``, None for a call without one (ranked every time)."""
        forced = self.forced_backend(backend)
        be = chosen_backends.kept(self.op, forced, signature)
        if be is None:
            be = self.select(call, backend)
            chosen_backends.keep(self.op, forced, signature, be)
        return be

    plan = make_plan
    """``plan(q, k, v, **forward's keywords)``: the call checked once, for a loop (``numba_flash.plan.make_plan``)."""
    plan_kvcache = make_kvcache_plan   # with_kvcache checked once, for a decode loop (numba_flash.plan_kvcache)

    def _run(self, call: AttentionCall, backend: str | None, method: str) -> Any:
        """Run ``call`` on the backend ``select`` picks; when that backend declines while running, on the next one.
        Each backend declines at most once, so this ends: with a result, or NoBackendError."""
        declined: dict[str, list[str]] = {}
        while True:
            # The plain two-argument select while nothing has declined: it is the form other code wraps.
            be = self.select(call, backend, declined=declined) if declined else self.select(call, backend)
            try:
                return getattr(be, method)(call)
            except BackendDeclined as exc:
                logger.warning("%s: backend %r declined %s: %s", self.op, be.name, call.describe(), exc)
                declined[be.name] = exc.reasons or [str(exc) or "declined"]
                chosen_backends.clear()   # a choice kept before may be this backend, which has learnt otherwise

    @checked_arguments
    def forward(self, q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str | None = None,
                return_lse: bool = False, backend: str | None = None, cu_seqlens_q: Any = None,
                cu_seqlens_k: Any = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                alibi_slopes: Any = None, attn_bias: Any = None, bias_mod: Any = None, mask_mod: Any = None,
                score_mod: Any = None, block_mask: Any = None, dropout_p: float = 0.0,
                dropout_seed: int | None = None, deterministic: bool = False, precision: str = "ieee",
                block_table: Any = None) -> Any:
        """Attention forward.

        q: (B, Sq, Hq, D) for layout "bshd" (the default) or (B, Hq, Sq, D) for "bhsd"; k, v: (B, Sk, Hkv, D) /
        (B, Hkv, Sk, D). Packed sequences, layout "thd" (the default when cu_seqlens are given): q (total_q, Hq, D),
        k, v (total_k, Hkv, D), ``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1,) int32 prefix sums, ``max_seqlen_q`` /
        ``max_seqlen_k`` optional upper bounds on the sequence lengths. Paged keys (flash-attn's paged prefill):
        with ``block_table`` (B, max_blocks) int32, k and v are caches (num_blocks, page_size, Hkv, D) and
        sequence b's keys are the first Sk_b rows of its pages in table order (``numba_flash.paged_keys``).
        ``alibi_slopes`` (Hq,) or (B, Hq): adds ``-slope * |i + Sk - Sq - j|`` to the scores (flash-attn's ALiBi).
        ``attn_bias``: an array broadcastable to (B, Hq, Sq, Sk), float32 or q's dtype, added to the scores after
        softcap; -inf hides a key. ``bias_mod``, ``mask_mod``, ``score_mod``: plain Python functions numba compiles
        (``numba_flash.mods``); ``block_mask``: ``numba_flash.block_mask(mask_mod, ...)``, to reuse across calls.
        ``dropout_p`` in [0, 1) drops probabilities after the softmax where ``numba_flash.dropout_mask(dropout_seed,
        ...)`` says so and scales the rest by 1 / (1 - p); ``dropout_seed`` (an int in [0, 2**64)) is needed then,
        and the backward must be given the same one. lse is the softmax's before dropout. ``deterministic`` is
        accepted (flash-attn's argument): every backend is bitwise reproducible run to run already.
        ``precision="tf32"`` allows float32 inputs' two products to run on TF32 tensor cores (the cuda backend on
        compute capability >= 8.0, D <= 128; accuracy as naive attention with TF32 products, README "TF32");
        elsewhere, and by default ("ieee"), float32 is computed in float32.
        Returns out shaped like q (same array kind, device, dtype), and with ``return_lse`` also lse (B, Hq, Sq),
        or (Hq, total_q) for "thd", float32.
        """
        paged, k, v = gather_paged_keys(k, v, block_table, cu_seqlens_k, layout)
        call = validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                softcap=softcap, layout=layout, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                alibi_slopes=alibi_slopes, attn_bias=attn_bias, bias_mod=bias_mod, mask_mod=mask_mod,
                                score_mod=score_mod, block_mask=block_mask, dropout_p=dropout_p,
                                dropout_seed=dropout_seed, precision=precision)
        check_deterministic(deterministic)
        out, lse = self._run(call, backend, "forward")
        return (out, lse) if return_lse else out

    @checked_arguments
    def backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, *, causal: bool = False,
                 softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                 layout: str | None = None, backend: str | None = None, cu_seqlens_q: Any = None,
                 cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
                 max_seqlen_k: int | None = None, alibi_slopes: Any = None, attn_bias: Any = None,
                 return_dbias: bool = False, bias_mod: Any = None, mask_mod: Any = None, score_mod: Any = None,
                 score_mod_grad: Any = None, block_mask: Any = None, dropout_p: float = 0.0,
                 dropout_seed: int | None = None, deterministic: bool = False,
                 precision: str = "ieee", block_table: Any = None) -> tuple[Any, ...]:
        """Attention backward. dout and out are shaped like q; lse is (B, Hq, Sq), or (Hq, total_q) for packed
        sequences, as ``forward`` returned it. Packed sequences take the forward's cu_seqlens and max_seqlen, and
        paged keys its block_table: dk and dv are then shaped like the paged k and v, 0 in rows no sequence reads.
        Returns dq, dk, dv shaped like q, k, v; with GQA dk and dv are summed over each group of query heads.
        With ``return_dbias`` (needs the forward's ``attn_bias``) also dbias shaped like attn_bias, float32 (float64
        for float64 inputs), summed over the dimensions the bias was broadcast along. The forward's mods again, and
        for a ``score_mod`` its derivative ``score_mod_grad(score, b, h, q_idx, kv_idx)``. ``deterministic`` is
        accepted: the result has the same bits on every run whatever it says. ``precision`` is accepted as the
        forward takes it; the backward computes float32 in float32 on every backend (no TF32 backward kernel)."""
        paged, k, v = gather_paged_keys(k, v, block_table, cu_seqlens_k, layout)
        call = validate_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                                 window_size=window_size, softcap=softcap, layout=layout, cu_seqlens_q=cu_seqlens_q,
                                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                 alibi_slopes=alibi_slopes, attn_bias=attn_bias, return_dbias=return_dbias,
                                 bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod,
                                 score_mod_grad=score_mod_grad, block_mask=block_mask, dropout_p=dropout_p,
                                 dropout_seed=dropout_seed)
        check_deterministic(deterministic)
        check_precision(precision)
        grads = self._run(call, backend, "backward")
        if paged is None:
            return grads
        dq, dk, dv, *rest = grads
        return (dq, paged.scatter(dk, paged.shape_k), paged.scatter(dv, paged.shape_v), *rest)

    @checked_arguments
    def with_kvcache(self, q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None,
                     rotary_sin: Any = None, cache_seqlens: Any = None, cache_batch_idx: Any = None,
                     cache_leftpad: Any = None, block_table: Any = None, softmax_scale: float | None = None,
                     causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     rotary_interleaved: bool = True, alibi_slopes: Any = None, num_splits: int = 0,
                     return_lse: bool = False, *, backend: str | None = None) -> Any:
        """Decoding with a KV cache, flash-attn's ``flash_attn_with_kvcache`` (``numba_flash.kvcache`` has the
        details): appends ``k``/``v`` to the caches in place at ``cache_seqlens`` (the only input ever modified;
        nothing is written when the call is refused), then attends each sequence's query block to its cached keys.

        q: (B, Sq, Hq, D); k_cache, v_cache: (B_cache, capacity, Hkv, D), or (num_blocks, page_size, Hkv, D) with
        ``block_table`` (B, max_blocks) int32; k, v: (B, S_new, Hkv, D) or None; rotary_cos / rotary_sin
        (seqlen_ro, rotary_dim / 2); cache_seqlens: int or (B,) int32, keys held before the append;
        cache_batch_idx, cache_leftpad: (B,) int32. ``num_splits``: key-range parts merged by lse (0 = chosen
        from the work and the machine's parallelism).
        Returns out (B, Sq, Hq, D) like q, and with ``return_lse`` also lse (B, Hq, Sq) float32.
        """
        # Checked in full once per call signature; later calls of it run its kept plan (numba_flash.kvcache_plans).
        options = dict(locals())
        del options["self"], options["backend"]
        arrays = {name: options.pop(name) for name in ("q", "k_cache", "v_cache", "k", "v")}
        forced = self.forced_backend(backend)

        def run_checked(kv: Any) -> Any:
            out, lse = self._run(kv.dense_call(), backend, "with_kvcache")
            return (out, lse) if return_lse else out
        return kvcache_plans.run_with_plans(self, forced, arrays, options, run_checked)

    @checked_arguments
    def explain(self, q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
                window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str | None = None,
                return_lse: bool = False, backend: str | None = None, cu_seqlens_q: Any = None,
                cu_seqlens_k: Any = None, max_seqlen_q: int | None = None,
                max_seqlen_k: int | None = None, alibi_slopes: Any = None, attn_bias: Any = None,
                bias_mod: Any = None, mask_mod: Any = None, score_mod: Any = None,
                block_mask: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
                deterministic: bool = False, precision: str = "ieee", block_table: Any = None) -> "Explanation":
        """Which backend a forward call would use and why each other one was passed over.

        Returns an ``Explanation``: a ``str`` of a few lines (``print`` it, or search it with ``in``) that also
        carries the decision as data (``.chosen``, ``.forced``, ``.candidates``) and shows as a table in a notebook.
        """
        _, k, v = gather_paged_keys(k, v, block_table, cu_seqlens_k, layout)   # the packed call the backends see
        call = validate_forward(q, k, v, causal=causal, softmax_scale=softmax_scale, window_size=window_size,
                                softcap=softcap, layout=layout, return_lse=return_lse, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                                alibi_slopes=alibi_slopes, attn_bias=attn_bias, bias_mod=bias_mod, mask_mod=mask_mod,
                                score_mod=score_mod, block_mask=block_mask, dropout_p=dropout_p,
                                dropout_seed=dropout_seed, precision=precision)
        check_deterministic(deterministic)
        return self._explanation(call, backend)

    def _explanation(self, call: AttentionCall, backend: str | None = None) -> "Explanation":
        chosen, table, forced = self._rank(call, backend)
        candidates = []
        for name, reasons in table.items():
            be = _instance(self.op, name)
            is_chosen = chosen is not None and name == chosen.name
            notes = tuple(be.notes(call)) if be is not None and not reasons else ()
            if is_chosen and reasons:
                notes = (f"serves as the last resort: no backend serves this call otherwise, so {name} runs it on "
                         f"{call.device}",)
            candidates.append(Candidate(name=name, priority=be.PRIORITY if be is not None else None,
                                        reasons=tuple(reasons), notes=notes, chosen=is_chosen))
        return Explanation(self.op, call.describe(), chosen.name if chosen is not None else None, forced,
                           tuple(candidates))

    def __repr__(self) -> str:
        return f"<Dispatcher op={self.op!r} backend={self.backend!r}>"
