"""CPU backend: the ``numba.njit(parallel=True)`` tiled kernels of ``numba_flash.cpu`` on host memory.

Serves numpy arrays, torch CPU tensors and host DLPack exporters; returns numpy for numpy (and DLPack) inputs and
torch tensors for torch inputs (for a torch subclass, the type torch itself would return for it). Numba has no
float16 or bfloat16 arithmetic on the CPU, so such inputs are widened to float32 once (O(B*S*H*D) extra memory,
never S x S) and the outputs are narrowed back (round to nearest even). bfloat16 comes only as torch tensors: numpy
has no bfloat16 dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from numba_flash.arrays import as_result_kind, is_torch_tensor, to_numpy
from numba_flash.validation import AttentionCall

from .base import Backend


def _bshd(a: np.ndarray, layout: str) -> np.ndarray:
    """A (B, S, H, D) view of an array in ``layout``; no copy."""
    return a.transpose(0, 2, 1, 3) if layout == "bhsd" else a


def _compute_dtype(dtype: str) -> type:
    return np.float64 if dtype == "float64" else np.float32


def _host(x: Any, compute: type) -> np.ndarray:
    a = to_numpy(x)
    return a if a.dtype == compute else a.astype(compute)


def _like(ref: Any, a: np.ndarray, dtype: str) -> Any:
    """``a`` as the same array kind and dtype as ``ref`` (numpy for anything but torch)."""
    if is_torch_tensor(ref):
        import torch

        return as_result_kind(ref, torch.from_numpy(a).to(getattr(torch, dtype)))
    return a if a.dtype == np.dtype(dtype) else a.astype(dtype)


class CpuBackend(Backend):
    name = "cpu"
    PRIORITY = 10
    SUPPORTED_KINDS = ("numpy", "torch", "dlpack")
    SUPPORTED_DEVICES = ("cpu",)
    SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(call, forced)
        if call.dtype == "bfloat16" and call.kind != "torch":
            reasons.append("bfloat16 only as torch tensors (numpy has no bfloat16)")
        return reasons

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        from numba_flash.cpu import flash_forward

        compute = _compute_dtype(call.dtype)
        q, k, v = (_host(x, compute) for x in (call.q, call.k, call.v))
        out = np.empty(q.shape, dtype=compute)
        lse = np.empty((call.batch, call.nheads_q, call.seqlen_q), dtype=compute)
        flash_forward(_bshd(q, call.layout), _bshd(k, call.layout), _bshd(v, call.layout), _bshd(out, call.layout),
                      lse, call.softmax_scale, call.window_left, call.window_right, call.softcap)
        lse_dtype = "float64" if call.dtype == "float64" else "float32"
        return _like(call.q, out, call.dtype), _like(call.q, lse, lse_dtype)

    def backward(self, call: AttentionCall) -> tuple[Any, Any, Any]:
        from numba_flash.cpu import flash_backward

        compute = _compute_dtype(call.dtype)
        dout, q, k, v, out, lse = (_host(x, compute) for x in (call.dout, call.q, call.k, call.v, call.out, call.lse))
        dq, dk, dv = np.empty(q.shape, compute), np.empty(k.shape, compute), np.empty(v.shape, compute)
        lay = call.layout
        flash_backward(_bshd(dout, lay), _bshd(q, lay), _bshd(k, lay), _bshd(v, lay), _bshd(out, lay), lse,
                       _bshd(dq, lay), _bshd(dk, lay), _bshd(dv, lay),
                       call.softmax_scale, call.window_left, call.window_right, call.softcap)
        return tuple(_like(call.q, g, call.dtype) for g in (dq, dk, dv))
