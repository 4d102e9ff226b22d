"""``flash_attn_with_kvcache``'s eager path (``numba_flash.torch_eager``): an eager call that needs no autograd
runs the registry's ``with_kvcache`` directly instead of the ``numba_flash::flash_kvcache`` op, and must be the
op's call in all but cost: the same bits (out, lse, both caches), the same version-counter bump on the caches the
op declares it mutates, the same refusals naming the argument with nothing written; and the op is still what a
torch dispatch mode, torch.compile and a cache that requires grad see.

Sizes are odd on purpose: B = 3, Hq = 6, Hkv = 3 (grouped-query), D = 24, capacity 13.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import numba_flash  # noqa: E402
from numba_flash import AttentionInputError, attention_ref_kvcache  # noqa: E402
from torch_eager_cases import SeesOps  # noqa: E402

B, HQ, HKV, D, CAPACITY = 3, 6, 3, 24, 13


def _inputs(seed: int) -> tuple[torch.Tensor, ...]:
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.standard_normal((B, 1, HQ, D), dtype=np.float32))
    k_cache, v_cache = (torch.from_numpy(rng.standard_normal((B, CAPACITY, HKV, D), dtype=np.float32))
                        for _ in range(2))
    k, v = (torch.from_numpy(rng.standard_normal((B, 1, HKV, D), dtype=np.float32)) for _ in range(2))
    return q, k_cache, v_cache, k, v


def _clones(tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(t.clone() for t in tensors)


LENS = torch.tensor([4, 11, 0], dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_the_eager_path_gives_the_ops_bits_and_the_reference(causal):
    q, k_cache, v_cache, k, v = _inputs(int(causal) + 3)
    copies = _clones((q, k_cache, v_cache, k, v))
    before = _clones((k_cache, v_cache))
    fast = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS, causal=causal,
                                               return_softmax_lse=True)
    mode = SeesOps()
    with mode:
        slow = numba_flash.flash_attn_with_kvcache(*copies, cache_seqlens=LENS, causal=causal,
                                                   return_softmax_lse=True)
    assert any("numba_flash.flash_kvcache" in name for name in mode.seen), mode.seen
    for got, want in zip(fast + (k_cache, v_cache), slow + copies[1:3], strict=True):
        assert torch.equal(got, want)
    ref_out, ref_lse, ref_k, ref_v = attention_ref_kvcache(
        q.numpy(), before[0].numpy(), before[1].numpy(), k.numpy(), v.numpy(), cache_seqlens=LENS.numpy(),
        causal=causal)
    np.testing.assert_allclose(fast[0].numpy(), ref_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(fast[1].numpy(), ref_lse, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(k_cache.numpy(), ref_k, atol=0, rtol=0)
    np.testing.assert_allclose(v_cache.numpy(), ref_v, atol=0, rtol=0)
    for x, was in zip((q, k, v), (copies[0], copies[3], copies[4])):   # inputs other than the caches untouched
        assert torch.equal(x, was)


def test_the_eager_path_bumps_the_caches_version_counters_as_the_op_does():
    """Autograd notices a cache written in place through its version counter (a tensor saved for a backward and
    then appended to must make that backward fail, not compute with the new values)."""
    q, k_cache, v_cache, k, v = _inputs(5)
    versions = (k_cache._version, v_cache._version)
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    # even without new keys: the op declares both caches mutated whatever the call, and so does the eager path
    versions = (k_cache._version, v_cache._version)
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=LENS)
    assert k_cache._version > versions[0] and v_cache._version > versions[1]
    # what the counter is for: a graph that saved the cache refuses to backpropagate through the stale copy
    w = torch.ones((), requires_grad=True)
    saved = k_cache * w       # mul saves k_cache for w's gradient
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved.sum().backward()


def test_a_refused_call_names_the_argument_and_writes_nothing():
    q, k_cache, v_cache, k, v = _inputs(6)
    numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS)   # a plan kept
    before = _clones((k_cache, v_cache))
    versions = (k_cache._version, v_cache._version)
    with pytest.raises(AttentionInputError, match=r"^cache_seqlens: "):
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=CAPACITY)
    with pytest.raises(AttentionInputError, match=r"^k: "):
        numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k[..., :5], v, cache_seqlens=LENS)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
    assert (k_cache._version, v_cache._version) == versions


def test_a_cache_that_requires_grad_still_goes_through_the_op():
    q, k_cache, v_cache, k, v = _inputs(7)
    q.requires_grad_(True)
    out = numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=LENS)
    assert out.requires_grad
    with pytest.raises(RuntimeError, match="does not support backward"):
        out.sum().backward()
