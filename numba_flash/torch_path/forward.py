"""The torch path's forward: an online softmax over query blocks and key blocks in Python loops, running max and
sum in float32 (float64 for float64 inputs), at most one block of scores alive per head, and key blocks outside the
causal/window band never computed. ``blockwise_into`` adapts it to the packed-sequence and KV-cache drivers.

``block_sizes`` and ``block_scores`` are looked up on their modules at each call, so that a test can substitute
small blocks or watch the blocks go by.
"""

from __future__ import annotations

from typing import Any

from numba_flash.validation import AttentionCall

from . import blocks, scores
from .blocks import (Band, block_visible, compute_dtype, dropout_factors, grouped_view, heads_view, lse_view,
                     nan_if_not_finite_, visible_matmul)
from .scores import ScoreTerms


def forward_blockwise(q: Any, k: Any, v: Any, call: AttentionCall, careful: bool = True) -> tuple[Any, Any]:
    """Blockwise online-softmax forward.

    q: (B, Sq, Hq, D) ["bshd"] or (B, Hq, Sq, D) ["bhsd"]; k: (B, Sk, Hkv, D) or (B, Hkv, Sk, D); v likewise with
    head dim Dv; torch tensors of one dtype on one device, any strides. Returns out shaped like q with head dim Dv,
    contiguous, q's dtype, and lse
    (B, Hq, Sq) float32 (float64 for float64 inputs), +inf for rows that see no key, NaN for poisoned rows.
    ``careful=False`` skips the non-finite handling, for inputs known to be ``inputs_clean``.
    """
    import torch

    cdt = compute_dtype(q.dtype)
    B, Hkv, D, Dv, g = call.batch, call.nheads_kv, call.head_dim, call.head_dim_v, call.group_size
    out = torch.empty(q.shape[:-1] + (Dv,), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, call.nheads_q, call.seqlen_q), dtype=cdt, device=q.device)
    qv, ov, lv = grouped_view(q, call.layout, Hkv), grouped_view(out, call.layout, Hkv), lse_view(lse, Hkv)
    kv, vv = heads_view(k, call.layout), heads_view(v, call.layout)
    band = Band(call)
    terms = ScoreTerms(call, cdt, q.device)
    block_q, block_k = blocks.block_sizes(call)
    for q0 in range(0, call.seqlen_q, block_q):
        q1 = min(q0 + block_q, call.seqlen_q)
        rows = (q1 - q0) * g
        qb = (qv[:, :, q0:q1].to(cdt) * call.softmax_scale).reshape(B, Hkv, rows, D)
        m = torch.full((B, Hkv, rows), float("-inf"), dtype=cdt, device=q.device)
        l = torch.zeros((B, Hkv, rows), dtype=cdt, device=q.device)
        acc = torch.zeros((B, Hkv, rows, Dv), dtype=cdt, device=q.device)
        for k0, k1, need_mask in band.key_blocks(q0, q1, block_k):
            keep = terms.keep(q0, q1, k0, k1, qb)
            if keep is not None and not bool(keep.any()):
                continue  # mask_mod hides every key of the block: it adds nothing
            s, _, hidden, _ = scores.block_scores(qb, kv[:, :, k0:k1].to(cdt), call, band, q0, q1, k0, k1, need_mask,
                                                  careful, terms, keep)
            # amax and maximum propagate NaN: a poisoned row's max, sum and accumulator become NaN and stay so.
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row with every key so far masked keeps max -inf; shift it by 0 so that exp gives 0, not NaN.
            m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)
            p = s.sub_(m_safe[..., None]).exp_()
            alpha = torch.exp(m - m_safe)
            l = l * alpha + p.sum(dim=-1)   # the sum before dropout: lse is the softmax's own
            drop = dropout_factors(call, q0, q1, k0, k1, cdt, q.device)
            if drop is not None:
                p.mul_(drop)
            vb = vv[:, :, k0:k1].to(cdt)
            if careful and (need_mask or hidden is not None):
                pv = visible_matmul(p, vb, block_visible(band, q0, q1, k0, k1, g, q.device, hidden))
            else:
                pv = p @ vb
            acc.mul_(alpha[..., None]).add_(pv)
            m = m_new
        # l > 0 is False for a row that saw no key (l = 0) and for a poisoned one (l = NaN); only the first is
        # 0 with lse = +inf.
        seen = l > 0
        poisoned = torch.isnan(l)
        l_safe = torch.where(seen, l, torch.ones_like(l))
        o = acc / l_safe[..., None]
        if careful:
            nan_if_not_finite_(o.masked_fill_(poisoned[..., None], float("nan")))
        ov[:, :, q0:q1] = o.view(B, Hkv, q1 - q0, g, Dv)
        m_fin = m.masked_fill(~seen, 0.0)
        row_lse = torch.where(seen, m_fin + torch.log(l_safe), float("inf")).masked_fill_(poisoned, float("nan"))
        lv[:, :, q0:q1] = row_lse.view(B, Hkv, q1 - q0, g)
    return out, lse


def blockwise_into(careful: bool) -> Any:
    """``run(call, q, k, v, out, lse)`` for the varlen and KV-cache drivers: ``forward_blockwise`` on one dense
    call's views, its results copied into ``out`` and ``lse``."""
    def run(c: AttentionCall, q_b: Any, k_b: Any, v_b: Any, out_b: Any, lse_b: Any) -> None:
        o, l = forward_blockwise(q_b, k_b, v_b, c, careful=careful)
        out_b.copy_(o)
        lse_b.copy_(l)

    return run



__all__ = ["forward_blockwise", "blockwise_into"]
