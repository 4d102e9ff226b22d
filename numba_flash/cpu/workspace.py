"""Host side of the CPU kernels: the compiled kernel per dtype (``kernel_entry``), the per-thread scratch buffers kept
between calls (``clear_workspace``, ``set_workspace_limit``, ``workspace_bytes``), the kernels that pack K, V, Q and
dO head-major, and the options every kernel takes.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
from typing import Any

import numba
import numpy as np
from numba import njit, prange, types
from numba.core.errors import NumbaExperimentalFeatureWarning

from numba_flash.semantics import clamp_window_bound, effective_softcap
from .cache_stamp import stamp_kernels
from .simd import BLOCK_M, D_ALIGN, as_dtype_of, fma
from .microkernels import DOT_CHUNK
from .passes import copy_rows, store_rows
from .schedule import BATCH, P0, Q0, SQ

@njit(parallel=True, cache=True)
def _pack_kernel(src, dst, head_dim, unit_stride):
    """dst[b, h, s, :D] = src[b, s, h, :D] and zero in dst's columns D.., in parallel over runs of 256 rows.
    src (B, S, H, D) any strides (``unit_stride``: its last axis is); dst (B, H, S, D_pad) C-contiguous."""
    batch, seqlen, nheads = src.shape[0], src.shape[1], src.shape[2]
    n_runs = (seqlen + 255) // 256
    zero = as_dtype_of(dst, 0.0)
    for u in prange(batch * nheads * n_runs):
        b = u // (nheads * n_runs)
        h = (u // n_runs) % nheads
        s0 = (u % n_runs) * 256
        n = min(256, seqlen - s0)
        d_rows = dst[b, h, s0:s0 + n]
        s_rows = src[b, s0:s0 + n, h]
        if unit_stride:  # else the IR copy (float32) would read the wrong elements
            copy_rows(d_rows, s_rows, n, head_dim)
        else:
            for r in range(n):
                for d in range(head_dim):
                    d_rows[r, d] = s_rows[r, d]
        for r in range(n):
            for d in range(head_dim, dst.shape[3]):
                d_rows[r, d] = zero


@njit(parallel=True, cache=True)
def pack_scaled_kernel(src, dst, head_dim, factor):
    """dst[b, h, s, :D] = src[b, s, h, :D] * factor (one rounding, as the forward scales Q) and zero in dst's columns
    D..; src (B, S, H, D) any strides, dst (B, H, S, D_pad) C-contiguous."""
    batch, seqlen, nheads = src.shape[0], src.shape[1], src.shape[2]
    n_runs = (seqlen + 255) // 256
    zero = as_dtype_of(dst, 0.0)
    f = as_dtype_of(dst, factor)
    for u in prange(batch * nheads * n_runs):
        b = u // (nheads * n_runs)
        h = (u // n_runs) % nheads
        s0 = (u % n_runs) * 256
        n = min(256, seqlen - s0)
        for r in range(n):
            for d in range(head_dim):
                dst[b, h, s0 + r, d] = src[b, s0 + r, h, d] * f
            for d in range(head_dim, dst.shape[3]):
                dst[b, h, s0 + r, d] = zero


@njit(inline="always", cache=True)
def _dot_chunk4(a, b, r0, r1, r2, r3, d0, d1, zero):
    """sum over d in [d0, d1) of a[r, d] * b[r, d] for rows r0..r3, each a chain of fused multiply-adds from 0 in
    order of d. Four independent chains: one chain alone waits on each multiply-add's latency."""
    c0 = c1 = c2 = c3 = zero
    for d in range(d0, d1):
        c0 = fma(a[r0, d], b[r0, d], c0)
        c1 = fma(a[r1, d], b[r1, d], c1)
        c2 = fma(a[r2, d], b[r2, d], c2)
        c3 = fma(a[r3, d], b[r3, d], c3)
    return c0, c1, c2, c3


@njit(inline="always", cache=True)
def _row_dots4(a, b, r0, r1, r2, r3, width, zero):
    """``row_dot_kernel``'s sums for rows r0..r3: chunks of ``DOT_CHUNK`` (``_dot_chunk4``) added in order."""
    t0, t1, t2, t3 = _dot_chunk4(a, b, r0, r1, r2, r3, 0, min(width, DOT_CHUNK), zero)
    for k0 in range(DOT_CHUNK, width, DOT_CHUNK):
        c0, c1, c2, c3 = _dot_chunk4(a, b, r0, r1, r2, r3, k0, min(width, k0 + DOT_CHUNK), zero)
        t0, t1, t2, t3 = t0 + c0, t1 + c1, t2 + c2, t3 + c3
    return t0, t1, t2, t3


@njit(parallel=True, cache=True)
def row_dot_kernel(a, b, res, seqs):
    """res[b, h, p] = a[b, s, h, :] . b[b, s, h, :] at each row's statistics row p (``schedule``; 0 in the padding
    up to whole query tiles), summed as ``mm_dot`` sums (chains of fused multiply-adds from 0, in order of d, in
    chunks of ``DOT_CHUNK`` added in order): delta = dO . O then cancels dP = dO . v exactly where a row sees one
    key (O = v), so dS = P (dP - delta) is exactly 0 there, as torch's is. Rows go four at a time (``_row_dots4``),
    twice as fast as one at a time, with the same bits; the last 1-3 rows of a sequence repeat its last row.
    a, b (B, S, H, D) any strides; res (B, H, statistics rows); seqs: ``schedule.Sequences.table``."""
    nheads, width = a.shape[2], a.shape[3]
    zero = as_dtype_of(res, 0.0)
    for u in prange(seqs.shape[0] * nheads):
        seq = seqs[u // nheads]
        bi, q0, p0, seqlen = seq[BATCH], seq[Q0], seq[P0], seq[SQ]
        h = u % nheads
        a_h, b_h = a[bi, q0:q0 + seqlen, h], b[bi, q0:q0 + seqlen, h]
        whole = seqlen // 4 * 4
        for s in range(0, whole, 4):   # rows s..s+3 as constants apart: the loop LLVM schedules best
            t0, t1, t2, t3 = _row_dots4(a_h, b_h, s, s + 1, s + 2, s + 3, width, zero)
            res[bi, h, p0 + s] = t0
            res[bi, h, p0 + s + 1] = t1
            res[bi, h, p0 + s + 2] = t2
            res[bi, h, p0 + s + 3] = t3
        if whole < seqlen:
            last = seqlen - 1
            t0, t1, t2, _ = _row_dots4(a_h, b_h, whole, min(whole + 1, last), min(whole + 2, last), last, width,
                                       zero)
            res[bi, h, p0 + whole] = t0
            if whole + 1 < seqlen:
                res[bi, h, p0 + whole + 1] = t1
            if whole + 2 < seqlen:
                res[bi, h, p0 + whole + 2] = t2
        for s in range(seqlen, (seqlen + BLOCK_M - 1) // BLOCK_M * BLOCK_M):
            res[bi, h, p0 + s] = zero


@njit(parallel=True, cache=True)
def store_dq_kernel(dq_acc, dq, head_dim, seqs):
    """dq[b, s, h, :D] = dq_acc[b, h, p, :D] (p: row s's statistics row) for the fused backward, NaN where not
    finite (the contract reports every non-finite result as NaN). dq_acc (B, H, statistics rows, D_pad)
    C-contiguous; dq (B, S, H, >= D) any strides; seqs: ``schedule.Sequences.table``."""
    nheads = dq.shape[2]
    for u in prange(seqs.shape[0] * nheads):
        seq = seqs[u // nheads]
        bi, q0, p0, seqlen = seq[BATCH], seq[Q0], seq[P0], seq[SQ]
        h = u % nheads
        store_rows(dq[bi, q0:q0 + seqlen, h], dq_acc[bi, h, p0:p0 + seqlen], seqlen, head_dim)


# ---------------------------------------------------------------------------------------------------------------
# Host side


def _padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


_entries: dict[tuple[Any, Any], Any] = {}
_entries_lock = threading.Lock()


def _signature(name: str, dtype: np.dtype, hooks: bool = False) -> tuple[Any, ...]:
    """The argument types kernel ``name`` is compiled with for ``dtype``. The caller's arrays are typed
    layout-generic ('A'), so that C-contiguous, transposed and strided views share one compilation (numba would
    otherwise compile, and cache, one per layout combination); the buffers this module allocates are typed
    C-contiguous, which lets LLVM vectorise the loops that read them (lse, delta). The forward and backward kernels
    take ``hooks`` last (``modhooks``): None, or with ``hooks`` the mods' hooks (``hooks_type``)."""
    nb = numba.from_dtype(np.dtype(dtype))
    user = {n: types.Array(nb, n, "A") for n in (3, 4)}
    own = {n: types.Array(nb, n, "C") for n in (3, 4, 5)}
    i64, f64, boolean = types.int64, types.float64, types.boolean
    slopes = types.Array(f64, 2, "A")
    drop = types.Array(f64, 1, "A")
    tiles = types.Array(types.int8, 4, "A")   # modhooks.states_for_call
    seqs, units, counter = types.Array(i64, 2, "C"), types.Array(i64, 1, "C"), types.Array(i64, 1, "C")
    sigs = {
        "forward_kernel": (user[4], user[4], user[4], user[4], user[3], i64, f64, i64, i64, f64, own[3], own[3],
                           boolean, slopes, user[4], drop, tiles, seqs, units, counter),
        "backward_kv_kernel": (user[4], user[4], user[4], user[4], user[4], own[3], own[3], own[3], own[4],
                               user[4], user[4], i64, f64, i64, i64, f64, i64, boolean, slopes, user[4], drop,
                               tiles, boolean, own[5], seqs, units, counter),
        "backward_dq_kernel": (user[4], user[4], user[4], user[4], own[3], own[3], own[3], user[4], i64, i64, f64,
                               i64, i64, f64, slopes, user[4], drop, tiles, boolean, own[5], seqs, units, counter),
        "_pack_kernel": (user[4], own[4], i64, boolean),
        "pack_scaled_kernel": (user[4], own[4], i64, f64),
        "row_dot_kernel": (user[4], user[4], own[3], seqs),
        "store_dq_kernel": (own[4], user[4], i64, seqs),
    }
    if name in ("forward_kernel", "backward_kv_kernel", "backward_dq_kernel"):
        return sigs[name] + (hooks_type(dtype) if hooks else types.none,)
    return sigs[name]


_hook_types: dict[str, Any] = {}


def hooks_type(dtype: np.dtype) -> Any:
    """numba's type of the mods' hooks (``modhooks``) for ``dtype``: a tuple of three first-class functions,
    (tile_state, mod_scores, zero_hidden), with the argument types the kernels call them with."""
    name = np.dtype(dtype).name
    found = _hook_types.get(name)
    if found is None:
        block = types.Array(numba.from_dtype(np.dtype(dtype)), 2, "C")
        vis, states = types.Array(types.boolean, 2, "C"), types.Array(types.int8, 4, "A")
        i64, flag = types.int64, types.boolean
        with warnings.catch_warnings():   # numba calls a tuple of first-class functions experimental
            warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
            found = _hook_types[name] = types.Tuple((
                types.FunctionType(i64(states, vis, i64, i64, i64, i64, i64, i64, i64, i64, flag)),
                types.FunctionType(i64(block, vis, block, i64, i64, i64, i64, i64, i64, i64, flag)),
                types.FunctionType(types.none(block, block, vis, i64, i64, flag))))
    return found


def kernel_entry(kernel: Any, dtype: np.dtype, hooks: bool = False) -> Any:
    """The compiled ``kernel`` for ``dtype``, with the argument types of ``_signature``. The first call of a
    process loads the kernel from numba's on-disk cache."""
    key = (kernel, dtype, hooks)
    fn = _entries.get(key)
    if fn is None:
        with _entries_lock:
            fn = _entries.get(key)
            if fn is None:
                with warnings.catch_warnings():   # as in hooks_type
                    warnings.simplefilter("ignore", NumbaExperimentalFeatureWarning)
                    fn = _entries[key] = kernel.compile(_signature(kernel.py_func.__name__, dtype, hooks))
    return fn


# Scratch buffers (packed K/V/Q/dO, dQ accumulators, lse/delta rows) are reused between calls on a thread.
# Fresh multi-MiB numpy buffers are madvised for huge pages, and faulting them in stalled on memory compaction here:
# the (1, 32, 512, 128) forward took a median of 35.9 ms with fresh buffers and 23.0 ms with reused ones (min of
# both ~22.5 ms). Buffers above the cap are not kept: their cost is small next to the O(S^2) work they serve.
# Each calling thread keeps its own until it exits or calls clear_workspace(): up to 2 x the cap after a forward
# (K, V) and 5 x the cap after a backward (Q, K, V, dO, dQ), plus the small lse/delta rows.
WORKSPACE_ENV = "NUMBA_FLASH_CPU_SCRATCH_MIB"


def _workspace_cap_from_env() -> int:
    text = os.environ.get(WORKSPACE_ENV, "").strip()
    try:
        return max(0, int(float(text) * 2**20)) if text else 64 << 20
    except ValueError:
        raise ValueError(f"{WORKSPACE_ENV}: expected a number of MiB, got {text!r}") from None


WORKSPACE_MAX_BYTES = _workspace_cap_from_env()
_workspace = threading.local()


def scratch(slot: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` for use inside one call, backed by this thread's buffer
    for ``slot`` (grown as needed) when it fits ``WORKSPACE_MAX_BYTES``."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffers = _workspace.__dict__.setdefault("buffers", {})
    if slot in buffers and buffers[slot].nbytes > WORKSPACE_MAX_BYTES:  # kept under a larger cap set since
        del buffers[slot]
    if nbytes > WORKSPACE_MAX_BYTES:
        return np.empty(shape, dtype)
    buf = buffers.get(slot)
    if buf is None or buf.nbytes < nbytes:
        buf = buffers[slot] = np.empty(max(nbytes, 1), np.uint8)
    return buf[:nbytes].view(dtype).reshape(shape)


def clear_workspace() -> None:
    """Free the scratch buffers this thread keeps between calls (at most ``WORKSPACE_MAX_BYTES`` each)."""
    _workspace.__dict__.pop("buffers", None)


def set_workspace_limit(nbytes: int) -> int:
    """Keep scratch buffers of at most ``nbytes`` each between calls (0: keep none); returns the previous limit.
    This thread's larger buffers are freed now, other threads' on their next call. The default is 64 MiB, or
    ``NUMBA_FLASH_CPU_SCRATCH_MIB`` when set at import."""
    global WORKSPACE_MAX_BYTES
    if nbytes < 0:
        raise ValueError(f"nbytes: expected >= 0, got {nbytes}")
    previous, WORKSPACE_MAX_BYTES = WORKSPACE_MAX_BYTES, int(nbytes)
    buffers = _workspace.__dict__.get("buffers", {})
    for slot in [s for s, b in buffers.items() if b.nbytes > WORKSPACE_MAX_BYTES]:
        del buffers[slot]
    return previous


def workspace_bytes() -> int:
    """Bytes of scratch this thread keeps between calls."""
    return sum(b.nbytes for b in _workspace.__dict__.get("buffers", {}).values())


def head_major(x: np.ndarray, head_dim: int, slot: str) -> np.ndarray:
    """A (B, S, H, D_pad) view of a C-contiguous (B, H, S, D_pad) buffer holding ``x`` (zero-padded to D_pad = D
    rounded up to 16): ``x`` itself when it already is one (a contiguous "bhsd" array, or "bshd" with H = 1), else a
    copy, in this thread's scratch buffer ``slot``.

    The kernels read K, V, Q and dO rows in place as micro-kernel operands. Head-major rows make a tile one
    contiguous block; in "bshd" a tile's rows sit H * D * 4 bytes apart, a power of two for the usual sizes, which
    maps them onto a few L1 sets and made the products about 1.4x slower in a microbenchmark (2 cores, D = 64,
    H = 8). The copy is O(B * H * S * D) against O(S^2) work: about 0.4 ms per 8 MiB here, on two threads."""
    t = x.transpose(0, 2, 1, 3)
    if t.flags.c_contiguous and head_dim % D_ALIGN == 0:
        return x
    batch, seqlen, nheads, _ = x.shape
    buf = scratch(slot, (batch, nheads, seqlen, _padded(head_dim, D_ALIGN)), x.dtype)
    kernel_entry(_pack_kernel, x.dtype)(x, buf, head_dim, x.strides[3] == x.itemsize)
    return buf.transpose(0, 2, 1, 3)


def kernel_options(seqlen_q: int, seqlen_k: int, window_left: int, window_right: int, softcap: float,
                   dtype: np.dtype) -> tuple[int, int, float]:
    """Window bounds and softcap as the kernels take them: bounds capped at Sq + Sk (the same mask, and int64
    arithmetic that cannot overflow), the softcap as ``semantics.effective_softcap`` defines it for ``dtype``.
    ``validate_forward`` has done both for calls through a backend; this covers direct calls."""
    left, right = (clamp_window_bound(int(w), seqlen_q, seqlen_k) for w in (window_left, window_right))
    return left, right, effective_softcap(float(softcap), np.dtype(dtype).name)


def score_scale(scale: float, softcap: float) -> float:
    """The factor the forward multiplies Q by (``qscale`` in ``forward_kernel``)."""
    return float(scale)


def check_dtypes(*arrays: np.ndarray) -> np.dtype:
    dtype = arrays[0].dtype
    if dtype not in (np.float32, np.float64) or any(a.dtype != dtype for a in arrays):
        raise TypeError(f"numba_flash.cpu kernels need all arrays float32 or all float64, got "
                        f"{sorted({str(a.dtype) for a in arrays})}")
    return dtype


_NO_SLOPES = np.zeros((0, 0))


def kernel_slopes(alibi: np.ndarray | None) -> np.ndarray:
    """ALiBi slopes as the kernels take them: (B, Hq) float64, or a (0, 0) array for none."""
    return _NO_SLOPES if alibi is None else np.asarray(alibi, dtype=np.float64)


def bias_view(attn_bias: np.ndarray | None, q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """attn_bias as the kernels take it: a read-only view broadcast to (B, Hq, Sq, Sk) (stride 0 along the
    broadcast dimensions, so no copy), or a (0, 0, 0, 0) array for none. q (B, Sq, Hq, D), k (B, Sk, Hkv, D)."""
    if attn_bias is None:
        return np.zeros((0, 0, 0, 0), q.dtype)
    if attn_bias.dtype != q.dtype:
        raise TypeError(f"attn_bias has dtype {attn_bias.dtype}, the kernels' is {q.dtype}")
    return np.broadcast_to(attn_bias, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))


_NO_DROPOUT = np.zeros(0)


def dropout_args(dropout_p: float, seed: int, batch0: int) -> np.ndarray:
    """Dropout as the kernels take it (``tiles.dropout_block``): float64 (seed_lo, seed_hi, threshold,
    1 / (1 - p), batch0), every value an integer below 2**33 or the scale, so exact; an empty array for p = 0."""
    if not dropout_p:
        return _NO_DROPOUT
    from ..dropout import dropout_scale, dropout_threshold, split_seed

    return np.array([*split_seed(seed), dropout_threshold(dropout_p), dropout_scale(dropout_p), batch0], np.float64)


# Recompile when any file the kernels inline from changes, not only this one (see cache_stamp).
stamp_kernels(globals())
