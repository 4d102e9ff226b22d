"""``attn_bias`` and its gradient on the backends that run it, against the float64 reference, and its bad input."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, backend_registry

torch = pytest.importorskip("torch")

BACKENDS = ("rocm", "cpu")
DBIAS = {"rocm": True, "cpu": True}
B, SQ, SK, HQ, HKV, D = 2, 23, 37, 4, 2, 24
# Every way a bias can broadcast to (B, Hq, Sq, Sk): full, per head, per row, per key, one number.
SHAPES = [(B, HQ, SQ, SK), (1, HQ, SQ, SK), (HQ, 1, SK), (SQ, SK), (B, 1, 1, SK), (B, HQ, SQ, 1), (1,)]
CASES = [dict(), dict(causal=True), dict(window_size=(5, 2), softcap=2.5), dict(causal=True, softmax_scale=0.3)]


def _inputs(rng, dtype=np.float32):
    q = rng.standard_normal((B, SQ, HQ, D)).astype(dtype)
    k = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    v = rng.standard_normal((B, SK, HKV, D)).astype(dtype)
    return q, k, v, rng.standard_normal(q.shape).astype(dtype)


def _run(backend, q, k, v, dout, bias, **kw):
    """out, lse, dq, dk, dv and dbias (None where the backend does not compute it)."""
    op = backend_registry.get("flash", backend=backend)
    out, lse = op.forward(q, k, v, attn_bias=bias, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, attn_bias=bias, return_dbias=DBIAS[backend], **kw)
    return (out, lse) + tuple(grads) + ((None,) if len(grads) == 3 else ())


def _rel(got, want):
    """Relative L2 error; a gradient that is 0 in exact arithmetic (a bias constant along each row moves no
    probability) is measured against 1 instead."""
    return np.linalg.norm(np.asarray(got, np.float64) - want) / max(np.linalg.norm(want), 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_forward_backward_and_dbias_match_reference(backend, shape, case):
    rng = np.random.default_rng(hash((shape, case)) % 2**32)
    q, k, v, dout = _inputs(rng)
    bias = (2 * rng.standard_normal(shape)).astype(np.float32)
    kw = CASES[case]
    out, lse, dq, dk, dv, dbias = _run(backend, q, k, v, dout, bias, **kw)
    want_out, want_lse = attention_ref(q, k, v, attn_bias=bias, **kw)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, **kw)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        if got is None and not DBIAS[backend]:
            continue
        assert got.shape == ref.shape, name
        assert _rel(got, ref) <= 2e-5, (name, _rel(got, ref))
    assert dbias is None or dbias.dtype == bias.dtype
    if shape[-1] != 1:  # a bias constant along each row moves no probability; any other changes the answer
        assert np.abs(attention_ref(q, k, v, **kw)[0] - want_out).max() > 1e-2


@pytest.mark.parametrize("backend", BACKENDS)
def test_minus_inf_hides_keys_and_nan_poisons_only_its_row(backend):
    rng = np.random.default_rng(31)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    bias[0, 3] = -np.inf                 # head 0, row 3: every key hidden, so it sees nothing
    bias[1, :, 5] = -np.inf              # head 1: key 5 hidden from every row ...
    v[:, 5, 0] = np.nan                  # ... so the NaN of kv head 0 at key 5 reaches head 0, not head 1
    bias[2, 7, 11] = np.nan              # head 2, row 7: poisoned
    out, lse, dq, dk, dv, dbias = _run(backend, q, k, v, dout, bias, causal=True)
    want_out, want_lse = attention_ref(q, k, v, attn_bias=bias, causal=True)
    assert np.array_equal(np.isnan(out), np.isnan(want_out))
    assert np.array_equal(np.isnan(lse), np.isnan(want_lse))
    assert np.all(out[:, 3, 0] == 0) and np.all(lse[:, 0, 3] == np.inf)
    assert np.all(np.isnan(out[:, 7, 2])) and np.isfinite(out[:, 6, 2]).all()
    assert np.isfinite(out[:, :, 1]).all()
    assert np.isnan(np.delete(out[:, :, 0], 3, axis=1)).all()
    ok = ~np.isnan(want_out)
    np.testing.assert_allclose(out[ok], want_out[ok], atol=2e-5, rtol=0)
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, causal=True, return_dbias=True)
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), (dq, dk, dv, dbias), want):
        if got is None and not DBIAS[backend]:
            continue
        assert np.array_equal(np.isnan(got), np.isnan(ref)), name
        fin = ~np.isnan(ref)
        np.testing.assert_allclose(got[fin], ref[fin], atol=5e-5, rtol=0, err_msg=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_within_twice_naive_error(backend, dtype):
    rng = np.random.default_rng(32)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((1, HQ, SQ, SK)).astype(np.float32)
    tdt = getattr(torch, dtype)
    t = {n: torch.from_numpy(x).to(tdt) for n, x in dict(q=q, k=k, v=v, dout=dout, bias=bias).items()}
    out, lse, dq, dk, dv, dbias = _run(backend, t["q"], t["k"], t["v"], t["dout"], t["bias"], causal=True)
    rounded = {n: x.float().numpy() for n, x in t.items()}
    want = attention_ref(rounded["q"], rounded["k"], rounded["v"], attn_bias=rounded["bias"], causal=True)[0]
    # naive attention in the same dtype, the yardstick flash-attn's tests use
    s = torch.einsum("bqhd,bkhd->bhqk", t["q"], t["k"].repeat_interleave(2, dim=2)) / D ** 0.5 + t["bias"]
    s = s.masked_fill(~torch.ones(SQ, SK, dtype=torch.bool).tril(SK - SQ), float("-inf"))
    naive = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), t["v"].repeat_interleave(2, dim=2))
    err, naive_err = np.abs(out.float().numpy() - want).max(), np.abs(naive.float().numpy() - want).max()
    assert err <= 2 * naive_err + 1e-3, (err, naive_err)
    if not DBIAS[backend]:
        return
    assert dbias.dtype == tdt and dbias.shape == (1, HQ, SQ, SK)
    want_dbias = attention_ref_backward(rounded["dout"], rounded["q"], rounded["k"], rounded["v"],
                                        attn_bias=rounded["bias"], causal=True, return_dbias=True)[3]
    assert _rel(dbias.float().numpy(), want_dbias) <= 3e-2


@pytest.mark.parametrize("backend", [b for b in BACKENDS if DBIAS[b]])
def test_flash_attn_func_gives_dbias_to_autograd(backend):
    rng = np.random.default_rng(33)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    tq, tk, tv, tb = (torch.from_numpy(x).requires_grad_() for x in (q, k, v, bias))
    out = numba_flash.flash_attn_func(tq, tk, tv, causal=True, softcap=3.0, attn_bias=tb, backend=backend)
    out.backward(torch.from_numpy(dout))
    np.testing.assert_allclose(out.detach().numpy(), attention_ref(q, k, v, causal=True, softcap=3.0,
                                                                   attn_bias=bias)[0], atol=2e-5, rtol=0)
    want = attention_ref_backward(dout, q, k, v, causal=True, softcap=3.0, attn_bias=bias, return_dbias=True)
    for got, ref in zip((tq.grad, tk.grad, tv.grad, tb.grad), want):
        assert _rel(got.numpy(), ref) <= 2e-5
    # A bias that needs no gradient gets none, and the inputs are left as they were.
    frozen = torch.from_numpy(bias.copy())
    tq.grad = None
    numba_flash.flash_attn_func(tq, tk, tv, attn_bias=frozen, backend=backend).sum().backward()
    assert frozen.grad is None and tq.grad is not None and np.array_equal(frozen.numpy(), bias)


def test_flash_attn_func_on_cpu_chooses_the_cpu_kernels_for_dbias_too():
    rng = np.random.default_rng(35)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    call = dict(causal=True, attn_bias=bias)
    assert backend_registry.get("flash").explain(q, k, v, **call).chosen == "cpu"
    tq, tk, tv, tb = (torch.from_numpy(x).requires_grad_() for x in (q, k, v, bias))
    out = numba_flash.flash_attn_func(tq, tk, tv, causal=True, attn_bias=tb)
    out.backward(torch.from_numpy(dout))
    want = attention_ref_backward(dout, q, k, v, causal=True, attn_bias=bias, return_dbias=True)
    for got, ref in zip((tq.grad, tk.grad, tv.grad, tb.grad), want):
        assert _rel(got.numpy(), ref) <= 2e-5


def test_dbias_with_a_score_mod_on_the_torch_path():
    """The bias enters before score_mod, so its gradient takes score_mod_grad's factor (the cpu kernels' dbias with
    mods: tests/numba_flash/test_mods_backends.py, with the set of mods compiled there)."""
    rng = np.random.default_rng(37)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((SQ, SK)).astype(np.float32)
    mods = dict(score_mod=_doubled, score_mod_grad=_two)
    out, lse = (x.astype(np.float32) for x in attention_ref(q, k, v, attn_bias=bias, score_mod=_doubled))
    dbias = backend_registry.get("flash", backend="rocm").backward(dout, q, k, v, out, lse, attn_bias=bias,
                                                                   return_dbias=True, **mods)[3]
    want = attention_ref_backward(dout, q, k, v, attn_bias=bias, return_dbias=True, **mods)[3]
    assert _rel(dbias, want) <= 2e-5


def _doubled(score, b, h, q_idx, kv_idx):
    return 2.0 * score


def _two(score, b, h, q_idx, kv_idx):
    return 2.0


# Sizes that cross the CPU kernels' 64 x 64 tiles (partial last tiles both ways), every way to broadcast.
CPU_SHAPES = [(2, 3, 150, 133), (150, 133), (3, 1, 133), (2, 1, 1, 133), (150, 1)]
CPU_CASES = [dict(), dict(causal=True), dict(window_size=(40, 9), softcap=3.0), dict(dropout_p=0.2, dropout_seed=3),
             dict(alibi_slopes=np.array([0.3, 0.05, 0.7]))]


@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("case", range(len(CPU_CASES)))
def test_cpu_kernels_across_tiles_with_hidden_pairs(case, dtype, tol):
    rng = np.random.default_rng(36 + case)
    q = rng.standard_normal((2, 150, 3, 24)).astype(dtype)
    k, v = (rng.standard_normal((2, 133, 1, 24)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    shape = CPU_SHAPES[case]
    bias = rng.standard_normal(shape).astype(dtype)
    bias[rng.random(shape) < 0.2] = -np.inf   # hidden pairs everywhere, in blocks no band mask touches too
    kw = dict(CPU_CASES[case], attn_bias=bias)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    np.testing.assert_allclose(out, want_out, atol=tol, rtol=0)
    seen = np.isfinite(want_lse)
    assert np.array_equal(lse[~seen], want_lse[~seen])
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=tol, rtol=tol)
    # dbias too: with 3 query tiles and 2 threads, a bias broadcast over batch, heads or queries is summed by runs
    # cut into parts with partial sums of their own (backward._dbias_parts).
    grads = op.backward(dout, q, k, v, out, lse, return_dbias=True, **kw)
    want = attention_ref_backward(dout, q, k, v, return_dbias=True, **kw)
    assert grads[3].shape == bias.shape and grads[3].dtype == dtype
    for name, got, ref in zip(("dq", "dk", "dv", "dbias"), grads, want):
        assert _rel(got, ref) <= tol, name   # a bias constant along each row has dbias 0: against 1 there
    assert not grads[3][np.isneginf(bias)].any()   # a hidden pair has no gradient


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_value_row_reaches_only_the_queries_the_bias_lets_see_it(backend):
    """Whole 64 x 64 tiles with no band mask: only the bias decides who sees key 70, whose v row is NaN."""
    rng = np.random.default_rng(38)
    q, k = (rng.standard_normal((1, 128, 2, 16)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((1, 128, 2, 16)).astype(np.float32)
    v[0, 70, 1, 5] = np.nan
    bias = rng.standard_normal((128, 128)).astype(np.float32)
    blind = rng.random(128) < 0.5          # these queries do not see key 70
    bias[blind, 70] = -np.inf
    out = backend_registry.get("flash", backend=backend).forward(q, k, v, attn_bias=bias)
    want = attention_ref(q, k, v, attn_bias=bias)[0]
    assert np.isnan(out[0, ~blind, 1]).any(axis=-1).all() and not np.isnan(out[0, blind, 1]).any()
    assert not np.isnan(out[0, :, 0]).any()
    seen = ~np.isnan(want)
    assert np.array_equal(seen, ~np.isnan(out))
    np.testing.assert_allclose(out[seen], want[seen], atol=2e-5, rtol=0)


@pytest.mark.parametrize("nheads_kv", [1, 3])   # dbias in the query-tile pass (1) or in the fused key-tile pass (3)
def test_dbias_keeps_a_nan_key_out_of_the_queries_that_do_not_see_it(nheads_kv):
    """softcap's chain factor is NaN at a pair whose raw score is (a NaN key row), also where the window hides the
    pair: asking for dbias must not carry that NaN into dq, dk or dv, and dbias is NaN exactly where the
    reference's is."""
    rng = np.random.default_rng(39)
    q = rng.standard_normal((2, 150, 3, 16)).astype(np.float32)
    k, v = (rng.standard_normal((2, 140, nheads_kv, 16)).astype(np.float32) for _ in range(2))
    k[1, 100, 0, 3] = np.nan
    dout = rng.standard_normal(q.shape).astype(np.float32)
    bias = rng.standard_normal((3, 150, 140)).astype(np.float32)
    kw = dict(window_size=(20, 5), softcap=4.0, attn_bias=bias)
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, return_dbias=True, **kw)
    for name, got, plain in zip(("dq", "dk", "dv"), grads, op.backward(dout, q, k, v, out, lse, **kw)):
        bad = np.isnan(plain)
        assert np.array_equal(np.isnan(got), bad) and not bad.all(), name
        assert _rel(got[~bad], plain[~bad]) <= 1e-6, name
    want = attention_ref_backward(dout, q, k, v, return_dbias=True, **kw)[3]
    bad = np.isnan(want)
    assert np.array_equal(np.isnan(grads[3]), bad) and bad.any() and not bad.all()
    assert _rel(grads[3][~bad], want[~bad]) <= 2e-5


def test_every_backend_takes_a_bias_and_cuda_sums_dbias_of_every_broadcast():
    from backends.base import Backend
    from numba_flash.validation import validate_backward, validate_forward

    rng = np.random.default_rng(34)
    q, k, v, dout = _inputs(rng)
    bias = rng.standard_normal((SQ, SK)).astype(np.float32)
    call = validate_forward(q, k, v, attn_bias=bias)
    for be in backend_registry.backends("flash"):
        assert "attn_bias not supported" not in be.feature_reasons(call), be.name   # cuda's: simulator-tested
    assert "attn_bias not supported" in Backend.feature_reasons(Backend(), call)
    out, lse = attention_ref(q, k, v, attn_bias=bias)
    grad_call = validate_backward(dout, q, k, v, out.astype(np.float32), lse.astype(np.float32), attn_bias=bias,
                                  return_dbias=True)
    cuda = next(be for be in backend_registry.backends("flash") if be.name == "cuda")
    # The cuda kernels sum dbias over any broadcast axes, with dropout too (test_dbias_sim.py runs them).
    assert cuda.feature_reasons(grad_call) == []
    for shape in [(1, SK), (SQ, 1), (1, 1), (SQ, SK)]:
        broadcast = rng.standard_normal(shape).astype(np.float32)
        out_k, lse_k = attention_ref(q, k, v, attn_bias=broadcast, dropout_p=0.2, dropout_seed=5)
        assert cuda.feature_reasons(validate_backward(dout, q, k, v, out_k.astype(np.float32),
                                                      lse_k.astype(np.float32), attn_bias=broadcast,
                                                      return_dbias=True, dropout_p=0.2, dropout_seed=5)) == []
    per_head = rng.standard_normal((HQ, SQ, SK)).astype(np.float32)
    out, lse = attention_ref(q, k, v, attn_bias=per_head)
    assert cuda.feature_reasons(validate_backward(dout, q, k, v, out.astype(np.float32), lse.astype(np.float32),
                                                  attn_bias=per_head, return_dbias=True)) == []
    assert f"attn_bias(1, 1, {SQ}, {SK})" in backend_registry.get("flash").explain(q, k, v, attn_bias=bias)


@pytest.mark.parametrize("bias,match", [
    (np.ones((SQ, SK + 1), np.float32), r"broadcastable to \(B, Hq, Sq, Sk\) = \(2, 4, 23, 37\), got shape"),
    (np.ones((HKV, SQ, SK), np.float32), "got shape"),
    (np.ones((1, 1, 1, SQ, SK), np.float32), "got shape"),
    (np.ones((SQ, SK), np.int32), "dtype float32 or q's dtype"),
    (np.ones((SQ, SK), np.float64), "dtype float32 or q's dtype"),
    ([[0.0] * SK] * SQ, "got an object of type list"),
])
def test_bad_bias(bias, match):
    rng = np.random.default_rng(35)
    q, k, v, _ = _inputs(rng)
    with pytest.raises(AttentionInputError, match=f"^attn_bias: expected .*{match}"):
        backend_registry.get("flash", backend="rocm").forward(q, k, v, attn_bias=bias)


def test_bias_of_another_kind_packed_or_dbias_without_bias_is_refused():
    rng = np.random.default_rng(36)
    q, k, v, dout = _inputs(rng)
    op = backend_registry.get("flash", backend="rocm")
    with pytest.raises(AttentionInputError, match="^attn_bias: expected a numpy array"):
        op.forward(q, k, v, attn_bias=torch.zeros(SQ, SK))
    cu_q, cu_k = np.array([0, SQ, 2 * SQ], np.int32), np.array([0, SK, 2 * SK], np.int32)
    with pytest.raises(AttentionInputError, match="^attn_bias: expected None for packed sequences"):
        op.forward(q.reshape(2 * SQ, HQ, D), k.reshape(2 * SK, HKV, D), v.reshape(2 * SK, HKV, D),
                   cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, attn_bias=np.zeros((SQ, SK), np.float32))
    out, lse = op.forward(q, k, v, return_lse=True)
    with pytest.raises(AttentionInputError, match="^return_dbias: expected False when no attn_bias"):
        op.backward(dout, q, k, v, out, lse, return_dbias=True)
