"""The torch path's backward: per (query block, key block), P recomputed from the forward's lse as exp(s - lse),
never S x S; dq accumulated per query block, dk and dv (and dbias) per key block, in float32 (float64 for float64).
"""

from __future__ import annotations

from typing import Any

from numba_flash.validation import AttentionCall

from . import blocks, scores
from .blocks import (Band, block_visible, compute_dtype, dropout_factors, grouped_view, heads_view, lse_view,
                     nan_if_not_finite_, visible_matmul)
from .scores import ScoreTerms


def backward_blockwise(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any,
                       call: AttentionCall, careful: bool = True) -> tuple[Any, ...]:
    """Blockwise backward from the forward's lse: P is recomputed per block as exp(s - lse), never S x S.

    dout, out, q: (B, Sq, Hq, D) ["bshd"] or (B, Hq, Sq, D); k, v: (B, Sk, Hkv, D) or (B, Hkv, Sk, D); lse
    (B, Hq, Sq). Returns dq, dk, dv shaped like q, k, v, contiguous, q's dtype; dk, dv summed over each group; with
    ``call.return_dbias`` also dbias shaped like the bias, in the bias's dtype.
    With ``careful`` (inputs or lse not finite), P and dS are forced to 0 where a row does not see a key (a
    poisoned row's lse is NaN, and exp(-inf - nan) is NaN) and no product lets a non-finite row reach those pairs.
    """
    import torch

    cdt = compute_dtype(q.dtype)
    B, Hkv, D, Dv, g = call.batch, call.nheads_kv, call.head_dim, call.head_dim_v, call.group_size
    dev = q.device
    dq = torch.empty(q.shape, dtype=q.dtype, device=dev)
    dk_acc = torch.zeros((B, Hkv, call.seqlen_k, D), dtype=cdt, device=dev)
    dv_acc = torch.zeros((B, Hkv, call.seqlen_k, Dv), dtype=cdt, device=dev)
    qv, dqv = grouped_view(q, call.layout, Hkv), grouped_view(dq, call.layout, Hkv)
    dov, ov = grouped_view(dout, call.layout, Hkv), grouped_view(out, call.layout, Hkv)
    lv = lse_view(lse, Hkv)
    kv, vv = heads_view(k, call.layout), heads_view(v, call.layout)
    band = Band(call)
    terms = ScoreTerms(call, cdt, dev)
    dbias = terms.bias.new_grad(cdt, dev) if call.return_dbias else None
    block_q, block_k = blocks.block_sizes(call)
    for q0 in range(0, call.seqlen_q, block_q):
        q1 = min(q0 + block_q, call.seqlen_q)
        rows = (q1 - q0) * g
        qb = (qv[:, :, q0:q1].to(cdt) * call.softmax_scale).reshape(B, Hkv, rows, D)
        dob = dov[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows, Dv)
        delta = (dob * ov[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows, Dv)).sum(dim=-1)
        lse_b = lv[:, :, q0:q1].to(cdt).reshape(B, Hkv, rows)
        dq_acc = torch.zeros((B, Hkv, rows, D), dtype=cdt, device=dev)
        for k0, k1, need_mask in band.key_blocks(q0, q1, block_k):
            kb, vb = kv[:, :, k0:k1].to(cdt), vv[:, :, k0:k1].to(cdt)
            keep = terms.keep(q0, q1, k0, k1, qb)
            if keep is not None and not bool(keep.any()):
                continue
            s, dcap, hidden, dmod = scores.block_scores(qb, kb, call, band, q0, q1, k0, k1, need_mask, careful, terms,
                                                        keep, grad=True)
            # lse is +inf on rows that see nothing: exp(s - inf) = 0 there, so those rows add no gradient.
            p = s.sub_(lse_b[..., None]).exp_()
            careful_block = careful and (need_mask or hidden is not None)
            if careful_block:
                vis = block_visible(band, q0, q1, k0, k1, g, dev, hidden)
                p.masked_fill_(~vis, 0.0)
            # With dropout out = (P * drop) V: dV takes the dropped P, dP the factors, and delta = dout . out is
            # still sum_j P dP.
            drop = dropout_factors(call, q0, q1, k0, k1, cdt, dev)
            p_out = p if drop is None else p * drop
            if careful_block:
                dv_acc[:, :, k0:k1] += visible_matmul(p_out.transpose(-1, -2), dob, vis.transpose(-1, -2))
            else:
                dv_acc[:, :, k0:k1] += p_out.transpose(-1, -2) @ dob
            dp = dob @ vb.transpose(-1, -2)
            if drop is not None:
                dp.mul_(drop)
            ds = dp.sub_(delta_where_p_is_one(p, dp, delta)[..., None]).mul_(p)
            if dmod is not None:
                ds.mul_(dmod)  # through score_mod, to the biased score
            if careful_block:
                ds.masked_fill_(~vis, 0.0)
            elif hidden is not None:
                ds.masked_fill_(hidden, 0.0)
            if dbias is not None:
                # The bias enters after softcap: its gradient is the score's, before softcap's chain factor.
                terms.bias.add_grad(dbias, ds, q0, q1, k0, k1)
            if dcap is not None:
                # tanh of a NaN raw score is NaN: 0 instead, so that a masked pair's dS stays 0 (a visible one's P is
                # NaN already, its row poisoned)
                ds.mul_(dcap.nan_to_num_(0.0))
            if careful_block:
                dq_acc += visible_matmul(ds, kb, vis)
                dk_acc[:, :, k0:k1] += visible_matmul(ds.transpose(-1, -2), qb, vis.transpose(-1, -2))
            else:
                dq_acc += ds @ kb
                # qb carries the softmax scale, so this is scale * dS^T q; summing the g rows of a group sums the
                # heads.
                dk_acc[:, :, k0:k1] += ds.transpose(-1, -2) @ qb
        dqv[:, :, q0:q1] = nan_if_not_finite_(dq_acc * call.softmax_scale).view(B, Hkv, q1 - q0, g, D)
    dk = torch.empty(k.shape, dtype=k.dtype, device=dev)
    dv = torch.empty(v.shape, dtype=v.dtype, device=dev)
    heads_view(dk, call.layout).copy_(nan_if_not_finite_(dk_acc))
    heads_view(dv, call.layout).copy_(nan_if_not_finite_(dv_acc))
    if dbias is None:
        return dq, dk, dv
    return dq, dk, dv, nan_if_not_finite_(dbias).reshape(tuple(call.bias.array.shape)).to(terms.bias.grouped.dtype)


def delta_where_p_is_one(p: Any, dp: Any, delta: Any) -> Any:
    """delta (B, Hkv, rows) for one block of P and dP (B, Hkv, rows, keys), with dP itself on the rows where P
    is exactly 1 at some key of the block.

    A row that sees one key has P = 1 and dS = P (dP - dO . O) = 0 exactly, since O = v; but dO . O, summed
    elementwise, and the matmul's dP = dO . v add the same products in different orders, which left dq and dk of
    1e-6 there (issue 47). torch's softmax backward forms delta as sum_j P dP, which is exactly dP on such a row,
    and so is this. Where P is 1 beside other keys whose P underflows or is below 2^-24, that delta differs from
    dO . O by at most 2^-23 |dP|, under the rounding of dO . O itself. Only the rows that have such a 1 pay more
    than the one read of P (amax); on a GPU the test costs one host synchronisation per block."""
    import torch

    one = p.amax(dim=-1) == 1.0   # NaN (a poisoned row) compares False
    if not bool(one.any()):
        return delta
    # P sums to 1, so a row's 1 is its only entry past 1/2: argmax finds it. Only those rows are read again.
    p_one, dp_one = p[one], dp[one]
    fixed = delta.clone()
    fixed[one] = torch.gather(dp_one, -1, p_one.argmax(dim=-1, keepdim=True)).squeeze(-1)
    return fixed


__all__ = ["backward_blockwise"]
