"""with_kvcache's append lands in the caller's cache or the call is refused before any write (issue 47, finding 1).

The cache is the one argument written in place, so every path that would make a private copy of it (torch's lazy
negation bit resolved by validation, a numpy cache of negative strides handed to torch) must either write through
to the caller's memory or refuse; and a cache whose rows alias (a stride-0 axis, an expanded tensor, two caches
overlapping at an offset) would let one sequence's append overwrite another's, as duplicate cache_batch_idx rows
would, which are refused.
"""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash import AttentionInputError, attention_ref_kvcache, backend_registry

torch = pytest.importorskip("torch")

from kvcache_cases import copy_args as _copy, random_case as _case  # noqa: E402

BACKENDS = ("cpu", "rocm")


def _op(backend):
    return backend_registry.get("flash", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_numpy_cache_of_negative_strides_gets_the_append(backend, rng):
    args = _case(rng, rotary=True, batch=2, capacity=13, d=10)
    want_out, _, want_k, want_v = attention_ref_kvcache(**_copy(args), causal=True)
    given = _copy(args)
    # the same values, stored back to front: the caller's view has a negative stride on the cache rows and heads
    for name in ("k_cache", "v_cache"):
        store = np.ascontiguousarray(given[name][::-1, :, ::-1])
        given[name] = store[::-1, :, ::-1]
        assert given[name].strides[0] < 0
    out = _op(backend).with_kvcache(**given, causal=True)
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)
    np.testing.assert_allclose(given["k_cache"], want_k, atol=1e-5, rtol=0)
    np.testing.assert_allclose(given["v_cache"], want_v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["k_cache", "v_cache"])
def test_a_torch_cache_with_the_negation_bit_is_refused_when_appended_to(backend, name, rng):
    args = _case(rng, rotary=False, batch=2, capacity=11, d=8)
    given = {n: (torch.from_numpy(a) if isinstance(a, np.ndarray) else a) for n, a in _copy(args).items()}
    physical = torch.from_numpy(-args[name])
    given[name] = torch._neg_view(physical)          # reads as args[name]
    assert given[name].is_neg()
    with pytest.raises(AttentionInputError, match=f"^{name}: expected .*negation.*got"):
        _op(backend).with_kvcache(**given)
    np.testing.assert_array_equal(physical.numpy(), -args[name])


def _aliased_caches(args, how):
    """(k_cache, v_cache, the argument named in the refusal) whose rows alias, as the caller would build them."""
    kc, vc = args["k_cache"], args["v_cache"]
    if how == "numpy stride 0":
        row = vc[:1].copy()
        v = np.lib.stride_tricks.as_strided(row, shape=vc.shape, strides=(0,) + row.strides[1:])
        assert v.flags.writeable
        return kc, v, "v_cache"
    if how == "torch expand":
        return torch.from_numpy(kc), torch.from_numpy(vc[:1].copy()).expand(vc.shape), "v_cache"
    if how == "torch offset overlap":   # buf[:, :C] and buf[:, 1:]: different data_ptr, shared elements
        buf = torch.from_numpy(np.concatenate([kc, vc[:, -1:]], axis=1))
        return buf[:, :kc.shape[1]], buf[:, 1:], "v_cache"
    if how == "numpy offset overlap":
        buf = np.concatenate([kc, vc[:, -1:]], axis=1)
        return buf[:, :kc.shape[1]], buf[:, 1:], "v_cache"
    if how == "torch heads stride 0":
        return torch.from_numpy(kc[:, :, :1].copy()).expand(kc.shape), torch.from_numpy(vc), "k_cache"
    raise AssertionError(how)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["numpy stride 0", "torch expand", "torch offset overlap", "numpy offset overlap",
                                 "torch heads stride 0"])
def test_aliased_cache_rows_are_refused_before_any_write(backend, how, rng):
    args = _case(rng, rotary=False, batch=2, capacity=9, d=8)
    k_cache, v_cache, named = _aliased_caches(_copy(args), how)
    is_torch = isinstance(k_cache, torch.Tensor)
    given = {n: (torch.from_numpy(a) if is_torch and isinstance(a, np.ndarray) else a)
             for n, a in _copy(args).items()}
    given.update(k_cache=k_cache, v_cache=v_cache)
    before = [np.array(np.asarray(c), copy=True) for c in (k_cache, v_cache)]
    with pytest.raises(AttentionInputError, match=f"^{named}: expected"):
        _op(backend).with_kvcache(**given)
    for c, b in zip((k_cache, v_cache), before):
        np.testing.assert_array_equal(np.asarray(c), b)


def test_aliased_caches_are_still_read_when_nothing_is_appended(rng):
    """Aliasing only matters to a write: an expanded cache with no new keys is a plain read."""
    args = _case(rng, rotary=False, batch=2, capacity=9, d=8, s_new=0)
    args["k_cache"] = np.broadcast_to(args["k_cache"][:1], args["v_cache"].shape)
    want = attention_ref_kvcache(**_copy(args))[0]
    given = {n: (torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a)
             for n, a in args.items()}
    given["k_cache"] = given["k_cache"][:1].expand(args["v_cache"].shape)
    got = _op("rocm").with_kvcache(**given)
    np.testing.assert_allclose(got.numpy(), want, atol=3e-5, rtol=0)


def _aliased_case(rng, batch=1):
    """A cache of 16 rows holding 3 keys a sequence, and q for one new row (D = 16)."""
    q = rng.standard_normal((batch, 1, 2, 16)).astype(np.float32)
    k_cache = rng.standard_normal((batch, 16, 1, 16)).astype(np.float32)
    v_cache = rng.standard_normal((batch, 16, 1, 16)).astype(np.float32)
    return q, k_cache, v_cache


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_values_that_are_a_view_of_the_slot_written_land_as_given(backend, rng):
    """A hostile pass (2026-12-07): v a view of the k_cache rows the append writes got the new key instead."""
    q, k_cache, v_cache = _aliased_case(rng)
    k = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
    v = k_cache[:, 3:4]                     # the slot k is written to
    given_v = v.copy()
    want_out, _, want_k, want_v = attention_ref_kvcache(q, k_cache.copy(), v_cache.copy(), k, given_v,
                                                        cache_seqlens=3, causal=True)
    out = _op(backend).with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, causal=True)
    np.testing.assert_array_equal(v_cache[0, 3], given_v[0, 0])
    np.testing.assert_allclose(k_cache, want_k, atol=1e-6, rtol=0)
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_keys_that_are_another_sequences_rows_land_as_given(backend, rng):
    """Sequence 1's new keys are rows of sequence 0's cache that sequence 0's append overwrites first."""
    q, k_cache, v_cache = _aliased_case(rng, batch=2)
    k = k_cache[::-1, 2:4]                  # sequence 1 reads k_cache[0, 2:4]; sequence 0 writes k_cache[0, 3:5]
    v = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    given_k = k.copy()
    want_out, _, want_k, _ = attention_ref_kvcache(q, k_cache.copy(), v_cache.copy(), given_k, v, cache_seqlens=3,
                                                   causal=True)
    out = _op(backend).with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=np.array([3, 3]), causal=True)
    np.testing.assert_allclose(k_cache, want_k, atol=1e-6, rtol=0)
    np.testing.assert_allclose(out, want_out, atol=3e-5, rtol=0)


def test_torch_new_keys_overlapping_their_own_slots_land_as_given(rng):
    from numba_flash.torch_api import flash_attn_with_kvcache

    q, k_cache, v_cache = (torch.from_numpy(a) for a in _aliased_case(rng))
    k = k_cache[:, 2:4]                     # written to rows 3 and 4: row 3 is k's own second row
    v = torch.from_numpy(rng.standard_normal((1, 2, 1, 16)).astype(np.float32))
    given_k = k.clone()
    want_out, _, want_k, _ = attention_ref_kvcache(q.numpy().copy(), k_cache.numpy().copy(),
                                                   v_cache.numpy().copy(), given_k.numpy(), v.numpy(),
                                                   cache_seqlens=3, causal=True)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=3, causal=True)
    assert torch.equal(k_cache[0, 3:5], given_k[0])
    np.testing.assert_allclose(k_cache.numpy(), want_k, atol=1e-6, rtol=0)
    np.testing.assert_allclose(out.numpy(), want_out, atol=3e-5, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_tensor_caches_are_refused_before_any_write(backend, rng):
    """torch refuses an in-place write to an inference tensor outside inference mode, after the k_cache's."""
    q, k_cache, v_cache = (torch.from_numpy(a) for a in _aliased_case(rng, batch=2))
    with torch.inference_mode():
        k_inf, v_inf = k_cache.clone(), v_cache.clone()
    k, v = (torch.from_numpy(rng.standard_normal((2, 1, 1, 16)).astype(np.float32)) for _ in range(2))
    with pytest.raises(AttentionInputError, match="k_cache: .*inference tensor"):
        _op(backend).with_kvcache(q, k_inf, v_inf, k, v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    assert torch.equal(k_inf, k_cache) and torch.equal(v_inf, v_cache)
    with torch.inference_mode():            # inside it the append is allowed, and lands
        _op(backend).with_kvcache(q, k_inf, v_inf, k, v, cache_seqlens=torch.tensor([3, 5], dtype=torch.int32))
    assert torch.equal(k_inf[0, 3], k[0, 0]) and torch.equal(v_inf[1, 5], v[1, 0])


def test_meta_index_arrays_and_a_backend_that_is_not_a_name_are_refused_by_name(rng):
    q, k_cache, v_cache = (torch.from_numpy(a) for a in _aliased_case(rng))
    lengths = torch.tensor([3], dtype=torch.int32).to("meta")
    with pytest.raises(AttentionInputError, match="cache_seqlens: .*meta tensor"):
        _op("cpu").with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
    with pytest.raises(AttentionInputError, match="backend: expected a backend's name"):
        backend_registry.get("flash").with_kvcache(q, k_cache, v_cache, cache_seqlens=3, backend=3)


def test_meta_prefix_sums_and_page_tables_are_refused_by_name(rng):
    from numba_flash.torch_api import flash_attn_varlen_func

    q, k, v = (torch.from_numpy(rng.standard_normal((7, 2, 16)).astype(np.float32)) for _ in range(3))
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="cu_seqlens_q: .*meta tensor"):
        flash_attn_varlen_func(q, k, v, cu.to("meta"), cu, 4, 4)
    pages = torch.from_numpy(rng.standard_normal((3, 4, 2, 16)).astype(np.float32))
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="block_table: .*meta tensor"):
        flash_attn_varlen_func(q, pages, pages, cu, cu, 4, 4, block_table=table.to("meta"))


def test_meta_caches_are_refused_by_name(rng):
    q, k_cache, v_cache = (torch.from_numpy(a).to("meta") for a in _aliased_case(rng))
    k = torch.empty((1, 1, 1, 16), device="meta")
    with pytest.raises(AttentionInputError, match="k_cache: .*meta tensor"):
        _op("cpu").with_kvcache(q, k_cache, v_cache, k, k, cache_seqlens=3)
