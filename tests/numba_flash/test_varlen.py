"""Packed sequences (layout "thd"): the reference against hand-derived values and against the dense reference run
on each sequence, the validation of cu_seqlens / max_seqlen, the CPU and ROCm (torch) backends against the
reference, and ``flash_attn_varlen_func`` with autograd. The CUDA kernels run the same cases under the simulator in
``tests/numba_flash/cuda/test_varlen_sim.py``.

Every case packs sequences of different, odd lengths, among them empty ones (no rows, no keys) and single ones;
inputs are fresh N(0, 1) draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import (AttentionInputError, attention_ref, attention_ref_backward, attention_ref_varlen,
                         attention_ref_varlen_backward, validate_backward, validate_forward)

# (lengths of the query sequences, lengths of the key sequences): a sequence with rows but no keys, one with keys
# but no rows, one with neither, a 1 x 1 one, Sq > Sk (causal rows that see nothing) and Sq < Sk.
LENGTHS = {
    "mixed": ([5, 0, 1, 9, 4, 0, 3], [8, 3, 1, 6, 0, 0, 11]),
    "tiles": ([70, 1, 0, 131], [65, 2, 5, 140]),   # sequences longer than a CPU tile (64)
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(3, 1)),
    "causal_window_softcap": dict(causal=True, window_size=(2, -1), softcap=1.5, softmax_scale=0.4),
}
HEADS = {"gqa": (4, 2), "mqa": (3, 1), "mha": (2, 2)}


def _cu(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, lens_q, lens_k, hq=4, hkv=2, d=7, dtype=np.float32):
    """q, k, v, dout of N(0, 1) values in ``dtype`` and the int32 cu_seqlens of the lengths."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q, dout = (rng.standard_normal((int(cu_q[-1]), hq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v, dout, cu_q, cu_k


def _f64(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x, np.float64)


def _rel_l2(got, want):
    return float(np.linalg.norm(_f64(got) - want) / max(np.linalg.norm(want), 1e-300))


def _sequences(cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


# ---------------------------------------------------------------------------------------------------------------
# The reference


def test_reference_hand_derived():
    """D = 1, scale 1. Sequence 0: one row, q = 1, keys 0 and ln 3, so weights 1/4 and 3/4 of v = (10, 20).
    Sequence 1: two rows, one key; causal (bottom-right) hides it from row 0 only, so row 1 reads v = -7 alone.
    Had sequence 1 seen sequence 0's keys, its row 1 would not be exactly -7."""
    q = np.array([[[1.0]], [[5.0]], [[2.0]]])
    k = np.array([[[0.0]], [[math.log(3.0)]], [[0.5]]])
    v = np.array([[[10.0]], [[20.0]], [[-7.0]]])
    cu_q, cu_k = np.array([0, 1, 3], np.int32), np.array([0, 2, 3], np.int32)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True, softmax_scale=1.0)
    np.testing.assert_allclose(out[:, 0, 0], [17.5, 0.0, -7.0], rtol=1e-14)
    np.testing.assert_allclose(lse[0], [math.log(4.0), np.inf, 1.0], rtol=1e-14)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, softmax_scale=1.0)   # not causal: row 0 sees the key
    np.testing.assert_allclose(out[:, 0, 0], [17.5, -7.0, -7.0], rtol=1e-14)
    np.testing.assert_allclose(lse[0], [math.log(4.0), 2.5, 1.0], rtol=1e-14)
    # d out_0 / d v = the weights; the key of sequence 1 gets row 1's whole dout, and nothing from sequence 0
    dout = np.ones_like(q)
    _, _, dv = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True, softmax_scale=1.0)
    np.testing.assert_allclose(dv[:, 0, 0], [0.25, 0.75, 1.0], rtol=1e-14)


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
def test_reference_matches_dense_reference_per_sequence(rng, opts, heads):
    lens_q, lens_k = LENGTHS["mixed"]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, *heads, dtype=np.float64)
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **opts)
    dq, dk, dv = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, **opts)
    assert out.shape == q.shape and lse.shape == (heads[0], q.shape[0])
    for rows, keys in _sequences(cu_q, cu_k):
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        want_o, want_l = attention_ref(q[None, rows], k[None, keys], v[None, keys], **opts)
        want_g = attention_ref_backward(dout[None, rows], q[None, rows], k[None, keys], v[None, keys], **opts)
        np.testing.assert_allclose(out[rows], want_o[0], atol=1e-13)
        np.testing.assert_array_equal(np.isinf(lse[:, rows]), np.isinf(want_l[0]))
        fin = np.isfinite(want_l[0])
        np.testing.assert_allclose(lse[:, rows][fin], want_l[0][fin], atol=1e-13)
        for got, want in zip((dq[rows], dk[keys], dv[keys]), want_g):
            np.testing.assert_allclose(got, want[0], atol=1e-12)
    _check_empty_sequences(out, lse, (dq, dk, dv), cu_q, cu_k)


def _check_empty_sequences(out, lse, grads, cu_q, cu_k):
    """Rows of a sequence without keys: out 0, lse +inf, dq 0. Keys of a sequence without rows: dk = dv = 0."""
    dq, dk, dv = grads
    for rows, keys in _sequences(cu_q, cu_k):
        if keys.stop == keys.start:
            assert np.all(out[rows] == 0) and np.all(np.isposinf(lse[:, rows])) and np.all(dq[rows] == 0)
        if rows.stop == rows.start:
            assert np.all(dk[keys] == 0) and np.all(dv[keys] == 0)


# ---------------------------------------------------------------------------------------------------------------
# Validation


def _valid(rng):
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, [3, 0, 5], [4, 2, 6])
    return dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)


def _raises(match, **kwargs):
    with pytest.raises(AttentionInputError, match=match):
        validate_forward(**kwargs)


def test_valid_packed_call(rng):
    args = _valid(rng)
    call = validate_forward(**args, causal=True, max_seqlen_q=5, max_seqlen_k=100)   # a bound, not exact
    assert call.layout == "thd" and call.is_varlen     # layout inferred from the cu_seqlens
    assert (call.batch, call.seqlen_q, call.seqlen_k, call.nheads_q, call.nheads_kv, call.head_dim) == (3, 5, 6, 4, 2, 7)
    assert call.lse_shape == (4, 8)
    assert "thd B=3 total_q=8 total_k=12 max_Sq=5 max_Sk=6" in call.describe()
    assert [tuple(s)[1:] for s in call.packing.sequences()] == [(0, 3, 0, 4), (3, 3, 4, 6), (3, 8, 6, 12)]
    # int64 prefix sums (np.cumsum's default) are accepted too, and so is an explicit layout
    call = validate_forward(**{**args, "cu_seqlens_q": args["cu_seqlens_q"].astype(np.int64)}, layout="thd")
    assert call.packing.total_q == 8


@pytest.mark.parametrize("value,pattern", [
    ([0, 3, 3, 8], r"^cu_seqlens_q: expected a 1-D int32 array .* got an object of type list"),
    (np.array([0, 3, 3, 8], np.float32), r"^cu_seqlens_q: expected dtype int32 \(or int64\), got dtype float32"),
    (np.array([0, 3, 3, 8], np.int16), r"^cu_seqlens_q: expected dtype int32 \(or int64\), got dtype int16"),
    (np.array([[0, 3, 3, 8]], np.int32), r"^cu_seqlens_q: expected a 1-D int32 array .* got shape \(1, 4\)"),
    (np.array([0], np.int32), r"^cu_seqlens_q: expected at least 2 entries .* got shape \(1,\)"),
    (np.array([1, 3, 3, 8], np.int32), r"^cu_seqlens_q: expected cu_seqlens_q\[0\] == 0, got cu_seqlens_q\[0\] = 1"),
    (np.array([0, 4, 3, 8], np.int32), r"^cu_seqlens_q: expected non-decreasing values .* got cu_seqlens_q\[2\] = 3 < "
                                       r"cu_seqlens_q\[1\] = 4"),
    (np.array([0, 3, 3, 7], np.int32), r"^cu_seqlens_q: expected cu_seqlens_q\[-1\] == total_q = 8, got "
                                       r"cu_seqlens_q\[-1\] = 7"),
    (np.array([0, 3, 8], np.int32), r"^cu_seqlens_k: expected B \+ 1 = 3 entries like cu_seqlens_q .* got 4 entries"),
])
def test_bad_cu_seqlens(rng, value, pattern):
    _raises(pattern, **{**_valid(rng), "cu_seqlens_q": value})


@pytest.mark.parametrize("change,pattern", [
    (dict(cu_seqlens_k=None), r"^cu_seqlens_k: expected an int32 array .* needs both cu_seqlens_k and cu_seqlens_q"),
    (dict(cu_seqlens_q=None, layout="thd"), r"^cu_seqlens_q: expected an int32 array"),
    (dict(layout="bshd"), r"^cu_seqlens_q: expected None for layout 'bshd' \(packed sequences take layout 'thd'\)"),
    (dict(max_seqlen_q=4), r"^max_seqlen_q: expected an int >= the longest query sequence \(5\), got 4"),
    (dict(max_seqlen_k=5), r"^max_seqlen_k: expected an int >= the longest key sequence \(6\), got 5"),
    (dict(max_seqlen_k=-1), r"^max_seqlen_k: expected an int >= the longest key sequence \(6\), got -1"),
    (dict(max_seqlen_q=5.0), r"^max_seqlen_q: expected None or an int, got 5.0"),
    (dict(max_seqlen_q=True), r"^max_seqlen_q: expected None or an int, got True"),
])
def test_bad_packing_arguments(rng, change, pattern):
    _raises(pattern, **{**_valid(rng), **change})


def test_bad_shapes_and_lse(rng):
    args = _valid(rng)
    q, k, v = args["q"], args["k"], args["v"]
    _raises(r"^q: expected 3 dimensions \(total_q, Hq, D\) for layout 'thd', got shape \(1, 8, 4, 7\)",
            **{**args, "q": q[None]})
    _raises(r"^k: expected an array", **{**args, "k": list(k)})
    _raises(r"^max_seqlen_q: expected None for layout 'bshd'", q=q[None], k=k[None], v=v[None], max_seqlen_q=3)
    out, lse = np.zeros_like(q), np.zeros((4, 8), np.float32)
    validate_backward(q, q, k, v, out, lse, cu_seqlens_q=args["cu_seqlens_q"], cu_seqlens_k=args["cu_seqlens_k"])
    with pytest.raises(AttentionInputError, match=r"^lse: expected shape \(Hq, total_q\) = \(4, 8\), got shape "
                                                  r"\(3, 4, 5\)"):
        validate_backward(q, q, k, v, out, np.zeros((3, 4, 5), np.float32), cu_seqlens_q=args["cu_seqlens_q"],
                          cu_seqlens_k=args["cu_seqlens_k"])
