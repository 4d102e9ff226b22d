"""Float64 numpy attention: the oracle every test and every accuracy figure is measured against.

It is written for clarity, not speed, and does build the ``(Sq, Sk)`` score matrix, one (batch, head) at a time.
Every semantic of the contract is here: bottom-right causal alignment, sliding windows, softcap, GQA/MQA, the
log-sum-exp, and rows that see no key (output 0, ``lse = +inf``, gradient 0).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import as_float64
from .semantics import default_scale, effective_window, visible_mask


def _to_bshd(x: Any, layout: str) -> np.ndarray:
    a = as_float64(x)
    return a.transpose(0, 2, 1, 3) if layout == "bhsd" else a


def _from_bshd(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3) if layout == "bhsd" else a)


def _scores(qh: np.ndarray, kh: np.ndarray, scale: float, softcap: float) -> tuple[np.ndarray, np.ndarray]:
    """Scores (Sq, Sk) after softcap, and d(score)/d(raw score) for the backward."""
    raw = scale * (qh @ kh.T)
    if softcap > 0:
        t = np.tanh(raw / softcap)
        return softcap * t, 1.0 - t * t
    return raw, np.ones_like(raw)


def attention_ref(
    q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str = "bshd",
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention in float64.

    Arguments:
        q: (B, Sq, Hq, D) for layout "bshd", (B, Hq, Sq, D) for "bhsd"; any float dtype, any array kind.
        k, v: (B, Sk, Hkv, D) / (B, Hkv, Sk, D), with Hq % Hkv == 0.
    Returns:
        out: float64, shaped like q.
        lse: (B, Hq, Sq) float64, natural log of the sum of exp(score) over visible keys; +inf for a row that sees
            no key.
    """
    qb, kb, vb = _to_bshd(q, layout), _to_bshd(k, layout), _to_bshd(v, layout)
    batch, sq, hq, d = qb.shape
    sk, hkv = kb.shape[1], kb.shape[2]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    left, right = effective_window(causal, window_size)
    mask = visible_mask(sq, sk, left, right)
    group = hq // hkv
    out = np.zeros((batch, sq, hq, d))
    lse = np.full((batch, hq, sq), np.inf)
    for b in range(batch):
        for h in range(hq):
            s, _ = _scores(qb[b, :, h], kb[b, :, h // group], scale, softcap)
            s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            seen = np.isfinite(m[:, 0])
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            out[b, :, h] = np.where(seen[:, None], (p @ vb[b, :, h // group]) / np.where(total > 0, total, 1.0), 0.0)
            lse[b, h] = np.where(seen, m[:, 0] + np.log(np.where(seen, total[:, 0], 1.0)), np.inf)
    return _from_bshd(out, layout), lse


def attention_ref_backward(
    dout: Any, q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str = "bshd",
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``sum(attention_ref(q, k, v) * dout)`` in float64.

    Arguments are shaped as in ``attention_ref``; dout is shaped like q.
    Returns dq, dk, dv (float64), shaped like q, k, v; with GQA, dk and dv are summed over each group's query heads.
    """
    qb, kb, vb, dob = (_to_bshd(x, layout) for x in (q, k, v, dout))
    batch, sq, hq, d = qb.shape
    sk, hkv = kb.shape[1], kb.shape[2]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    left, right = effective_window(causal, window_size)
    mask = visible_mask(sq, sk, left, right)
    group = hq // hkv
    dq, dk, dv = np.zeros_like(qb), np.zeros_like(kb), np.zeros_like(vb)
    for b in range(batch):
        for h in range(hq):
            kv = h // group
            qh, kh, vh, doh = qb[b, :, h], kb[b, :, kv], vb[b, :, kv], dob[b, :, h]
            s, dcap = _scores(qh, kh, scale, softcap)
            s = np.where(mask, s, -np.inf)
            m = s.max(axis=1, keepdims=True)
            m = np.where(np.isfinite(m), m, 0.0)
            p = np.exp(s - m)
            total = p.sum(axis=1, keepdims=True)
            p = p / np.where(total > 0, total, 1.0)  # rows that see nothing stay all-zero
            dv[b, :, kv] += p.T @ doh
            dp = doh @ vh.T
            ds = p * (dp - (dp * p).sum(axis=1, keepdims=True)) * dcap * scale
            dq[b, :, h] = ds @ kh
            dk[b, :, kv] += ds.T @ qh
    return _from_bshd(dq, layout), _from_bshd(dk, layout), _from_bshd(dv, layout)


def naive_attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False) -> np.ndarray:
    """The textbook peer: softmax(q k^T * scale) v in the input's dtype, materialising (B, H, Sq, Sk) at once.
    Layout "bhsd", Hq == Hkv. Used by benchmarks as the baseline a flash kernel must beat in time and memory."""
    scale = default_scale(q.shape[-1])
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * np.asarray(scale, dtype=q.dtype)
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        s = np.where(visible_mask(sq, sk, -1, 0), s, -np.inf)
    s = s - s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return np.matmul(s, v)
