"""bias_mod, mask_mod, score_mod and block_mask on the backends that run them, against the float64 reference (which
calls the mods as plain Python), and their bad input."""

from __future__ import annotations

import numpy as np
import pytest
from mods_cases import (CPU_SHIFT, HIDDEN_KEY, cpu_doc_mask, cpu_head_bias, nan_value_reaches_without_score_mod,
                        soft_clip, soft_clip_grad)

import numba_flash
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, backend_registry, block_mask

pytest.importorskip("torch")

BACKENDS = ("rocm", "cpu")
# The cpu backend compiles small hooks per set of mods (seconds each on 2 cores, cpu/modhooks.py): its tests run
# the sets that hold all three mods (the keys-hidden test as well), under different options: 45 key positions in
# 5 documents here, query i at key position i + SK - SQ.
CPU_CASES = ("all+causal+softcap", "all+window")
B, SQ, SK, HQ, HKV, D = 2, 29, 45, 4, 2, 16
assert SK - SQ == CPU_SHIFT
doc_mask, head_bias = cpu_doc_mask, cpu_head_bias


CASES = {
    "bias_mod": dict(bias_mod=head_bias),
    "mask_mod": dict(mask_mod=doc_mask),
    "score_mod": dict(score_mod=soft_clip),
    "all+causal+softcap": dict(bias_mod=head_bias, mask_mod=doc_mask, score_mod=soft_clip, causal=True, softcap=5.0),
    "mask_mod+window": dict(mask_mod=doc_mask, window_size=(7, 3)),
    "all+window": dict(bias_mod=head_bias, mask_mod=doc_mask, score_mod=soft_clip, window_size=(7, 3)),
}


def _inputs(rng, dtype=np.float32):
    q = rng.standard_normal((B, SQ, HQ, D)).astype(dtype)
    k = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    v = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


def _grad_kw(kw):
    return dict(kw, score_mod_grad=soft_clip_grad) if "score_mod" in kw else kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("with_block_mask", [False, True])
def test_mods_match_reference(backend, name, with_block_mask):
    if backend == "cpu" and name not in CPU_CASES:
        pytest.skip("one compilation per set of mods: the cpu backend runs CPU_CASES")
    kw = dict(CASES[name])
    if with_block_mask:
        if "mask_mod" not in kw:
            pytest.skip("a block mask belongs to a mask_mod")
        kw["block_mask"] = block_mask(doc_mask, 1, 1, SQ, SK, block_m=8, block_n=16)
    rng = np.random.default_rng(len(name) + 10 * with_block_mask)
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, **_grad_kw(kw))
    ref_kw = {n: x for n, x in kw.items() if n != "block_mask"}
    want_out, want_lse = attention_ref(q, k, v, **ref_kw)
    want = attention_ref_backward(dout, q, k, v, **_grad_kw(ref_kw))
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    for n, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert np.linalg.norm(got - ref) <= 2e-5 * np.linalg.norm(ref), n
    plain = {n: x for n, x in ref_kw.items() if n not in ("bias_mod", "mask_mod", "score_mod")}
    assert np.abs(attention_ref(q, k, v, **plain)[0] - want_out).max() > 1e-2  # the mods change the answer


@pytest.mark.parametrize("backend", BACKENDS)
def test_keys_hidden_by_mods_never_poison_and_rows_without_keys_are_zero(backend):
    rng = np.random.default_rng(51)
    q, k, v, dout = _inputs(rng)

    v[:, HIDDEN_KEY] = np.nan  # hidden from every row by soft_clip
    k[1, 20] = np.inf          # batch 1 key 20: visible to the rows of its document, whom it poisons
    kw = dict(CASES["all+window"], window_size=(-1, -1))   # the cpu backend's compiled set; doc_mask hides rows 0-3
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    assert np.array_equal(np.isnan(out), np.isnan(want_out)) and np.array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.all(out[:, :4] == 0) and np.all(lse[:, :, :4] == np.inf)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).any()
    assert nan_value_reaches_without_score_mod(q, k, v, kw)   # the case is live
    ok = np.isfinite(want_out)
    np.testing.assert_allclose(out[ok], want_out[ok], atol=2e-5, rtol=0)
    grads = op.backward(dout, q, k, v, out, lse, score_mod_grad=soft_clip_grad, **kw)
    want = attention_ref_backward(dout, q, k, v, score_mod_grad=soft_clip_grad, **kw)
    for n, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert np.array_equal(np.isnan(got), np.isnan(ref)), n


@pytest.mark.parametrize("softcap", [0.0, 6.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_minus_inf_product_under_score_mod_poisons_its_row(backend, softcap):
    """score_mod runs on finite scores only: a query whose every product is -inf (a -inf in q against keys of one
    sign there) keeps those scores, and its row is NaN as the contract says, not hidden as if score_mod had
    returned -inf (which gave the row 0 and lse +inf on the CUDA kernels)."""
    rng = np.random.default_rng(56)
    q, k, v, dout = _inputs(rng)
    k[..., 0] = np.abs(k[..., 0]) + 0.25
    q[1, 9, 3, 0] = -np.inf
    kw = dict(score_mod=soft_clip, softcap=softcap)
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, score_mod_grad=soft_clip_grad, **kw)
    want = attention_ref(q, k, v, **kw) + attention_ref_backward(dout, q, k, v, score_mod_grad=soft_clip_grad, **kw)
    assert np.isnan(want[0][1, 9, 3]).all() and np.isnan(want[1][1, 3, 9])   # the case is live
    for n, got, ref in zip(("out", "lse", "dq", "dk", "dv"), (out, lse) + tuple(grads), want):
        assert np.array_equal(np.isnan(got), np.isnan(ref)), n
        ok = ~np.isnan(ref)
        np.testing.assert_allclose(got[ok], ref[ok], atol=5e-5, rtol=0, err_msg=n)


@pytest.mark.parametrize("backend", ["rocm"])   # the cpu backend widens float16 to its float32 kernels
def test_float16_within_twice_the_error_of_naive_float16(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(52)
    q, k, v, _ = _inputs(rng)
    t = [torch.from_numpy(x).half() for x in (q, k, v)]
    out = backend_registry.get("flash", backend=backend).forward(*t, mask_mod=doc_mask, bias_mod=head_bias)
    rounded = [x.float().numpy() for x in t]
    want = attention_ref(*rounded, mask_mod=doc_mask, bias_mod=head_bias)[0]
    grid = np.array([[[[head_bias(b, h, i, j) if doc_mask(b, h, i, j) else -np.inf for j in range(SK)]
                       for i in range(SQ)] for h in range(HQ)] for b in range(B)])
    s = torch.einsum("bqhd,bkhd->bhqk", t[0], t[1].repeat_interleave(2, dim=2)) / D ** 0.5
    s = s + torch.from_numpy(grid).half()
    probs = s.softmax(-1).nan_to_num(0.0)    # rows 0-3 see no key: 0, not softmax's NaN
    naive = torch.einsum("bhqk,bkhd->bqhd", probs, t[2].repeat_interleave(2, dim=2)).float().numpy()
    assert np.abs(out.float().numpy() - want).max() <= 2 * np.abs(naive - want).max() + 1e-4


def test_block_mask_skips_whole_documents_on_a_long_sequence():
    docs = np.repeat(np.arange(8), 512)

    def documents(b, h, q_idx, kv_idx):
        return docs[q_idx] == docs[kv_idx] and kv_idx <= q_idx

    bm = block_mask(documents, 1, 1, 4096, 4096)
    # 8 documents of 8 tiles each: per document 8 diagonal (partial) tiles and 28 full ones below them
    assert (bm.states == numba_flash.mods.PARTIAL).sum() == 64 and (bm.states == numba_flash.mods.FULL).sum() == 224
    assert bm.visible_fraction() == pytest.approx(288 / 4096)


def test_explain_says_who_runs_mods():
    rng = np.random.default_rng(53)
    q, k, v, _ = _inputs(rng)
    text = str(backend_registry.get("flash").explain(q, k, v, mask_mod=doc_mask))
    assert "mask_mod=doc_mask" in text and "chosen: cpu" in text
    # Every backend runs mods (cuda's in numba_flash/cuda/device/user_mods.py): the GPU ones decline these host arrays
    # for that reason only.
    cuda_line = next(line for line in text.splitlines() if "cuda [priority 30]: " in line)
    assert "host (numpy) input" in cuda_line and "not supported" not in text


def test_bad_mods():
    rng = np.random.default_rng(54)
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend="rocm")
    with pytest.raises(AttentionInputError, match=r"^bias_mod: expected .* numba could not compile .*text"):
        op.forward(q, k, v, bias_mod=lambda b, h, i, j: "text" + i)
    with pytest.raises(AttentionInputError, match=r"^mask_mod: expected a function .*, got int"):
        op.forward(q, k, v, mask_mod=3)

    def refuses(b, h, q_idx, kv_idx):
        raise ValueError("never")

    # numba types such a body as returning None, which the role's signature casts: it compiled, then failed inside
    # the kernel's own compile with numba's TypingError
    for backend in BACKENDS:
        for role in ("mask_mod", "bias_mod"):
            with pytest.raises(AttentionInputError, match=rf"^{role}: expected a function .*refuses returns nothing"):
                backend_registry.get("flash", backend=backend).forward(q, k, v, **{role: refuses})
    out, lse = op.forward(q, k, v, score_mod=soft_clip, return_lse=True)
    with pytest.raises(AttentionInputError, match=r"^score_mod_grad: expected d score_mod / d score"):
        op.backward(dout, q, k, v, out, lse, score_mod=soft_clip)
    with pytest.raises(AttentionInputError, match=r"^score_mod_grad: expected None without a score_mod"):
        op.backward(dout, q, k, v, out, lse, score_mod_grad=soft_clip_grad)
    with pytest.raises(AttentionInputError, match=r"^block_mask: expected the BlockMask of this call's mask_mod"):
        op.forward(q, k, v, mask_mod=doc_mask, block_mask=block_mask(head_bias, 1, 1, SQ, SK))
    with pytest.raises(AttentionInputError, match=r"^block_mask: expected one built for \(B, H, Sq, Sk\) = "):
        op.forward(q, k, v, mask_mod=doc_mask, block_mask=block_mask(doc_mask, 1, 1, SQ, SK - 1))
    with pytest.raises(AttentionInputError, match=r"^block_mask: expected a numba_flash.BlockMask"):
        op.forward(q, k, v, mask_mod=doc_mask, block_mask=np.ones((1, 1, 1, 1)))
    cu = np.array([0, SQ], np.int32)
    with pytest.raises(AttentionInputError, match=r"^mask_mod: expected None for packed sequences"):
        op.forward(q[0], k[0, :SQ], v[0, :SQ], cu_seqlens_q=cu, cu_seqlens_k=cu, mask_mod=doc_mask)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_func_with_mods_and_autograd(backend):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(55)
    q, k, v, dout = _inputs(rng)
    table = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tb = torch.from_numpy(table).requires_grad_()
    kw = dict(mask_mod=doc_mask, score_mod=soft_clip, bias_mod=head_bias)
    out = numba_flash.flash_attn_func(tq, tk, tv, causal=True, attn_bias=tb, score_mod_grad=soft_clip_grad,
                                      backend=backend, **kw)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out.detach().numpy(), attention_ref(q, k, v, causal=True, attn_bias=table, **kw)[0],
                               atol=2e-5, rtol=0)
    want = attention_ref_backward(dout, q, k, v, causal=True, attn_bias=table, return_dbias=True,
                                  score_mod_grad=soft_clip_grad, **kw)
    for got, ref in zip((t.grad for t in (tq, tk, tv, tb)), want):
        assert np.linalg.norm(got.numpy() - ref) <= 2e-5 * np.linalg.norm(ref)
    # score_mod without its gradient: the forward runs, the backward says what is missing (the same mods: on the cpu
    # backend, a new set would compile kernels of its own)
    out = numba_flash.flash_attn_func(tq, tk, tv, backend=backend, **kw)
    with pytest.raises(AttentionInputError, match="^score_mod_grad: expected"):
        out.sum().backward()


@pytest.mark.parametrize("shape", [(1, 1, SQ, SK), (HQ, 1, SK), (SQ, 1)])
def test_cpu_dbias_with_mods_takes_score_mod_grad_and_matches_reference(shape):
    """attn_bias enters before score_mod: its gradient takes score_mod_grad's factor (kept apart from softcap's and
    the scale), for a bias shared by the batch and heads, one broadcast over the rows and one over the keys."""
    rng = np.random.default_rng(56)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal(shape).astype(np.float32)
    mods = CASES["all+window"]   # the cpu backend's compiled set
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, attn_bias=bias, return_lse=True, **mods)
    kw = dict(mods, score_mod_grad=soft_clip_grad, attn_bias=bias)
    got = op.backward(dout, q, k, v, out, lse, return_dbias=True, **kw)
    want = attention_ref_backward(dout, q, k, v, return_dbias=True, **kw)
    for name, g, ref in zip(("dq", "dk", "dv", "dbias"), got, want):
        assert np.linalg.norm(g - ref) <= 2e-5 * np.linalg.norm(ref), name
    assert got[3].shape == bias.shape
    # the test can tell: the gradient of a bias added after score_mod (no score_mod_grad factor) is another
    unmodded = attention_ref_backward(dout, q, k, v, return_dbias=True, **dict(kw, score_mod_grad=_one))[3]
    assert np.linalg.norm(unmodded - want[3]) > 1e-2 * np.linalg.norm(want[3])


def _one(score, b, h, q_idx, kv_idx):
    return 1.0


def test_no_backend_error_names_the_backend_that_serves_the_call_when_named(monkeypatch):
    from backends.cpu import CpuBackend

    # every backend numpy arrays reach unnamed serves every feature today: a cpu backend that declines one stands in
    monkeypatch.setattr(CpuBackend, "feature_reasons", lambda self, call: ["a feature of the test's not supported"])
    rng = np.random.default_rng(57)
    q, k, v, _ = _inputs(rng)
    with pytest.raises(numba_flash.NoBackendError, match="backend='rocm' serves it when named$") as exc:
        backend_registry.get("flash").forward(q, k, v, causal=True)
    assert exc.value.if_named == ("rocm",)
    with pytest.raises(numba_flash.NoBackendError) as exc:    # named and still refused: no hint
        backend_registry.get("flash", backend="cpu").forward(q, k, v, causal=True)
    assert exc.value.if_named == () and "serves it when named" not in str(exc.value)
