"""Tiny calls on one thread, forward and backward: decode steps (Sq = 1), short sequences, small heads.

The tiled kernels (``forward``) pay for their shape on such calls: a query tile is ``BLOCK_M`` = 64 rows however
few are real, so a decode step computes 64x the products it needs; K and V are packed head-major first; and each
of the two is a parallel region. Below ``TINY_WORK`` multiply-adds a plain loop nest on the calling thread is
faster than all of that (issue 44: 1 x 16 keys x 8 heads went from ~100 us in the kernel to a few us), so
``tiny_forward`` serves those calls: one row at a time, its visible scores, then the exact softmax over them,
reading q, k and v in place with any strides. No parallel region, so no thread pool is woken (and none competes
with torch's).

Semantics are the tiled kernel's (``numba_flash.reference.attention_ref``): scores ``scale * q.k``, then softcap,
then ALiBi; bottom-right aligned causal/window bounds; a row that sees no key gets 0 and lse = +inf; a visible
score that is not finite (a NaN or inf in q or in a visible k row, or a product that overflows) makes the row's
out and lse NaN; a non-finite v row that a row sees makes that row's out non-finite, written as NaN. The exponents
and sums run in float64, so the result is at least as accurate as the tiled kernel's; the scaled scores are
rounded to the inputs' dtype first, so that a score float32 cannot hold poisons its row as in the tiled kernel.
Calls with attn_bias, mods or dropout go to the tiled kernels (``fits_tiny``). ``tiny_backward`` is the same loop
nest for the gradients (FlashAttention-2's formulas per row; see ``tiny_backward_kernel``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numba
import numpy as np
from numba import njit, types

from .simd import as_dtype_of

# Multiply-adds (B * Hq * Sq * Sk * (D + Dv)) up to which ``tiny_forward`` beats the tiled kernel on this class of
# machine; measured on 2 cores (AMD EPYC, AVX2): 1 x 16 keys, 8 heads, D = 64 is 16k; Sq = Sk = 64 (2.1M) is the
# tiled kernel's. Past ~0.5M the loop nest, which reads each k row once per query row, loses to the tiles.
TINY_WORK = 1 << 19


@njit(fastmath={"contract", "reassoc"}, cache=True)
def tiny_forward_kernel(q, k, v, out, lse, scale, left, right, softcap, alibi, heads_first):
    """Exact attention forward, written into out and lse; serial.

    q: (B, Sq, Hq, D), k: (B, Sk, Hkv, D), v: (B, Sk, Hkv, Dv), out: (B, Sq, Hq, Dv), or with ``heads_first`` the
    same arrays as (B, H, S, D) ("bhsd"); lse: (B, Hq, Sq). One float dtype (float32 or float64); Hq % Hkv == 0.
    scale > 0; left, right: window bounds, -1 for unbounded (causal is right = 0), already clamped at Sq + Sk;
    softcap: 0 for off; alibi: (B, Hq) float64 slopes, or (0, 0) for none. Rows are read as 1-D views, contiguous
    when the arrays are, so that the head-dim loops vectorise."""
    if heads_first:
        batch, nheads_q, seqlen_q, head_dim = q.shape
        nheads_kv, seqlen_k = k.shape[1], k.shape[2]
    else:
        batch, seqlen_q, nheads_q, head_dim = q.shape
        seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    dv = v.shape[3]
    group = nheads_q // nheads_kv
    shift = seqlen_k - seqlen_q
    zero = as_dtype_of(q, 0.0)   # products summed in the inputs' dtype, as the tiled kernel does
    qscale = as_dtype_of(q, scale)
    scores = np.empty(seqlen_k, np.float64)
    acc = np.empty(dv, np.float64)
    for b in range(batch):
        for h in range(nheads_q):
            hk = h // group
            slope = alibi[b, h] if alibi.shape[0] > 0 else 0.0
            for i in range(seqlen_q):
                q_row = q[b, h, i] if heads_first else q[b, i, h]
                o_row = out[b, h, i] if heads_first else out[b, i, h]
                centre = i + shift
                lo = 0 if left < 0 else max(0, centre - left)
                hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
                if lo >= hi:   # sees no key
                    o_row[:] = 0.0
                    lse[b, h, i] = np.inf
                    continue
                poisoned = False
                m = -np.inf
                for j in range(lo, hi):
                    k_row = k[b, hk, j] if heads_first else k[b, j, hk]
                    dot = zero
                    for d in range(head_dim):
                        dot += q_row[d] * k_row[d]
                    raw = np.float64(dot * qscale)   # in the inputs' dtype: a float32 overflow is inf
                    if not math.isfinite(raw):   # a non-finite q or k, or an overflow: the row is poisoned
                        poisoned = True
                        break
                    s = softcap * math.tanh(raw / softcap) if softcap > 0.0 else raw
                    s -= slope * abs(centre - j)
                    scores[j] = s
                    m = max(m, s)
                if poisoned:
                    o_row[:] = np.nan
                    lse[b, h, i] = np.nan
                    continue
                total = 0.0
                acc[:] = 0.0
                for j in range(lo, hi):
                    v_row = v[b, hk, j] if heads_first else v[b, j, hk]
                    p = math.exp(scores[j] - m)
                    total += p
                    for d in range(dv):
                        acc[d] += p * v_row[d]
                inv = 1.0 / total
                for d in range(dv):
                    o = acc[d] * inv
                    o_row[d] = o if abs(o) < np.inf else np.nan
                lse[b, h, i] = m + math.log(total)


@njit(fastmath={"contract", "reassoc"}, cache=True)
def tiny_backward_kernel(dout, q, k, v, out, lse, dq, dk, dv, scale, left, right, softcap, alibi, eps):
    """Exact attention backward, written into dq, dk and dv; serial. FlashAttention-2's formulas per query row:
    P from the scores (the row's own max and sum, or exp(score - lse) where the given lse is not this row's own:
    ring attention, as ``stash.defer_to_caller_lse`` decides, within 8 ``eps`` of it), delta = dout . out,
    dS = P (dout . v - delta) (times the softcap's derivative), dq = scale dS k, dk = scale dS^T q, dv = P^T dout;
    dk and dv summed over each group's query heads, in float64. A non-finite gradient value is written as NaN.

    dout, q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v, dv: (B, Sk, Hkv, Dv); out: (B, Sq, Hq, Dv); dq like q, dk like
    k; lse: (B, Hq, Sq); any strides, one float dtype. Options as ``tiny_forward_kernel``'s."""
    batch, seqlen_q, nheads_q, head_dim = q.shape
    seqlen_k, nheads_kv, dvh = k.shape[1], k.shape[2], v.shape[3]
    group = nheads_q // nheads_kv
    shift = seqlen_k - seqlen_q
    zero = as_dtype_of(q, 0.0)
    qscale = as_dtype_of(q, scale)
    scores = np.empty(seqlen_k, np.float64)
    cap_grad = np.ones(seqlen_k, np.float64)
    probs = np.empty(seqlen_k, np.float64)
    dq_row = np.empty(head_dim, np.float64)
    dk_acc = np.zeros((batch, seqlen_k, nheads_kv, head_dim), np.float64)
    dv_acc = np.zeros((batch, seqlen_k, nheads_kv, dvh), np.float64)
    for b in range(batch):
        for h in range(nheads_q):
            hk = h // group
            slope = alibi[b, h] if alibi.shape[0] > 0 else 0.0
            for i in range(seqlen_q):
                centre = i + shift
                lo = 0 if left < 0 else max(0, centre - left)
                hi = seqlen_k if right < 0 else min(seqlen_k, centre + right + 1)
                dq_row[:] = 0.0
                poisoned = False
                m = -np.inf
                for j in range(lo, hi):
                    dot = zero
                    for d in range(head_dim):
                        dot += q[b, i, h, d] * k[b, j, hk, d]
                    raw = np.float64(dot * qscale)   # in the inputs' dtype: a float32 overflow is inf
                    if not math.isfinite(raw):
                        poisoned = True
                    if softcap > 0.0:
                        t = math.tanh(raw / softcap)
                        cap_grad[j] = 1.0 - t * t
                        raw = softcap * t
                    scores[j] = raw - slope * abs(centre - j)
                    m = max(m, scores[j])
                if lo < hi:
                    given = np.float64(lse[b, h, i])
                    total = 0.0
                    if not poisoned:
                        for j in range(lo, hi):
                            total += math.exp(scores[j] - m)
                    own = m + math.log(total) if not poisoned else np.nan
                    near = abs(own - given) <= 8.0 * eps * max(1.0, abs(given))
                    for j in range(lo, hi):
                        if poisoned:
                            probs[j] = np.nan
                        elif near:
                            probs[j] = math.exp(scores[j] - m) / total
                        else:   # the caller's softmax (over more keys, or a poisoned row elsewhere)
                            probs[j] = math.exp(scores[j] - given)
                    delta = 0.0
                    for d in range(dvh):
                        delta += np.float64(dout[b, i, h, d]) * np.float64(out[b, i, h, d])
                    for j in range(lo, hi):
                        p = probs[j]
                        dp = 0.0
                        for d in range(dvh):
                            g = np.float64(dout[b, i, h, d])
                            dp += g * v[b, j, hk, d]
                            dv_acc[b, j, hk, d] += p * g
                        ds = p * (dp - delta) * scale
                        if softcap > 0.0:
                            ds *= cap_grad[j]
                        for d in range(head_dim):
                            dq_row[d] += ds * k[b, j, hk, d]
                            dk_acc[b, j, hk, d] += ds * q[b, i, h, d]
                for d in range(head_dim):
                    g = dq_row[d]
                    dq[b, i, h, d] = g if abs(g) < np.inf else np.nan
    for b in range(batch):
        for j in range(seqlen_k):
            for hk in range(nheads_kv):
                for d in range(head_dim):
                    g = dk_acc[b, j, hk, d]
                    dk[b, j, hk, d] = g if abs(g) < np.inf else np.nan
                for d in range(dvh):
                    g = dv_acc[b, j, hk, d]
                    dv[b, j, hk, d] = g if abs(g) < np.inf else np.nan


def tiny_work(batch: int, seqlen_q: int, seqlen_k: int, nheads_q: int, head_dim: int, head_dim_v: int) -> int:
    """Multiply-adds of a dense forward with these sizes, the measure ``TINY_WORK`` bounds."""
    return batch * nheads_q * seqlen_q * seqlen_k * (head_dim + head_dim_v)


def fits_tiny(work: int, has_bias: bool, has_mods: bool, dropout_p: float, packed: bool) -> bool:
    """Whether ``tiny_forward`` serves a forward of ``work`` multiply-adds (``tiny_work``): small enough, and
    none of the features only the tiled kernels have (attn_bias, mods, dropout, packed sequences)."""
    return work <= TINY_WORK and not (has_bias or has_mods or dropout_p or packed)


_NO_SLOPES = np.zeros((0, 0))
_entries: dict[tuple[Any, str, str], Any] = {}
_entries_lock = threading.Lock()
_F64, _I64, _SLOPES = types.float64, types.int64, types.Array(types.float64, 2, "A")
_FORWARD_ARGS = ("4", "4", "4", "4", "3", _F64, _I64, _I64, _F64, _SLOPES, types.boolean)
_BACKWARD_ARGS = ("4",) * 5 + ("3",) + ("4",) * 3 + (_F64, _I64, _I64, _F64, _SLOPES, _F64)


def _entry(kernel: Any, dtype: np.dtype, layout: str) -> Any:
    """``kernel`` (``tiny_forward_kernel`` or ``tiny_backward_kernel``) compiled for ``dtype`` with its 4-d arrays
    of numba ``layout``: "C" for contiguous ones (their rows vectorise: 3x faster at D = 64), "A" for any strides.
    Two compilations per kernel and dtype, kept in numba's disk cache, whatever mix of layouts callers pass."""
    key = (kernel, np.dtype(dtype).char, layout)   # .name would do, but computes a string each call (a microsecond)
    fn = _entries.get(key)
    if fn is None:
        with _entries_lock:
            fn = _entries.get(key)
            if fn is None:
                nb = numba.from_dtype(np.dtype(dtype))
                ranks = {"4": types.Array(nb, 4, layout), "3": types.Array(nb, 3, "A")}
                args = _FORWARD_ARGS if kernel is tiny_forward_kernel else _BACKWARD_ARGS
                fn = _entries[key] = kernel.compile(tuple(ranks.get(a, a) if isinstance(a, str) else a
                                                          for a in args))
    return fn


def tiny_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray,
                  dq: np.ndarray, dk: np.ndarray, dv: np.ndarray, scale: float, window_left: int, window_right: int,
                  softcap: float, alibi: np.ndarray | None = None) -> None:
    """Attention backward on the calling thread, written into dq, dk and dv (``tiny_backward_kernel``).

    dout, q, dq: (B, Sq, Hq, D / Dv); k, dk: (B, Sk, Hkv, D); v, dv: (B, Sk, Hkv, Dv); out: (B, Sq, Hq, Dv);
    lse: (B, Hq, Sq) as the forward wrote it; (B, S, H, D) views with any strides, all float32 or all float64.
    Options as ``tiny_forward``'s. Inputs not modified."""
    contiguous = all(x.flags.c_contiguous for x in (dout, q, k, v, out, dq, dk, dv))
    slopes = _NO_SLOPES if alibi is None else alibi
    _entry(tiny_backward_kernel, q.dtype, "C" if contiguous else "A")(
        dout, q, k, v, out, lse, dq, dk, dv, float(scale), int(window_left), int(window_right), float(softcap),
        slopes, float(np.finfo(q.dtype).eps))


def tiny_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray, scale: float,
                 window_left: int, window_right: int, softcap: float, alibi: np.ndarray | None = None,
                 layout: str = "bshd") -> None:
    """Attention forward on the calling thread, written into ``out`` and ``lse``.

    q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); out: (B, Sq, Hq, Dv) for layout "bshd", each
    (B, H, S, D) for "bhsd"; lse: (B, Hq, Sq); any strides, all float32 or all float64; not modified (but out and
    lse). scale multiplies q.k; window bounds as validated (-1 unbounded, clamped at Sq + Sk); softcap as
    ``semantics.effective_softcap`` gives it (0 = off); alibi: None or (B, Hq) float64 slopes."""
    slopes = _NO_SLOPES if alibi is None else alibi
    heads_first = layout == "bhsd"
    contiguous = q.flags.c_contiguous and k.flags.c_contiguous and v.flags.c_contiguous and out.flags.c_contiguous
    if not contiguous and heads_first:   # the "A" entry takes (B, S, H, D) views
        q, k, v, out = (x.transpose(0, 2, 1, 3) for x in (q, k, v, out))
        heads_first = False
    _entry(tiny_forward_kernel, q.dtype, "C" if contiguous else "A")(
        q, k, v, out, lse, float(scale), int(window_left), int(window_right), float(softcap), slopes, heads_first)
