"""The tensor-core backward kernels (``numba_flash.cuda.kernels.tc_dkdv``, ``tc_dq``) under the simulator: dQ, dK and dV in
float16 and bfloat16 against the float64 reference, within the contract's bound and at most twice the error of
attention computed plainly in the same dtype (torch's autograd on the CPU), for every mask and variant the kernels
take, both tile-copy paths, GQA summed over the group, and the non-finite rule. The forward's out and lse come from
the same backend, as a training step would have them.

Tiles are one or two warps: the simulator runs a Python thread per CUDA thread.
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref_backward
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from tc_sim_cases import BOUND, ONE_WARP, TORCH_DTYPE, inputs, naive_same_dtype, rel_l2  # noqa: E402

#: Two warps in every kernel: 32 query rows in the forward and dQ kernels, 32 keys in the dK/dV kernel.
TWO_WARPS_BOTH_WAYS = dict(block_m=32, block_n=32, threads=64, tensor_cores=True)


@pytest.fixture
def tc_backward_launches(monkeypatch):
    """The tensor-core backward kernels built, as (kernel, config, async_copy) per factory call."""
    from cuda_sim_cases import factory_home

    seen = []
    for name in ("make_tc_dkdv_kernel", "make_tc_dq_kernel"):
        home = factory_home(name)
        real = getattr(home, name)

        def spy(cfg, *flags, _real=real):
            seen.append((cfg.kernel, cfg, flags[-2]))   # (..., async_copy, mods)
            return _real(cfg, *flags)

        monkeypatch.setattr(home, name, spy)
    return seen


def forward_backward(q, k, v, dout, tiles=ONE_WARP, **kw):
    """(out, lse, dq, dk, dv) of the cuda backend, the backward given the forward's out and lse."""
    if isinstance(kw.get("alibi_slopes"), np.ndarray):
        kw["alibi_slopes"] = torch.from_numpy(kw["alibi_slopes"])
    if isinstance(kw.get("attn_bias"), np.ndarray):
        kw["attn_bias"] = torch.from_numpy(kw["attn_bias"])
    with tile_config_override(**tiles):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        return (out, lse) + tuple(op.backward(dout, q, k, v, out, lse, **kw))


def numpy_kw(kw):
    return {key: (value.numpy() if isinstance(value, torch.Tensor) else value) for key, value in kw.items()}


def judge_gradients(grads, q, k, v, dout, dtype, **kw):
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    ref = attention_ref_backward(do64, q64, k64, v64, **numpy_kw(kw))
    _, naive = naive_same_dtype(q, k, v, dout=dout, **numpy_kw(kw))
    for name, got, want, plain in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        err, naive_err = rel_l2(got.double().numpy(), want), rel_l2(plain, want)
        assert err <= BOUND[dtype] and err <= 2 * naive_err, (name, err, naive_err)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param(2, 21, 37, 2, 2, 16, {}, id="ragged"),
    pytest.param(1, 35, 19, 4, 1, 24, dict(causal=True), id="causal-sq>sk-gqa4"),
    pytest.param(1, 13, 40, 2, 2, 32, dict(causal=True), id="causal-sq<sk"),
    pytest.param(1, 32, 46, 1, 1, 16, dict(causal=True), id="causal-edge-by-one"),
    pytest.param(1, 29, 23, 3, 1, 16, dict(window_size=(3, 2)), id="window-empty-rows-mqa"),
    pytest.param(1, 18, 45, 2, 1, 40, dict(window_size=(20, -1), softcap=2.5, softmax_scale=0.3),
                 id="left-window-softcap-bucket64"),
    pytest.param(1, 17, 33, 2, 1, 16, dict(alibi_slopes=np.array([0.7, 0.2], np.float32), causal=True),
                 id="alibi"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_gradients_against_the_reference(rng, tc_backward_launches, dtype, b, sq, sk, hq, hkv, d, kw):
    (q, k, v), _ = inputs(rng, dtype, b, sq, sk, hq, hkv, d)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).to(TORCH_DTYPE[dtype])
    copies = [x.clone() for x in (q, k, v, dout)]
    _, _, *grads = forward_backward(q, k, v, dout, **kw)
    assert all(torch.equal(x, c) for x, c in zip((q, k, v, dout), copies))   # inputs untouched
    judge_gradients(grads, q, k, v, dout, dtype, **kw)
    kernels = {kernel for kernel, _, _ in tc_backward_launches}
    assert kernels == {"tc_backward_dkdv", "tc_backward_dq"}


def test_two_warps_a_bias_and_plain_loads(rng, tc_backward_launches):
    # D = 20: rows of 40 bytes, not 16-byte aligned: the tiles come in through plain loads. A bias with -inf
    # entries (a row that sees nothing has zero gradients).
    (q, k, v), _ = inputs(rng, "float16", 1, 45, 33, 2, 1, 20)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    bias = rng.standard_normal((1, 2, 45, 33)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[0, 1, 7] = -np.inf
    kw = dict(attn_bias=bias, causal=True)
    _, _, dq, dk, dv = forward_backward(q, k, v, dout, tiles=TWO_WARPS_BOTH_WAYS, **kw)
    assert torch.all(dq[0, 7, 1] == 0)
    judge_gradients((dq, dk, dv), q, k, v, dout, "float16", **kw)
    assert {(kernel, a) for kernel, _, a in tc_backward_launches} == {("tc_backward_dkdv", False),
                                                                       ("tc_backward_dq", False)}


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("where,value", [("q", "nan"), ("k", "inf"), ("v", "nan"), ("dout", "inf")])
def test_a_non_finite_input_reaches_exactly_the_gradients_the_reference_says(rng, where, value):
    """The NaN pattern of every gradient equals the float64 reference's, and the finite entries stay within the
    bound: a masked pair's 0 never multiplies the inf into a row or key that does not see it."""
    (q, k, v), _ = inputs(rng, "float16", 1, 24, 30, 1, 1, 16)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    x = {"q": q, "k": k, "v": v, "dout": dout}[where]
    x[0, 9 if where in ("q", "dout") else 17, 0, 3] = float(value)
    _, _, *grads = forward_backward(q, k, v, dout, causal=True)
    q64, k64, v64, do64 = (t.double().numpy() for t in (q, k, v, dout))
    ref = attention_ref_backward(do64, q64, k64, v64, causal=True)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        got = got.double().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want)), (name, np.argwhere(np.isnan(got) != np.isnan(want)))
        ok = ~np.isnan(want)   # (an inf key poisons every row that sees it: all of dk may be NaN)
        assert not ok.any() or rel_l2(got[ok], want[ok]) <= BOUND["float16"], name


def test_explain_says_where_the_backward_runs(rng):
    op = backend_registry.get("flash", backend="cuda")
    (q, k, v), _ = inputs(rng, "float16", 1, 5, 7, 1, 1, 16)
    assert "tensor-core kernels (mma.sync, float16), forward and backward" in str(op.explain(q, k, v))
    assert "tensor-core kernels (mma.sync, float16), forward and backward" in str(
        op.explain(q, k, v, dropout_p=0.2, dropout_seed=1))
    (q, k, v), _ = inputs(rng, "bfloat16", 1, 5, 7, 1, 1, 200)
    text = str(op.explain(q, k, v))
    assert "tensor-core kernels (mma.sync, bfloat16); the backward on the SIMT kernels: head dim 200" in text


def test_head_dims_past_128_keep_the_simt_backward(rng, tc_backward_launches):
    (q, k, v), _ = inputs(rng, "float16", 1, 9, 7, 1, 1, 136)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    _, _, *grads = forward_backward(q, k, v, dout, tiles=dict(tensor_cores=None))
    judge_gradients(grads, q, k, v, dout, "float16")
    assert tc_backward_launches == []


def test_the_first_use_self_check_covers_the_tensor_core_backward(rng, monkeypatch):
    """With the check on, a float16 backward checks both tensor-core kernels once against the reference, on the copy
    path the call takes, before either runs."""
    from numba_flash.cuda import selfcheck

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    selfcheck.reset()
    try:
        (q, k, v), _ = inputs(rng, "float16", 1, 19, 23, 2, 1, 16)
        dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
        _, _, *grads = forward_backward(q, k, v, dout, causal=True)
        judge_gradients(grads, q, k, v, dout, "float16", causal=True)
        checked = sorted((s.cfg.kernel, s.async_copy, verdict.passed)
                         for (_, s), verdict in selfcheck.verdicts().items())
        assert checked == [("tc_backward_dkdv", True, True), ("tc_backward_dq", True, True),
                           ("tc_forward", True, True)]
    finally:
        selfcheck.reset()
