"""The CUDA kernels under the Numba CUDA simulator, against the float64 reference.

Shapes are tiny and tiles small (8 x 8, 16 threads, set through tile_config_override) so that the simulator, one
Python thread per CUDA thread, runs a case in about a second; odd sizes make every last tile ragged.
Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda
"""

import numpy as np
import pytest

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)


def _inputs(rng, b, sq, sk, hq, hkv, d, dtype=np.float32, layout="bshd"):
    def shape(s, h):
        return (b, s, h, d) if layout == "bshd" else (b, h, s, d)

    q = rng.standard_normal(shape(sq, hq)).astype(dtype)
    k = rng.standard_normal(shape(sk, hkv)).astype(dtype)
    v = rng.standard_normal(shape(sk, hkv)).astype(dtype)
    return q, k, v


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _forward(q, k, v, **kw):
    with tile_config_override(**TILES):
        return backend_registry.get("flash", backend="cuda").forward(q, k, v, return_lse=True, **kw)


def _check_lse(lse, ref_lse):
    assert lse.dtype == np.float32
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)           # rows that see nothing: +inf, same rows
    assert np.all(lse[~finite] == np.inf)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=0, atol=1e-5)


CASES = [
    # (B, Sq, Sk, Hq, Hkv, D, kwargs)
    pytest.param(2, 13, 21, 2, 2, 12, {}, id="ragged"),
    pytest.param(1, 19, 11, 2, 1, 8, dict(causal=True), id="causal-sq>sk"),
    pytest.param(1, 11, 23, 2, 2, 8, dict(causal=True), id="causal-sq<sk"),
    pytest.param(1, 17, 17, 1, 1, 16, dict(causal=True), id="causal-square"),
    pytest.param(1, 21, 14, 3, 1, 9, dict(window_size=(2, 1)), id="window-empty-rows-mqa"),
    pytest.param(1, 15, 26, 4, 2, 7, dict(window_size=(4, -1)), id="left-only-gqa"),
    pytest.param(1, 14, 19, 2, 1, 12, dict(window_size=(-1, 3), softcap=1.5, softmax_scale=0.7), id="softcap"),
    pytest.param(1, 9, 12, 1, 1, 33, {}, id="d33-bucket64"),
    # ALiBi: distances on both sides of the diagonal (no mask), then per-(batch, head) slopes with causal GQA,
    # a left window and softcap, Sq > Sk (rows that see nothing).
    pytest.param(1, 13, 22, 2, 1, 8, dict(alibi_slopes=np.array([0.9, 0.15], np.float32)), id="alibi"),
    pytest.param(2, 18, 11, 4, 2, 8, dict(causal=True, window_size=(5, 0), softcap=2.0, alibi_slopes=np.array(
        [[0.5, 0.25, 0.125, 1.0], [0.03, 0.3, 0.7, 0.09]], np.float32)), id="alibi-per-batch-window-softcap"),
]


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", CASES)
def test_forward_matches_reference(rng, b, sq, sk, hq, hkv, d, kw):
    q, k, v = _inputs(rng, b, sq, sk, hq, hkv, d)
    out, lse = _forward(q, k, v, **kw)
    ref, ref_lse = attention_ref(q, k, v, **kw)
    assert out.dtype == np.float32 and out.shape == q.shape
    assert np.all(np.isfinite(out))
    assert np.max(np.abs(out - ref)) <= 1e-5
    _check_lse(lse, ref_lse)


def test_rows_that_see_no_key_give_zero_and_inf(rng):
    # Sq > Sk with causal: the first Sq - Sk rows see nothing.
    q, k, v = _inputs(rng, 1, 20, 6, 1, 1, 8)
    out, lse = _forward(q, k, v, causal=True)
    assert np.all(out[:, :14] == 0) and np.all(lse[:, :, :14] == np.inf)
    ref, _ = attention_ref(q, k, v, causal=True)
    assert np.max(np.abs(out - ref)) <= 1e-5


# The backward splits its score products over TILES, not over the same tiles with 4 threads (a 4 x 4 block each).
BACKWARD_TILES = {"split": TILES, "whole": dict(TILES, threads=4)}


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,kw", [CASES[0], CASES[2], CASES[4], CASES[6], CASES[7], CASES[8],
                                                 CASES[9]])
@pytest.mark.parametrize("tiles", list(BACKWARD_TILES))
def test_backward_matches_reference(rng, b, sq, sk, hq, hkv, d, kw, tiles):
    q, k, v = _inputs(rng, b, sq, sk, hq, hkv, d)
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = _forward(q, k, v, **kw)
    with tile_config_override(**BACKWARD_TILES[tiles]):
        dq, dk, dv = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, **kw)
    rdq, rdk, rdv = attention_ref_backward(dout, q, k, v, **kw)
    for got, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert got.shape == ref.shape and got.dtype == np.float32
        assert np.all(np.isfinite(got))
        assert _rel_l2(got, ref) <= 1e-5


def test_float16_forward_and_backward(rng):
    q, k, v = _inputs(rng, 1, 14, 19, 2, 1, 16, dtype=np.float16)
    dout = rng.standard_normal(q.shape).astype(np.float16)
    out, lse = _forward(q, k, v, causal=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, _ = attention_ref(q, k, v, causal=True)
    # Naive attention computed in float16 sets the bar the kernel must stay within 2x of.
    qf, kf, vf = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    kf, vf = np.repeat(kf, 2, axis=1), np.repeat(vf, 2, axis=1)
    s = (qf @ kf.transpose(0, 1, 3, 2)) * np.float16(0.25)
    mask = np.tril(np.ones((14, 19), bool), k=19 - 14)
    s = np.where(mask, s, np.float16(-np.inf))
    p = np.exp(s - s.max(-1, keepdims=True))
    naive = ((p / p.sum(-1, keepdims=True)).astype(np.float16) @ vf).transpose(0, 2, 1, 3)
    err, naive_err = _rel_l2(out, ref), _rel_l2(naive, ref)
    assert err <= 2e-3 and err <= 2 * naive_err
    with tile_config_override(**TILES):
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, causal=True)
    for got, ref_g in zip(grads, attention_ref_backward(dout, q, k, v, causal=True)):
        assert got.dtype == np.float16
        assert _rel_l2(got, ref_g) <= 2e-3


def test_bhsd_layout(rng):
    q, k, v = _inputs(rng, 1, 13, 10, 2, 1, 8, layout="bhsd")
    dout = rng.standard_normal(q.shape).astype(np.float32)
    out, lse = _forward(q, k, v, causal=True, layout="bhsd")
    ref, ref_lse = attention_ref(q, k, v, causal=True, layout="bhsd")
    assert out.shape == q.shape and np.max(np.abs(out - ref)) <= 1e-5
    _check_lse(lse, ref_lse)
    with tile_config_override(**TILES):
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, causal=True,
                                                                       layout="bhsd")
    for got, ref_g in zip(grads, attention_ref_backward(dout, q, k, v, causal=True, layout="bhsd")):
        assert got.shape == ref_g.shape and _rel_l2(got, ref_g) <= 1e-5


def test_non_contiguous_device_arrays(rng):
    from numba import cuda

    # Strided views of bigger device arrays: every other sequence position, heads reversed.
    big = [rng.standard_normal((1, 2 * s, 3, 10)).astype(np.float32) for s in (11, 15, 15)]
    dq_, dk_, dv_ = (cuda.to_device(x) for x in big)
    q, k, v = dq_[:, ::2, ::-1], dk_[:, ::2, ::-1], dv_[:, ::2, ::-1]
    assert not q.is_c_contiguous()
    out, lse = _forward(q, k, v, window_size=(5, 2))
    hq, hk, hv = (x[:, ::2, ::-1] for x in big)
    ref, ref_lse = attention_ref(hq, hk, hv, window_size=(5, 2))
    assert np.max(np.abs(out.copy_to_host() - ref)) <= 1e-5
    _check_lse(lse.copy_to_host(), ref_lse)


# ---- bfloat16: int16 bit patterns in, float32 math, bit patterns out ----

BF16_BOUND = 1.6e-2   # the contract's relative L2 bound for bfloat16


def _bf16(rng, shape):
    """(int16 bit patterns, the same values widened to float32) of random N(0, 1) bfloat16 numbers."""
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().copy(), t.float().numpy()


def _round_bf16(x):
    """int16 bit patterns of float32 ``x`` rounded to bfloat16 by torch (nearest, ties to even)."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy()


def _widen(bits):
    import torch

    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.bfloat16).float().numpy()


def test_bfloat16_helpers_match_torch_rounding(rng):
    torch = pytest.importorskip("torch")
    from numba_flash.cuda.device.dtypes import load_bf16, store_bf16

    # Random magnitudes over the whole exponent range, exact ties (a set bit 15 and nothing below it, both parities
    # of bit 16), values that round up into the next binade or to inf, subnormals, signed zeros and infinities.
    with np.errstate(over="ignore"):
        x = (rng.standard_normal(300) * np.exp2(rng.integers(-140, 128, 300))).astype(np.float32)
    # a product past float32's range is inf, and inf's bits with bit 15 set are a NaN, whose payload rounding is
    # not the point here: the infinities are among the specials below
    x = x[np.isfinite(x)]
    bits = x.view(np.uint32)
    ties = ((bits & 0xFFFF0000) | 0x8000).view(np.float32)
    special = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7F0000, 0x7F7F8000, 0xFF7FFFFF,
                        0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00008000, 0x0001C000, 0x807FFFFF], np.uint32)
    x = np.concatenate([x, ties, special.view(np.float32)])
    got = np.array([store_bf16(np.float32(v)) for v in x], np.int16)
    want = _round_bf16(x)
    assert np.array_equal(got, want), x[got != want]
    nan = store_bf16(np.float32(np.nan))
    assert np.isnan(torch.tensor([nan], dtype=torch.int16).view(torch.bfloat16).float().item())
    back = np.array([load_bf16(b) for b in want], np.float32)
    assert np.array_equal(back, _widen(want))


def _launch_kw(q, causal, dtype):
    from numba_flash.cuda import TileOverride

    return dict(softmax_scale=1 / np.sqrt(q.shape[-1]), window_left=-1, window_right=0 if causal else -1,
                softcap=0.0, dtype=dtype, override=TileOverride(**TILES))


def _launch_forward(q, k, v, *, causal, dtype):
    """numba_flash.cuda.host.flash.flash_forward on simulated device arrays of q's element type (int16 bfloat16 bits
    or float32); host (out, lse)."""
    from numba import cuda

    from numba_flash.cuda.host.flash import flash_forward

    b, sq, hq, _ = q.shape
    out = cuda.device_array(q.shape, q.dtype)
    lse = cuda.device_array((b, hq, sq), np.float32)
    flash_forward(*(cuda.to_device(x) for x in (q, k, v)), out, lse, **_launch_kw(q, causal, dtype))
    return out.copy_to_host(), lse.copy_to_host()


def _launch_backward(dout, q, k, v, out, lse, *, causal, dtype):
    """numba_flash.cuda.host.flash.flash_backward, as _launch_forward; host (dq, dk, dv)."""
    from numba import cuda

    from numba_flash.cuda.host.flash import flash_backward

    b, sq, hq, _ = q.shape
    grads = [cuda.device_array(x.shape, x.dtype) for x in (q, k, v)]
    delta = cuda.device_array((b, hq, sq), np.float32)
    flash_backward(*(cuda.to_device(x) for x in (dout, q, k, v, out, lse)), *grads, delta,
                   **_launch_kw(q, causal, dtype))
    return tuple(g.copy_to_host() for g in grads)


def test_bfloat16_kernels_round_the_float32_result(rng):
    # Ragged tiles, causal with Sq < Sk, GQA. The bfloat16 kernels widen exactly and then compute what the float32
    # kernels compute on the widened values, so their outputs must be those results rounded, bit for bit.
    b, sq, sk, hq, hkv, d = 1, 13, 19, 2, 1, 12
    (q, q32), (k, k32), (v, v32), (do, do32) = (_bf16(rng, s) for s in
                                                ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d)))
    copies = [x.copy() for x in (q, k, v, do)]
    out, lse = _launch_forward(q, k, v, causal=True, dtype="bfloat16")
    grads = _launch_backward(do, q, k, v, out, lse, causal=True, dtype="bfloat16")
    for x, c in zip((q, k, v, do), copies):
        assert np.array_equal(x, c)
    assert out.dtype == np.int16 and lse.dtype == np.float32

    ref, ref_lse = attention_ref(q32, k32, v32, causal=True)
    assert _rel_l2(_widen(out), ref) <= BF16_BOUND
    _check_lse(lse, ref_lse)
    for got, want in zip(grads, attention_ref_backward(do32, q32, k32, v32, causal=True)):
        assert got.shape == want.shape and got.dtype == np.int16
        assert np.all(np.isfinite(_widen(got)))
        assert _rel_l2(_widen(got), want) <= BF16_BOUND

    # The float32 kernels on the same values (the backward reads the bfloat16 output, for delta, widened).
    out32, lse32 = _launch_forward(q32, k32, v32, causal=True, dtype="float32")
    assert np.array_equal(out, _round_bf16(out32)) and np.array_equal(lse, lse32)
    grads32 = _launch_backward(do32, q32, k32, v32, _widen(out), lse, causal=True, dtype="float32")
    for got, want in zip(grads, grads32):
        assert np.array_equal(got, _round_bf16(want))


def test_storage_mismatch_raises(rng):
    from numba import cuda

    from numba_flash.cuda.host.flash import flash_forward

    q, _ = _bf16(rng, (1, 5, 1, 4))
    dq_ = cuda.to_device(q)
    with pytest.raises(ValueError, match="expected float32 device array"):
        flash_forward(dq_, dq_, dq_, cuda.device_array(q.shape, np.int16), cuda.device_array((1, 1, 5), np.float32),
                      softmax_scale=0.5, window_left=-1, window_right=-1, softcap=0.0, dtype="float32")
