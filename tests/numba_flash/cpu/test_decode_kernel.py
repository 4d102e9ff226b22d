"""The CPU flash-decoding kernel (``numba_flash.cpu.decode.decode_forward``) called directly, against the float64
reference on keys gathered from the cache here with numpy, independently of the kernel's own addressing.

Every case draws fresh seeded N(0, 1) inputs of odd sizes; float32 and float64 share the cases. One compiled kernel
per dtype serves every layout, so the file pays two compilations (cached on disk by numba)."""

from __future__ import annotations

import numpy as np
import pytest

from numba_flash.cpu import decode
from numba_flash.cpu.decode import MAX_SPLITS, choose_num_splits, decode_forward
from numba_flash.reference import attention_ref
from numba_flash.semantics import default_scale

DTYPES = [np.float32, np.float64]


def _make_case(rng, dtype, *, batch=3, sq=1, hq=6, hkv=2, d=37, lengths=(29, 0, 61), starts=(0, 0, 0),
               page_size=0, spare_rows=2):
    """Random q and cache for ``batch`` sequences; sequence b's keys are positions [starts[b], starts[b] +
    lengths[b]) of its cache row (or pages). Returns the kernel's arguments and, per batch, the gathered (k, v)."""
    ends = [s + n for s, n in zip(starts, lengths)]
    capacity = max(ends) + 3
    q = rng.standard_normal((batch, sq, hq, d)).astype(dtype)
    if page_size:
        max_blocks = -(-capacity // page_size)
        num_blocks = batch * max_blocks + spare_rows
        k_cache = rng.standard_normal((num_blocks, page_size, hkv, d)).astype(dtype)
        v_cache = rng.standard_normal((num_blocks, page_size, hkv, d)).astype(dtype)
        block_table = rng.permutation(num_blocks)[:batch * max_blocks].reshape(batch, max_blocks).astype(np.int64)
        cache_rows = np.zeros(batch, np.int64)
    else:
        k_cache = rng.standard_normal((batch + spare_rows, capacity, hkv, d)).astype(dtype)
        v_cache = rng.standard_normal((batch + spare_rows, capacity, hkv, d)).astype(dtype)
        cache_rows = rng.permutation(batch + spare_rows)[:batch].astype(np.int64)
        block_table = np.zeros((1, 1), np.int64)
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_rows=cache_rows,
                key_start=np.array(starts, np.int64), key_end=np.array(ends, np.int64), block_table=block_table,
                page_size=page_size)
    return case


def _gather(case, b):
    """Batch b's keys and values, (Sk_b, Hkv, D), read position by position from the cache."""
    pos = np.arange(case["key_start"][b], case["key_end"][b])
    if case["page_size"]:
        ps = case["page_size"]
        blocks = case["block_table"][b, pos // ps]
        return case["k_cache"][blocks, pos % ps], case["v_cache"][blocks, pos % ps]
    row = case["cache_rows"][b]
    return case["k_cache"][row, pos], case["v_cache"][row, pos]


def _run(case, scale, left=-1, right=-1, softcap=0.0, num_splits=1, out=None):
    q = case["q"]
    batch, sq, hq, _ = q.shape
    out = np.full(q.shape, np.nan, q.dtype) if out is None else out
    lse = np.full((batch, hq, sq), -7.0, q.dtype)
    decode_forward(q, case["k_cache"], case["v_cache"], case["cache_rows"], case["key_start"], case["key_end"],
                   case["block_table"], case["page_size"], out, lse, scale, left, right, softcap, num_splits)
    return out, lse


def _reference(case, scale, left=-1, right=-1, softcap=0.0):
    """float64 out and lse per batch; a batch without keys is all 0 / +inf (the reference needs Sk >= 1)."""
    q = case["q"]
    out = np.zeros(q.shape)
    lse = np.full((q.shape[0], q.shape[2], q.shape[1]), np.inf)
    err32 = np.zeros(q.shape[0])
    for b in range(q.shape[0]):
        k, v = _gather(case, b)
        if k.shape[0] == 0:
            continue
        args = dict(softmax_scale=scale, window_size=(left, right), softcap=softcap)
        out[b], lse[b] = (x[0] for x in attention_ref(q[b:b + 1], k[None], v[None], **args))
        err32[b] = _textbook_f32_error(q[b], k, v, scale, left, right, softcap, out[b])
    return out, lse, err32.max()


def _textbook_f32_error(q, k, v, scale, left, right, softcap, ref):
    """Max abs error of plain float32 softmax(q k^T) v on one batch: the yardstick of the contract's bound."""
    from numba_flash.semantics import visible_mask

    sq, sk, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qf, kf, vf = (x.astype(np.float32) for x in (q, k, v))
    kf, vf = np.repeat(kf, group, axis=1), np.repeat(vf, group, axis=1)
    s = np.einsum("ihd,jhd->hij", qf, kf) * np.float32(scale)
    if softcap > 0:
        s = np.float32(softcap) * np.tanh(s / np.float32(softcap))
    mask = visible_mask(sq, sk, left, right)
    with np.errstate(invalid="ignore", divide="ignore"):
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(axis=-1, keepdims=True))
    o = np.einsum("hij,jhd->ihd", p, vf)
    return float(np.nanmax(np.abs(o - ref)))


def _check(got, ref, dtype, err32):
    out, lse = got
    out_ref, lse_ref, _ = ref
    tol = 1e-12 if dtype == np.float64 else max(1e-5, 4 * err32)
    lse_tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out_ref))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(lse_ref))
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    ok = ~np.isnan(out_ref)
    assert np.abs(out[ok] - out_ref[ok]).max(initial=0) <= tol
    fin = np.isfinite(lse_ref)
    assert np.abs(lse[fin] - lse_ref[fin]).max(initial=0) <= lse_tol * max(1.0, np.abs(lse_ref[fin]).max(initial=0))


CASES = {
    # name: (make_case kwargs, window (left, right), softcap)
    "mqa_sq1": (dict(hq=4, hkv=1), (-1, -1), 0.0),
    "gqa_sq5_causal": (dict(sq=5), (-1, 0), 0.0),
    "left_padding": (dict(sq=5, starts=(3, 0, 7), lengths=(40, 5, 0)), (-1, 0), 0.0),
    "window": (dict(sq=5, lengths=(70, 2, 33)), (9, 2), 0.0),
    "softcap": (dict(sq=5), (-1, 0), 2.5),
    "paged4": (dict(sq=5, page_size=4, starts=(2, 0, 5)), (-1, 0), 0.0),
    "paged16_window": (dict(sq=1, page_size=16, lengths=(100, 17, 0)), (20, -1), 1.5),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("num_splits", [1, 3, 8])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, num_splits, dtype):
    kwargs, (left, right), softcap = CASES[name]
    rng = np.random.default_rng([hash(name) % 2**32, num_splits])
    if name in ("mqa_sq1",) and num_splits == 8:
        kwargs = dict(kwargs, lengths=(5, 0, 3))  # more splits than keys: empty parts weigh nothing
    case = _make_case(rng, dtype, **kwargs)
    scale = default_scale(case["q"].shape[3])
    ref = _reference(case, scale, left, right, softcap)
    _check(_run(case, scale, left, right, softcap, num_splits), ref, dtype, ref[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("name", list(CASES))
def test_head_blocks(name, dtype, monkeypatch):
    """Units that take several kv heads (what long "bshd" caches get) on the same cases: with no minimum split
    length every case here runs Hkv heads per unit."""
    monkeypatch.setattr(decode, "MIN_KEYS_PER_SPLIT", 1)
    kwargs, (left, right), softcap = CASES[name]
    kwargs = dict(kwargs, hq=6, hkv=3) if name == "mqa_sq1" else kwargs
    case = _make_case(np.random.default_rng([hash(name) % 2**32, 99]), dtype, **kwargs)
    assert decode._heads_per_unit(case["k_cache"].shape[2], 20, 2) == case["k_cache"].shape[2]
    scale = default_scale(case["q"].shape[3])
    ref = _reference(case, scale, left, right, softcap)
    _check(_run(case, scale, left, right, softcap, 2), ref, dtype, ref[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_strided_q_out_and_cache(dtype):
    """q and out as non-contiguous views, the cache a strided ("bhsd"-transposed, D-reversed) view."""
    rng = np.random.default_rng(11)
    case = _make_case(rng, dtype, sq=5, d=24)
    q_big = np.zeros((3, 5, 6, 48), dtype)
    q_big[..., ::2] = case["q"]
    case["q"] = q_big[..., ::2]
    for name in ("k_cache", "v_cache"):
        c = case[name]
        case[name] = np.ascontiguousarray(c.transpose(0, 2, 1, 3)[..., ::-1]).transpose(0, 2, 1, 3)[..., ::-1]
        assert not case[name].flags.c_contiguous and np.array_equal(case[name], c)
    out_big = np.full((3, 5, 6, 48), 5.0, dtype)
    scale = 0.3
    ref = _reference(case, scale, -1, 0)
    got = _run(case, scale, -1, 0, num_splits=3, out=out_big[..., 1::2])
    _check(got, ref, dtype, ref[2])
    assert np.all(out_big[..., ::2] == 5.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_nonfinite_rule(num_splits, dtype):
    """A NaN in v row j reaches only the rows that see key j; an inf in a q row poisons only that row; an inf in
    a q row that sees no key leaves it 0 / +inf."""
    rng = np.random.default_rng(5 + num_splits)
    case = _make_case(rng, dtype, sq=5, lengths=(40, 12, 0), starts=(1, 0, 0))
    # Causal with Sq = 5: in batch 0 key 36 (position 37) is seen by rows 1..4 only, never by row 0.
    case["v_cache"][case["cache_rows"][0], 37, 1, 3] = np.nan
    case["q"][1, 2, 4, 0] = np.inf
    case["q"][2, 0, 0, 0] = np.inf  # batch 2 has no keys
    scale = default_scale(case["q"].shape[3])
    ref = _reference(case, scale, -1, 0)
    out, lse = _run(case, scale, -1, 0, num_splits=num_splits)
    _check((out, lse), ref, dtype, ref[2])
    nan_at = np.zeros(out[0].shape, bool)
    nan_at[1:, 3:6, 3] = True  # rows 1..4 of the kv head's query heads, in the NaN's column only
    np.testing.assert_array_equal(np.isnan(out[0]), nan_at)
    assert np.isnan(lse[1, 4, 2]) and np.isnan(out[1, 2, 4]).all()
    assert np.isnan(lse[1]).sum() == 1 and np.isnan(out[1]).sum() == out.shape[3]
    assert (out[2] == 0).all() and np.isposinf(lse[2]).all()


def test_merge_weights_the_splits():
    """Splits of one row with very different maxima: dropping the lse weighting of the merge fails this."""
    rng = np.random.default_rng(3)
    case = _make_case(rng, np.float64, batch=1, sq=1, hq=2, hkv=1, d=16, lengths=(50,), starts=(0,))
    case["k_cache"][case["cache_rows"][0], :10] *= 4.0
    ref = _reference(case, 0.5)
    one = _run(case, 0.5, num_splits=1)
    split = _run(case, 0.5, num_splits=5)
    _check(split, ref, np.float64, 0.0)
    np.testing.assert_allclose(split[0], one[0], rtol=0, atol=1e-12)


def test_choose_num_splits():
    for args in [(1, 1, 1, 1), (1, 8, 65536, 2), (64, 32, 100, 64), (1, 1, 10**7, 10**4)]:
        assert 1 <= choose_num_splits(*args) <= MAX_SPLITS
    assert choose_num_splits(1, 8, 100, 2) == 1  # too few keys to be worth splitting
    assert choose_num_splits(64, 8, 65536, 16) == 1  # batch x heads already keeps every thread busy
    assert choose_num_splits(1, 1, 65536, 16) > 8
    lengths = [1, 300, 1000, 5000, 20000, 10**5, 10**6]
    for threads in (1, 2, 16, 128):
        ns = [choose_num_splits(1, 2, n, threads) for n in lengths]
        assert ns == sorted(ns)
    for n in (1000, 65536):
        ns = [choose_num_splits(1, 8, n, t) for t in (1, 2, 4, 16, 64, 256)]
        assert ns == sorted(ns)
        ns = [choose_num_splits(b, 8, n, 16) for b in (1, 2, 4, 16, 64)]
        assert ns == sorted(ns, reverse=True)
