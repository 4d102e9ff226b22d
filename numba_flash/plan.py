"""Plans for calls in a loop, FlashInfer's plan / run convention: the contract's checks and the choice of backend
are paid once, at plan time, and each step only puts its own arrays into the planned call.

    op = backend_registry.get("flash")
    plan = op.plan(q, k, v, causal=True)       # checks every argument, chooses the backend
    for q, k, v in steps:
        out = plan.run(q, k, v)                 # new arrays of the planned signature, straight to the backend

What a plan fixes: every argument of ``Dispatcher.forward`` but q, k and v, and the backend (a ``use()`` block or
``NUMBA_FLASH_BACKEND`` is read once, at plan time). ``cu_seqlens_*``, ``max_seqlen_*``, ``block_table`` and
``alibi_slopes`` are read at plan time: their values are part of the plan, and other values need a plan of their
own. ``attn_bias`` is the planned array itself, read by every run, as the mods are the planned functions.

What ``run`` checks: that q, k and v each have the planned signature, ``call_signature.array_signature``'s facts
(exact type, shape, strides, dtype, device). The validated call holds nothing that does not follow from those facts
and the fixed arguments, so an array that matches gets the planned call with it in place, as
``call_signature.recalled`` builds one; an array that does not is refused by name, with the planned facts and
those that came, before any work. A plan never runs on arrays it was not checked for.

Paged keys (``block_table``): k and v are the caches, and each run gathers the planned pages from them again, since
the caches' contents change between steps while the rows each sequence reads do not.

Refused at plan time, by name, after the checks ``op.forward`` makes (so a bad call reads the same either way):
array kinds without a signature (numba device arrays, ``__cuda_array_interface__`` and DLPack exporters, torch
tensors with a pending negation or conjugation bit), which ``op.forward`` serves; and ``dropout_p > 0``, since a
plan would fix ``dropout_seed`` and every step would drop the same entries.

``with_kvcache``'s plan, for decode loops, is ``numba_flash.plan_kvcache``: a step differs from the last in
``cache_seqlens`` too, and so in the validated ``KVCacheCall`` itself; it runs on a ``PlannedCall`` as well.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .arguments import checked_arguments
from .call_signature import array_signature
from .errors import BackendDeclined, bad_arg
from .paged_keys import PagedKeys, gather_paged_keys
from .validation import AttentionCall, check_deterministic, validate_backward, validate_forward

logger = logging.getLogger("numba_flash")

# validate_forward's options among Dispatcher.forward's keywords (the rest: backend, deterministic, block_table).
_FORWARD_OPTIONS = ("causal", "softmax_scale", "window_size", "softcap", "layout", "return_lse", "cu_seqlens_q",
                    "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "alibi_slopes", "attn_bias", "bias_mod",
                    "mask_mod", "score_mod", "block_mask", "dropout_p", "dropout_seed", "precision")
_BACKWARD_OPTIONS = tuple(n for n in _FORWARD_OPTIONS if n not in ("return_lse", "precision"))
_FACTS = ("type", "shape", "dtype", "strides", "device")
_SIGNATURE_KINDS = "a numpy array or a strided torch tensor (the array kinds a plan checks by signature)"


def _facts(signature: tuple) -> dict[str, str]:
    """An ``array_signature``'s facts by name, as a message quotes them."""
    if signature[0] is np.ndarray:
        _, shape, strides, dtype = signature
        return {"type": "numpy.ndarray", "shape": str(shape), "dtype": str(dtype),
                "strides": f"{strides} (bytes)", "device": "cpu"}
    kind, shape, strides, dtype, device = signature
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "shape": str(tuple(shape)),
            "dtype": str(dtype).replace("torch.", ""), "strides": str(tuple(strides)), "device": str(device)}


def _text(facts: dict[str, str]) -> str:
    return (f"a {facts['type']} of shape {facts['shape']}, dtype {facts['dtype']}, strides {facts['strides']}, "
            f"on {facts['device']}")


def _unsigned(x: Any) -> str:
    """What came, for an object without a signature."""
    kind = type(x)
    text = f"a {kind.__module__}.{kind.__qualname__}"
    shape = getattr(x, "shape", None)
    return text + (f" of shape {tuple(shape)}" if shape is not None else "")


def planned_signature(name: str, x: Any) -> tuple:
    """``array_signature(x)``, or AttentionInputError naming ``name`` for an array kind a plan does not take."""
    signature = array_signature(x)
    if signature is None:
        raise bad_arg(name, f"{_SIGNATURE_KINDS}; op.forward serves other kinds", _unsigned(x))
    return signature


def check_planned(name: str, x: Any, planned: tuple) -> None:
    """AttentionInputError naming ``name`` unless ``x`` has the planned signature: the step's own arrays only."""
    signature = array_signature(x)
    if signature == planned:
        return
    want = _facts(planned)
    if signature is None:
        got = _unsigned(x)
    else:
        facts = _facts(signature)
        other = ", ".join(f for f in _FACTS if facts[f] != want[f])
        got = f"{_text(facts)} (differs in {other})"
    raise bad_arg(name, f"the planned array, {_text(want)} (a call of another signature needs a plan of its own)",
                  got)


class PlannedCall:
    """A validated call and the backend that serves it; runs it again with a step's arrays in place."""

    def __init__(self, dispatcher: Any, call: AttentionCall, backend: str | None, method: str) -> None:
        self.dispatcher, self.call, self.backend, self.method = dispatcher, call, backend, method
        self.chosen = dispatcher.select(call, backend)
        self.fields = dict(call.__dict__)
        # The chosen backend's own runner of this plan's calls, where it has one (Backend.forward_step for a
        # forward, Backend.kvcache_step for with_kvcache): kept with that backend (``prepared_step``).
        step = (self.chosen.forward_step(call) if method == "forward" else
                self.chosen.kvcache_step(call.kvcache) if method == "with_kvcache" else None)
        self._prepared = (self.chosen, step)

    def prepared_step(self) -> Any:
        """The chosen backend's prepared runner of this plan's calls while that backend is still the one chosen (a
        backend that declines is replaced), else None: a forward's takes ``(q, k, v)``, a with_kvcache's a step's
        ``KVCacheCall``."""
        backend, step = self._prepared
        return step if backend is self.chosen else None

    def run(self, arrays: dict[str, Any]) -> Any:
        """The backend's result on the planned call with ``arrays`` (q, k, v; dout, out, lse) in its place."""
        step = self.prepared_step() if self.method == "forward" else None
        if step is not None:
            return step(**arrays)
        call = object.__new__(AttentionCall)   # frozen: the fields are set as call_signature.recalled sets them
        call.__dict__.update(self.fields, extra={}, **arrays)
        return self.run_call(call)

    def run_call(self, call: AttentionCall) -> Any:
        """The backend's result on ``call``, a step's call of this plan (one the planned backend was chosen for)."""
        declined: dict[str, list[str]] = {}
        while True:
            try:
                return getattr(self.chosen, self.method)(call)
            except BackendDeclined as exc:
                # As the dispatcher does: the next backend serves it, and this plan keeps that one, since a backend
                # that declined reports the same reasons from then on.
                logger.warning("%s: backend %r declined %s: %s", self.dispatcher.op, self.chosen.name,
                               call.describe(), exc)
                declined[self.chosen.name] = exc.reasons or [str(exc) or "declined"]
                self.chosen = self.dispatcher.select(call, self.backend, declined=declined)


class AttentionPlan:
    """A forward call checked once, with its backend chosen; ``Dispatcher.plan`` makes one. ``run(q, k, v)`` runs
    it on a step's arrays, ``backward(dout, q, k, v, out, lse)`` its backward (the module's docstring says what a
    plan fixes and what each run checks)."""

    def __init__(self, dispatcher: Any, q: Any, k: Any, v: Any, options: dict[str, Any]) -> None:
        self._options = options
        self._paged: PagedKeys | None
        self._paged, packed_k, packed_v = gather_paged_keys(k, v, options["block_table"], options["cu_seqlens_k"],
                                                            options["layout"])
        call = validate_forward(q, packed_k, packed_v, **{n: options[n] for n in _FORWARD_OPTIONS})
        check_deterministic(options["deterministic"])
        if call.dropout_p:
            raise bad_arg("dropout_p", "0 in a plan (a plan fixes dropout_seed, so every step would drop the same "
                          "entries: call op.forward with a seed per step)", call.dropout_p)
        self._signatures = {name: planned_signature(name, x) for name, x in (("q", q), ("k", k), ("v", v))}
        self._dispatcher = dispatcher
        self._forward = PlannedCall(dispatcher, call, options["backend"], "forward")
        self._backward: PlannedCall | None = None
        self._result_signatures: dict[str, tuple] = {}

    @property
    def backend(self) -> str:
        """The name of the backend that runs this plan's forward."""
        return self._forward.chosen.name

    @property
    def call(self) -> AttentionCall:
        """The validated forward call (with the arrays given at plan time; paged keys gathered)."""
        return self._forward.call

    def _step_keys(self, k: Any, v: Any) -> tuple[Any, Any]:
        if self._paged is None:
            return k, v
        return self._paged.gather(k), self._paged.gather(v)

    def run(self, q: Any, k: Any, v: Any) -> Any:
        """The planned forward on this step's arrays, exactly what ``op.forward`` returns for them.

        q, k, v: arrays with the signatures of those planned (type, shape, strides, dtype and device): q
        (B, Sq, Hq, D), k and v (B, Sk, Hkv, D) / (B, Sk, Hkv, Dv) for layout "bshd" ((B, H, S, D) for "bhsd",
        (total, H, D) for "thd"; paged caches (num_blocks, page_size, Hkv, D) with block_table), float16, bfloat16,
        float32 or float64, one dtype. Returns out shaped like q with v's head dim, q's kind, dtype and device, and
        when planned with ``return_lse`` also lse (B, Hq, Sq), or (Hq, total_q) for "thd", float32.
        AttentionInputError naming the argument for an array of another signature.
        """
        planned = self._signatures
        check_planned("q", q, planned["q"])
        check_planned("k", k, planned["k"])
        check_planned("v", v, planned["v"])
        return self.step(q, k, v)

    def step(self, q: Any, k: Any, v: Any) -> Any:
        """``run`` for a caller that found q, k and v of the planned signatures already (``dense_plans``, whose key
        holds them), so they are not compared again. Arguments and result as ``run``'s."""
        k, v = self._step_keys(k, v)
        out, lse = self._forward.run({"q": q, "k": k, "v": v})
        return (out, lse) if self._forward.fields["return_lse"] else out

    def drop_planned_arrays(self) -> None:
        """Let go of the q, k and v given at plan time, which no run reads (each brings its own): a plan kept for
        later calls (``numba_flash.dense_plans``) must not keep its first call's tensors alive. ``call`` then holds
        None in their place."""
        planned = self._forward
        call = object.__new__(AttentionCall)   # frozen: a copy with those fields set, as run makes its calls
        call.__dict__.update(planned.call.__dict__, q=None, k=None, v=None)
        planned.call, planned.fields = call, dict(call.__dict__)

    def backward(self, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
        """The planned call's backward on this step's arrays, what ``op.backward`` with the planned options returns.

        q, k, v: with the planned signatures, as ``run`` takes them; dout, out: shaped like q with v's head dim
        (q's dtype); lse: (B, Hq, Sq), or (Hq, total_q) for "thd", float32, as ``run`` returned them. The first
        backward checks them in full and chooses the backward's backend; later ones check that dout, out and lse
        have the signatures the first one's had. Returns dq, dk, dv shaped like q, k, v (with block_table, dk and
        dv shaped like the caches, 0 in rows no sequence reads). A plan's backward returns no dbias, and a
        ``score_mod`` plan has none (its backward needs ``score_mod_grad``: use ``op.backward``).
        """
        planned = self._signatures
        check_planned("q", q, planned["q"])
        check_planned("k", k, planned["k"])
        check_planned("v", v, planned["v"])
        packed_k, packed_v = self._step_keys(k, v)
        if self._backward is None:
            options = self._options
            call = validate_backward(dout, q, packed_k, packed_v, out, lse,
                                     **{n: options[n] for n in _BACKWARD_OPTIONS})
            signatures = {name: planned_signature(name, x) for name, x in (("dout", dout), ("out", out), ("lse", lse))}
            self._backward = PlannedCall(self._dispatcher, call, options["backend"], "backward")
            self._result_signatures = signatures
        else:
            for name, x in (("dout", dout), ("out", out), ("lse", lse)):
                check_planned(name, x, self._result_signatures[name])
        dq, dk, dv = self._backward.run({"dout": dout, "q": q, "k": packed_k, "v": packed_v, "out": out,
                                         "lse": lse})[:3]
        if self._paged is not None:
            dk, dv = self._paged.scatter(dk, self._paged.shape_k), self._paged.scatter(dv, self._paged.shape_v)
        return dq, dk, dv

    def __repr__(self) -> str:
        shapes = ", ".join(f"{name} {_facts(s)['shape']}" for name, s in self._signatures.items())
        paged = " (k, v paged)" if self._paged is not None else ""
        return f"<AttentionPlan backend={self.backend!r} {shapes}{paged}: {self._forward.call.describe()}>"


def make_plan(self: Any, q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
              window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str | None = None,
              return_lse: bool = False, backend: str | None = None, cu_seqlens_q: Any = None,
              cu_seqlens_k: Any = None, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
              alibi_slopes: Any = None, attn_bias: Any = None, bias_mod: Any = None, mask_mod: Any = None,
              score_mod: Any = None, block_mask: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
              deterministic: bool = False, precision: str = "ieee", block_table: Any = None) -> AttentionPlan:
    """``Dispatcher.plan``: check a forward call once and choose its backend, for running it again on new arrays.

    Takes ``Dispatcher.forward``'s arguments, checked as it checks them (the same AttentionInputError for a bad
    one), with the arrays of one step: q (B, Sq, Hq, D) for layout "bshd" or (B, Hq, Sq, D) for "bhsd", k and v
    (B, Sk, Hkv, D) / (B, Hkv, Sk, D) (v's head dim may differ); packed, q (total_q, Hq, D), k and v
    (total_k, Hkv, D) with ``cu_seqlens_q`` / ``cu_seqlens_k`` (B + 1,) int32; paged, k and v caches
    (num_blocks, page_size, Hkv, D) with ``block_table`` (B, max_blocks) int32. float16, bfloat16, float32 or
    float64, one dtype; numpy arrays or strided torch tensors. Everything but q, k and v is fixed by the plan (the
    module ``numba_flash.plan`` says how); ``dropout_p > 0`` is refused.

    Returns an ``AttentionPlan``: ``plan.run(q, k, v)`` returns what ``forward`` would, for arrays of the planned
    type, shape, strides, dtype and device, and refuses others naming the argument.
    """
    options = dict(locals())
    return AttentionPlan(options.pop("self"), options.pop("q"), options.pop("k"), options.pop("v"), options)


make_plan.__qualname__ = "Dispatcher.plan"   # bound as that method: an unknown keyword's error names it so
make_plan = checked_arguments(make_plan)

__all__ = ["AttentionPlan", "PlannedCall", "check_planned", "make_plan", "planned_signature"]
