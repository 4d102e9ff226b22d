"""CPU backend: the ``numba.njit(parallel=True)`` tiled kernels of ``numba_flash.cpu`` on host memory.

Serves numpy arrays, torch CPU tensors and host DLPack exporters; returns numpy for numpy (and DLPack) inputs and
torch tensors for torch inputs (for a torch subclass, the type torch itself would return for it). Numba has no
float16 or bfloat16 arithmetic on the CPU, so such inputs are widened to float32 once (O(B*S*H*D) extra memory,
never S x S) and the outputs are narrowed back (round to nearest even). bfloat16 comes only as torch tensors: numpy
has no bfloat16 dtype.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

import numba
import numpy as np

from numba_flash.arrays import (as_result_kind, dtype_name, host_tensor_view, is_host_float_tensor, is_torch_tensor,
                                to_numpy)
from numba_flash.semantics import clamp_window_bound
from numba_flash.validation import AttentionCall

from . import kvcache
from .base import Backend


def _bshd(a: np.ndarray, layout: str) -> np.ndarray:
    """A (B, S, H, D) view of an array in ``layout``; no copy."""
    return a.transpose(0, 2, 1, 3) if layout == "bhsd" else a


def _compute_dtype(dtype: str) -> type:
    return np.float64 if dtype == "float64" else np.float32


def _host(x: Any, compute: type) -> np.ndarray:
    """``x`` (validated: no lazy torch bit left) as a host array of the ``compute`` dtype; a view where it can be."""
    if type(x) is np.ndarray:
        a = x
    elif is_host_float_tensor(x):   # a tiny call's microseconds: skip to_numpy's general case (and detach)
        a = host_tensor_view(x)
    else:
        a = to_numpy(x)
    return a if a.dtype == compute else a.astype(compute)


def _like(ref: Any, a: np.ndarray, dtype: str) -> Any:
    """``a`` as the same array kind and dtype as ``ref`` (numpy for anything but torch)."""
    if is_host_float_tensor(ref) and a.dtype == np.dtype(dtype):
        return sys.modules["torch"].from_numpy(a)   # ref is a tensor: torch is imported
    if is_torch_tensor(ref):
        import torch

        return as_result_kind(ref, torch.from_numpy(a).to(getattr(torch, dtype)))
    return a if a.dtype == np.dtype(dtype) else a.astype(dtype)


def _outputs_like(q: Any, out: np.ndarray, lse: np.ndarray, dtype: str) -> tuple[Any, Any]:
    """A forward's (out, lse) as q's array kind: out in the inputs' ``dtype``, lse float32 (float64 for float64)."""
    return _like(q, out, dtype), _like(q, lse, "float64" if dtype == "float64" else "float32")


class CpuBackend(Backend):
    name = "cpu"
    PRIORITY = 10
    SUPPORTED_KINDS = ("numpy", "torch", "dlpack")
    SUPPORTED_DEVICES = ("cpu",)
    SUPPORTED_DTYPES = ("float32", "float16", "bfloat16", "float64")
    SUPPORTED_LAYOUTS = ("bshd", "bhsd", "thd")
    SUPPORTS_KVCACHE = True
    SUPPORTS_ALIBI = True
    SUPPORTS_DROPOUT = True
    SUPPORTS_BIAS = True
    SUPPORTS_DBIAS = True
    SUPPORTED_MAX_HEAD_DIM = 576   # q and k; v and the output to 512 (validation's limits)
    SUPPORTS_HEAD_DIM_V = True
    SUPPORTS_MODS = True   # compiled into kernels of their own, once per mod in a process (numba_flash.cpu.modhooks)

    def not_supported_reasons(self, call: AttentionCall, forced: bool = False) -> list[str]:
        reasons = super().not_supported_reasons(call, forced)
        if call.dtype == "bfloat16" and call.kind != "torch":
            reasons.append("bfloat16 only as torch tensors (numpy has no bfloat16)")
        return reasons

    def forward(self, call: AttentionCall) -> tuple[Any, Any]:
        compute = _compute_dtype(call.dtype)
        q, k, v = (_host(x, compute) for x in (call.q, call.k, call.v))
        out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=compute)   # Dv, v's head dim
        lse = np.empty(call.lse_shape, dtype=compute)
        if call.is_varlen:   # one kernel call for every sequence (no attn_bias or mods: validation)
            _run_forward(call, q, k, v, out, lse, packing=call.packing)
        elif _is_tiny(call):   # decode steps and short sequences: one thread, no packing, no padded tiles
            _tiny().tiny_forward(q, k, v, out, lse, call.softmax_scale, call.window_left, call.window_right,
                                 call.softcap, call.alibi, call.layout)
        else:
            with _serial_if_small(_call_work(call)):
                _run_forward(call, *(_bshd(x, call.layout) for x in (q, k, v, out)), lse)
        return _outputs_like(call.q, out, lse, call.dtype)

    def backward(self, call: AttentionCall) -> tuple[Any, ...]:
        """(dq, dk, dv), and dbias shaped like attn_bias in its dtype when ``call.return_dbias``."""
        compute = _compute_dtype(call.dtype)
        dout, q, k, v, out, lse = (_host(x, compute) for x in (call.dout, call.q, call.k, call.v, call.out, call.lse))
        dq, dk, dv = np.empty(q.shape, compute), np.empty(k.shape, compute), np.empty(v.shape, compute)
        dbias = None
        if call.is_varlen:  # one call of each pass for every sequence (no attn_bias with packed sequences)
            _run_backward(call, dout, q, k, v, out, lse, dq, dk, dv, packing=call.packing)
        else:
            lay = call.layout
            if _is_tiny(call) and not call.return_dbias:
                _tiny().tiny_backward(*(_bshd(x, lay) for x in (dout, q, k, v, out)), lse,
                                      *(_bshd(x, lay) for x in (dq, dk, dv)), call.softmax_scale, call.window_left,
                                      call.window_right, call.softcap, call.alibi)
                grads = tuple(_like(call.q, g, call.dtype) for g in (dq, dk, dv))
                return grads
            with _serial_if_small(_call_work(call)):
                dbias = _run_backward(call, *(_bshd(x, lay) for x in (dout, q, k, v, out)), lse,
                                      *(_bshd(x, lay) for x in (dq, dk, dv)))
        grads = tuple(_like(call.q, g, call.dtype) for g in (dq, dk, dv))
        if not call.return_dbias:
            return grads
        bias = call.bias.array
        return grads + (_like(bias, dbias.reshape(tuple(int(n) for n in bias.shape)), dtype_name(bias)),)

    def with_kvcache(self, call: AttentionCall) -> tuple[Any, Any]:
        kv = call.kvcache
        compute = _compute_dtype(kv.dtype)
        views = kvcache.cache_views(kv, compute)   # torch caches the append writes and the kernel reads in place
        q = kvcache.rotate_and_append_host(kv, compute, views)
        # After the append, so that a float32 cache is read in place (a view) with its new keys. float16 caches
        # are widened once: numba has no float16 arithmetic on the CPU.
        if views is not None and views[0].dtype == compute:
            k_cache, v_cache = views
        else:
            k_cache, v_cache = _host(kv.k_cache, compute), _host(kv.v_cache, compute)
        if _tiny_decode_serves(kv):
            return _tiny_decode(kv, q, k_cache, v_cache, compute)
        out = np.empty(q.shape, dtype=compute)
        lse = np.empty((kv.batch, kv.nheads_q, kv.seqlen_q), dtype=compute)
        work = _decode_work(kv)
        from numba_flash.cpu.decode import decode_forward   # not on the tiny path above: 0.8 us a step

        rows = kv.cache_rows if kv.cache_rows is not None else np.zeros(kv.batch, np.int64)
        table = kv.block_table if kv.paged else np.zeros((1, 1), np.int64)
        with _serial_if_small(work):
            splits = kvcache.choose_num_splits(kv, numba.get_num_threads())
            decode_forward(q, k_cache, v_cache, rows, kv.key_start, kv.key_end, table, kv.page_size, out, lse,
                           kv.softmax_scale, kv.window_left, kv.window_right, kv.softcap, splits, kv.alibi)
        return _outputs_like(kv.q, out, lse, kv.dtype)

    def forward_step(self, call: AttentionCall) -> Callable[..., tuple[Any, Any]] | None:
        """A plan's forwards without ``forward``'s per-call decisions, where they cannot change between calls: a
        tiny forward (``_is_tiny``: no packed sequences, bias, mods or dropout) on float32 or float64 numpy arrays or
        plain CPU tensors (a plan fixes every array's type, dtype and strides). None otherwise. The function takes
        ``(q, k, v)`` and holds none of ``call``'s arrays, only its options. It stands in for this class's
        ``forward``: a subclass that overrides ``forward`` gets none."""
        if type(self).forward is not CpuBackend.forward or call.is_varlen or not _is_tiny(call):
            return None
        compute = _compute_dtype(call.dtype)
        if not _read_in_place(compute, call.q, call.k, call.v):
            return None
        options = (call.softmax_scale, call.window_left, call.window_right, call.softcap, call.alibi, call.layout)
        return functools.partial(_tiny_forward_step, compute=compute, lse_shape=call.lse_shape, options=options,
                                 to_torch=type(call.q) is not np.ndarray)

    def kvcache_step(self, kv: Any) -> Callable[[Any], tuple[Any, Any]] | None:
        """A plan's steps without ``with_kvcache``'s per-step decisions, where they cannot change between steps:
        a tiny decode (``_tiny_decode_serves``) without rotary, on float32 or float64 numpy arrays or plain CPU
        tensors throughout, read and written in place (a plan fixes every array's type, dtype and device). None
        otherwise. Decided on ``kv``'s facts alone; the function holds none of its arrays. It stands in for this
        class's ``with_kvcache``: a subclass that overrides ``with_kvcache`` gets none."""
        if type(self).with_kvcache is not CpuBackend.with_kvcache or kv.rotary_cos is not None \
                or not _tiny_decode_serves(kv):
            return None
        compute = _compute_dtype(kv.dtype)
        if not _read_in_place(compute, kv.q, kv.k_cache, kv.v_cache, *((kv.k_new, kv.v_new) if kv.seqlen_new else ())):
            return None
        return functools.partial(_in_place_decode_step, compute=compute)


def _read_in_place(compute: type, *arrays: Any) -> bool:
    """Whether every one of ``arrays`` is read (and written) in place in numpy's ``compute`` dtype: a numpy array of
    that dtype, or a plain float32 / float64 CPU tensor (float16 numpy arrays differ from the compute dtype)."""
    return all((type(x) is np.ndarray and x.dtype == compute) or is_host_float_tensor(x) for x in arrays)


def _tiny_forward_step(q: Any, k: Any, v: Any, compute: type, lse_shape: tuple[int, ...], options: tuple,
                       to_torch: bool) -> tuple[Any, Any]:
    """``forward`` of a call that ``CpuBackend.forward_step`` serves: q, k, v as the plan fixed them (read in
    place), ``options`` the planned (scale, window_left, window_right, softcap, alibi, layout). out like q with v's
    head dim and lse ``lse_shape``, both of ``compute``, as torch tensors for torch inputs."""
    q, k, v = (_host(x, compute) for x in (q, k, v))
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=compute)
    lse = np.empty(lse_shape, dtype=compute)
    _tiny().tiny_forward(q, k, v, out, lse, *options)
    if to_torch:
        from_numpy = sys.modules["torch"].from_numpy   # the inputs are tensors: torch is imported
        return from_numpy(out), from_numpy(lse)
    return out, lse


def _in_place_decode_step(kv: Any, compute: type) -> tuple[Any, Any]:
    """``with_kvcache`` of a step that ``CpuBackend.kvcache_step`` serves: the append through numpy views of the
    caches (torch's version counters bumped as its own assignment would), then ``_tiny_decode`` reading them."""
    q, k_cache, v_cache = (_host(x, compute) for x in (kv.q, kv.k_cache, kv.v_cache))
    if kv.seqlen_new:
        kvcache.append(kv, k_cache, v_cache, _host(kv.k_new, compute), _host(kv.v_new, compute))
        if type(kv.k_cache) is not np.ndarray:
            kvcache.bump_cache_versions(kv)
    return _tiny_decode(kv, q, k_cache, v_cache, compute)


_tiny_module: Any = None


def _tiny() -> Any:
    """``numba_flash.cpu.tiny``, imported on first use (an import statement per call costs a microsecond)."""
    global _tiny_module
    if _tiny_module is None:
        from numba_flash.cpu import tiny

        _tiny_module = tiny
    return _tiny_module


# Calls up to this many multiply-adds (B * Hq * Sq * Sk * (D + Dv), a forward's) run their kernels on one thread:
# a parallel region's fork and join cost more than they save there, and on a machine whose cores are busy with other
# work each join waits for a descheduled thread (a 64 x 64 backward, H = 8, took 124 ms on 2 threads with 2.8
# other processes per core, 0.5 ms on 1). Also the torch pool and numba's then never contend for a tiny call.
SERIAL_WORK = 1 << 22


@contextlib.contextmanager
def _serial_if_small(work: int) -> Iterator[None]:
    """Run the block's numba kernels on this thread alone when ``work`` <= ``SERIAL_WORK`` (numba's thread count
    is per calling thread; restored after)."""
    before = numba.get_num_threads()
    if work > SERIAL_WORK or before == 1:
        yield
        return
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(before)


def _decode_work(kv: Any) -> int:
    """Multiply-adds of a decode step at most (every sequence attending the whole capacity)."""
    return kv.batch * kv.nheads_q * kv.seqlen_q * kv.capacity * 2 * kv.head_dim


def _tiny_decode_serves(kv: Any) -> bool:
    """Whether ``_tiny_decode`` serves a decode step: an unpaged cache, and work within ``numba_flash.cpu.tiny``'s
    bound."""
    return not kv.paged and _tiny().fits_tiny(_decode_work(kv), False, False, 0.0, False)


def _tiny_decode(kv: Any, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, compute: type) -> tuple[Any, Any]:
    """A small decode step (``_tiny_decode_serves``) as one tiny forward per sequence, ``decode_forward``'s
    semantics: batch b attends to positions [key_start[b], key_end[b]) of its cache row, bottom-right aligned.
    q (B, Sq, Hq, D) and the caches (B_cache, capacity, Hkv, D), appended to already, all of numpy dtype
    ``compute``. Window bounds are capped per sequence, as ``decode_forward`` caps them. Returns out like kv.q and
    lse (B, Hq, Sq) float32 (float64 for float64)."""
    tiny = _tiny()
    out = np.empty(q.shape, dtype=compute)
    lse = np.empty((kv.batch, kv.nheads_q, kv.seqlen_q), dtype=compute)
    # Python ints, once (indexing the arrays per sequence costs a microsecond a step)
    rows, starts, ends = kv.cache_rows.tolist(), kv.key_start.tolist(), kv.key_end.tolist()
    for b, r, k0, k1 in zip(range(kv.batch), rows, starts, ends):
        left, right = (clamp_window_bound(int(w), kv.seqlen_q, k1 - k0) for w in (kv.window_left, kv.window_right))
        slopes = None if kv.alibi is None else kv.alibi[b:b + 1]
        tiny.tiny_forward(q[b:b + 1], k_cache[r:r + 1, k0:k1], v_cache[r:r + 1, k0:k1], out[b:b + 1], lse[b:b + 1],
                          kv.softmax_scale, left, right, kv.softcap, slopes)
    return _outputs_like(kv.q, out, lse, kv.dtype)


def _call_work(call: AttentionCall) -> int:
    return _tiny().tiny_work(call.batch, call.seqlen_q, call.seqlen_k, call.nheads_q, call.head_dim,
                             call.head_dim_v)


def _is_tiny(call: AttentionCall) -> bool:
    """Whether ``numba_flash.cpu.tiny`` serves this forward (small, and no feature only the tiled kernels have)."""
    return _tiny().fits_tiny(_call_work(call), call.bias is not None, call.mods is not None, call.dropout_p,
                             call.is_varlen)


def _bias(call: AttentionCall, compute: np.dtype) -> np.ndarray | None:
    """The call's attn_bias on the host in the compute dtype (a copy only when its dtype differs: a float16 bias
    with float16 inputs), in its own shape; the kernels broadcast it."""
    return None if call.bias is None else _host(call.bias.array, compute.type)


def _sequence_args(packing: Any) -> dict[str, Any]:
    return {} if packing is None else dict(cu_seqlens_q=packing.cu_seqlens_q, cu_seqlens_k=packing.cu_seqlens_k)


def _run_forward(call: AttentionCall, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                 lse: np.ndarray, packing: Any = None) -> None:
    """The kernel on (B, S, H, D) views and a (B, Hq, Sq) lse, all of the compute dtype; writes out and lse.
    With ``packing`` (a "thd" call's ``numba_flash.varlen.Packing``), the packed (total, H, D) arrays and the
    (Hq, total_q) lse."""
    from numba_flash.cpu import flash_forward

    flash_forward(q, k, v, out, lse, call.softmax_scale, call.window_left, call.window_right, call.softcap,
                  call.alibi, call.dropout_p, call.dropout_seed, call.dropout_batch0, _bias(call, q.dtype), call.mods,
                  **_sequence_args(packing))


def _run_backward(call: AttentionCall, dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                  out: np.ndarray, lse: np.ndarray, dq: np.ndarray, dk: np.ndarray, dv: np.ndarray,
                  packing: Any = None) -> np.ndarray | None:
    """The backward kernels on (B, S, H, D) views (or packed arrays, as ``_run_forward``); writes dq, dk and dv,
    and returns dbias (the bias's shape padded to 4 dimensions, compute dtype) when ``call.return_dbias``, else
    None."""
    from numba_flash.cpu import flash_backward

    return flash_backward(dout, q, k, v, out, lse, dq, dk, dv, call.softmax_scale, call.window_left,
                          call.window_right, call.softcap, call.alibi, call.dropout_p, call.dropout_seed,
                          call.dropout_batch0, _bias(call, q.dtype), call.mods, call.return_dbias,
                          **_sequence_args(packing))
