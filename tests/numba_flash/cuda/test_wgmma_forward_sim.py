"""The Hopper wgmma forward (tc_forward.py's WGMMA path, ``tile_config_override(wgmma=True)``) under the simulator,
against the float64 reference: at most 2x naive attention's error in the same dtype, on fresh random inputs of
odd sizes, across the variants its softmax shares with the mma.sync kernel (masks, GQA, softcap, ALiBi, attn_bias,
Dv != D, a non-finite V) and both warpgroup counts' worth of rows.

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim \
tests/numba_flash/cuda/test_wgmma_forward_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from tc_sim_cases import break_small_tiles, forward, inputs, judge  # noqa: E402

WGMMA = dict(wgmma=True)


@pytest.fixture
def wgmma_launches(monkeypatch):
    """The tile configs the forward kernel factory built, so a test knows wgmma ran (not mma.sync)."""
    from numba_flash.cuda.kernels import tc_forward

    seen = []
    real = tc_forward.make_tc_forward_kernel

    def spy(cfg, *flags, **kw):
        seen.append(cfg)
        return real(cfg, *flags, **kw)

    monkeypatch.setattr(tc_forward, "make_tc_forward_kernel", spy)
    return seen


CASES = [
    # (dtype, B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param("float16", 1, 67, 83, 2, 1, 64, {}, id="f16-d64-gqa"),
    pytest.param("bfloat16", 1, 71, 45, 1, 1, 128, dict(causal=True), id="bf16-d128-causal-sq>sk"),
    pytest.param("float16", 2, 37, 90, 2, 2, 40, dict(window_size=(21, 3), softcap=2.5, softmax_scale=0.3),
                 id="f16-d40-window-softcap"),
    pytest.param("bfloat16", 1, 29, 77, 3, 1, 96, dict(alibi_slopes=np.array([0.7, 0.2, 0.05], np.float32),
                                                        causal=True), id="bf16-d96-alibi-mqa"),
]


@pytest.mark.parametrize("dtype,b,sq,sk,hq,hkv,d,kw", CASES)
def test_against_the_reference(rng, wgmma_launches, dtype, b, sq, sk, hq, hkv, d, kw):
    (q, k, v), (q64, k64, v64) = inputs(rng, dtype, b, sq, sk, hq, hkv, d)
    copies = [x.clone() for x in (q, k, v)]
    out, lse = forward(q, k, v, tiles=WGMMA, **kw)
    assert all(torch.equal(x, c) for x, c in zip((q, k, v), copies))   # inputs untouched
    judge(out, lse, q, k, v, q64, k64, v64, dtype, **kw)
    assert wgmma_launches and all(cfg.kernel == "wgmma_forward" for cfg in wgmma_launches)


def test_two_warpgroups_each_multiply_their_own_64_rows(rng, wgmma_launches):
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 150, 61, 1, 1, 64)
    out, lse = forward(q, k, v, tiles=dict(wgmma=True, block_m=128, threads=256), causal=True)
    judge(out, lse, q, k, v, q64, k64, v64, "float16", causal=True)
    assert {(cfg.block_m, cfg.threads) for cfg in wgmma_launches} == {(128, 256)}


def test_attn_bias_and_a_v_head_dim_of_its_own(rng, wgmma_launches):
    (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 33, 50, 2, 1, 72)
    v = torch.from_numpy(rng.standard_normal((1, 50, 1, 104)).astype(np.float32)).half()   # Dv = 104, bucket 128
    v64 = v.double().numpy()
    bias = rng.standard_normal((1, 2, 33, 50)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    kw = dict(attn_bias=torch.from_numpy(bias), causal=True)
    out, lse = forward(q, k, v, tiles=WGMMA, **kw)
    assert out.shape == (1, 33, 2, 104)
    judge(out, lse, q, k, v, q64, k64, v64, "float16", attn_bias=bias, causal=True)
    assert all(cfg.kernel == "wgmma_forward" for cfg in wgmma_launches)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_an_inf_in_v_poisons_exactly_its_column_of_the_rows_that_see_it(rng):
    (q, k, v), _ = inputs(rng, "bfloat16", 1, 70, 70, 1, 1, 64)
    clean_out, clean_lse = forward(q, k, v, tiles=WGMMA, causal=True)
    v[0, 66, 0, 3] = float("inf")   # in the second key tile: rows 66 and on see it
    out, lse = forward(q, k, v, tiles=WGMMA, causal=True)
    o, co = out[0, :, 0].float().numpy(), clean_out[0, :, 0].float().numpy()
    poisoned = np.arange(70) >= 66
    assert np.isnan(o[poisoned, 3]).all() and np.isfinite(np.delete(o, 3, axis=1)).all()
    np.testing.assert_array_equal(o[~poisoned], co[~poisoned])
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(clean_lse))


def test_explain_says_when_the_forward_runs_on_wgmma_and_why_it_cannot(rng):
    from backends import backend_registry
    from numba_flash.cuda import tile_config_override

    (q, k, v), _ = inputs(rng, "float16", 1, 5, 5, 1, 1, 64)
    op = backend_registry.get("flash", backend="cuda")
    assert "wgmma" not in str(op.explain(q, k, v))
    with tile_config_override(wgmma=True):
        assert "the forward on Hopper's wgmma kernel" in str(op.explain(q, k, v))
    (q, k, v), _ = inputs(rng, "float16", 1, 5, 5, 1, 1, 256)
    with tile_config_override(wgmma=True):
        assert "wgmma=True: head dim 256" in str(op.explain(q, k, v))


def test_a_wgmma_kernel_that_fails_its_self_check_gives_way_to_mma_sync(rng, monkeypatch):
    """With the first-use check on, a broken wgmma specialisation (its output scaled by 1.01: float16's bound is
    2e-3) gives way to the mma.sync forward, and explain() says so."""
    from backends import backend_registry
    from numba_flash.cuda import selfcheck, tile_config_override

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")

    def corrupt(out):   # uint16 bits of float16
        out[...] = (out.copy_to_host().view(np.float16) * np.float16(1.01)).view(np.uint16)

    break_small_tiles(monkeypatch, "make_tc_forward_kernel", corrupt, lambda cfg: cfg.kernel == "wgmma_forward")
    selfcheck.reset()
    try:
        (q, k, v), (q64, k64, v64) = inputs(rng, "float16", 1, 21, 37, 2, 1, 64)
        out, lse = forward(q, k, v, tiles=WGMMA, causal=True)
        judge(out, lse, q, k, v, q64, k64, v64, "float16", causal=True)
        verdicts = {(s.cfg.kernel, s.cfg.block_m, s.cfg.block_n): v.passed
                    for (_, s), v in selfcheck.verdicts().items()}
        assert verdicts == {("wgmma_forward", 64, 64): False, ("tc_forward", 64, 32): True}
        with tile_config_override(wgmma=True):
            text = str(backend_registry.get("flash", backend="cuda").explain(q, k, v, causal=True))
        assert "self-check failed for wgmma_forward 64x64/128" in text and "using tc_forward 64x32/128" in text
    finally:
        selfcheck.reset()
