"""Dropout in the tensor-core kernels (``numba_flash.cuda.kernels.tc_forward``, ``tc_dkdv``, ``tc_dq``) under the simulator:
out, lse, dQ, dK and dV in float16 and bfloat16 against the float64 reference with the same seed (its mask is
``numba_flash.dropout_mask``, the one every backend draws), within the contract's bound and at most twice the error
of attention computed plainly in the same dtype with that mask; the keep mask read back from the forward's output
and from dV (the dK/dV kernel holds the scores transposed) equals ``dropout_mask`` exactly; and the kernels that ran
were the tensor-core ones, built with dropout.

Tiles are one or two warps: the simulator runs a Python thread per CUDA thread.
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward, dropout_mask
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from tc_sim_cases import BOUND, ONE_WARP, TORCH_DTYPE, inputs, judge, naive_same_dtype, rel_l2  # noqa: E402

SEED = 2 ** 63 + 977     # the top bit set: the key's high word is not a small number
P = 0.3
#: Two warps in every kernel: 32 query rows in the forward and dQ kernels, 32 keys in the dK/dV kernel.
TWO_WARPS_BOTH_WAYS = dict(block_m=32, block_n=32, threads=64, tensor_cores=True)


@pytest.fixture
def tc_builds(monkeypatch):
    """The tensor-core kernels built, as (kernel, dropout) per factory call."""
    from cuda_sim_cases import factory_home

    seen = []
    for name in ("make_tc_forward_kernel", "make_tc_dkdv_kernel", "make_tc_dq_kernel"):
        home = factory_home(name)
        real = getattr(home, name)

        def spy(cfg, *flags, _real=real):
            seen.append((cfg.kernel, flags[-3]))   # (..., dropout, async_copy, mods)
            return _real(cfg, *flags)

        monkeypatch.setattr(home, name, spy)
    return seen


def run(q, k, v, dout=None, tiles=ONE_WARP, **kw):
    """(out, lse) of the cuda backend, and with ``dout`` also (dq, dk, dv) from the forward's out and lse."""
    with tile_config_override(**tiles):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        if dout is None:
            return out, lse
        return (out, lse) + tuple(op.backward(dout, q, k, v, out, lse, **kw))


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs): odd sizes, so that tiles end inside a fragment
    pytest.param(1, 19, 23, 2, 2, 16, {}, id="ragged"),
    pytest.param(2, 19, 23, 2, 1, 16, dict(causal=True), id="causal-gqa2-batch2"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_forward_and_backward_against_the_reference(rng, tc_builds, dtype, b, sq, sk, hq, hkv, d, kw):
    (q, k, v), (q64, k64, v64) = inputs(rng, dtype, b, sq, sk, hq, hkv, d)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).to(TORCH_DTYPE[dtype])
    kw = dict(kw, dropout_p=P, dropout_seed=SEED)
    out, lse, *grads = run(q, k, v, dout, **kw)
    assert sorted(set(tc_builds)) == [("tc_backward_dkdv", True), ("tc_backward_dq", True), ("tc_forward", True)]
    judge(out, lse, q, k, v, q64, k64, v64, dtype, **kw)   # lse: the softmax's, before dropout

    ref = attention_ref_backward(dout.double().numpy(), q64, k64, v64, **kw)
    _, naive = naive_same_dtype(q, k, v, dout=dout, **kw)
    for name, got, want, plain in zip(("dq", "dk", "dv"), grads, ref, naive):
        assert got.dtype == q.dtype and got.shape == want.shape, name
        err, naive_err = rel_l2(got.double().numpy(), want), rel_l2(plain, want)
        assert err <= BOUND[dtype] and err <= 2 * naive_err, (name, err, naive_err)

    # The factor matters: without dropout the answers are far from these (a kernel that ignored it would fail
    # above), and the reference's own p = 0 answer is as far.
    no_dropout = attention_ref(q64, k64, v64, **dict(kw, dropout_p=0.0))[0]
    assert rel_l2(out.double().numpy(), no_dropout) > 20 * BOUND[dtype]
    no_dropout_dv = attention_ref_backward(dout.double().numpy(), q64, k64, v64, **dict(kw, dropout_p=0.0))[2]
    assert rel_l2(grads[2].double().numpy(), no_dropout_dv) > 20 * BOUND[dtype]


def test_two_warps_and_the_sliding_window(rng, tc_builds):
    """Two warps per block in every kernel (a warp's rows, and the dK/dV kernel's keys, start at 16), a window."""
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 37, 41, 2, 1, 16)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).to(torch.float16)
    kw = dict(window_size=(9, 4), softcap=3.0, dropout_p=0.5, dropout_seed=7)
    out, lse, *grads = run(q, k, v, dout, TWO_WARPS_BOTH_WAYS, **kw)
    assert {kernel for kernel, dropout in tc_builds if dropout} == {"tc_forward", "tc_backward_dkdv",
                                                                     "tc_backward_dq"}
    judge(out, lse, q, k, v, q64, k64, v64, "float16", **kw)
    ref = attention_ref_backward(dout.double().numpy(), q64, k64, v64, **kw)
    _, naive = naive_same_dtype(q, k, v, dout=dout, **kw)
    for name, got, want, plain in zip(("dq", "dk", "dv"), grads, ref, naive):
        err, naive_err = rel_l2(got.double().numpy(), want), rel_l2(plain, want)
        assert err <= BOUND["float16"] and err <= 2 * naive_err, (name, err, naive_err)


@pytest.mark.parametrize("tiles", [ONE_WARP, TWO_WARPS_BOTH_WAYS], ids=["one-warp", "two-warps"])
def test_the_keep_mask_is_dropout_mask(rng, tc_builds, tiles):
    """With V the identity, out[b, i, h, j] is row i's probability of key j times its factor, and with dO the
    identity, dV[b, j, h, i] is the same from the dK/dV kernel's transposed fragments: every probability of random
    scores is positive, so both are nonzero exactly where ``dropout_mask`` keeps the pair, and out is the
    reference's dropped probabilities."""
    b, sq, sk, h, d = 2, 19, 23, 2, 32
    (q, k, _), (q64, k64, _) = inputs(rng, "float16", b, sq, sk, h, h, d, scale=0.5)
    v = torch.eye(sk, d, dtype=torch.float16)[None, :, None, :].expand(b, sk, h, d).contiguous()
    dout = torch.eye(sq, d, dtype=torch.float16)[None, :, None, :].expand(b, sq, h, d).contiguous()
    out, _, _, _, dv = run(q, k, v, dout, tiles, dropout_p=P, dropout_seed=SEED)
    assert {kernel for kernel, dropout in tc_builds if dropout} == {"tc_forward", "tc_backward_dkdv",
                                                                     "tc_backward_dq"}
    keep = dropout_mask(SEED, b, h, sq, sk, P)
    kept_out = out.double().numpy()[..., :sk].transpose(0, 2, 1, 3) != 0        # (b, h, i, j)
    kept_dv = dv.double().numpy()[..., :sq].transpose(0, 2, 3, 1) != 0          # (b, h, i, j)
    assert np.array_equal(kept_out, keep)
    assert np.array_equal(kept_dv, keep)
    assert 0.5 < keep.mean() < 0.9
    want = attention_ref(q64, k64, v.double().numpy(), dropout_p=P, dropout_seed=SEED)[0]
    assert rel_l2(out.double().numpy(), want) <= BOUND["float16"]


def test_explain_says_tensor_cores_with_dropout(rng):
    op = backend_registry.get("flash", backend="cuda")
    (q, k, v), _ = inputs(rng, "bfloat16", 1, 5, 7, 1, 1, 16)
    text = str(op.explain(q, k, v, dropout_p=0.2, dropout_seed=1))
    assert "tensor-core kernels (mma.sync, bfloat16), forward and backward" in text


def test_the_first_use_self_check_passes_the_dropout_kernels(rng, monkeypatch):
    """With the check on, each tensor-core kernel is checked with dropout on against the self-check's own
    reference (selfcheck.py draws the same mask), and passes: a false failure would turn the backend away."""
    from numba_flash.cuda import selfcheck

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    selfcheck.reset()
    try:
        (q, k, v), _ = inputs(rng, "bfloat16", 1, 9, 11, 1, 1, 16)
        run(q, k, v, torch.ones_like(q), causal=True, dropout_p=P, dropout_seed=SEED)
        checked = {(s.cfg.kernel, s.dropout, verdict.passed) for (_, s), verdict in selfcheck.verdicts().items()}
        assert checked == {("tc_forward", True, True), ("tc_backward_dkdv", True, True),
                           ("tc_backward_dq", True, True)}
    finally:
        selfcheck.reset()
