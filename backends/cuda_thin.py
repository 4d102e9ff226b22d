"""The cuda backend's thin launch path (opt-in: ``NUMBA_FLASH_THIN_LAUNCH=1``): planned launches per call signature.

The first call of a signature (shapes, strides, dtypes, device, the 16-byte alignment of each data pointer, every
switch and scalar of the call, the tile override, the stream) runs numba's dispatcher path as always, under the
launch recorder; its launches become a ``CallPlan`` (``numba_flash.cuda.host.launch_plan``) kept for the
signature. Later calls of that signature allocate their outputs with torch, write the tensors' ``data_ptr()`` into
the packed arguments and call ``cuLaunchKernel`` on torch's current stream: no ``__cuda_array_interface__``, no
numba typing or argument flattening, no per-call specialisation past 48 KiB of shared memory.

Where the thin path cannot serve, numba's dispatcher does, and ``note(call)`` says why (``explain()`` shows it):
anything but plain torch CUDA tensors, the simulator, features whose arguments are made per call on the host
(ALiBi slopes, attn_bias and its gradient, dropout, mods, packed sequences, the KV cache), or a launch the plan
could not bind (``NotPlannable``). Until a GPU run proves it bit for bit against the dispatcher
(``tools/gpu_check.py``, jobs ``thin-<dtype>``), it stays off by default.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable

# None of these import numba.cuda, cuda.bindings or torch (``import numba_flash`` needs numpy and numba alone); at
# module level, because an import inside ``serve`` costs about a microsecond per call on the hot path.
from numba_flash.cuda.host import driver_launch, launch_plan, launch_record
from numba_flash.validation import AttentionCall

ENV_VAR = "NUMBA_FLASH_THIN_LAUNCH"

_PLANS: dict[tuple, Any] = {}       # signature -> CallPlan, or the reason (str) it could not be planned
#: Signatures kept at most: a plan holds its workspace (the backward's delta, B x Hq x Sq float32), and a model
#: with ever-changing shapes must not grow it without bound; the oldest signature goes first.
MAX_PLANS = 256
_LOCK = threading.Lock()
_ATTEMPTS: dict[tuple, int] = {}    # signature -> plans tried that may succeed on a later call (NotPlannable.retry)
#: Tries before such a signature is left to the dispatcher for good: the first call of a specialisation runs its
#: self-check (which copies its own inputs to the GPU), the second is the first plain one.
RETRIES = 3


def enabled() -> bool:
    """Whether the cuda backend plans its launches: ``NUMBA_FLASH_THIN_LAUNCH`` 1/true/on (default off)."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "on", "yes")


def unplannable_reason(call: AttentionCall) -> str | None:
    """Why the thin path cannot serve ``call`` at all (None when it can try)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return "the CUDA simulator runs kernels through numba's dispatcher"
    if call.kind != "torch" or call.device != "cuda":
        return f"{call.kind} {call.device} arrays (the thin path takes torch CUDA tensors)"
    import torch

    if any(type(x) is not torch.Tensor for x in (call.q, call.k, call.v) if x is not None):
        return "torch tensor subclasses (the dispatcher path returns their kind)"
    features = dict(alibi=call.alibi is not None, attn_bias=call.bias is not None, dbias=call.return_dbias,
                    dropout=bool(call.dropout_p), mods=call.mods is not None, varlen=call.is_varlen,
                    kvcache=call.kvcache is not None)
    on = [name for name, used in features.items() if used]
    if on:
        return f"{', '.join(on)}: their kernel arguments are made on the host per call"
    return None


@functools.lru_cache(maxsize=None)
def _torch() -> Any:
    """torch, imported on the first planned call."""
    import torch

    return torch


def _sig(x: Any) -> tuple:
    # get_device(): an int, where .device builds a torch.device per call (a hot path: every planned call keys)
    return (x.shape, x.stride(), x.dtype, x.get_device(), not x.data_ptr() & 15)


def plan_key(role: str, call: AttentionCall, tensors: tuple, config: Any, stream: int) -> tuple:
    """Everything a plan holds fixed: the role, each tensor's shape, strides, dtype, device and alignment, the
    call's scalars and switches, the tile override and the stream (a plan's workspace serves one stream)."""
    torch = _torch()
    return (role, tuple(_sig(x) for x in tensors), call.layout, call.causal, call.softmax_scale, call.window_left,
            call.window_right, call.softcap, call.precision, repr(config), stream, torch.cuda.current_device())


def _key_tensors(call: AttentionCall, role: str) -> tuple:
    if role == "forward":
        return (call.q, call.k, call.v)
    return (call.dout, call.q, call.k, call.v, call.out, call.lse)


def serve(role: str, call: AttentionCall, config: Any, dispatch: Callable[[AttentionCall], tuple],
           names: tuple[str, ...]) -> tuple:
    """The thin path of one call: a planned replay, else the dispatcher path (recorded into a plan the first
    time). ``names``: the call arrays in plan order, inputs then outputs; the outputs are ``dispatch``'s result."""
    torch = _torch()
    if call.q.get_device() != torch.cuda.current_device():   # the launch goes to the current context
        return dispatch(call)
    inputs = _key_tensors(call, role)
    stream = torch.cuda.current_stream(call.q.device).cuda_stream
    key = plan_key(role, call, inputs, config, stream)
    plan = _PLANS.get(key)
    if isinstance(plan, launch_plan.CallPlan):
        try:
            return plan.run_new_outputs(*inputs, outputs=len(names) - len(inputs), stream=stream)
        except driver_launch.LaunchFailed as exc:   # launched nothing (no current context here?): numba's way
            with _LOCK:
                _PLANS[key] = str(exc)
            return dispatch(call)
    if plan is not None:                       # known not plannable: the dispatcher, as always
        return dispatch(call)
    with launch_record.recording() as records:     # the dispatcher path, watched: its launches become the plan
        result = dispatch(call)
    arrays = dict(zip(names, (*inputs, *result[:len(names) - len(inputs)])))
    try:
        new_plan = launch_plan.build_plan(records, arrays, driver_launch.real_driver())
        unbound = new_plan.unbound()
        if unbound:
            raise launch_plan.NotPlannable(unbound)
    except launch_plan.NotPlannable as exc:
        with _LOCK:
            _ATTEMPTS[key] = _ATTEMPTS.get(key, 0) + 1
            if exc.retry and _ATTEMPTS[key] < RETRIES:
                return result                  # nothing stored: the next call records again
        new_plan = str(exc)
    except Exception as exc:   # unproven path: a planning bug costs the plan, never the call (its result stands)
        new_plan = f"planning failed: {type(exc).__name__}: {exc}"
    with _LOCK:
        _PLANS[key] = new_plan
        _ATTEMPTS.pop(key, None)
        while len(_PLANS) > MAX_PLANS:
            _PLANS.pop(next(iter(_PLANS)))
    return result


def forward(call: AttentionCall, config: Any, dispatch: Callable[[AttentionCall], tuple]) -> tuple:
    """(out, lse) of a forward call, planned where it can be (``dispatch``: the backend's dispatcher path)."""
    if unplannable_reason(call):
        return dispatch(call)
    return serve("forward", call, config, dispatch, ("q", "k", "v", "out", "lse"))


def backward(call: AttentionCall, config: Any, dispatch: Callable[[AttentionCall], tuple]) -> tuple:
    """(dq, dk, dv) of a backward call, planned where it can be."""
    if unplannable_reason(call):
        return dispatch(call)
    return serve("backward", call, config, dispatch, ("dout", "q", "k", "v", "out", "lse", "dq", "dk", "dv"))


def stats() -> dict[str, Any]:
    """How many signatures are planned, and why the others are not (for tools/gpu_check.py's record)."""
    reasons = [p for p in _PLANS.values() if isinstance(p, str)]
    return {"planned": len(_PLANS) - len(reasons), "not_planned": sorted(set(reasons))}


def note(call: AttentionCall) -> str | None:
    """What ``explain()`` says about the thin path for ``call``: off, why it cannot serve, or None when it
    serves (or will plan the call on its first run)."""
    if not enabled():
        return None
    reason = unplannable_reason(call)
    if reason is None:
        reasons = sorted({p for p in _PLANS.values() if isinstance(p, str)})
        return f"thin launch: {len(_PLANS) - len(reasons)} planned signatures" + (
            f"; not planned: {'; '.join(reasons)}" if reasons else "")
    return f"thin launch not used: {reason}"
