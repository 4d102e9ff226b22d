"""Float64 numpy attention: the oracle every test and every accuracy figure is measured against.

It is written for clarity, not speed, and does build the ``(Sq, Sk)`` score matrix, one (batch, head) at a time.
Every semantic of the contract is here: bottom-right causal alignment, sliding windows, softcap, GQA/MQA, the
log-sum-exp, rows that see no key (output 0, ``lse = +inf``, gradient 0), and non-finite values, which are never
hidden:

* A row that sees a key whose score is not finite (a NaN or +-inf in q row i or in the row of any key it sees, or a
  score that overflows) is poisoned: its output row and lse are NaN, and so are its probabilities wherever it sees
  a key. With softcap, the raw score ``scale * q.k`` decides (``tanh(inf) = 1`` would hide an infinity).
* Every product runs over visible (row, key) pairs only: a key a row does not see adds nothing to it, even where
  the key's value row is not finite (a plain matrix product would add ``0 * nan = nan``).
* Every non-finite result (out, dq, dk, dv) is reported as NaN; lse is NaN for a poisoned row and +inf for a row
  that sees no key (which stays 0 whatever its q holds: it reads nothing).

An additive bias (``attn_bias``, ALiBi, ``bias_mod``) enters after softcap, then ``score_mod``; a -inf bias, or a
score_mod that turns a finite score into -inf, hides its key exactly as a mask (``mask_mod`` too) does, so a row
whose keys are all hidden sees nothing. ``attention_ref_backward(..., return_dbias=True)`` gives the bias's
gradient. The mods (``numba_flash.mods``) are called here as the plain Python functions they are, one element at a
time, never through numba. Dropout (``dropout_p``, ``dropout_seed``) multiplies the probabilities after the
softmax by the factors of ``numba_flash.dropout_mask``; the lse stays that of the softmax before dropout.

Packed sequences (layout "thd") have functions of their own, ``attention_ref_varlen`` and its backward: the same
rules hold within each sequence, and nothing crosses from one sequence to another. Their ``block_table`` reads
the keys from paged caches (``reference_pages``).

The backward is the chain rule through exactly these operations, so a gradient is NaN where it depends on a
non-finite value and equal to the clean run's elsewhere (dv, which does not depend on v, stays finite for a NaN in
v; the rows that see it get NaN dq and dk, through ``delta = dout . out``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arguments import checked_arguments
from .arrays import as_float64, to_numpy
from .reference_pages import page_grads_ref, unpage_ref
from .semantics import default_scale, effective_window, packed_visible_mask, visible_mask


def _to_bshd(x: Any, layout: str) -> np.ndarray:
    a = as_float64(x)
    return a.transpose(0, 2, 1, 3) if layout == "bhsd" else a


def _from_bshd(a: np.ndarray, layout: str) -> np.ndarray:
    return np.ascontiguousarray(a.transpose(0, 2, 1, 3) if layout == "bhsd" else a)


def _nan_if_not_finite(a: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(a), a, np.nan)


def _scores(qh: np.ndarray, kh: np.ndarray, scale: float, softcap: float) -> tuple[np.ndarray, np.ndarray]:
    """Scores (Sq, Sk) after softcap, NaN where the raw score is not finite, and d(score)/d(raw score)."""
    raw = scale * (qh @ kh.T)
    if softcap > 0:
        t = np.tanh(raw / softcap)
        return np.where(np.isfinite(raw), softcap * t, np.nan), 1.0 - t * t
    return raw, np.ones_like(raw)


def _visible_matmul(a: np.ndarray, b: np.ndarray, vis: np.ndarray) -> np.ndarray:
    """``sum_j a[i, j] * b[j]`` over the j with ``vis[i, j]``; ``a`` is 0 wherever ``vis`` is False. Equal to
    ``a @ b`` except that a non-finite row of b reaches only the rows that see it."""
    bad = ~np.isfinite(b).all(axis=1)
    if not bad.any():
        return a @ b
    res = a @ np.where(bad[:, None], 0.0, b)
    for j in np.flatnonzero(bad):
        rows = vis[:, j]
        res[rows] += a[rows, j, None] * b[j]
    return res


def _probabilities(qh, kh, scale, softcap, mask, bias=None, score_mod=None):
    """(P, d score / d raw, d score' / d score, poisoned rows, m, total, mask): P (Sq, Sk) normalised, 0 where a row
    does not see a key and NaN where a poisoned row does; m and total are the max and the sum of exp(s - m) of the
    rows that are not. ``bias`` (Sq, Sk) is added after softcap; where it is -inf the key is hidden, exactly as a
    mask hides it, so the mask returned is ``mask`` without those pairs. ``score_mod(s) -> (s', d s' / d s)`` then
    changes the finite scores; a -inf it returns hides the key too."""
    s, dcap = _scores(qh, kh, scale, softcap)
    dmod = 1.0
    if bias is not None:
        mask = mask & (bias != -np.inf)
        s = s + np.where(mask, bias, 0.0)
    if score_mod is not None:
        fin = np.isfinite(s)
        modded, dmod = score_mod(np.where(fin, s, 0.0))
        mask = mask & ~(fin & (modded == -np.inf))
        s = np.where(fin, modded, s)
    poisoned = (mask & ~np.isfinite(s)).any(axis=1)
    s = np.where(mask & ~poisoned[:, None], s, -np.inf)
    m = s.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m[:, None])
    total = p.sum(axis=1)
    p = p / np.where(total > 0, total, 1.0)[:, None]
    p = np.where(poisoned[:, None] & mask, np.nan, p)
    return p, dcap, dmod, poisoned, m, total, mask


# NaN and inf are propagated on purpose (see the module docstring); numpy's warnings about them are noise here.
_QUIET = dict(invalid="ignore", over="ignore")


def _forward_head(qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, scale: float, softcap: float,
                  mask: np.ndarray, bias: np.ndarray | None = None, score_mod: Any = None,
                  drop: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One head: qh (Sq, D), kh (Sk, D) and vh (Sk, Dv) float64, mask (Sq, Sk) bool, bias (Sq, Sk) float64 or
    None, score_mod as for ``_probabilities``, drop (Sq, Sk) float64 dropout factors (0 or 1 / (1 - p)) or None.
    Returns out (Sq, Dv) and lse (Sq,): the lse of the softmax before dropout."""
    p, _, _, poisoned, m, total, mask = _probabilities(qh, kh, scale, softcap, mask, bias, score_mod)
    seen = mask.any(axis=1)
    o = _nan_if_not_finite(_visible_matmul(p if drop is None else p * drop, vh, mask))
    ok = seen & ~poisoned
    lse = np.where(poisoned, np.nan, np.where(ok, m + np.log(np.where(ok, total, 1.0)), np.inf))
    return np.where(seen[:, None], o, 0.0), lse


def _backward_head(doh: np.ndarray, qh: np.ndarray, kh: np.ndarray, vh: np.ndarray, scale: float, softcap: float,
                   mask: np.ndarray, bias: np.ndarray | None = None, score_mod: Any = None,
                   drop: np.ndarray | None = None,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One head's dq (Sq, D), dk (Sk, D), dv (Sk, Dv), and the gradient of the biased score (Sq, Sk), which is
    dbias; arguments as for ``_forward_head``, doh (Sq, Dv). With dropout, out = (P * drop) V: dv takes the dropped
    P and dP the factors, and delta = dout . out still equals sum_j P_ij dP_ij."""
    p, dcap, dmod, _, _, _, mask = _probabilities(qh, kh, scale, softcap, mask, bias, score_mod)  # no keys: 0
    dv = _visible_matmul(p.T if drop is None else (p * drop).T, doh, mask.T)
    dp = doh @ vh.T  # a non-finite v row makes its column NaN in every row; the masks keep it in band
    if drop is not None:
        dp = dp * drop
    # delta_i = sum_j P_ij dP_ij = dout_i . out_i over the keys row i sees (so dS is exactly 0 when a row sees one
    # key, P = 1); non-finite where out_i is
    delta = np.where(mask, p * dp, 0.0).sum(axis=1)
    dscore = np.where(mask, p * (dp - delta[:, None]) * dmod, 0.0)  # through score_mod: the biased score's gradient
    ds = np.where(mask, dscore * dcap, 0.0) * scale   # softcap's derivative is NaN where the raw score is: masked
    return _visible_matmul(ds, kh, mask), _visible_matmul(ds.T, qh, mask.T), dv, dscore


def _head_bias(attn_bias: np.ndarray | None, alibi: np.ndarray | None, b: int, h: int, sq: int,
               sk: int) -> np.ndarray | None:
    """The (Sq, Sk) float64 bias of batch b, query head h: attn_bias (already broadcast to (B, Hq, Sq, Sk)) plus
    ALiBi's ``-slope * |i + Sk - Sq - j|`` with slopes (B, Hq); None when neither is given."""
    if attn_bias is None and alibi is None:
        return None
    bias = np.zeros((sq, sk)) if attn_bias is None else attn_bias[b, h]
    if alibi is not None:
        distance = np.abs(np.arange(sq)[:, None] + (sk - sq) - np.arange(sk)[None, :])
        bias = bias - alibi[b, h] * distance
    return bias


def _mod_grid(fn: Any, b: int, h: int, sq: int, sk: int, scores: np.ndarray | None = None) -> np.ndarray:
    """``fn`` called as the plain Python function it is at every (b, h, i, j) of one head, (Sq, Sk) float64
    (score_mod and score_mod_grad also get the score first)."""
    i, j = np.meshgrid(np.arange(sq), np.arange(sk), indexing="ij")
    if scores is None:
        vals = np.frompyfunc(lambda ii, jj: fn(b, h, int(ii), int(jj)), 2, 1)(i, j)
    else:
        vals = np.frompyfunc(lambda x, ii, jj: fn(float(x), b, h, int(ii), int(jj)), 3, 1)(scores, i, j)
    return np.asarray(vals, dtype=np.float64).reshape(sq, sk)


def _head_terms(mods: dict, mask: np.ndarray, bias: np.ndarray | None, b: int, h: int
                ) -> tuple[np.ndarray, np.ndarray | None, Any]:
    """One head's (mask, bias, score_mod) with the user mods applied: mask_mod narrows the mask, bias_mod adds to
    the bias, score_mod becomes ``s -> (score_mod(s), score_mod_grad(s))`` (the grad 1 in the forward)."""
    sq, sk = mask.shape
    if mods.get("mask_mod") is not None:
        mask = mask & _mod_grid(mods["mask_mod"], b, h, sq, sk).astype(bool)
    if mods.get("bias_mod") is not None:
        extra = _mod_grid(mods["bias_mod"], b, h, sq, sk)
        bias = extra if bias is None else bias + extra
    score_mod = None
    if mods.get("score_mod") is not None:
        fn, grad = mods["score_mod"], mods.get("score_mod_grad")

        def score_mod(x: np.ndarray) -> tuple[np.ndarray, Any]:
            return (_mod_grid(fn, b, h, sq, sk, x),
                    _mod_grid(grad, b, h, sq, sk, x) if grad is not None else 1.0)
    return mask, bias, score_mod


def _bias_inputs(attn_bias: Any, alibi_slopes: Any, shape: tuple[int, int, int, int]
                 ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """attn_bias broadcast (a read-only view) to ``shape`` = (B, Hq, Sq, Sk) and ALiBi slopes as (B, Hq), float64."""
    bias = None if attn_bias is None else np.broadcast_to(as_float64(attn_bias), shape)
    alibi = None
    if alibi_slopes is not None:
        alibi = np.broadcast_to(as_float64(alibi_slopes), shape[:2])
    return bias, alibi


def _dropout_factors(dropout_p: float, dropout_seed: int | None, shape: tuple[int, int, int, int]
                     ) -> np.ndarray | None:
    """(B, Hq, Sq, Sk) float64 factors that multiply the probabilities, 1 / (1 - p) where
    ``dropout.dropout_mask`` keeps and 0 where it drops; None without dropout."""
    if float(dropout_p) == 0.0:
        return None
    from .dropout import dropout_mask   # it defines numba functions; importing numba_flash does not need them

    keep = dropout_mask(dropout_seed, *shape, dropout_p)
    return np.where(keep, 1.0 / (1.0 - float(dropout_p)), 0.0)


def _sum_to_shape(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``grad`` (B, Hq, Sq, Sk) summed over the dimensions a bias of ``shape`` was broadcast along."""
    lead = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(lead))) if lead else grad
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=axes, keepdims=True) if axes else grad


@checked_arguments
def attention_ref(
    q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str = "bshd", attn_bias: Any = None,
    alibi_slopes: Any = None, bias_mod: Any = None, mask_mod: Any = None, score_mod: Any = None,
    dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention in float64.

    Arguments:
        q: (B, Sq, Hq, D) for layout "bshd", (B, Hq, Sq, D) for "bhsd"; any float dtype, any array kind.
        k: (B, Sk, Hkv, D) / (B, Hkv, Sk, D), with Hq % Hkv == 0.
        v: (B, Sk, Hkv, Dv) / (B, Hkv, Sk, Dv): its head dim may differ from D (MLA: D = 576, Dv = 512).
        attn_bias: None or an array broadcastable to (B, Hq, Sq, Sk), added to the scores after softcap. A -inf
            entry hides that key from that row, as a mask does (a row whose keys are all hidden sees none: out 0,
            lse +inf); NaN or +inf poisons the row where the key is visible.
        alibi_slopes: None, (Hq,) or (B, Hq): adds ``-slope[h] * |i + Sk - Sq - j|`` (flash-attn's ALiBi).
        bias_mod, mask_mod, score_mod: None or plain Python functions (see ``numba_flash.mods``), called here one
            element at a time: ``bias_mod(b, h, i, j)`` is added with the bias, ``score_mod(s, b, h, i, j)``
            replaces the biased score, ``mask_mod(b, h, i, j)`` False hides key j from row i.
        dropout_p, dropout_seed: dropout on the probabilities after the softmax: P[b, h, i, j] is kept and scaled
            by 1 / (1 - p) where ``numba_flash.dropout_mask(seed, B, Hq, Sq, Sk, p)`` is True, else 0. The seed
            (an int in [0, 2**64)) is needed when p > 0.
    Returns:
        out: float64, shaped like q with head dim Dv.
        lse: (B, Hq, Sq) float64, natural log of the sum of exp(score) over visible keys (before dropout, as in
            flash-attn); +inf for a row that sees no key, NaN for a row poisoned by a non-finite score (see the
            module docstring).
    """
    qb, kb, vb = _to_bshd(q, layout), _to_bshd(k, layout), _to_bshd(v, layout)
    batch, sq, hq, d = qb.shape
    sk, hkv = kb.shape[1], kb.shape[2]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    left, right = effective_window(causal, window_size)
    mask = visible_mask(sq, sk, left, right)
    group = hq // hkv
    bias, alibi = _bias_inputs(attn_bias, alibi_slopes, (batch, hq, sq, sk))
    drop = _dropout_factors(dropout_p, dropout_seed, (batch, hq, sq, sk))
    out = np.zeros((batch, sq, hq, vb.shape[3]))
    lse = np.full((batch, hq, sq), np.inf)
    mods = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod)
    with np.errstate(**_QUIET):
        for b in range(batch):
            for h in range(hq):
                terms = _head_terms(mods, mask, _head_bias(bias, alibi, b, h, sq, sk), b, h)
                out[b, :, h], lse[b, h] = _forward_head(qb[b, :, h], kb[b, :, h // group], vb[b, :, h // group],
                                                        scale, softcap, *terms, None if drop is None else drop[b, h])
    return _from_bshd(out, layout), lse


@checked_arguments
def attention_ref_backward(
    dout: Any, q: Any, k: Any, v: Any, *, causal: bool = False, softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, layout: str = "bshd", attn_bias: Any = None,
    alibi_slopes: Any = None, return_dbias: bool = False, bias_mod: Any = None, mask_mod: Any = None,
    score_mod: Any = None, score_mod_grad: Any = None, dropout_p: float = 0.0, dropout_seed: int | None = None,
) -> tuple[np.ndarray, ...]:
    """Gradients of ``sum(attention_ref(q, k, v) * dout)`` in float64.

    Arguments are shaped as in ``attention_ref``; dout is shaped like the output (q with head dim Dv).
    Returns dq, dk, dv (float64), shaped like q, k, v; with GQA, dk and dv are summed over each group's query heads.
    With ``return_dbias`` also dbias, shaped like ``attn_bias`` (summed over the dimensions it was broadcast along).
    ``score_mod`` needs ``score_mod_grad(s, b, h, i, j)``, its derivative in s.
    """
    qb, kb, vb, dob = (_to_bshd(x, layout) for x in (q, k, v, dout))
    batch, sq, hq, d = qb.shape
    sk, hkv = kb.shape[1], kb.shape[2]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    left, right = effective_window(causal, window_size)
    mask = visible_mask(sq, sk, left, right)
    group = hq // hkv
    if return_dbias and attn_bias is None:
        raise ValueError("return_dbias=True needs attn_bias")
    if score_mod is not None and score_mod_grad is None:
        raise ValueError("the backward of score_mod needs score_mod_grad")
    mods = dict(bias_mod=bias_mod, mask_mod=mask_mod, score_mod=score_mod, score_mod_grad=score_mod_grad)
    bias, alibi = _bias_inputs(attn_bias, alibi_slopes, (batch, hq, sq, sk))
    drop = _dropout_factors(dropout_p, dropout_seed, (batch, hq, sq, sk))
    dq, dk, dv = np.zeros_like(qb), np.zeros_like(kb), np.zeros_like(vb)
    dbias = np.zeros((batch, hq, sq, sk)) if return_dbias else None
    with np.errstate(**_QUIET):
        for b in range(batch):
            for h in range(hq):
                kv = h // group
                terms = _head_terms(mods, mask, _head_bias(bias, alibi, b, h, sq, sk), b, h)
                dq_h, dk_h, dv_h, dscore = _backward_head(dob[b, :, h], qb[b, :, h], kb[b, :, kv], vb[b, :, kv],
                                                          scale, softcap, *terms, None if drop is None else drop[b, h])
                dq[b, :, h] = dq_h
                dk[b, :, kv] += dk_h
                dv[b, :, kv] += dv_h
                if dbias is not None:
                    dbias[b, h] = dscore
    grads = tuple(_from_bshd(_nan_if_not_finite(g), layout) for g in (dq, dk, dv))
    if dbias is None:
        return grads
    return grads + (_nan_if_not_finite(_sum_to_shape(dbias, np.shape(to_numpy(attn_bias)))),)


def _packed_alibi(alibi_slopes: Any, cu_q: np.ndarray, cu_k: np.ndarray, h: int) -> np.ndarray | None:
    """ALiBi of query head h over the packed (total_q, total_k) scores: within sequence b,
    ``-slope[b, h] * |i + Sk_b - Sq_b - j|`` with i and j counted from the sequence's start; 0 elsewhere (the mask
    hides those pairs). None without slopes."""
    if alibi_slopes is None:
        return None
    slopes = np.broadcast_to(as_float64(alibi_slopes), (len(cu_q) - 1, np.shape(alibi_slopes)[-1]))
    bias = np.zeros((cu_q[-1], cu_k[-1]))
    for b in range(len(cu_q) - 1):
        sq, sk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        dist = np.abs(np.arange(sq)[:, None] + sk - sq - np.arange(sk)[None, :])
        bias[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]] = -slopes[b, h] * dist
    return bias


@checked_arguments
def attention_ref_varlen(
    q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Any = None, block_table: Any = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Exact attention over packed sequences (layout "thd") in float64.

    A function of its own rather than options of ``attention_ref``: the shapes and the lse layout differ, and the
    computation is not a loop of dense calls. It runs each head over the whole packed ``(total_q, total_k)`` score
    matrix with a block-diagonal mask (``semantics.packed_visible_mask``), so a test that compares it with
    ``attention_ref`` run on each sequence checks the packing as well as the kernels. ``max_seqlen_q/k`` are not
    taken: they are only bounds for kernels, and the cumulative lengths say everything.

    Arguments:
        q: (total_q, Hq, D); k, v: (total_k, Hkv, D), Hq % Hkv == 0; any float dtype, any array kind.
        cu_seqlens_q, cu_seqlens_k: (B + 1,) integer prefix sums: sequence b holds rows
            ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]`` of k and v.
            A sequence may be empty on either side.
        causal, window_size: aligned to the bottom-right corner of each sequence's own (Sq_b, Sk_b) block.
        alibi_slopes: None, (Hq,) or (B, Hq): ALiBi with each sequence's own distances (``_packed_alibi``).
        block_table: None, or (B, max_blocks) integers: k and v are then paged caches (num_blocks, page_size,
            Hkv, D) and sequence b's key j is ``k[block_table[b, j // page_size], j % page_size]``.
    Returns:
        out: (total_q, Hq, D) float64; 0 for rows that see no key (every row of a sequence without keys).
        lse: (Hq, total_q) float64, +inf for a row that sees no key, NaN for a poisoned row. The non-finite rule of
            this module holds within each sequence: a bad value never reaches another sequence.
    """
    k, v = unpage_ref(k, v, block_table, cu_seqlens_k)
    qp, kp, vp = as_float64(q), as_float64(k), as_float64(v)
    total_q, hq, d = qp.shape
    hkv = kp.shape[1]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    cu_q, cu_k = to_numpy(cu_seqlens_q).astype(np.int64), to_numpy(cu_seqlens_k).astype(np.int64)
    mask = packed_visible_mask(cu_q, cu_k, *effective_window(causal, window_size))
    group = hq // hkv
    out = np.zeros((total_q, hq, vp.shape[2]))
    lse = np.full((hq, total_q), np.inf)
    with np.errstate(**_QUIET):
        for h in range(hq):
            out[:, h], lse[h] = _forward_head(qp[:, h], kp[:, h // group], vp[:, h // group], scale, softcap, mask,
                                              _packed_alibi(alibi_slopes, cu_q, cu_k, h))
    return out, lse


@checked_arguments
def attention_ref_varlen_backward(
    dout: Any, q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, *, causal: bool = False,
    softmax_scale: float | None = None, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: Any = None, block_table: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of ``sum(attention_ref_varlen(q, k, v, ...)[0] * dout)`` in float64.

    Arguments as for ``attention_ref_varlen``; dout (total_q, Hq, D). Returns dq (total_q, Hq, D), dk and dv
    (total_k, Hkv, D), float64; dk, dv summed over each group's query heads and 0 for keys no row sees. With
    ``block_table``, dk and dv are shaped like the paged k and v, each key's gradient at its page row, 0 elsewhere.
    """
    shapes, (k, v) = (np.shape(k), np.shape(v)), unpage_ref(k, v, block_table, cu_seqlens_k)
    qp, kp, vp, dop = (as_float64(x) for x in (q, k, v, dout))
    hq, d, hkv = qp.shape[1], qp.shape[2], kp.shape[1]
    scale = default_scale(d) if softmax_scale is None else float(softmax_scale)
    cu_q, cu_k = to_numpy(cu_seqlens_q).astype(np.int64), to_numpy(cu_seqlens_k).astype(np.int64)
    mask = packed_visible_mask(cu_q, cu_k, *effective_window(causal, window_size))
    group = hq // hkv
    dq, dk, dv = np.zeros_like(qp), np.zeros_like(kp), np.zeros_like(vp)
    with np.errstate(**_QUIET):
        for h in range(hq):
            kv = h // group
            dq[:, h], dk_h, dv_h, _ = _backward_head(dop[:, h], qp[:, h], kp[:, kv], vp[:, kv], scale, softcap, mask,
                                                     _packed_alibi(alibi_slopes, cu_q, cu_k, h))
            dk[:, kv] += dk_h
            dv[:, kv] += dv_h
    dk, dv = page_grads_ref(dk, dv, block_table, cu_seqlens_k, *shapes)
    return tuple(_nan_if_not_finite(g) for g in (dq, dk, dv))


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


def _rotate_ref(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, positions: np.ndarray,
                interleaved: bool) -> np.ndarray:
    """RoPE as a complex multiplication: pair (x1, x2) is the number x1 + i x2, turned by exp(i theta).
    x (B, S, H, D), positions (B, S) -> a rotated float64 copy."""
    half = cos.shape[1]
    out = np.array(x, dtype=np.float64, copy=True)
    idx1, idx2 = (np.arange(0, 2 * half, 2), np.arange(1, 2 * half, 2)) if interleaved else \
        (np.arange(half), np.arange(half, 2 * half))
    turn = (cos[positions] + 1j * sin[positions])[:, :, None, :]
    z = (out[..., idx1] + 1j * out[..., idx2]) * turn
    out[..., idx1], out[..., idx2] = z.real, z.imag
    return out


@checked_arguments
def attention_ref_kvcache(
    q: Any, k_cache: Any, v_cache: Any, k: Any = None, v: Any = None, rotary_cos: Any = None,
    rotary_sin: Any = None, cache_seqlens: Any = None, cache_batch_idx: Any = None, cache_leftpad: Any = None,
    block_table: Any = None, *, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, rotary_interleaved: bool = True,
    alibi_slopes: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decoding with a KV cache (flash-attn's ``flash_attn_with_kvcache``) in float64, on copies: the caches given
    are not modified. Arguments as ``numba_flash.kvcache`` describes them (valid ones: nothing is checked here).
    ``alibi_slopes`` (Hq,) or (B, Hq): ALiBi over each sequence's keys as over a dense call's, the distance
    ``|i + Sk_b - Sq - j|`` counted from the first key attended (after ``cache_leftpad``).

    Returns:
        out: (B, Sq, Hq, D) float64; lse: (B, Hq, Sq) float64 (+inf for a row that sees no key).
        k_cache, v_cache: float64 copies of the caches after the append. The appended keys are rotated in
            float64, then rounded to the cache's dtype, as a kernel stores them, and attention reads them back.
    """
    qa = as_float64(q)
    kc_in = to_numpy(k_cache)
    kc, vc = as_float64(k_cache), as_float64(v_cache)
    batch, sq, hq, d = qa.shape
    hkv = kc.shape[2]
    paged = block_table is not None
    table = None if not paged else to_numpy(block_table).astype(np.int64)
    page = kc.shape[1]
    capacity = table.shape[1] * page if paged else kc.shape[1]
    s_new = 0 if k is None else int(k.shape[1])
    if cache_seqlens is None or isinstance(cache_seqlens, (int, np.integer)):   # numpy's ints too, as validation
        lens = np.full(batch, capacity if cache_seqlens is None else int(cache_seqlens), dtype=np.int64)
    else:
        lens = to_numpy(cache_seqlens).astype(np.int64)
    rows = np.arange(batch) if cache_batch_idx is None else to_numpy(cache_batch_idx).astype(np.int64)
    starts = np.zeros(batch, np.int64) if cache_leftpad is None else to_numpy(cache_leftpad).astype(np.int64)

    def slot(b: int, p: int) -> tuple[int, int]:
        """Where sequence b's logical key p lives in the cache arrays."""
        return (int(table[b, p // page]), p % page) if paged else (int(rows[b]), p)

    if rotary_cos is not None:
        cos, sin = as_float64(rotary_cos), as_float64(rotary_sin)
        offsets = np.arange(sq) if (causal or tuple(window_size) != (-1, -1)) else np.zeros(sq, np.int64)
        qa = _rotate_ref(qa, cos, sin, lens[:, None] + offsets[None, :], rotary_interleaved)
    if k is not None:
        kn, vn = as_float64(k), as_float64(v)
        if rotary_cos is not None:
            kn = _rotate_ref(kn, cos, sin, lens[:, None] + np.arange(s_new)[None, :], rotary_interleaved)
        # stored in the cache's own precision (bfloat16 comes to numpy as float32: rounded to that)
        kn, vn = (x.astype(kc_in.dtype).astype(np.float64) for x in (kn, vn))
        for b in range(batch):
            for t in range(s_new):
                kc[slot(b, int(lens[b]) + t)] = kn[b, t]
                vc[slot(b, int(lens[b]) + t)] = vn[b, t]
    out = np.zeros((batch, sq, hq, vc.shape[-1]))
    lse = np.full((batch, hq, sq), np.inf)
    for b in range(batch):
        positions = range(int(starts[b]), int(lens[b]) + s_new)
        if not len(positions):
            continue
        keys = np.stack([kc[slot(b, p)] for p in positions])[None]
        values = np.stack([vc[slot(b, p)] for p in positions])[None]
        slopes = None if alibi_slopes is None else np.broadcast_to(as_float64(alibi_slopes), (batch, hq))[b:b + 1]
        out[b:b + 1], lse[b:b + 1] = attention_ref(qa[b:b + 1], keys, values, causal=causal,
                                                   softmax_scale=softmax_scale, window_size=window_size,
                                                   softcap=softcap, alibi_slopes=slopes)
    return out, lse, kc, vc
