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
