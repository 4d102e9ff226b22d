"""The checks every public entry point makes first (numba_flash.arguments): a keyword it does not take is named
with the closest one it does, and a masked array is refused by its argument's name, before any work, with the
inputs untouched."""

from __future__ import annotations

import inspect
import re

import numpy as np
import pytest

import numba_flash
from numba_flash import AttentionInputError, backend_registry
from numba_flash.errors import UnknownKeywordError


def _qkv(rng, batch=2, seqlen_q=5, seqlen_k=7, heads=2, head_dim=16):
    q = rng.standard_normal((batch, seqlen_q, heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((batch, seqlen_k, heads, head_dim)).astype(np.float32)
    v = rng.standard_normal((batch, seqlen_k, heads, head_dim)).astype(np.float32)
    return q, k, v


def _entry_points():
    """(name, function, typo, the keyword it should suggest) for each public function that takes keywords."""
    op = backend_registry.get("flash")
    cases = [
        ("forward", op.forward, "casual", "causal"),
        ("backward", op.backward, "softmax_scal", "softmax_scale"),
        ("with_kvcache", op.with_kvcache, "cache_seqlen", "cache_seqlens"),
        ("explain", op.explain, "windows_size", "window_size"),
        ("plan", op.plan, "casual", "causal"),
        ("plan_kvcache", op.plan_kvcache, "cache_seqlen", "cache_seqlens"),
        ("attention_ref", numba_flash.attention_ref, "causl", "causal"),
        ("attention_ref_backward", numba_flash.attention_ref_backward, "soft_cap", "softcap"),
        ("attention_ref_varlen", numba_flash.attention_ref_varlen, "cu_seqlen_q", "cu_seqlens_q"),
        ("attention_ref_varlen_backward", numba_flash.attention_ref_varlen_backward, "alibi_slope", "alibi_slopes"),
        ("attention_ref_kvcache", numba_flash.attention_ref_kvcache, "block_tables", "block_table"),
        ("merge_attention_states", numba_flash.merge_attention_states, "out_c", "out_a' or 'out_b"),
        ("block_mask", numba_flash.block_mask, "blockm", "block_m"),
        ("dropout_mask", numba_flash.dropout_mask, "dropoutp", "dropout_p"),
    ]
    return cases


@pytest.mark.parametrize("case", _entry_points(), ids=lambda c: c[0])
def test_a_misspelt_keyword_names_the_closest_one(rng, case):
    _, fn, typo, meant = case
    q, k, v = _qkv(rng)
    plain = [x.copy() for x in (q, k, v)]
    with pytest.raises(UnknownKeywordError) as err:
        fn(q, k, v, **{typo: True})
    message = str(err.value)
    assert re.fullmatch(rf"{typo}: not an argument of [\w.]+\(\); did you mean '{meant}'\?", message), message
    # Python's error for it is a TypeError; numba-flash's for any bad argument is AttentionInputError: both hold
    assert isinstance(err.value, TypeError) and isinstance(err.value, AttentionInputError)
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v), plain))


def test_a_keyword_like_none_lists_what_the_function_takes(rng):
    q, k, v = _qkv(rng)
    with pytest.raises(UnknownKeywordError, match=r"^zzz: not an argument of Dispatcher\.forward\(\); it takes "
                                                  r"q, k, v, causal, softmax_scale, window_size, "
                                                  r".*dropout_seed, deterministic, precision, block_table$"):
        backend_registry.get("flash").forward(q, k, v, zzz=1)


def test_the_wrapped_functions_keep_their_signatures_and_docs():
    """Notebooks' help() and completion read these: the wrapper must not hide them behind (*args, **kwargs)."""
    op = backend_registry.get("flash")
    assert "causal" in inspect.signature(op.forward).parameters
    assert list(inspect.signature(numba_flash.merge_attention_states).parameters) == ["out_a", "lse_a", "out_b",
                                                                                        "lse_b"]
    assert "(B, Sq, Hq, D)" in op.forward.__doc__


def _mask_one(rng, x):
    mask = np.zeros(np.shape(x), bool)
    mask.flat[int(rng.integers(mask.size))] = True
    return np.ma.masked_array(x, mask=mask)


def _assert_refused(name, call):
    with pytest.raises(AttentionInputError, match=rf"^{name}: expected an array without masked elements .*"
                                                  r"got a masked array with 1 masked element\(s\)$"):
        call()


@pytest.mark.parametrize("name", ["out_a", "lse_a", "out_b", "lse_b"])
def test_merge_refuses_a_masked_array(rng, name):
    out, lse = rng.standard_normal((2, 5, 3, 16)), rng.standard_normal((2, 3, 5))
    args = {"out_a": out, "lse_a": lse, "out_b": out + 1, "lse_b": lse - 1}
    plain = {n: x.copy() for n, x in args.items()}
    args[name] = _mask_one(rng, args[name])
    _assert_refused(name, lambda: numba_flash.merge_attention_states(**args))
    assert np.array_equal(np.asarray(args[name].data), plain[name]) and args[name].mask.sum() == 1


@pytest.mark.parametrize("name", ["cu_seqlens_q", "cu_seqlens_k"])
def test_packed_sequences_refuse_masked_prefix_sums(rng, name):
    q = rng.standard_normal((12, 2, 16)).astype(np.float32)
    cu = {"cu_seqlens_q": np.array([0, 5, 12], np.int32), "cu_seqlens_k": np.array([0, 5, 12], np.int32)}
    cu[name] = np.ma.masked_array(cu[name], mask=[False, True, False])
    op = backend_registry.get("flash")
    _assert_refused(name, lambda: op.forward(q, q, q, layout="thd", max_seqlen_q=7, max_seqlen_k=7, **cu))
    _assert_refused(name, lambda: numba_flash.attention_ref_varlen(q, q, q, **cu))


def test_the_kv_cache_refuses_masked_lengths(rng):
    q, _, _ = _qkv(rng, seqlen_q=1)
    k_cache, v_cache = _qkv(rng, seqlen_q=9, seqlen_k=9)[1:]
    lens = np.ma.masked_array(np.array([3, 4], np.int32), mask=[True, False])
    _assert_refused("cache_seqlens",
                    lambda: backend_registry.get("flash").with_kvcache(q, k_cache, v_cache, cache_seqlens=lens))
    _assert_refused("cache_seqlens", lambda: numba_flash.attention_ref_kvcache(q, k_cache, v_cache,
                                                                               cache_seqlens=lens))


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_the_reference_refuses_a_masked_array(rng, name):
    """The oracle drops nothing silently either: it would compute on the masked elements' data."""
    args = dict(zip("qkv", _qkv(rng)))
    args[name] = _mask_one(rng, args[name])
    _assert_refused(name, lambda: numba_flash.attention_ref(**args))
    _assert_refused(name, lambda: numba_flash.attention_ref(*args.values()))


def test_a_masked_array_with_nothing_masked_is_its_data(rng):
    out, lse = rng.standard_normal((2, 5, 3, 16)), rng.standard_normal((2, 3, 5))
    unmasked = np.ma.masked_array(lse, mask=np.zeros(lse.shape, bool))
    got = numba_flash.merge_attention_states(out, unmasked, out + 1, lse - 1)
    want = numba_flash.merge_attention_states(out, lse, out + 1, lse - 1)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("name, typo, meant", [
    ("flash_attn_func", "dropout", "dropout_p"),
    ("flash_attn_varlen_func", "max_seqlen", "max_seqlen_q' or 'max_seqlen_k"),
    ("flash_attn_with_kvcache", "return_lse", "return_softmax_lse"),
    ("ring_attention", "casual", "causal"),
])
def test_the_torch_faces_name_the_closest_keyword(rng, name, typo, meant):
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    with pytest.raises(UnknownKeywordError, match=rf"^{typo}: not an argument of {name}\(\); did you mean "
                                                  rf"'{meant}'\?$"):
        getattr(numba_flash, name)(q, k, v, **{typo: True})


def test_the_torch_faces_refuse_a_masked_tensor_by_name(rng):
    torch = pytest.importorskip("torch")
    masked = pytest.importorskip("torch.masked")
    q, k, v = (torch.from_numpy(x) for x in _qkv(rng))
    mq = masked.masked_tensor(q, torch.rand(q.shape) > 0.5)
    with pytest.raises(AttentionInputError, match=r"^q: expected a plain tensor .*got a torch.masked.MaskedTensor$"):
        numba_flash.flash_attn_func(mq, k, v)
    lens = torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match=r"^cache_seqlens: expected a plain tensor"):
        numba_flash.flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=masked.masked_tensor(
            lens, torch.tensor([True, False])))
