"""ROCm backend: attention in plain PyTorch, for AMD GPUs through a HIP build of torch.

Numba has no AMD GPU target, so on AMD hardware the work is done by torch itself:

* ``torch.nn.functional.scaled_dot_product_attention`` where its semantics are exactly the contract's: no sliding
  window, no softcap, no lse asked for, and causal only when Sq == Sk (SDPA aligns ``is_causal`` to the top-left
  corner, the contract to the bottom-right; the two agree only on square masks). The scale is always passed.
  SDPA, whose dropout has its own generator, is not used with dropout; nor, since it would drop a key whose score
  is -inf, with inputs that are not ``inputs_clean``.
* otherwise the blockwise online softmax of ``numba_flash.torch_path`` (the algorithm lives there; this module
  checks capabilities, moves arrays to and from torch tensors and calls it).

Every tensor op works on any torch device, so forcing ``backend="rocm"`` runs it on CPU or NVIDIA tensors too (and
on numpy arrays, through CPU tensors); without forcing it is chosen only for tensors on a HIP GPU.
torch is imported inside functions: importing this module or registering the backend does not import it.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from numba_flash.arrays import as_plain_tensor, as_result_kind, is_torch_tensor
from numba_flash.torch_path import (backward_blockwise, bias_finite, blockwise_into, compute_dtype,
                                    forward_blockwise, heads_view, inputs_clean)
from numba_flash.validation import AttentionCall

from . import kvcache, varlen
from .base import Backend


def _hip_runtime_reasons() -> list[str]:
    """Why this process cannot run torch on a HIP GPU (read at call time, so that tests can fake a HIP build)."""
    try:
        import torch
    except ImportError:
        return ["torch is not installed"]
    if getattr(torch.version, "hip", None) is None:
        return ["not a HIP device (torch.version.hip is None)"]
    if not torch.cuda.is_available():
        return ["no HIP GPU (torch.cuda.is_available() is False)"]
    return []


def _to_kind(ref: Any, t: Any) -> Any:
    """``t`` (a plain torch tensor) back as the array kind of ``ref``: numpy for numpy inputs, the tensor type
    torch would return for a torch subclass."""
    if isinstance(ref, np.ndarray):
        return t.numpy()
    if t is not None and is_torch_tensor(ref):
        return as_result_kind(ref, t)
    return t


def _forward_sdpa(q: Any, k: Any, v: Any, call: AttentionCall) -> Any:
    """Output of ``scaled_dot_product_attention`` in the call's layout, contiguous, q's dtype."""
    import torch.nn.functional as F

    qh, kh, vh = (heads_view(x, call.layout) for x in (q, k, v))
    kwargs = {"enable_gqa": True} if call.nheads_q != call.nheads_kv else {}
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=call.window_right == 0,
                                         scale=call.softmax_scale, **kwargs)
    return heads_view(out, call.layout).contiguous()


def sdpa_fits(call: AttentionCall) -> bool:
    """True when ``scaled_dot_product_attention`` computes exactly what the contract asks for ``call``."""
    if (call.return_lse or call.is_backward or call.softcap > 0 or call.window_left >= 0 or call.alibi is not None
            or call.bias is not None or call.mods is not None
            or call.dropout_p):   # SDPA's dropout draws from torch's generator, not from numba_flash.dropout
        return False
    if call.window_right >= 0:
        # SDPA's is_causal keeps j <= i (top-left); the contract keeps j <= i + Sk - Sq. Equal only when Sq == Sk.
        return call.window_right == 0 and call.seqlen_q == call.seqlen_k
    return True


def _sdpa_has_gqa() -> bool:
    """SDPA learnt ``enable_gqa`` in torch 2.5; before that, GQA calls take the blockwise path."""
    import torch

    return torch.__version__ >= "2.5"  # TorchVersion compares as a version, not as a string


class RocmBackend(Backend):
    """Torch attention for AMD GPUs: SDPA where it fits the contract exactly, a blockwise online softmax elsewhere.

    Chosen automatically for torch tensors on a HIP GPU, and as the last resort for torch tensors on any other GPU
    that no backend serves (``last_resort_reasons``); forced (``backend="rocm"``) it serves torch tensors on any
    device and numpy arrays (run as CPU tensors, returned as numpy).
    """

    name = "rocm"
    PRIORITY = 40
    SUPPORTED_KINDS = ("torch", "numpy")
    SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")
    SUPPORTED_LAYOUTS = ("bshd", "bhsd", "thd")
    SUPPORTS_KVCACHE = True
    SUPPORTS_ALIBI = True
    SUPPORTS_BIAS = True
    SUPPORTS_DBIAS = True
    SUPPORTED_MAX_HEAD_DIM = 576
    SUPPORTS_HEAD_DIM_V = True
    SUPPORTS_MODS = True
    SUPPORTS_DROPOUT = True

    def unavailable_reasons(self, forced: bool = False) -> list[str]:
        if forced:
            try:
                import torch  # noqa: F401
            except ImportError:
                return ["torch is not installed"]
            return []
        return _hip_runtime_reasons()

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        # Cheap facts first: a numpy call that is not forced here is turned down without importing torch.
        if call.kind == "numpy" and not forced:
            return ["numpy input: rocm takes host arrays only when forced, backend='rocm'"]
        reasons = super().not_supported_reasons(call, forced)
        if call.kind == "numpy" and call.dtype == "bfloat16":
            reasons.append("bfloat16 numpy arrays not supported (pass a torch tensor)")
        if reasons or forced:
            return reasons
        # A HIP build of torch names its GPU device "cuda"; _hip_runtime_reasons has already ruled out NVIDIA.
        if call.device != "cuda":
            return [f"{call.device} tensors not supported (runs on HIP GPUs unless forced with backend='rocm')"]
        return []

    def last_resort_reasons(self, call: AttentionCall) -> list[str] | None:
        """Torch tensors on a GPU that no backend serves (on an NVIDIA GPU: head dims past the cuda kernels' 256,
        Dv != D, attn_bias's gradient, a kernel whose every tile config failed its self-check) run here, in torch
        on their own device, rather than fail. Host arrays and CPU tensors keep the cpu backend's verdict (and
        NoBackendError's hint to name this backend), and so do meta tensors, which hold no data to attend over."""
        if call.kind != "torch" or call.device in ("cpu", "meta"):
            return None
        return self.not_supported_reasons(call, forced=True)

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        """Return ``(out, lse)``: out like q (kind, device, dtype, layout), contiguous; lse (B, Hq, Sq) float32
        (float64 for float64 inputs), or None when the call did not ask for it and SDPA served it."""
        import torch

        q, k, v = (as_plain_tensor(x) for x in (call.q, call.k, call.v))
        results = _results_shapes(call)
        if q.device.type == "meta":   # shape inference: a meta tensor has no data, its results none either
            return tuple(_meta_like(q, shape, dt) for _, shape, dt in results)
        _check_fits(results, q)
        with torch.no_grad():
            clean = inputs_clean(call, compute_dtype(q.dtype), q, k, v) and bias_finite(call)
            if call.is_varlen:
                return self._forward_varlen(call, q, k, v, careful=not clean)
            if clean and sdpa_fits(call) and (call.nheads_q == call.nheads_kv or _sdpa_has_gqa()):
                return _to_kind(call.q, _forward_sdpa(q, k, v, call)), None
            out, lse = forward_blockwise(q, k, v, call, careful=not clean)
        return _to_kind(call.q, out), _to_kind(call.q, lse)

    def backward(self, call: AttentionCall) -> tuple[Any, Any, Any]:
        """Return ``(dq, dk, dv)`` shaped like q, k, v, same kind, device and dtype as q, contiguous."""
        import torch

        dout, q, k, v, out, lse = (as_plain_tensor(x) for x in (call.dout, call.q, call.k, call.v, call.out, call.lse))
        results = [(("dq", "dk", "dv")[i], tuple(x.shape), "q") for i, x in enumerate((q, k, v))]
        if q.device.type == "meta":
            return tuple(_meta_like(q, shape, dt) for _, shape, dt in results)
        _check_fits(results, q)
        with torch.no_grad():
            # lse is +inf for rows that see no key: only a NaN in it (a poisoned row) needs the careful path.
            clean = (inputs_clean(call, compute_dtype(q.dtype), q, k, v, dout, out) and not bool(torch.isnan(lse).any())
                     and bias_finite(call))
            if call.is_varlen:
                grads = self._backward_varlen(call, dout, q, k, v, out, lse, careful=not clean)
            else:
                grads = backward_blockwise(dout, q, k, v, out, lse, call, careful=not clean)
        return tuple(_to_kind(call.q, gr) for gr in grads)

    def with_kvcache(self, call: AttentionCall) -> tuple[Any, Any]:
        """Rotary and the append in torch on the caches' device, then the blockwise forward per sequence and key
        part (``backends.kvcache``), partial results kept in the compute dtype until the merge."""
        import torch

        kv = call.kvcache
        q, k_cache, v_cache = (as_plain_tensor(x) for x in (kv.q, kv.k_cache, kv.v_cache))
        cdt, dev = compute_dtype(q.dtype), q.device
        with torch.no_grad():
            new = [as_plain_tensor(x) for x in (kv.k_new, kv.v_new)] if kv.seqlen_new else [None, None]
            q = kvcache.rotate_and_append_torch(kv, q, k_cache, v_cache, *new)
            for theirs, mine in ((kv.k_cache, k_cache), (kv.v_cache, v_cache)):
                if kv.seqlen_new and isinstance(theirs, np.ndarray) and any(s < 0 for s in theirs.strides):
                    theirs[...] = mine.numpy()  # as_plain_tensor copied it (torch has no negative strides): write back
            out = torch.empty(q.shape, dtype=cdt, device=dev)
            lse = torch.empty((kv.batch, kv.nheads_q, kv.seqlen_q), dtype=cdt, device=dev)

            workers = (torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda"
                       else torch.get_num_threads())
            gather = lambda c, blocks: c[torch.as_tensor(blocks, device=c.device)].flatten(0, 1)  # noqa: E731
            kvcache.forward(kv, blockwise_into(careful=True), q, out, lse, kvcache.choose_num_splits(kv, workers),
                            empty_like=torch.empty_like, keys=kvcache.cache_keys(kv, k_cache, v_cache, gather))
        return _to_kind(kv.q, out.to(q.dtype)), _to_kind(kv.q, lse)

    @staticmethod
    def _forward_varlen(call: AttentionCall, q: Any, k: Any, v: Any, careful: bool) -> tuple[Any, Any]:
        """Packed sequences: the blockwise forward per sequence (it gives the lse that SDPA does not), each result
        copied into the packed out (total_q, Hq, D) and lse (Hq, total_q)."""
        import torch

        out = torch.empty(q.shape[:-1] + (call.head_dim_v,), dtype=q.dtype, device=q.device)
        lse = torch.empty(call.lse_shape, dtype=compute_dtype(q.dtype), device=q.device)
        varlen.forward(call, blockwise_into(careful), q, k, v, out, lse)
        return _to_kind(call.q, out), _to_kind(call.q, lse)

    @staticmethod
    def _backward_varlen(call: AttentionCall, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                         careful: bool) -> tuple[Any, Any, Any]:
        """Packed sequences: the blockwise backward per sequence, copied into packed dq, dk, dv like q, k, v."""
        import torch

        grads = tuple(torch.empty(x.shape, dtype=q.dtype, device=q.device) for x in (q, k, v))

        def run(c: AttentionCall, dout_b: Any, q_b: Any, k_b: Any, v_b: Any, out_b: Any, lse_b: Any, dq_b: Any,
                dk_b: Any, dv_b: Any) -> None:
            parts = backward_blockwise(dout_b, q_b, k_b, v_b, out_b, lse_b, c, careful=careful)
            for packed, part in zip((dq_b, dk_b, dv_b), parts):
                packed.copy_(part)

        varlen.backward(call, run, dout, q, k, v, out, lse, *grads)
        return grads


__all__ = ["RocmBackend", "sdpa_fits"]


def _results_shapes(call: AttentionCall) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype: "q" for q's, "lse" for the lse's) of a forward's results, out and lse."""
    q_shape = tuple(int(s) for s in call.q.shape)
    lse = (call.nheads_q, q_shape[0]) if call.is_varlen else (call.batch, call.nheads_q, call.seqlen_q)
    return [("out", q_shape[:-1] + (call.head_dim_v,), "q"), ("lse", lse, "lse")]


def _meta_like(q: Any, shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    return torch.empty(shape, dtype=q.dtype if dtype == "q" else compute_dtype(q.dtype), device="meta")


def _check_fits(results: list[tuple[str, tuple[int, ...], str]], q: Any) -> None:
    """MemoryError naming the size when the results cannot fit in the memory of q's device, raised before any
    input is read: ``inputs_clean`` reads every element, and broadcast views of a huge shape hold few bytes but
    take minutes to scan before the allocation would fail anyway."""
    import torch

    sizes = {"q": q.element_size(), "lse": torch.empty((), dtype=compute_dtype(q.dtype)).element_size()}
    need = {name: math.prod(shape) * sizes[dt] for name, shape, dt in results}
    if q.device.type == "cpu":
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):   # no sysconf (Windows): the allocation will tell
            return
    elif q.device.type == "cuda":
        total = torch.cuda.get_device_properties(q.device).total_memory
    else:
        return
    if sum(need.values()) > total:
        name, shape, _ = max(results, key=lambda r: need[r[0]])
        raise MemoryError(f"{name}: {shape} {str(q.dtype).replace('torch.', '')} needs "
                          f"{need[name] / 2**30:.0f} GiB, and the results {sum(need.values()) / 2**30:.0f} GiB, "
                          f"more than the {total / 2**30:.0f} GiB of memory of {q.device}")
