"""The CUDA decode kernel (numba_flash/cuda/kernels/decode.py) behind ``with_kvcache``, under the Numba CUDA simulator and
its race, bounds and barrier checker, against the float64 reference ``attention_ref_kvcache``.

Toy tiles (4 query rows, 8 keys, 16 threads) so that a group's rows fill more than one row tile and a split more
than one key tile; odd head dims, page sizes and cache lengths; fresh random inputs each run (the ``rng``
fixture). One case runs the picker's own tile config for D = 64 (128 threads).

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim \
tests/numba_flash/cuda/test_decode_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import factory_home
from kvcache_cases import as_torch, copy_args, random_case

from backends import backend_registry
from numba_flash import AttentionInputError, attention_ref_kvcache
from numba_flash.cuda import tile_config_override

# numpy warns about the inf and NaN the simulated kernels compute with, which some cases put in on purpose.
pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TILES = dict(block_m=4, block_n=8, threads=16)
LOW_PRECISION = {"float16": 2e-3, "bfloat16": 1.6e-2}

# (case, options, num_splits, dtype): paged or not, cache_batch_idx, cache_leftpad, GQA and MQA, Sq 1 and 3, every
# mask, softcap and ALiBi, splits 1, 3 and 0 (the heuristic: 1 SM under the simulator), every dtype.
GRID = [
    (dict(sq=1, hq=4, hkv=2, d=7), dict(), 1, "float32"),
    (dict(sq=3, hq=4, hkv=2, d=7, batch_idx=True, leftpad=True), dict(causal=True), 3, "float32"),
    (dict(sq=1, hq=3, hkv=1, d=12, paged=True, page=4), dict(causal=True), 0, "float32"),
    (dict(sq=3, hq=3, hkv=1, d=12, paged=True, page=5), dict(window_size=(5, 0)), 3, "float32"),
    (dict(sq=3, hq=2, hkv=2, d=20, leftpad=True), dict(window_size=(3, 2), softcap=2.0), 3, "float32"),
    (dict(sq=3, hq=4, hkv=2, d=7, batch_idx=True), dict(window_size=(-1, 1)), 3, "float32"),
    (dict(sq=1, hq=4, hkv=1, d=9, batch_idx=True, leftpad=True),
     dict(alibi_slopes="per head", window_size=(6, 0), softcap=3.0), 0, "float32"),
    (dict(sq=3, hq=4, hkv=2, d=7, paged=True, page=3), dict(alibi_slopes="per batch", causal=True), 3, "float32"),
    (dict(sq=3, hq=4, hkv=2, d=7, leftpad=True), dict(causal=True, softmax_scale=0.3), 3, "float16"),
    (dict(sq=1, hq=2, hkv=1, d=12, paged=True, page=4), dict(softcap=2.0), 1, "float16"),
    (dict(sq=3, hq=3, hkv=1, d=7, paged=True, page=5), dict(alibi_slopes="per batch", causal=True), 3, "bfloat16"),
    (dict(sq=1, hq=4, hkv=2, d=12, batch_idx=True, leftpad=True), dict(window_size=(4, 0)), 0, "bfloat16"),
]


def _options(options, rng, batch, nheads):
    opts = dict(options)
    if opts.get("alibi_slopes") == "per batch":
        opts["alibi_slopes"] = rng.uniform(0.05, 1.0, (batch, nheads)).astype(np.float32)
    elif opts.get("alibi_slopes") == "per head":
        opts["alibi_slopes"] = rng.uniform(0.05, 1.0, nheads).astype(np.float32)
    return opts


def _cuda():
    return backend_registry.get("flash", backend="cuda")


def _as_dtype(args, dtype):
    """numpy arrays for float32 and float16; torch CPU tensors (the simulator's only bfloat16 host arrays) for
    bfloat16, floating arrays rounded to it."""
    if dtype == "float32":
        return args
    if dtype == "float16":
        return {n: (a.astype(np.float16) if isinstance(a, np.ndarray) and a.dtype.kind == "f" and n != "alibi_slopes"
                    else a) for n, a in args.items()}
    import torch

    return {n: (t.bfloat16() if t.dtype.is_floating_point else t) for n, t in as_torch(args).items()}


def _f64(x):
    return x.double().numpy() if hasattr(x, "double") else np.asarray(x, np.float64)


@pytest.mark.parametrize("case,options,splits,dtype", GRID)
def test_matches_reference(rng, case, options, splits, dtype):
    if dtype == "bfloat16":
        pytest.importorskip("torch")
    args = _as_dtype(random_case(rng, batch=3, capacity=23, s_new=2, **case), dtype)
    opts = _options(options, rng, 3, case["hq"])
    if dtype == "bfloat16" and "alibi_slopes" in opts:   # the slopes go with q's array kind
        opts["alibi_slopes"] = as_torch(opts)["alibi_slopes"]
    want_out, want_lse, want_k, want_v = attention_ref_kvcache(**args, **opts)
    given = {n: (a.clone() if hasattr(a, "clone") else a) for n, a in copy_args(args).items()}
    with tile_config_override(**TILES):
        out, lse = _cuda().with_kvcache(**given, **opts, num_splits=splits, return_lse=True)
    assert str(out.dtype).endswith(dtype) and tuple(out.shape) == tuple(args["q"].shape)
    out, lse = _f64(out), _f64(lse)
    seen = np.isfinite(want_lse)
    if dtype == "float32":
        np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    else:
        assert np.linalg.norm(out - want_out) / np.linalg.norm(want_out) < LOW_PRECISION[dtype]
    # q is rotated, then rounded to its dtype (flash-attn's kernels read it so); the reference keeps it exact.
    lse_tol = (2e-5, 1e-5) if dtype == "float32" else (LOW_PRECISION[dtype],) * 2
    np.testing.assert_allclose(lse[seen], want_lse[seen], atol=lse_tol[0], rtol=lse_tol[1])
    assert np.all(np.isposinf(lse[~seen]))
    np.testing.assert_array_equal(out.transpose(0, 2, 1, 3)[~seen], 0)   # rows that see no key: 0
    tol = 2e-6 if dtype == "float32" else 8 * LOW_PRECISION[dtype]   # appended keys rotated, then rounded
    np.testing.assert_allclose(_f64(given["k_cache"]), want_k, atol=tol, rtol=0)
    np.testing.assert_array_equal(_f64(given["v_cache"]), want_v)


def test_nan_in_the_cache_reaches_exactly_the_rows_that_see_it(rng):
    """A NaN key that only the last query row sees and a NaN value that the last two see, in one sequence; a
    window hides both from the first row. The other sequences, and rows of other kv heads, stay clean."""
    args = random_case(rng, batch=3, sq=3, hq=4, hkv=2, d=7, capacity=23, s_new=0, rotary=False, batch_idx=True)
    b, row, end = 1, args["cache_batch_idx"][1], int(args["cache_seqlens"][1])
    args["cache_seqlens"][1] = end = max(end, 12)
    args["k_cache"][row, end - 1, 0, 3] = np.nan        # kv head 0: query heads 0 and 1
    args["v_cache"][row, end - 2, 1, 5] = np.nan        # kv head 1: query heads 2 and 3
    opts = dict(window_size=(4, 0))
    want_out, want_lse, _, _ = attention_ref_kvcache(**args, **opts)
    assert np.isnan(want_out[b, 2, :2]).all() and not np.isnan(want_out[b, :2, :2]).any()
    assert np.isnan(want_out[b, 1:, 2:]).any() and not np.isnan(want_out[b, 0]).any()
    with tile_config_override(**TILES):
        out, lse = _cuda().with_kvcache(**copy_args(args), **opts, num_splits=3, return_lse=True)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(want_out))
    np.testing.assert_array_equal(np.isnan(lse), np.isnan(want_lse))
    clean = ~np.isnan(want_out)
    np.testing.assert_allclose(out[clean], want_out[clean], atol=2e-5, rtol=0)


def test_rows_that_see_no_key_get_zero_and_inf(rng):
    """Causal with more query rows than keys (the first rows see nothing), and a sequence with no keys at all."""
    args = random_case(rng, batch=3, sq=3, hq=2, hkv=1, d=7, capacity=23, s_new=0, rotary=False, leftpad=True)
    args["cache_seqlens"][0], args["cache_leftpad"][0] = 5, 4       # one key: rows 0 and 1 see none
    args["cache_seqlens"][2], args["cache_leftpad"][2] = 6, 6       # no key at all
    want_out, want_lse, _, _ = attention_ref_kvcache(**args, causal=True)
    with tile_config_override(**TILES):
        out, lse = _cuda().with_kvcache(**copy_args(args), causal=True, num_splits=3, return_lse=True)
    assert np.all(out[0, :2] == 0) and np.all(np.isposinf(lse[0, :, :2])) and np.all(np.isfinite(lse[0, :, 2]))
    assert np.all(out[2] == 0) and np.all(np.isposinf(lse[2]))
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.isposinf(lse), np.isposinf(want_lse))


def test_memory_outside_the_attended_keys_is_never_read(rng):
    args = random_case(rng, batch=3, sq=2, hq=2, hkv=1, d=7, capacity=23, s_new=1, rotary=False, leftpad=True)
    want = attention_ref_kvcache(**args)[0]
    given = copy_args(args)
    for b in range(3):
        for cache in (given["k_cache"], given["v_cache"]):
            cache[b, args["cache_seqlens"][b] + 1:] = np.nan
            cache[b, :args["cache_leftpad"][b]] = np.inf
    with tile_config_override(**TILES):
        out = _cuda().with_kvcache(**given, num_splits=3)
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


@pytest.fixture
def kernel_launches(monkeypatch):
    """The grid of every decode-kernel and merge launch, and the dense forward's launches (there should be none)."""
    from numba_flash.cuda.host import launch_decode
    from numba_flash.cuda.kernels import forward

    seen = {"decode": [], "merge": [], "forward": []}

    def recording(factory, name):
        def make(*args):
            kernel = factory(*args)

            class Recorder:
                def __getitem__(self, config):
                    seen[name].append(config[0])
                    return kernel[config]
            return Recorder()
        return make

    decode_home = factory_home("make_decode_kernel")   # the decode kernel's file: its registry entry builds it
    monkeypatch.setattr(decode_home, "make_decode_kernel", recording(decode_home.make_decode_kernel, "decode"))
    monkeypatch.setattr(launch_decode, "make_split_merge_kernel",
                        recording(launch_decode.make_split_merge_kernel, "merge"))
    monkeypatch.setattr(forward, "make_forward_kernel", recording(forward.make_forward_kernel, "forward"))
    return seen


@pytest.mark.parametrize("paged", [False, True])
def test_one_decode_launch_and_one_merge_per_call(rng, kernel_launches, paged):
    batch, splits = 4, 3
    args = random_case(rng, batch=batch, sq=3, hq=4, hkv=2, d=7, capacity=19, s_new=1, paged=paged, page=4)
    with tile_config_override(**TILES):
        _cuda().with_kvcache(**copy_args(args), causal=True, num_splits=splits)
    # group * Sq = 6 rows: two row tiles of 4, times the splits; one block per (kv head, sequence).
    assert kernel_launches["decode"] == [(splits * 2, 2, batch)]
    assert kernel_launches["merge"] == [batch * 4 * 3]
    assert kernel_launches["forward"] == []


def test_picker_tiles_d64(rng):
    """The decode config a GPU gets for D = 64 (16 rows x 64 keys, 128 threads), keys spanning several tiles."""
    from numba_flash.cuda import tile_config_for

    cfg = tile_config_for(64, kernel="decode")
    assert (cfg.block_m, cfg.block_n, cfg.threads) == (16, 64, 128)
    args = random_case(rng, batch=2, sq=1, hq=4, hkv=1, d=61, capacity=150, s_new=1, paged=True, page=16)
    opts = dict(causal=True, softcap=5.0)
    want_out, want_lse, _, _ = attention_ref_kvcache(**args, **opts)
    out, lse = _cuda().with_kvcache(**copy_args(args), **opts, num_splits=2, return_lse=True)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=2e-5, rtol=1e-5)


def test_bad_input_is_refused_and_the_cache_untouched(rng):
    args = random_case(rng, batch=3, sq=1, hq=2, hkv=1, d=7, capacity=13, s_new=2)
    bad = {**args, "cache_seqlens": np.array([12, 0, 1], np.int32)}   # 12 + 2 > 13
    given = copy_args(bad)
    with pytest.raises(AttentionInputError, match="^cache_seqlens: expected"):
        _cuda().with_kvcache(**given)
    for name in ("k_cache", "v_cache"):
        np.testing.assert_array_equal(given[name], bad[name])
