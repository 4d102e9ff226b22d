"""The baselines ``numba-flash bench --compare`` times the backends against.

``naive``        numpy on the host: softmax(q k^T * scale) v with the whole (B, H, Sq, Sk) score matrix in memory
                 (``numba_flash.reference.naive_attention_numpy``), and its textbook backward.
``torch``        ``torch.nn.functional.scaled_dot_product_attention`` on torch's default device (CUDA if present).
``torch_naive``  the same textbook attention written in torch, on the same device: the GPU's naive baseline.

Every peer computes in the benchmark's dtype, like the user code it stands for. torch is imported inside functions.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .reference import naive_attention_numpy
from .semantics import default_scale, visible_mask

PEERS = ("naive", "torch", "torch_naive")


def _bhsd(a: Any, layout: str) -> Any:
    """A (B, H, S, D) view of a numpy array or torch tensor in ``layout``; no copy."""
    if layout == "bhsd":
        return a
    return a.transpose(0, 2, 1, 3) if isinstance(a, np.ndarray) else a.transpose(1, 2)


def _repeat_kv(k: Any, group: int) -> Any:
    """Naive attention needs one key/value head per query head: repeat each KV head ``group`` times (a copy,
    exactly what a textbook GQA implementation pays)."""
    if group == 1:
        return k
    return np.repeat(k, group, axis=1) if isinstance(k, np.ndarray) else k.repeat_interleave(group, dim=1)


def naive_forward_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, layout: str) -> np.ndarray:
    """Textbook attention in the inputs' dtype.

    q: (B, Sq, Hq, D) for "bshd" or (B, Hq, Sq, D) for "bhsd"; k, v: (B, Sk, Hkv, D) / (B, Hkv, Sk, D);
    float32 or float16. Returns out shaped and typed like q (a transposed view for "bshd").
    """
    qh, kh, vh = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    group = qh.shape[1] // kh.shape[1]
    out = naive_attention_numpy(qh, _repeat_kv(kh, group), _repeat_kv(vh, group), causal=causal)
    return _bhsd(out, layout)


def naive_backward_numpy(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool,
                         layout: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Textbook backward: recomputes the (B, H, Sq, Sk) probabilities and keeps dP and dS of the same size.

    dout, q: (B, Sq, Hq, D) / (B, Hq, Sq, D); k, v: (B, Sk, Hkv, D) / (B, Hkv, Sk, D); float32 or float16.
    Returns dq, dk, dv shaped like q, k, v, in their dtype (dk, dv summed over each group of query heads).
    """
    qh, kh, vh, doh = (_bhsd(x, layout) for x in (q, k, v, dout))
    hkv = kh.shape[1]
    group = qh.shape[1] // hkv
    kr, vr = _repeat_kv(kh, group), _repeat_kv(vh, group)
    scale = np.asarray(default_scale(qh.shape[-1]), dtype=q.dtype)
    s = np.matmul(qh, np.swapaxes(kr, -1, -2)) * scale
    if causal:
        s = np.where(visible_mask(s.shape[-2], s.shape[-1], -1, 0), s, -np.inf)
    s -= s.max(axis=-1, keepdims=True)
    p = np.exp(s, out=s)
    p /= p.sum(axis=-1, keepdims=True)
    dv = np.matmul(np.swapaxes(p, -1, -2), doh)
    dp = np.matmul(doh, np.swapaxes(vr, -1, -2))
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True)) * scale
    dq = np.matmul(ds, kr)
    dk = np.matmul(np.swapaxes(ds, -1, -2), qh)
    if group > 1:
        b, _, sk, d = dk.shape
        dk = dk.reshape(b, hkv, group, sk, d).sum(axis=2)
        dv = dv.reshape(b, hkv, group, sk, d).sum(axis=2)
    return _bhsd(dq, layout), _bhsd(dk, layout), _bhsd(dv, layout)


def sdpa_torch(q: Any, k: Any, v: Any, causal: bool, layout: str) -> Any:
    """``torch.nn.functional.scaled_dot_product_attention`` on tensors in ``layout`` (torch's own is "bhsd").
    Shapes as in ``naive_forward_numpy``; torch tensors of any float dtype and device. Sq == Sk in every
    benchmark, so torch's top-left causal alignment equals the contract's bottom-right one."""
    import torch.nn.functional as F

    qh, kh, vh = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    gqa = {"enable_gqa": True} if qh.shape[1] != kh.shape[1] else {}
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=default_scale(qh.shape[-1]), **gqa)
    return _bhsd(out, layout)


def naive_torch(q: Any, k: Any, v: Any, causal: bool, layout: str) -> Any:
    """Textbook attention in torch, materialising the (B, H, Sq, Sk) scores. Shapes as in ``sdpa_torch``."""
    import torch

    qh, kh, vh = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    group = qh.shape[1] // kh.shape[1]
    kh, vh = _repeat_kv(kh, group), _repeat_kv(vh, group)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * default_scale(qh.shape[-1])
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        mask = torch.ones(sq, sk, dtype=torch.bool, device=s.device).tril(sk - sq)
        s = s.masked_fill(~mask, float("-inf"))
    return _bhsd(torch.matmul(torch.softmax(s, dim=-1), vh), layout)
