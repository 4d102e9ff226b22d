"""The score pipeline described once (numba_flash/score_pipeline.py), held to the float64 reference.

The description is built three ways: as plain Python (the decorator is the identity), with numba's njit in float64
(bit for bit the Python build's) and in float32. Its scores of one head are put through a softmax here and compared
with the reference's probabilities, mask and chain factors on inputs with every stage on at once, non-finite
values in q, k and attn_bias, and mods that hide pairs. The CUDA kernels' builds (cuda/score_terms.py) are tested
through the kernels themselves, under the simulator (tests/numba_flash/cuda).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from numba import njit

from numba_flash.reference import _head_bias, _head_terms, _probabilities
from numba_flash.score_pipeline import STAGES, compile_with
from numba_flash.semantics import visible_mask

SQ, SK, D = 7, 12, 5
SOFTCAP, SCALE, SLOPE = 4.0, 0.45, 0.3
B_IDX, H_IDX = 1, 2


@njit
def mask_mod(b, h, q_idx, kv_idx):
    return (q_idx + kv_idx) % 5 != 0


@njit
def bias_mod(b, h, q_idx, kv_idx):
    return 0.1 * (q_idx - kv_idx) + 0.05 * h


@njit
def score_mod(score, b, h, q_idx, kv_idx):
    if (q_idx * kv_idx) % 7 == 3:
        return -math.inf
    return 0.7 * score + 0.02 * kv_idx


@njit
def score_mod_grad(score, b, h, q_idx, kv_idx):
    return 0.7


def _py_tanh(raw, qmult):
    return math.tanh(raw * qmult)


def _py_hook(x, apply, b, h, row, col, last_row, last_col):
    if apply and abs(x) < math.inf:
        return score_mod(x, b, h, row, col), score_mod_grad(x, b, h, row, col)
    return x, 1.0


def _inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (SQ, D), k (SK, D) and attn_bias (SQ, SK), float64, with scores large enough for softcap to bend them, an
    inf in a query row, and -inf, +inf and NaN bias entries (rows 2, 3 and 6 are poisoned; a NaN in a key would
    poison every row that sees it)."""
    q = rng.standard_normal((SQ, D)) * 2.0
    k = rng.standard_normal((SK, D)) * 2.0
    q[2, 1] = np.inf
    bias = rng.standard_normal((SQ, SK))
    bias[0, 3] = bias[4, 10] = bias[5, 11] = -np.inf
    bias[3, 8] = np.inf
    bias[6, 11] = np.nan
    return q, k, bias


def _grid(pipeline, q, k, bias, vis, real) -> list[np.ndarray]:
    """The pipeline's (x, dcap, dmod, shown, finite) at every pair, each (SQ, SK); the scores in natural units."""
    out = [np.zeros((SQ, SK)), np.zeros((SQ, SK)), np.zeros((SQ, SK)), np.zeros((SQ, SK), bool),
           np.zeros((SQ, SK), bool)]
    for i, j in itertools.product(range(SQ), range(SK)):
        raw = real(q[i] @ k[j])
        got = pipeline(raw, real(SCALE / SOFTCAP), real(SOFTCAP), real(SLOPE), real(i + SK - SQ - j), real(bias[i, j]),
                       real(bias_mod(B_IDX, H_IDX, i, j)), not mask_mod(B_IDX, H_IDX, i, j), bool(vis[i, j]), B_IDX,
                       H_IDX, i, j, SQ - 1, SK - 1)
        for a, value in zip(out, got):
            a[i, j] = value
    return out


def _builds() -> dict[str, tuple]:
    """name -> (pipeline, float type): every stage on."""
    switches = dict(softcap=True, alibi=True, bias=True, index_mods=True)
    builds = {"python": (compile_with(lambda f: f, _py_tanh, float, 1.0, score_mod=_py_hook, **switches), float)}
    for name, real in (("njit-float64", np.float64), ("njit-float32", np.float32)):
        jit = njit(inline="always")
        hook = jit(_py_hook)
        builds[name] = (compile_with(jit, jit(_py_tanh), real, 1.0, score_mod=hook, **switches), real)
    return builds


@pytest.fixture(scope="module")
def builds() -> dict[str, tuple]:
    return _builds()


def _softmax(x, shown, finite, vis) -> tuple[np.ndarray, np.ndarray]:
    """P (SQ, SK) of the pipeline's scores as the contract states it (reference.py's docstring), and the mask."""
    mask = vis & shown
    poisoned = (mask & ~finite).any(axis=1)
    s = np.where(mask & ~poisoned[:, None], x, -np.inf)
    m = s.max(axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m[:, None])
    p = p / np.where(p.sum(axis=1) > 0, p.sum(axis=1), 1.0)[:, None]
    return np.where(poisoned[:, None] & mask, np.nan, p), mask


def test_stages_are_the_contracts_order():
    """design.md: scale, softcap, + bias (attn_bias, ALiBi, bias_mod), then score_mod. ALiBi is named before
    attn_bias (the sum is the same in either order; the kernels add it first)."""
    assert STAGES == ("scale", "softcap", "alibi", "attn_bias", "mods", "score_mod")


@pytest.mark.parametrize("window", [(-1, -1), (3, 0)], ids=["full", "window-causal"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_pipeline_gives_the_references_probabilities_mask_and_chain(builds, window, seed):
    q, k, bias = _inputs(np.random.default_rng(seed))
    vis = visible_mask(SQ, SK, *window)
    slopes = np.full((B_IDX + 1, H_IDX + 1), SLOPE)
    head_bias = _head_bias(np.broadcast_to(bias, (B_IDX + 1, H_IDX + 1, SQ, SK)), slopes, B_IDX, H_IDX, SQ, SK)
    mods = dict(mask_mod=mask_mod, bias_mod=bias_mod, score_mod=score_mod, score_mod_grad=score_mod_grad)
    with np.errstate(invalid="ignore", over="ignore"):
        mask, full_bias, ref_mod = _head_terms(mods, vis, head_bias, B_IDX, H_IDX)
        p_ref, dcap_ref, dmod_ref, poisoned_ref, _, _, mask_ref = _probabilities(q, k, SCALE, SOFTCAP, mask, full_bias,
                                                                                ref_mod)
        pipeline, real = builds["python"]
        x, dcap, dmod, shown, finite = _grid(pipeline, q, k, bias, vis, real)
        p, got_mask = _softmax(x, shown, finite, vis)
    np.testing.assert_array_equal(got_mask, mask_ref)
    assert (x[~shown] == -np.inf).all(), "a hidden pair's score is -inf (the tensor-core kernels read only x)"
    assert poisoned_ref.any() and (~poisoned_ref).sum() >= 3, "the inputs must poison some rows and not others"
    assert (vis & ~mask_ref).any(), "some stage must hide a pair the window shows"
    np.testing.assert_allclose(p, p_ref, rtol=1e-12, atol=1e-15, equal_nan=True)
    ok = mask_ref & ~poisoned_ref[:, None]
    np.testing.assert_allclose(dcap[ok], dcap_ref[ok], rtol=1e-12)
    np.testing.assert_allclose(dmod[ok], np.broadcast_to(dmod_ref, dmod.shape)[ok], rtol=1e-12)


def test_numba_builds_match_the_python_build(builds):
    """njit in float64 computes the Python build's values bit for bit; in float32, to float32's rounding."""
    q, k, bias = _inputs(np.random.default_rng(7))
    vis = visible_mask(SQ, SK, -1, -1)
    with np.errstate(invalid="ignore", over="ignore"):
        want = _grid(builds["python"][0], q, k, bias, vis, float)
        f64 = _grid(builds["njit-float64"][0], q, k, bias, vis, np.float64)
        f32 = _grid(builds["njit-float32"][0], q, k, bias, vis, np.float32)
    for a, b in zip(want, f64):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(want[3:], f32[3:]):   # shown, finite: no pair here sits at float32's edge
        np.testing.assert_array_equal(a, b)
    fin = want[3] & want[4]
    np.testing.assert_allclose(f32[0][fin], want[0][fin], rtol=2e-6, atol=2e-6)


def test_a_stage_that_is_off_reads_nothing():
    """With every switch off the score is qmult * raw whatever the other arguments hold (NaN there, here)."""
    pipeline = compile_with(lambda f: f, _py_tanh, float, 1.0, softcap=False, alibi=False, bias=False,
                            index_mods=False)
    nan = math.nan
    x, dcap, dmod, shown, finite = pipeline(3.0, 0.5, nan, nan, nan, nan, nan, True, True, 0, 0, 0, 0, 0, 0)
    assert (x, dcap, dmod, shown, finite) == (1.5, 1.0, 1.0, True, True)
    x, _, _, shown, finite = pipeline(math.inf, 0.5, nan, nan, nan, nan, nan, True, True, 0, 0, 0, 0, 0, 0)
    assert (shown, finite) == (True, False)


def _block_hook(x, apply, b, h, row, col, last_row, last_col):
    """score_mod over a whole (SQ, SK) block, as the torch path's hook: where ``apply`` and the score is finite."""
    use = apply & np.isfinite(x)
    safe = np.where(use, x, 0.0)
    grid = [(i, j) for i in range(SQ) for j in range(SK)]
    modded = np.array([score_mod(s, b, h, i, j) for s, (i, j) in zip(safe.ravel(), grid)]).reshape(x.shape)
    grad = np.array([score_mod_grad(s, b, h, i, j) for s, (i, j) in zip(safe.ravel(), grid)]).reshape(x.shape)
    return np.where(use, modded, x), np.where(use, grad, 1.0)


def test_a_block_build_gives_the_scalar_builds_values():
    """The torch path's way: the same description run once on whole (Sq, Sk) arrays (``select`` and
    ``logical_not`` over arrays, in place where it can), with every stage on, holds to the scalar build pair by
    pair; ``scaled`` (raw carrying the scale) and ``check_finite=False`` give the same scores on finite inputs."""
    rng = np.random.default_rng(11)
    q, k, bias = _inputs(rng)
    vis = visible_mask(SQ, SK, -1, -1)
    switches = dict(softcap=True, alibi=True, bias=True, index_mods=True)
    block = compile_with(lambda f: f, lambda raw, qmult: np.tanh(raw * qmult), float, 1.0, score_mod=_block_hook,
                         select=np.where, logical_not=np.logical_not, **switches)
    scalar = compile_with(lambda f: f, _py_tanh, float, 1.0, score_mod=_py_hook, **switches)
    rows, cols = np.meshgrid(np.arange(SQ), np.arange(SK), indexing="ij")
    mod_hidden = ~np.vectorize(mask_mod)(B_IDX, H_IDX, rows, cols)
    extra = np.vectorize(bias_mod)(B_IDX, H_IDX, rows, cols)
    with np.errstate(invalid="ignore", over="ignore"):
        raw = q @ k.T
        got = block(raw, SCALE / SOFTCAP, SOFTCAP, SLOPE, (rows + SK - SQ - cols).astype(float), bias, extra,
                    mod_hidden, vis, B_IDX, H_IDX, SQ - 1, SK - 1, SQ - 1, SK - 1)
        want = _grid(scalar, q, k, bias, vis, float)
    for name, a, b in zip(("x", "dcap", "dmod", "shown", "finite"), got, want):
        np.testing.assert_allclose(np.broadcast_to(a, b.shape), b, rtol=1e-13, atol=0, equal_nan=True, err_msg=name)

    q, k = rng.standard_normal((SQ, D)), rng.standard_normal((SK, D))   # finite, so check_finite may be off
    plain = compile_with(lambda f: f, _py_tanh, float, 1.0, softcap=False, alibi=True, bias=True, index_mods=False,
                         select=np.where, logical_not=np.logical_not)
    lean = compile_with(lambda f: f, _py_tanh, float, 1.0, softcap=False, alibi=True, bias=True, index_mods=False,
                        select=np.where, logical_not=np.logical_not, scaled=True, bias_hides=False, chain=False,
                        check_finite=False)
    finite_bias = rng.standard_normal((SQ, SK))
    args = (SLOPE, (rows + SK - SQ - cols).astype(float), finite_bias, 0.0, False, True, 0, 0, 0, 0, 0, 0)
    x, *_, shown, finite = plain(q @ k.T, SCALE, 0.0, *args)
    x_lean, *_, shown_lean, finite_lean = lean((q * SCALE) @ k.T, 1.0, 0.0, *args)
    np.testing.assert_allclose(x_lean, x, rtol=1e-13, atol=1e-14)
    assert shown_lean is True and finite_lean is True and np.all(shown) and np.all(finite)
