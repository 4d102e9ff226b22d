"""User mods (bias_mod, mask_mod, score_mod with score_mod_grad) in the CUDA kernels, under the Numba CUDA simulator:
the float32 SIMT kernels with toy tiles (both backward paths) and the tensor-core kernels with one-warp tiles, forward
and backward against the float64 reference (which calls the mods as plain Python), keys the mods hide never
poisoning (also on the kernels' rare paths, which recompute a score to ask score_mod), and float16 and bfloat16
within twice the error of attention computed plainly in that dtype. The real compiler builds these kernels with
mods in tests/numba_flash/cuda/test_cuda_compile.py; the cpu and rocm backends run the same mods in
tests/numba_flash/test_mods_backends.py.

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import BACKWARD_TILES, random_inputs, rel_l2
from cuda_sim_cases import forward_backward as simt_forward_backward
from mods_cases import HIDDEN_KEY, document_mods, nan_value_reaches_without_score_mod, soft_clip, soft_clip_grad

from numba_flash import attention_ref, attention_ref_backward

# RuntimeWarnings: the simulator's numpy arithmetic on the inf and NaN some tests put in.
pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

B, SQ, SK, HQ, HKV, D = 2, 13, 19, 2, 1, 8
DOCS = np.repeat(np.arange(4), [5, 7, 1, 6])   # 19 key positions in 4 documents; query i is at i + SK - SQ
doc_mask, head_bias = document_mods(DOCS, SQ, SK, blind_rows=2)


CASES = {
    "bias_mod": dict(bias_mod=head_bias),
    "mask_mod+window": dict(mask_mod=doc_mask, window_size=(6, 2)),
    "score_mod": dict(score_mod=soft_clip),
    "all+causal+softcap": dict(bias_mod=head_bias, mask_mod=doc_mask, score_mod=soft_clip, causal=True, softcap=5.0),
    "all+alibi+attn_bias": dict(bias_mod=head_bias, mask_mod=doc_mask, score_mod=soft_clip,
                                alibi_slopes=np.array([0.3, 0.9], np.float32)),
}


def _grad_kw(kw):
    return dict(kw, score_mod_grad=soft_clip_grad) if "score_mod" in kw else kw


def _plain(kw):
    return {n: x for n, x in kw.items() if n not in ("bias_mod", "mask_mod", "score_mod", "score_mod_grad")}


@pytest.mark.parametrize("tiles", list(BACKWARD_TILES))
@pytest.mark.parametrize("name", list(CASES))
def test_simt_kernels_match_reference(name, tiles):
    rng = np.random.default_rng(len(name))
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    kw = _grad_kw(CASES[name])
    if name.endswith("attn_bias"):
        kw["attn_bias"] = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    got = simt_forward_backward(q, k, v, dout, BACKWARD_TILES[tiles], **kw)
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    want_out, want_lse = attention_ref(q, k, v, **fwd_kw)
    np.testing.assert_allclose(got[0], want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(got[1], want_lse, atol=2e-5, rtol=1e-5)
    for grad, g, ref in zip(("dq", "dk", "dv"), got[2:], attention_ref_backward(dout, q, k, v, **kw)):
        assert rel_l2(g, ref) <= 2e-5, grad
    assert np.abs(attention_ref(q, k, v, **_plain(fwd_kw))[0] - want_out).max() > 1e-2   # the mods count


def test_simt_keys_hidden_by_mods_never_poison():
    rng = np.random.default_rng(51)
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    v[:, HIDDEN_KEY] = np.nan  # hidden from every row by soft_clip: the forward's rare path must ask score_mod
    k[1, 12] = np.inf          # batch 1 key 12: visible to the rows of its document, whom it poisons
    q[0, 0] = np.nan           # row 0 sees no key (doc_mask): its NaN poisons nothing, in the backward's rare path
    dout[0, 1] = np.inf        # likewise row 1's dO
    kw = _grad_kw(CASES["all+causal+softcap"])
    got = simt_forward_backward(q, k, v, dout, **kw)
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    want = attention_ref(q, k, v, **fwd_kw) + attention_ref_backward(dout, q, k, v, **kw)
    assert np.all(got[0][:, :2] == 0) and np.all(got[1][:, :, :2] == np.inf)
    assert np.isfinite(got[0][0]).all() and np.isnan(got[0][1]).any()
    assert nan_value_reaches_without_score_mod(q, k, v, kw)   # the case is live
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(g[fin], ref[fin], atol=5e-5, rtol=0, err_msg=name)


def _minus_inf_products(q, k, b, row, h):
    """Make every raw product of query ``row`` (batch ``b``, head ``h``) -inf: one -inf in its first dimension, every
    key's first entry positive."""
    k[..., 0] = abs(k[..., 0]) + 0.25
    q[b, row, h, 0] = -np.inf


def test_simt_minus_inf_product_under_score_mod_poisons_its_row():
    """score_mod runs on finite scores only, so a -inf product comes back from it unchanged: that must poison the
    row (a -inf in q), not hide its keys as a -inf that score_mod returned does (which gave the row 0)."""
    rng = np.random.default_rng(54)
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    _minus_inf_products(q, k, 1, 4, 1)
    kw = _grad_kw(CASES["score_mod"])
    got = simt_forward_backward(q, k, v, dout, **kw)
    want = attention_ref(q, k, v, score_mod=soft_clip) + attention_ref_backward(dout, q, k, v, **kw)
    assert np.isnan(want[0][1, 4, 1]).all()   # the case is live
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(g[fin], ref[fin], atol=5e-5, rtol=0, err_msg=name)


torch = pytest.importorskip("torch")

from tc_sim_cases import BOUND, ONE_WARP, inputs, naive_same_dtype  # noqa: E402
from tc_sim_cases import rel_l2 as tc_rel_l2  # noqa: E402

TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D = 1, 21, 37, 2, 1, 16
TC_DOCS = np.repeat(np.arange(4), [9, 12, 1, 15])


tc_doc_mask, tc_head_bias = document_mods(TC_DOCS, TC_SQ, TC_SK, blind_rows=2)


TC_CASES = {
    "all+causal+softcap": dict(bias_mod=tc_head_bias, mask_mod=tc_doc_mask, score_mod=soft_clip, causal=True,
                               softcap=5.0),
    "mask_mod+score_mod": dict(mask_mod=tc_doc_mask, score_mod=soft_clip),
    "bias_mod+window": dict(bias_mod=tc_head_bias, window_size=(9, 4)),
}


def _tc_run(q, k, v, dout, **kw):
    from backends import backend_registry
    from numba_flash.cuda import tile_config_override

    with tile_config_override(**ONE_WARP):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **{n: x for n, x in kw.items() if n != "score_mod_grad"})
        return (out, lse) + tuple(op.backward(dout, q, k, v, out, lse, **kw))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", list(TC_CASES))
def test_tensor_core_kernels_within_twice_the_error_of_naive_same_dtype(name, dtype):
    rng = np.random.default_rng(7 + len(name))
    (q, k, v), (q64, k64, v64) = inputs(rng, dtype, TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).to(q.dtype)
    kw = _grad_kw(TC_CASES[name])
    out, lse, *grads = _tc_run(q, k, v, dout, **kw)
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    want_out, want_lse = attention_ref(q64, k64, v64, **fwd_kw)
    want = attention_ref_backward(dout.double().numpy(), q64, k64, v64, **kw)
    naive_out, naive_grads = naive_same_dtype(q, k, v, dout=dout, **kw)
    for what, got, ref, plain in zip(("out", "dq", "dk", "dv"), [out] + grads, [want_out] + list(want),
                                     [naive_out] + naive_grads):
        assert got.dtype == q.dtype, what
        err, naive_err = tc_rel_l2(got.double().numpy(), ref), tc_rel_l2(plain, ref)
        assert err <= BOUND[dtype] and err <= 2 * naive_err, (what, err, naive_err)
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], rtol=0, atol=1e-4)
    assert np.abs(attention_ref(q64, k64, v64, **_plain(fwd_kw))[0] - want_out).max() > 1e-2


def test_tensor_core_keys_hidden_by_mods_never_poison():
    rng = np.random.default_rng(52)
    (q, k, v), _ = inputs(rng, "float16", TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    v[:, HIDDEN_KEY] = float("nan")   # hidden from every row by soft_clip: the forward's rare path must ask score_mod
    k[0, 30] = float("inf")    # visible to the rows of its document (and the window), whom it poisons
    dout[0, 20, 1] = float("inf")   # row 20 (doc 3) never sees HIDDEN_KEY: dV's rare path must not reach it
    kw = _grad_kw(TC_CASES["all+causal+softcap"])
    got = _tc_run(q, k, v, dout, **kw)
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    want = attention_ref(q64, k64, v64, **fwd_kw) + attention_ref_backward(do64, q64, k64, v64, **kw)
    assert np.isnan(want[4][0, 30]).any() and not np.isnan(want[4][0, HIDDEN_KEY]).any()   # the cases are live
    assert nan_value_reaches_without_score_mod(q64, k64, v64, kw)
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.double().numpy() if hasattr(g, "double") else np.asarray(g)
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name


def test_tensor_core_backward_keeps_nan_of_a_visible_key_under_softcap():
    """A non-finite key poisons the rows that see it, and its dK must be NaN too: the backward's dS of a visible
    pair is NaN there (softcap's derivative of a NaN score is NaN), where a hidden pair's is 0 by a select."""
    rng = np.random.default_rng(53)
    (q, k, v), _ = inputs(rng, "float16", 1, 19, 23, 2, 1, 16)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    k[0, 7, 0, 2] = float("inf")
    kw = dict(softcap=3.0, causal=True)
    got = _tc_run(q, k, v, dout, **kw)
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    want = attention_ref(q64, k64, v64, **kw) + attention_ref_backward(do64, q64, k64, v64, **kw)
    assert np.isnan(want[3][0, 7]).all()
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.double().numpy() if hasattr(g, "double") else np.asarray(g)
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name


def test_tensor_core_minus_inf_product_under_score_mod_poisons_its_row():
    rng = np.random.default_rng(55)
    (q, k, v), _ = inputs(rng, "float16", TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    _minus_inf_products(q, k, 0, 6, 1)
    kw = _grad_kw(TC_CASES["mask_mod+score_mod"])
    got = _tc_run(q, k, v, dout, **kw)
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    fwd_kw = {n: x for n, x in kw.items() if n != "score_mod_grad"}
    want = attention_ref(q64, k64, v64, **fwd_kw) + attention_ref_backward(do64, q64, k64, v64, **kw)
    assert np.isnan(want[0][0, 6, 1]).all()
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.double().numpy() if hasattr(g, "double") else np.asarray(g)
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name
