"""The faces' own errors for inputs that used to fail deep inside torch or numpy (issue 47, finding 4): index
arrays of any host kind or stride, ``backward()`` through the KV-cache face, meta tensors, and calls whose output
cannot fit, refused before a single input element is read."""

from __future__ import annotations

import time

import numpy as np
import pytest

from numba_flash import AttentionInputError, attention_ref, attention_ref_kvcache, attention_ref_varlen, \
    backend_registry

torch = pytest.importorskip("torch")

from kvcache_cases import copy_args as _copy, random_case as _case  # noqa: E402


def _t(x):
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


@pytest.mark.parametrize("index", ["cache_seqlens", "cache_batch_idx", "block_table"])
def test_flash_attn_with_kvcache_takes_numpy_index_arrays(index, rng):
    from numba_flash.torch_api import flash_attn_with_kvcache

    args = _case(rng, rotary=False, batch=2, capacity=11, d=8, batch_idx=index == "cache_batch_idx",
                 paged=index == "block_table", page=4)
    want = attention_ref_kvcache(**_copy(args))[0]
    given = {n: (a if n == index else _t(a)) for n, a in _copy(args).items()}
    given[index] = given[index][::-1].copy()[::-1]   # numpy, negative strides
    assert isinstance(given[index], np.ndarray) and given[index].strides[0] < 0
    out = flash_attn_with_kvcache(**given)
    np.testing.assert_allclose(out.numpy(), want, atol=3e-5, rtol=0)


def test_flash_attn_varlen_func_takes_numpy_prefix_sums_of_negative_stride(rng):
    from numba_flash.torch_api import flash_attn_varlen_func

    q, k, v = (rng.standard_normal((13, 2, 8)).astype(np.float32) for _ in range(3))
    cu = np.array([13, 5, 0], np.int32)[::-1]
    want = attention_ref_varlen(q, k, v, cu.copy(), cu.copy())[0]
    out = flash_attn_varlen_func(_t(q), _t(k), _t(v), cu, cu, 8, 8)
    np.testing.assert_allclose(out.numpy(), want, atol=3e-5, rtol=0)


@pytest.mark.parametrize("seqlens", [np.int64(3), np.int32(3), 3])
def test_attention_ref_kvcache_takes_a_numpy_integer_length(seqlens, rng):
    args = _case(rng, rotary=False, batch=2, capacity=11, d=8)
    args["cache_seqlens"] = np.full(2, 3, np.int32)
    want = attention_ref_kvcache(**_copy(args))
    got = attention_ref_kvcache(**dict(_copy(args), cache_seqlens=seqlens))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_backward_through_flash_attn_with_kvcache_says_it_is_not_supported(rng):
    from numba_flash.torch_api import flash_attn_with_kvcache

    args = {n: _t(a) for n, a in _case(rng, rotary=False, batch=2, capacity=11, d=8).items()}
    args["q"].requires_grad_(True)
    out = flash_attn_with_kvcache(**args)
    with pytest.raises(RuntimeError, match="flash_attn_with_kvcache does not support backward"):
        out.sum().backward()


def test_meta_tensors_get_meta_results_of_the_right_shapes():
    op = backend_registry.get("flash")
    q = torch.empty(2, 5, 4, 16, device="meta")
    k = torch.empty(2, 7, 2, 16, device="meta")
    v = torch.empty(2, 7, 2, 12, device="meta", dtype=torch.float32)
    out, lse = op.forward(q, k, v, causal=True, return_lse=True, backend="rocm")
    assert out.device.type == "meta" and out.shape == (2, 5, 4, 12) and out.dtype == torch.float32
    assert lse.device.type == "meta" and lse.shape == (2, 4, 5) and lse.dtype == torch.float32
    dq, dk, dv = op.backward(out, q, k, v, out, lse, causal=True, backend="rocm")
    assert [tuple(g.shape) for g in (dq, dk, dv)] == [tuple(x.shape) for x in (q, k, v)]
    assert all(g.device.type == "meta" for g in (dq, dk, dv))


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_an_output_that_cannot_fit_is_refused_before_any_input_is_read(kind):
    shape = (256, 65536, 64, 256)   # float32: a 1 TiB output from broadcast views of one small array
    base = np.random.default_rng(5).standard_normal((1, 1, 1, 256)).astype(np.float32)
    x = np.broadcast_to(base, shape) if kind == "numpy" else torch.from_numpy(base).expand(shape)
    start = time.monotonic()
    with pytest.raises((MemoryError, AttentionInputError), match="out: .*1024 GiB"):
        backend_registry.get("flash").forward(x, x, x, backend="rocm")
    assert time.monotonic() - start < 10


def test_small_calls_still_run_on_the_torch_path(rng):
    """The allocation check does not refuse what fits (a check of the check)."""
    q, k, v = (rng.standard_normal((2, 9, 3, 8)).astype(np.float32) for _ in range(3))
    out = backend_registry.get("flash").forward(_t(q), _t(k), _t(v), backend="rocm")
    np.testing.assert_allclose(out.numpy(), attention_ref(q, k, v)[0], atol=3e-5, rtol=0)
