"""The contract's non-finite rule and extreme options on the CUDA kernels, under the Numba CUDA simulator with toy
tiles (8 x 8, 16 threads) and tiny shapes: the same cases and expectations as tests/numba_flash/test_nonfinite.py
and test_extreme_options.py run on the reference, the CPU backend and the ROCm path.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_nonfinite_sim.py
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
from nonfinite_cases import BAD, check, expected, place_bad, poke, random_inputs

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.cuda import tile_config_override
from numba_flash.semantics import visible_mask

# numpy warns about every inf and NaN the simulated kernels compute with; here that is the point.
pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]

TILES = dict(block_m=8, block_n=8, threads=16)
# (B, Sq, Sk, Hq, Hkv, D): rows that see nothing (Sq > Sk, causal) and GQA; and several 8 x 8 tiles each way.
SHAPES = {"small": (1, 13, 11, 4, 2, 12), "tiles": (1, 21, 27, 2, 1, 8)}


def _f64(x):
    return np.asarray(x, np.float64)


def _forward(q, k, v, **kw):
    with tile_config_override(**TILES):
        out, lse = backend_registry.get("flash", backend="cuda").forward(q, k, v, return_lse=True, **kw)
    return _f64(out), _f64(lse)


def _run(q, k, v, dout, tiles=TILES, **kw):
    with tile_config_override(**tiles):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (_f64(x) for x in (out, lse, *grads))))


def _reference(q, k, v, dout, **kw):
    out, lse = attention_ref(q, k, v, **kw)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *attention_ref_backward(dout, q, k, v, **kw))))


def _empty_rows(shape):
    return ~visible_mask(shape[1], shape[2], -1, 0).any(axis=1)


# One bad value in each input, with and without softcap (tanh(+-inf) = +-1 must not hide an inf in k; softcap's
# derivative at a NaN score is NaN, and must not reach the rows that do not see the key).
CASES = [("q", "nan", 0.0), ("q", "inf", 0.0), ("k", "inf", 0.0), ("k", "nan", 0.0), ("v", "nan", 0.0),
         ("v", "-inf", 0.0), ("k", "inf", 2.0), ("dout", "nan", 0.0), ("dout", "inf", 0.0), ("k", "nan", 2.0)]


@pytest.fixture(scope="module")
def clean_runs(module_rng):
    """The clean call each bad value is compared with, run once per (shape, softcap, tiles) in this module: half of
    each case's simulator time. Fresh random inputs per session (``module_rng``), shared by the cases of one
    shape."""
    inputs = {name: random_inputs(module_rng, shape) for name, shape in SHAPES.items()}
    runs = {}

    def clean(shape_name, softcap, tiles=TILES):
        key = (shape_name, softcap, tuple(sorted(tiles.items())))
        if key not in runs:
            runs[key] = _run(*inputs[shape_name], tiles=tiles, causal=True, softcap=softcap)
        return inputs[shape_name], runs[key]

    return clean


@pytest.mark.parametrize("where,bad,softcap", CASES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_one_bad_value(rng, clean_runs, shape_name, where, bad, softcap):
    shape = SHAPES[shape_name]
    clean_inputs, clean = clean_runs(shape_name, softcap)
    at = place_bad(rng, shape, where)
    q, k, v, dout = poke(clean_inputs, where, at, BAD[bad])
    copies = [x.copy() for x in (q, k, v, dout)]
    kw = dict(causal=True, softcap=softcap)
    got = _run(q, k, v, dout, **kw)
    for x, c in zip((q, k, v, dout), copies):
        assert np.array_equal(x, c, equal_nan=True), "inputs are never modified"
    check(got, clean, _reference(q, k, v, dout, **kw), expected(shape, where, at), _empty_rows(shape))


@pytest.mark.parametrize("where,bad,softcap", [CASES[0], CASES[2], CASES[4], CASES[6], CASES[8]])
def test_one_bad_value_whole_score_blocks(rng, clean_runs, where, bad, softcap):
    """As above with 4 threads, each owning a whole 4 x 4 score block: the backward's path without the split."""
    shape = SHAPES["tiles"]
    tiles = dict(TILES, threads=4)
    clean_inputs, clean = clean_runs("tiles", softcap, tiles)
    at = place_bad(rng, shape, where)
    q, k, v, dout = poke(clean_inputs, where, at, BAD[bad])
    check(_run(q, k, v, dout, tiles=tiles, causal=True, softcap=softcap), clean,
          _reference(q, k, v, dout, causal=True, softcap=softcap), expected(shape, where, at), _empty_rows(shape))


@pytest.mark.parametrize("scale", [1e38, 1e300])
def test_huge_scale_gives_nan_rows_or_the_right_answer(rng, scale):
    q, k, v, _ = random_inputs(rng, (1, 9, 11, 2, 1, 8))
    out, lse = _forward(q, k, v, softmax_scale=scale)
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=scale)
    rows_nan = np.isnan(lse)
    assert np.array_equal(np.isnan(out).all(axis=-1), rows_nan.transpose(0, 2, 1))
    assert np.all(np.isfinite(lse) | rows_nan), "never lse = +inf for a row that sees keys"
    fin = ~rows_nan
    assert np.abs(out[fin.transpose(0, 2, 1)] - ref_out[fin.transpose(0, 2, 1)]).max(initial=0.0) <= 1e-5
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= 1e-4 + 1e-5 * np.abs(ref_lse[fin]))


def test_finite_inputs_give_no_nan_and_empty_rows_zero(rng):
    shape = (2, 23, 9, 4, 2, 10)
    q, k, v, dout = random_inputs(rng, shape)
    kw = dict(window_size=(2, 1), softcap=1.5)
    got, ref = _run(q, k, v, dout, **kw), _reference(q, k, v, dout, **kw)
    empty = ~visible_mask(23, 9, 2, 1).any(axis=1)
    assert empty.any() and not empty.all()
    for name, g in got.items():
        assert not np.isnan(g).any(), name
    assert np.all(got["out"][:, empty] == 0) and np.all(np.isposinf(got["lse"][:, :, empty]))
    assert np.all(got["dq"][:, empty] == 0)
    assert np.abs(got["out"] - ref["out"]).max() <= 1e-5
    assert np.abs(got["lse"][:, :, ~empty] - ref["lse"][:, :, ~empty]).max() <= 1e-4
    for name in ("dq", "dk", "dv"):
        assert np.linalg.norm(got[name] - ref[name]) <= 1e-5 * np.linalg.norm(ref[name]), name


def _check_against_reference(got, q, k, v, dout, **kw):
    ref = _reference(q, k, v, dout, **kw)
    assert np.all(np.isfinite(got["out"])) and not np.isnan(got["lse"]).any()
    assert np.abs(got["out"] - ref["out"]).max() <= 1e-5
    fin = np.isfinite(ref["lse"])
    assert np.array_equal(np.isfinite(got["lse"]), fin)
    assert np.abs(got["lse"][fin] - ref["lse"][fin]).max(initial=0.0) <= 1e-4
    for name in ("dq", "dk", "dv"):
        assert np.linalg.norm(got[name] - ref[name]) <= 1e-5 * np.linalg.norm(ref[name]) + 1e-6, name


@pytest.mark.parametrize("softcap", [1e-40, 1e-50, 2.0 ** -30, 1e-8, 1e38, 3e38, 1e300])
def test_softcap_extremes_match_the_reference(rng, softcap):
    """numba_flash.semantics.effective_softcap's values, applied in validation, are ones the kernels can run."""
    q, k, v, dout = random_inputs(rng, (1, 11, 13, 2, 1, 8))
    _check_against_reference(_run(q, k, v, dout, causal=True, softcap=softcap), q, k, v, dout, causal=True,
                             softcap=softcap)


@pytest.mark.parametrize("window", [(-1, sys.maxsize), (sys.maxsize, -1), (2 ** 63, 0), (2 ** 100, 3)])
def test_huge_window_bounds(rng, window):
    q, k, v, dout = random_inputs(rng, (1, 11, 13, 2, 1, 8))
    _check_against_reference(_run(q, k, v, dout, window_size=window), q, k, v, dout, window_size=window)
