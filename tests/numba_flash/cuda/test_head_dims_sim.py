"""Head dims past 256 and a value head dim Dv different from D on the CUDA SIMT kernels, under the simulator,
against the float64 reference. The kernels are built for the bucket of max(D, Dv) and read Dv from v's shape
(zeros past D in Q and K, past Dv in V and dO), so both orders and buckets are covered, with masks, GQA, packed
sequences and float16 (whose tensor-core forward takes Dv != D, its backward not); the wide buckets (512, 576) once
with the tiles a GPU would run (sm_90's: the simulator's) and with the small test tiles, forward and backward, and
the decode kernel at 576."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward, attention_ref_kvcache
from numba_flash.cuda import tile_config_override
from numba_flash.errors import AttentionInputError

pytestmark = pytest.mark.cudasim

TILES = dict(block_m=8, block_n=8, threads=16)


def _inputs(rng, b, sq, sk, hq, hkv, d, dv, dtype=np.float32):
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, dv)).astype(dtype)
    dout = rng.standard_normal((b, sq, hq, dv)).astype(dtype)
    return q, k, v, dout


def _rel_l2(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("b,sq,sk,hq,hkv,d,dv,kw", [
    pytest.param(2, 13, 21, 2, 1, 12, 7, dict(causal=True), id="dv<d-causal-gqa"),
    pytest.param(1, 11, 17, 2, 2, 5, 19, dict(window_size=(4, 2), softcap=2.5), id="dv>d-window-softcap"),
    pytest.param(1, 9, 14, 1, 1, 40, 3, dict(alibi_slopes=np.array([0.3], np.float32)), id="d-bucket64-dv3-alibi"),
])
def test_forward_and_backward_match_the_reference(b, sq, sk, hq, hkv, d, dv, kw):
    rng = np.random.default_rng(d * 100 + dv)
    q, k, v, dout = _inputs(rng, b, sq, sk, hq, hkv, d, dv)
    originals = [x.copy() for x in (q, k, v, dout)]
    op = backend_registry.get("flash", backend="cuda")
    with tile_config_override(**TILES):
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        dq, dk, dvv = op.backward(dout, q, k, v, out, lse, **kw)
    want_out, want_lse = attention_ref(q, k, v, **kw)
    want = attention_ref_backward(dout, q, k, v, **kw)
    assert out.shape == want_out.shape == (b, sq, hq, dv)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dvv), want):
        assert got.shape == ref.shape, name
        assert _rel_l2(got, ref) <= 1e-5, name
    for x, orig in zip((q, k, v, dout), originals):
        assert np.array_equal(x, orig)


def test_packed_sequences():
    rng = np.random.default_rng(47)
    cu_q, cu_k = np.array([0, 5, 14, 15], np.int32), np.array([0, 9, 20, 33], np.int32)
    q = rng.standard_normal((15, 2, 10)).astype(np.float32)
    k = rng.standard_normal((33, 1, 10)).astype(np.float32)
    v = rng.standard_normal((33, 1, 17)).astype(np.float32)
    dout = rng.standard_normal((15, 2, 17)).astype(np.float32)
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    op = backend_registry.get("flash", backend="cuda")
    with tile_config_override(**TILES):
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw)
    want_out, _ = numba_flash.attention_ref_varlen(q, k, v, cu_q, cu_k, causal=True)
    want = numba_flash.attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, causal=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == ref.shape and _rel_l2(got, ref) <= 1e-5, name


@pytest.mark.parametrize("d,dv", [(16, 8), (12, 40)], ids=["dv<d-cp.async", "dv>d-plain-loads"])
def test_float16_forward_on_tensor_cores_backward_on_simt_and_says_why(d, dv):
    """The tensor-core forward reads Dv from v's shape too (its V copies and output stores; rows of 24 bytes, D =
    12, are not 16-byte aligned and take the plain-load copies); the tensor-core backward needs Dv = D."""
    from tc_sim_cases import ONE_WARP

    rng = np.random.default_rng(48 + d)
    q, k, v, dout = _inputs(rng, 1, 21, 26, 2, 1, d, dv, np.float16)
    op = backend_registry.get("flash", backend="cuda")
    text = str(backend_registry.get("flash").explain(q, k, v, backend="cuda"))
    assert (f"tensor-core kernels (mma.sync, float16); the backward on the SIMT kernels: v's head dim Dv={dv} "
            f"differs from D={d}") in text
    with tile_config_override(**ONE_WARP):
        out, lse = op.forward(q, k, v, causal=True, return_lse=True)
    with tile_config_override(**TILES):
        grads = op.backward(dout, q, k, v, out, lse, causal=True)
    q64, k64, v64, do64 = (x.astype(np.float64) for x in (q, k, v, dout))
    want_out, want_lse = attention_ref(q64, k64, v64, causal=True)
    assert out.dtype == np.float16 and out.shape == want_out.shape and _rel_l2(out, want_out) <= 2e-3
    np.testing.assert_allclose(lse, want_lse, atol=1e-3, rtol=0)
    for got, ref in zip(grads, attention_ref_backward(do64, q64, k64, v64, causal=True)):
        assert got.dtype == np.float16 and _rel_l2(got, ref) <= 2e-3
    with tile_config_override(**ONE_WARP), pytest.raises(AttentionInputError,
                                                         match="tensor_cores=True: v's head dim"):
        op.backward(dout, q, k, v, out, lse, causal=True)


def _check_forward_backward(q, k, v, dout, kw, tiles):
    op = backend_registry.get("flash", backend="cuda")
    with tiles:
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw) if dout is not None else ()
    want_out, want_lse = attention_ref(q, k, v, **kw)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    want = attention_ref_backward(dout, q, k, v, **kw) if dout is not None else ()
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
        assert got.shape == ref.shape and _rel_l2(got, ref) <= 1e-5, name
    return out, lse


def test_bucket_512_with_a_gpus_tiles():
    """D = 300, Dv = 512: bucket 512, the forward's 32 x 32 / 256 and the backward's 16 x 8 / 128 tiles (dynamic
    shared memory), scores split in 16 parts over the head dim."""
    import contextlib

    rng = np.random.default_rng(51)
    q, k, v, dout = _inputs(rng, 1, 5, 9, 1, 1, 300, 512)
    _check_forward_backward(q, k, v, dout, dict(causal=True, softcap=3.0), contextlib.nullcontext())


def test_mla_dims_forward_and_backward_with_a_gpus_tiles():
    """D = 576, Dv = 512 (MLA): bucket 576, the forward's 32 x 32 / 256 tiles, the dK/dV kernel's 16 x 8 / 128 with
    36 columns of dK and of dV a thread, the dQ kernel's 16 x 8 / 128."""
    import contextlib

    rng = np.random.default_rng(52)
    q, k, v, dout = _inputs(rng, 1, 4, 7, 1, 1, 576, 512)
    _check_forward_backward(q, k, v, dout, dict(window_size=(3, 1)), contextlib.nullcontext())
    text = str(backend_registry.get("flash").explain(q, k, v, backend="cuda", window_size=(3, 1)))
    assert "another backend" not in text


def test_mla_dims_backward_with_sm86_tiles():
    """The dK/dV tiles sm_86 and sm_89 take at 576 (16 x 2 / 32 within their 99 KiB: one warp, 36 columns of dK and
    of dV a thread), from the reference's out and lse."""
    from numba_flash.cuda.host.config import smem_limit_for
    from numba_flash.cuda.host.picker import tile_config_for

    assert tile_config_for(576, "float32", (8, 6), smem_limit_for((8, 6)), "backward_dkdv").threads == 32
    rng = np.random.default_rng(54)
    q, k, v, dout = _inputs(rng, 1, 5, 6, 2, 1, 576, 512)
    kw = dict(causal=True, softcap=4.0)
    out, lse = (x.astype(np.float32) for x in attention_ref(q, k, v, **kw))
    with tile_config_override(block_m=16, block_n=2, threads=32):
        grads = backend_registry.get("flash", backend="cuda").backward(dout, q, k, v, out, lse, **kw)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, attention_ref_backward(dout, q, k, v, **kw)):
        assert got.shape == ref.shape and _rel_l2(got, ref) <= 1e-5, name


@pytest.mark.parametrize("d,dv", [(576, 512), (512, 200)])
def test_wide_buckets_with_small_tiles(d, dv):
    rng = np.random.default_rng(d + dv)
    q, k, v, dout = _inputs(rng, 1, 11, 14, 2, 1, d, dv)
    _check_forward_backward(q, k, v, dout, dict(causal=True, alibi_slopes=np.array([0.2, 0.5], np.float32)),
                            tile_config_override(**TILES))


def test_decode_with_a_576_wide_cache():
    rng = np.random.default_rng(53)
    b, hq, hkv, d, cache_len = 2, 2, 1, 576, 11
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k_cache, v_cache = (rng.standard_normal((b, cache_len, hkv, d)).astype(np.float32) for _ in range(2))
    k_new, v_new = (rng.standard_normal((b, 1, hkv, d)).astype(np.float32) for _ in range(2))
    seqlens = np.array([6, 9], np.int32)
    want_out, want_lse, want_k, _ = attention_ref_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens,
                                                          causal=True, softcap=5.0)
    out, lse = backend_registry.get("flash", backend="cuda").with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, softcap=5.0, num_splits=2,
        return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_array_equal(k_cache, want_k)   # appended in place
