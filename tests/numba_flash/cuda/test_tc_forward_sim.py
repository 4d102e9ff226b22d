"""The tensor-core forward kernel (``numba_flash.cuda.kernels.tc_forward``) under the simulator, whose warp primitives are
the emulations of ``warp_sim.py``: float16 and bfloat16 against the float64 reference, judged as flash-attn judges
low precision (relative L2 within the contract's bound, and at most twice the error of attention computed plainly
in the same dtype), lse against the reference's, every mask and variant the kernel takes, both tile-copy paths
(``cp.async`` and plain loads), and the non-finite rule.

Tiles are one or two warps (16 or 32 query rows, 16 keys): the simulator runs a Python thread per CUDA thread.
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from tc_sim_cases import (BOUND, ONE_WARP, TWO_WARPS, break_small_tiles, forward, inputs,  # noqa: E402
                          judge, rel_l2)


@pytest.fixture
def tc_launches(monkeypatch):
    """The tensor-core kernels launched, as (config, async_copy) per factory call."""
    from numba_flash.cuda.kernels import tc_forward

    seen = []
    real = tc_forward.make_tc_forward_kernel

    def spy(cfg, *flags):
        seen.append((cfg, flags[-2]))   # (..., async_copy, mods)
        return real(cfg, *flags)

    monkeypatch.setattr(tc_forward, "make_tc_forward_kernel", spy)
    return seen


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param(2, 21, 37, 2, 2, 16, {}, id="ragged"),
    # A warp's band edge exactly one key short of a tile's end (row 0 sees keys <= 14 of the first 16-key tile,
    # row 16 <= 30; with a left window the last row of a warp starts one key into a tile): such a tile is an edge
    # tile by one key.
    pytest.param(1, 32, 46, 1, 1, 16, dict(causal=True), id="causal-edge-by-one"),
    pytest.param(1, 32, 32, 1, 1, 16, dict(window_size=(14, 0)), id="left-edge-by-one"),
    pytest.param(1, 35, 19, 2, 1, 24, dict(causal=True), id="causal-sq>sk-gqa"),
    pytest.param(1, 13, 40, 2, 2, 32, dict(causal=True), id="causal-sq<sk"),
    pytest.param(1, 29, 23, 3, 1, 16, dict(window_size=(3, 2)), id="window-empty-rows-mqa"),
    pytest.param(1, 18, 45, 2, 1, 40, dict(window_size=(20, -1), softcap=2.5, softmax_scale=0.3),
                 id="left-window-softcap-bucket64"),
    pytest.param(1, 17, 33, 2, 1, 16, dict(alibi_slopes=np.array([0.7, 0.2], np.float32), causal=True),
                 id="alibi"),
]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_against_the_reference(rng, tc_launches, dtype, b, sq, sk, hq, hkv, d, kw):
    (q, k, v), (q64, k64, v64) = inputs(rng, dtype, b, sq, sk, hq, hkv, d)
    copies = [x.clone() for x in (q, k, v)]
    out, lse = forward(q, k, v, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert all(torch.equal(x, c) for x, c in zip((q, k, v), copies))   # inputs untouched
    judge(out, lse, q, k, v, q64, k64, v64, dtype, **kw)
    assert tc_launches and all(async_copy for _, async_copy in tc_launches)   # D % 8 == 0, contiguous


def test_two_warps_and_plain_loads_for_an_unaligned_head_dim(rng, tc_launches):
    # D = 20: rows of 40 bytes are not 16-byte aligned, so the tiles come in through plain loads.
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 45, 30, 2, 1, 20)
    out, lse = forward(q, k, v, tiles=TWO_WARPS, causal=True)
    judge(out, lse, q, k, v, q64, k64, v64, "float16", causal=True)
    assert [(cfg.block_m, cfg.threads, a) for cfg, a in tc_launches] == [(32, 64, False)]


def test_a_strided_layout_uses_plain_loads_and_bhsd_the_async_ones(rng, tc_launches):
    from numba import cuda

    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 19, 26, 2, 2, 16)
    wide = np.zeros((1, 26, 2, 32), np.float16)
    wide[..., ::2] = k.numpy()
    # Simulated device arrays are taken as they are (host arrays would be copied contiguous): k strided along D.
    dq, dk, dv = cuda.to_device(q.numpy()), cuda.to_device(wide)[..., ::2], cuda.to_device(v.numpy())
    out, lse = forward(dq, dk, dv)
    out = torch.from_numpy(out.copy_to_host())
    judge(out, lse.copy_to_host(), q, k, v, q64, k64, v64, "float16")
    out_t, _ = forward(*(x.transpose(1, 2).contiguous() for x in (q, k, v)), layout="bhsd")
    assert torch.equal(out_t.transpose(1, 2), out)            # the same kernel math, another layout
    assert [a for _, a in tc_launches] == [False, True]


def test_bias_with_minus_inf_entries(rng):
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 20, 27, 2, 1, 16)
    bias = rng.standard_normal((1, 2, 20, 27)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[0, 1, 5] = -np.inf                                   # a row that sees nothing: 0 and lse +inf
    kw = dict(attn_bias=torch.from_numpy(bias), causal=True)
    out, lse = forward(q, k, v, **kw)
    ref, ref_lse = attention_ref(q64, k64, v64, attn_bias=bias, causal=True)
    assert torch.all(out[0, 5, 1] == 0) and lse[0, 1, 5] == np.inf
    judge(out, lse, q, k, v, q64, k64, v64, "float16", attn_bias=bias, causal=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("where,value,softcap", [("q", "nan", 0.0), ("q", "-inf", 0.0), ("k", "nan", 0.0),
                                                 ("k", "inf", 3.0), ("k", "-inf", 0.0), ("v", "inf", 0.0)])
def test_a_non_finite_input_poisons_exactly_the_rows_that_see_it(rng, where, value, softcap):
    # softcap's tanh would turn an inf score into a finite cap, and -inf would pass for a masked key: the raw
    # score must decide either way.
    (q, k, v), _ = inputs(rng, "float16", 1, 24, 30, 1, 1, 16)
    clean_out, clean_lse = forward(q, k, v, causal=True, softcap=softcap)
    x = {"q": q, "k": k, "v": v}[where]
    bad_row = 9 if where == "q" else 17
    x[0, bad_row, 0, 3] = float(value)
    out, lse = forward(q, k, v, causal=True, softcap=softcap)
    lse, clean_lse = np.asarray(lse), np.asarray(clean_lse)
    rows = np.arange(24)
    if where == "q":
        poisoned = rows == bad_row
    else:   # causal, bottom right: row i sees key j iff j <= i + 6
        poisoned = rows + 6 >= bad_row
    o, co = out[0, :, 0].float().numpy(), clean_out[0, :, 0].float().numpy()
    if where == "v":   # only the column that holds the inf
        assert np.isnan(o[poisoned, 3]).all() and np.isfinite(np.delete(o, 3, axis=1)).all()
        np.testing.assert_array_equal(lse, clean_lse)
    else:
        assert np.isnan(o[poisoned]).all() and np.isnan(lse[0, 0, poisoned]).all()
    np.testing.assert_array_equal(o[~poisoned], co[~poisoned])
    np.testing.assert_array_equal(lse[0, 0, ~poisoned], clean_lse[0, 0, ~poisoned])


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_minus_inf_bias_hides_a_non_finite_key(rng):
    # Key 11 of k is inf; the bias hides it from rows 0-9 (-inf), which must come out as without that key, while
    # rows 10-19 see it and are poisoned.
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 20, 23, 1, 1, 16)
    k[0, 11, 0, 5] = float("inf")
    k64[0, 11, 0, 5] = np.inf
    bias = rng.standard_normal((1, 1, 20, 23)).astype(np.float32)
    bias[0, 0, :10, 11] = -np.inf
    out, lse = forward(q, k, v, attn_bias=torch.from_numpy(bias))
    ref, ref_lse = attention_ref(q64, k64, v64, attn_bias=bias)
    o = out[0, :, 0].double().numpy()
    assert np.isnan(o[10:]).all() and np.isnan(np.asarray(lse)[0, 0, 10:]).all()
    assert np.isfinite(o[:10]).all()
    assert rel_l2(o[:10], ref[0, :10, 0]) <= BOUND["float16"]


def test_explain_names_the_tensor_core_kernels_and_why_not(rng):
    (q, k, v), _ = inputs(rng, "float16", 1, 5, 5, 1, 1, 16)
    op = backend_registry.get("flash", backend="cuda")
    assert "tensor-core" in str(op.explain(q, k, v))
    assert "SIMT" not in str(op.explain(q, k, v, dropout_p=0.1, dropout_seed=3))   # dropout runs on tensor cores
    with tile_config_override(tensor_cores=False):
        assert "switched off" in str(op.explain(q, k, v))
    with tile_config_override(block_m=8, block_n=8, threads=16):
        assert "does not fit the tensor-core kernels" in str(op.explain(q, k, v))


def test_the_first_use_self_check_covers_the_tensor_core_kernel(rng, monkeypatch):
    """With the check on, the tensor-core specialisation is checked once against the reference (on the copy path
    the call takes), and a broken one (its output scaled by 1.01: float16's bound is 2e-3) gives way to a fallback
    tile config that passes, with the reason in explain()."""
    from numba_flash.cuda import selfcheck

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    selfcheck.reset()
    try:
        (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 19, 23, 2, 1, 16)
        out, lse = forward(q, k, v, causal=True)
        judge(out, lse, q, k, v, q64, k64, v64, "float16", causal=True)
        checked = [(s.cfg.kernel, s.cfg.block_m, s.async_copy, verdict.passed)
                   for (_, s), verdict in selfcheck.verdicts().items()]
        assert checked == [("tc_forward", 16, True, True)]

        def corrupt(out):   # uint16 bits of float16
            out[...] = (out.copy_to_host().view(np.float16) * np.float16(1.01)).view(np.uint16)

        break_small_tiles(monkeypatch, "make_tc_forward_kernel", corrupt)
        selfcheck.reset()
        out, lse = forward(q, k, v, causal=True)
        judge(out, lse, q, k, v, q64, k64, v64, "float16", causal=True)
        verdicts = {(s.cfg.block_m, s.cfg.threads): v.passed for (_, s), v in selfcheck.verdicts().items()}
        assert verdicts == {(16, 32): False, (32, 64): True}
        with tile_config_override(**ONE_WARP):
            text = str(backend_registry.get("flash", backend="cuda").explain(q, k, v, causal=True))
        assert "self-check failed for tc_forward 16x16/32" in text and "using 32x32/64 instead" in text
    finally:
        selfcheck.reset()
