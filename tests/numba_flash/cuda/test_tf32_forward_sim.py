"""The TF32 forward kernel (``numba_flash.cuda.kernels.tf32_forward``, ``precision="tf32"``) under the simulator, whose
``mma_tf32`` and ``float_to_tf32`` are the emulations of ``warp_sim.py``: float32 inputs against the float64
reference, judged by the rule the "TF32" section of docs/guide/cuda.md states: at most twice the error of attention
computed plainly with TF32 products (q, k, v and the probabilities rounded to TF32, 10 mantissa bits, to nearest;
float32 elsewhere), and within 2e-3 relative L2 (these head dims); lse within twice the reference's own shift when q, k
and v are rounded so. Every variant the kernel takes, the non-finite rule,
the choice between it and the SIMT kernel, explain(), and the first-use self-check.

Tiles are one or two warps (16 or 32 query rows, 16 keys): the simulator runs a Python thread per CUDA thread.
Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import AttentionInputError, attention_ref
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim
torch = pytest.importorskip("torch")

from tc_sim_cases import break_small_tiles, naive_same_dtype, rel_l2  # noqa: E402

ONE_WARP = dict(block_m=16, block_n=16, threads=32)
TWO_WARPS = dict(block_m=32, block_n=16, threads=64)
BOUND = 2e-3


def to_tf32(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to TF32 as ``cvt.rna.tf32.f32`` does (nearest, ties away from zero), written here
    from the format's definition (not from the kernel's emulation): keep 10 mantissa bits; inf and NaN kept."""
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return np.where(np.isfinite(x), rounded, x).astype(np.float32)


@pytest.fixture
def tf32_launches(monkeypatch):
    """The TF32 kernel's builds, as (config, async_copy) per factory call."""
    from numba_flash.cuda.kernels import tf32_forward

    seen = []
    real = tf32_forward.make_tf32_forward_kernel

    def spy(cfg, *flags, **kw):
        seen.append((cfg, flags[6]))   # (has_left, has_right, softcap, alibi, bias, dropout, async_copy, mods)
        return real(cfg, *flags, **kw)

    monkeypatch.setattr(tf32_forward, "make_tf32_forward_kernel", spy)
    return seen


def inputs(rng, b, sq, sk, hq, hkv, d, dv=None):
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, dv or d))
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def forward(q, k, v, tiles=ONE_WARP, **kw):
    with tile_config_override(**tiles):
        return backend_registry.get("flash", backend="cuda").forward(q, k, v, return_lse=True, precision="tf32",
                                                                      **kw)


def judge(out, lse, q, k, v, **kw):
    """The TF32 rule against the float64 reference (module docstring)."""
    ref, ref_lse = attention_ref(*(x.astype(np.float64) for x in (q, k, v)), **kw)
    rounded = [to_tf32(x) for x in (q, k, v)]
    naive = naive_same_dtype(*(torch.from_numpy(x) for x in rounded), **kw,
                             round_p=lambda p: torch.from_numpy(to_tf32(p.numpy())))
    err, naive_err = rel_l2(out, ref), rel_l2(naive, ref)
    assert err <= BOUND and err <= 2 * naive_err, (err, naive_err)
    _, shifted_lse = attention_ref(*(x.astype(np.float64) for x in rounded), **kw)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite) and np.all(lse[~finite] == np.inf)
    shift = np.abs(shifted_lse[finite] - ref_lse[finite]).max(initial=0.0)
    assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0.0) <= 2 * shift + 1e-5
    return err


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param(2, 21, 37, 2, 2, 16, {}, id="ragged"),
    pytest.param(1, 32, 46, 1, 1, 16, dict(causal=True), id="causal-edge-by-one"),
    pytest.param(1, 35, 19, 2, 1, 24, dict(causal=True), id="causal-sq>sk-gqa"),
    pytest.param(1, 29, 23, 3, 1, 16, dict(window_size=(3, 2)), id="window-empty-rows-mqa"),
    pytest.param(1, 18, 45, 2, 1, 40, dict(window_size=(20, -1), softcap=2.5, softmax_scale=0.3),
                 id="left-window-softcap-bucket64"),
    pytest.param(1, 17, 33, 2, 1, 16, dict(alibi_slopes=np.array([0.7, 0.2], np.float32), causal=True),
                 id="alibi"),
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_against_the_reference(rng, tf32_launches, b, sq, sk, hq, hkv, d, kw):
    q, k, v = inputs(rng, b, sq, sk, hq, hkv, d)
    copies = [x.copy() for x in (q, k, v)]
    out, lse = forward(q, k, v, **kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert all(np.array_equal(x, c) for x, c in zip((q, k, v), copies))   # inputs untouched
    err = judge(out, lse, q, k, v, **kw)
    assert err > 1e-5   # TF32 ran: a float32 kernel's error is near 1e-7
    assert tf32_launches and all(cfg.kernel == "tf32_forward" and copies for cfg, copies in tf32_launches)


def test_two_warps_a_smaller_dv_and_attn_bias(rng, tf32_launches):
    q, k, v = inputs(rng, 1, 45, 30, 2, 1, 20, dv=12)
    bias = rng.standard_normal((1, 2, 45, 30)).astype(np.float32)
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    bias[0, 1, 5] = -np.inf                                   # a row that sees nothing: 0 and lse +inf
    out, lse = forward(q, k, v, tiles=TWO_WARPS, causal=True, attn_bias=bias)
    assert out.shape == (1, 45, 2, 12)
    judge(out, lse, q, k, v, causal=True, attn_bias=bias)
    assert np.all(out[0, 5, 1] == 0) and lse[0, 1, 5] == np.inf
    assert [(cfg.block_m, cfg.threads, copies) for cfg, copies in tf32_launches] == [(32, 64, True)]


@pytest.mark.parametrize("how", ["strided-head-dim", "rows-not-16-byte-aligned"])
def test_layouts_cp_async_cannot_read_take_plain_loads(rng, tf32_launches, how):
    from numba import cuda

    if how == "strided-head-dim":
        # Simulated device arrays are taken as they are (host arrays would be copied contiguous): k and v every
        # other float of a wider array.
        q, k, v = inputs(rng, 1, 23, 29, 2, 1, 12)
        wide = [np.zeros(x.shape[:-1] + (24,), np.float32) for x in (k, v)]
        for w, x in zip(wide, (k, v)):
            w[..., ::2] = x
        out, lse = forward(cuda.to_device(q), *(cuda.to_device(w)[..., ::2] for w in wide), causal=True)
        out, lse = out.copy_to_host(), lse.copy_to_host()
    else:   # D = 6: rows of 24 bytes
        q, k, v = inputs(rng, 1, 23, 29, 2, 1, 6)
        out, lse = forward(q, k, v, causal=True)
    judge(out, lse, q, k, v, causal=True)
    assert [copies for _, copies in tf32_launches] == [False]


def test_dropout_and_a_score_mod(rng):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score * 0.5 if (q_idx + kv_idx) % 3 else -np.inf

    q, k, v = inputs(rng, 1, 19, 26, 2, 1, 16)
    kw = dict(causal=True, dropout_p=0.25, dropout_seed=11, score_mod=score_mod)
    out, lse = forward(q, k, v, **kw)
    judge(out, lse, q, k, v, **kw)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_block_mask_is_trusted_its_empty_tiles_never_read(rng, tf32_launches):
    """mask_mod staged per tile, and a BlockMask's tiles trusted: with one FULL tile called EMPTY the answer is the
    reference's for the mask with that tile hidden (its keys never read), and differs from the honest one."""
    from numba_flash import block_mask
    from numba_flash.mods import EMPTY, FULL, BlockMask

    sq, sk, shift = 37, 53, 16
    docs = np.repeat(np.arange(3), [18, 3, 32])   # query i sits at key position i + 16

    def doc_mask(b, h, q_idx, kv_idx):
        return docs[q_idx + shift] == docs[kv_idx]

    states = block_mask(doc_mask, 1, 1, sq, sk, 16, 16).states.copy()
    qt, kt = np.argwhere(states[0, 0] == FULL)[0]
    states[0, 0, qt, kt] = EMPTY
    grid = np.array([[doc_mask(0, 0, i, j) for j in range(sk)] for i in range(sq)])
    grid[16 * qt:16 * (qt + 1), 16 * kt:16 * (kt + 1)] = False
    described = np.where(grid, 0.0, -np.inf).astype(np.float32)
    q, k, v = inputs(rng, 1, sq, sk, 2, 1, 16)
    out, lse = forward(q, k, v, mask_mod=doc_mask, block_mask=BlockMask(doc_mask, states, sq, sk, 16, 16))
    judge(out, lse, q, k, v, attn_bias=described)
    honest, _ = attention_ref(*(x.astype(np.float64) for x in (q, k, v)), mask_mod=doc_mask)
    assert np.abs(out - honest).max() > 1e-1   # the lie shows
    assert all(copies for _, copies in tf32_launches)


def test_packed_sequences(rng):
    cu_q, cu_k = np.array([0, 7, 7, 30], np.int32), np.array([0, 12, 20, 41], np.int32)
    q = rng.standard_normal((30, 2, 16)).astype(np.float32)
    k, v = (rng.standard_normal((41, 1, 16)).astype(np.float32) for _ in range(2))
    out, lse = forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    for i in range(3):
        rows, keys = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if rows.start == rows.stop:
            continue
        judge(out[None, rows], lse[None, :, rows], q[None, rows], k[None, keys], v[None, keys], causal=True)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("where,value,softcap", [("q", "nan", 0.0), ("k", "inf", 3.0), ("k", "-inf", 0.0),
                                                 ("v", "inf", 0.0), ("v", "nan", 0.0)])
def test_a_non_finite_input_poisons_exactly_the_rows_that_see_it(rng, where, value, softcap):
    q, k, v = inputs(rng, 1, 24, 30, 1, 1, 16)
    clean_out, clean_lse = forward(q, k, v, causal=True, softcap=softcap)
    x = {"q": q, "k": k, "v": v}[where]
    bad_row = 9 if where == "q" else 17
    x[0, bad_row, 0, 3] = float(value)
    out, lse = forward(q, k, v, causal=True, softcap=softcap)
    rows = np.arange(24)
    # causal, bottom right: row i sees key j iff j <= i + 6
    poisoned = rows == bad_row if where == "q" else rows + 6 >= bad_row
    o, co = out[0, :, 0], clean_out[0, :, 0]
    if where == "v":   # only the column that holds the inf or NaN
        assert np.isnan(o[poisoned, 3]).all() and np.isfinite(np.delete(o, 3, axis=1)).all()
        np.testing.assert_array_equal(lse, clean_lse)
    else:
        assert np.isnan(o[poisoned]).all() and np.isnan(lse[0, 0, poisoned]).all()
    np.testing.assert_array_equal(o[~poisoned], co[~poisoned])
    np.testing.assert_array_equal(lse[0, 0, ~poisoned], clean_lse[0, 0, ~poisoned])
    ref, _ = attention_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), causal=True,
                           softcap=softcap)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_finite_v_that_rounds_to_inf_poisons_only_the_rows_that_see_it(rng):
    """float32's largest values round up to TF32's inf: like an inf in V, such a value must not reach rows that do
    not see its key through masked pairs' 0 * inf; the rows that see it overflow (NaN in its column, the contract's
    rule for an overflow), the others are exactly as without it."""
    q, k, v = inputs(rng, 1, 20, 24, 1, 1, 16)
    clean_out, clean_lse = forward(q, k, v, causal=True)
    v[0, 7, 0, 5] = np.float32(3.4025e38)          # finite in float32; rounds to inf in TF32
    out, lse = forward(q, k, v, causal=True)
    sees = np.arange(20) + 4 >= 7                   # causal, bottom right: row i sees keys j <= i + 4
    assert np.isnan(out[0, sees, 0, 5]).all() and np.isfinite(np.delete(out[0, :, 0], 5, axis=1)).all()
    np.testing.assert_array_equal(out[0, ~sees], clean_out[0, ~sees])
    np.testing.assert_array_equal(lse, clean_lse)


def test_which_kernel_runs_and_what_explain_says(rng, tf32_launches):
    from numba_flash.cuda.host.plan import forward_kernel, tf32_reason

    q, k, v = inputs(rng, 1, 5, 6, 1, 1, 16)
    op = backend_registry.get("flash", backend="cuda")
    assert "TF32 tensor-core forward" in str(op.explain(q, k, v, precision="tf32"))
    default = str(op.explain(q, k, v))                                 # float32 computed in float32 by default
    assert "float32 SIMT kernels; precision='tf32' would run the forward on TF32 tensor cores" in default
    assert "precision='tf32'" not in str(op.explain(*inputs(rng, 1, 5, 6, 1, 1, 200)))   # where it would not
    ieee, _ = op.forward(q, k, v, return_lse=True)
    assert not tf32_launches and rel_l2(ieee, attention_ref(q.astype(np.float64), k, v)[0]) < 1e-6
    assert forward_kernel("float32", 64, precision="tf32", cc=(8, 0)) == "tf32_forward"
    assert forward_kernel("float16", 64, precision="tf32", cc=(8, 0)) == "tc_forward"   # float32 only
    assert forward_kernel("float32", 64, precision="tf32", cc=(7, 5)) == "forward"
    assert "compute capability >= 8.0" in tf32_reason(64, cc=(7, 5))
    assert "head dim 256 > 128" in tf32_reason(256, cc=(9, 0))
    assert tf32_reason(64, cc=(9, 0), bias=True) is None and "attn_bias at head dim 100 > 64" in tf32_reason(
        100, cc=(9, 0), bias=True)
    wide = rng.standard_normal((1, 5, 1, 200)).astype(np.float32)
    assert "SIMT kernels (float32): TF32 allowed, not used: head dim 200" in str(
        op.explain(wide, wide, wide, precision="tf32"))
    wide_v = rng.standard_normal(k.shape[:3] + (200,)).astype(np.float32)
    assert "v's head dim Dv=200 > 128" in str(op.explain(q, k, wide_v, precision="tf32"))
    with tile_config_override(tensor_cores=False):
        assert "switched off" in str(op.explain(q, k, v, precision="tf32"))
        op.forward(q, k, v, precision="tf32")
    with tile_config_override(tensor_cores=True):
        with pytest.raises(AttentionInputError, match="tensor_cores=True: head dim 200"):
            op.forward(wide, wide, wide, precision="tf32")
    assert not tf32_launches


def test_the_first_use_self_check_covers_the_tf32_kernel(rng, monkeypatch):
    """With the check on, the TF32 specialisation is checked once against the reference under the TF32 bounds, and
    one that breaks them (its output scaled by 1.01) gives way to a fallback tile config that passes."""
    from numba_flash.cuda import selfcheck

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    selfcheck.reset()
    try:
        q, k, v = inputs(rng, 1, 19, 23, 2, 1, 16)
        out, lse = forward(q, k, v, causal=True)
        judge(out, lse, q, k, v, causal=True)
        checked = [(s.cfg.kernel, s.cfg.block_m, verdict.passed) for (_, s), verdict in selfcheck.verdicts().items()]
        assert checked == [("tf32_forward", 16, True)]

        def corrupt(out):
            out[...] = out.copy_to_host() * np.float32(1.01)

        break_small_tiles(monkeypatch, "make_tf32_forward_kernel", corrupt)
        selfcheck.reset()
        out, lse = forward(q, k, v, causal=True)
        judge(out, lse, q, k, v, causal=True)
        verdicts = {(s.cfg.block_m, s.cfg.threads): v.passed for (_, s), v in selfcheck.verdicts().items()}
        assert verdicts == {(16, 32): False, (32, 64): True}
    finally:
        selfcheck.reset()
