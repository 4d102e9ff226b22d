"""The float64 reference with user mods (bias_mod, mask_mod, score_mod + score_mod_grad), against the same attention
written out in torch float64 with autograd (which differentiates score_mod by itself) and against the equivalent
attn_bias / mask."""

from __future__ import annotations

import math

import numpy as np
import pytest

from numba_flash import attention_ref, attention_ref_backward

torch = pytest.importorskip("torch")

B, SQ, SK, HQ, HKV, D = 2, 9, 14, 4, 2, 8
DOCS = np.array([0] * 6 + [1] * 8)  # keys in two documents; query i sits at key position i + SK - SQ


def bias_mod(b, h, q_idx, kv_idx):
    return 0.3 * (h - 1) - 0.05 * abs(q_idx + SK - SQ - kv_idx) + 0.2 * b


def mask_mod(b, h, q_idx, kv_idx):
    return DOCS[q_idx + SK - SQ] == DOCS[kv_idx]


def score_mod(score, b, h, q_idx, kv_idx):
    return 2.0 * math.tanh(score / 2.0) * (1.0 + 0.1 * h) + 0.01 * kv_idx


def score_mod_grad(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 2.0)
    return (1.0 - t * t) * (1.0 + 0.1 * h)


def _torch_score_mod(s):
    h = torch.arange(HQ, dtype=s.dtype)[None, :, None, None]
    j = torch.arange(SK, dtype=s.dtype)
    return 2.0 * torch.tanh(s / 2.0) * (1.0 + 0.1 * h) + 0.01 * j


def _inputs(rng):
    q, k, v, dout = (rng.standard_normal(s) for s in ((B, SQ, HQ, D), (B, SK, HKV, D), (B, SK, HKV, D),
                                                      (B, SQ, HQ, D)))
    return q, k, v, dout


def _grid(fn):
    return np.array([[[[fn(b, h, i, j) for j in range(SK)] for i in range(SQ)] for h in range(HQ)]
                     for b in range(B)], dtype=np.float64)


def _torch_attention(q, k, v, dout, bias, mask, causal, with_score_mod):
    tq, tk, tv, tb = (torch.tensor(x, requires_grad=True) for x in (q, k, v, bias))
    s = torch.einsum("bqhd,bkhd->bhqk", tq, tk.repeat_interleave(HQ // HKV, dim=2)) / math.sqrt(D) + tb
    if with_score_mod:
        s = _torch_score_mod(s)
    visible = torch.tensor(mask)
    if causal:
        visible = visible & torch.ones(SQ, SK, dtype=torch.bool).tril(SK - SQ)
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), tv.repeat_interleave(HQ // HKV, dim=2))
    out.backward(torch.tensor(dout))
    return [x.detach().numpy() for x in (out, tq.grad, tk.grad, tv.grad, tb.grad)]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("use", ["bias_mod", "mask_mod", "score_mod", "all"])
def test_mods_match_torch_autograd(causal, use):
    rng = np.random.default_rng(7 + causal)
    q, k, v, dout = _inputs(rng)
    table = rng.standard_normal((HQ, SQ, SK))  # an attn_bias under everything, to check dbias through score_mod
    mods = {}
    bias, mask = table[None].repeat(B, 0), np.ones((B, HQ, SQ, SK), bool)
    if use in ("bias_mod", "all"):
        mods["bias_mod"] = bias_mod
        bias = bias + _grid(bias_mod)
    if use in ("mask_mod", "all"):
        mods["mask_mod"] = mask_mod
        mask = _grid(mask_mod).astype(bool)
    if use in ("score_mod", "all"):
        mods["score_mod"] = score_mod
    want = _torch_attention(q, k, v, dout, bias, mask, causal, "score_mod" in mods)
    out, _ = attention_ref(q, k, v, causal=causal, attn_bias=table, **mods)
    grad_mods = dict(mods, score_mod_grad=score_mod_grad) if "score_mod" in mods else mods
    grads = attention_ref_backward(dout, q, k, v, causal=causal, attn_bias=table, return_dbias=True, **grad_mods)
    np.testing.assert_allclose(out, want[0], atol=1e-12, rtol=0)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, want[1:4] + [want[4].sum(0)]):
        np.testing.assert_allclose(got, ref, atol=1e-12, rtol=0, err_msg=name)


def test_score_mod_returning_minus_inf_hides_the_key_and_a_fully_masked_row_sees_nothing():
    rng = np.random.default_rng(9)
    q, k, v, _ = _inputs(rng)

    def hide_odd_keys(score, b, h, q_idx, kv_idx):
        return -math.inf if kv_idx % 2 else score

    def no_keys_for_row_0(b, h, q_idx, kv_idx):
        return q_idx != 0

    got, _ = attention_ref(q, k, v, score_mod=hide_odd_keys)
    hidden = np.zeros((SQ, SK))
    hidden[:, 1::2] = -np.inf
    np.testing.assert_allclose(got, attention_ref(q, k, v, attn_bias=hidden)[0], atol=1e-14, rtol=0)
    out, lse = attention_ref(q, k, v, mask_mod=no_keys_for_row_0)
    assert np.all(out[:, 0] == 0) and np.all(lse[:, :, 0] == np.inf) and np.isfinite(out).all()


def test_score_mod_backward_needs_its_gradient():
    rng = np.random.default_rng(10)
    q, k, v, dout = _inputs(rng)
    with pytest.raises(ValueError, match="score_mod_grad"):
        attention_ref_backward(dout, q, k, v, score_mod=score_mod)
