"""The contract's non-finite rule on the reference, the CPU backend and the ROCm (torch) path, forced.

A NaN or +-inf in q row i poisons row i; one in k row j poisons every row that sees key j; one in v reaches the
rows that see it; rows that do not see it are bitwise those of a clean run; non-finite results are NaN; float32
overflow (huge scale, huge q) gives non-finite rows, never a silent 0 or a dropped key; and finite inputs still
give no NaN anywhere, with 0 and lse = +inf for rows that see no key. ``tests/nonfinite_cases.py`` derives the
expected pattern independently of the reference. The CUDA kernels run the same cases in
``tests/numba_flash/cuda/test_nonfinite_sim.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from nonfinite_cases import BAD, PLACES, SHAPES, check, expected, place_bad, poke, random_inputs

from backends import backend_registry
from numba_flash import attention_ref, attention_ref_backward
from numba_flash.semantics import visible_mask

BACKENDS = ["reference", "cpu", "rocm", "rocm_small_blocks"]


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    name = request.param
    monkeypatch.delenv(backend_registry.ENV_VAR, raising=False)
    if name.startswith("rocm"):
        pytest.importorskip("torch")
        if name == "rocm_small_blocks":
            from numba_flash.torch_path import blocks

            # Many query and key blocks, partial ones at the edges, the bad key inside a masked block for some
            # query blocks and inside a full one for others.
            monkeypatch.setattr(blocks, "block_sizes", lambda call: (5, 7) if call.seqlen_q < 64 else (37, 29))
    return name


def _f64(x):
    return np.asarray(x, np.float64)


def run_forward(backend, q, k, v, **kw):
    if backend == "reference":
        return attention_ref(q, k, v, **kw)
    op = backend_registry.get("flash", backend=backend.replace("_small_blocks", ""))
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    return _f64(out), _f64(lse)


def run(backend, q, k, v, dout, **kw):
    """{out, lse, dq, dk, dv} as float64 arrays; the backward gets the backend's own out and lse."""
    if backend == "reference":
        out, lse = attention_ref(q, k, v, **kw)
        grads = attention_ref_backward(dout, q, k, v, **kw)
    else:
        op = backend_registry.get("flash", backend=backend.replace("_small_blocks", ""))
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw)
    return dict(zip(("out", "lse", "dq", "dk", "dv"), (_f64(x) for x in (out, lse, *grads))))


def reference(q, k, v, dout, **kw):
    return run("reference", q, k, v, dout, **kw)


def _empty_rows(shape, causal=True, window=(-1, -1)):
    _, sq, sk = shape[:3]
    left, right = window[0], 0 if causal else window[1]
    return ~visible_mask(sq, sk, left, right).any(axis=1)


# With softcap, tanh maps an inf score to a finite +-1: the cases where an inf reaches the score run with one too.
# And softcap's derivative at a NaN score is NaN, which must not reach the rows that do not see the key.
CASES = [("q", "nan", 0.0), ("q", "inf", 0.0), ("k", "inf", 0.0), ("k", "-inf", 0.0), ("k", "nan", 0.0),
         ("v", "nan", 0.0), ("v", "-inf", 0.0), ("q", "inf", 2.0), ("k", "inf", 2.0), ("k", "-inf", 2.0),
         ("dout", "nan", 0.0), ("dout", "inf", 0.0), ("k", "nan", 2.0), ("q", "nan", 2.0)]


@pytest.mark.parametrize("where,bad,softcap", CASES)
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_one_bad_value(rng, backend, shape_name, where, bad, softcap):
    shape = SHAPES[shape_name]
    clean_inputs = random_inputs(rng, shape)
    at = place_bad(rng, shape, where, PLACES.get(shape_name))
    q, k, v, dout = poke(clean_inputs, where, at, BAD[bad])
    copies = [x.copy() for x in (q, k, v, dout)]
    kw = dict(causal=True, softcap=softcap)
    clean = run(backend, *clean_inputs, **kw)
    got = run(backend, q, k, v, dout, **kw)
    for x, c in zip((q, k, v, dout), copies):
        assert np.array_equal(x, c, equal_nan=True), "inputs are never modified"
    check(got, clean, reference(q, k, v, dout, **kw), expected(shape, where, at), _empty_rows(shape))


def test_bad_q_row_that_sees_no_key(rng, backend):
    """A row that sees no key reads nothing: 0 and lse = +inf, gradient 0, whatever its q holds."""
    shape = SHAPES["small"]  # Sq > Sk, causal: the first Sq - Sk rows see nothing
    clean_inputs = random_inputs(rng, shape)
    q, k, v, dout = poke(clean_inputs, "q", (1, 0, 2, 3), np.nan)
    clean = run(backend, *clean_inputs, causal=True)
    got = run(backend, q, k, v, dout, causal=True)
    assert np.all(got["out"][:, :2] == 0) and np.all(np.isposinf(got["lse"][:, :, :2]))
    assert np.all(got["dq"][:, :2] == 0)
    for name in got:
        assert np.array_equal(got[name], clean[name]), name


def _check_rows_nan_or_exact(got_out, got_lse, ref_out, ref_lse):
    """Per (b, h, row): either poisoned (out row and lse NaN) or finite and equal to the float64 reference;
    never 0 with lse = +inf (every row here sees keys), never another non-finite value."""
    rows_nan = np.isnan(got_lse)
    assert np.array_equal(np.isnan(got_out).all(axis=-1), rows_nan.transpose(0, 2, 1))
    assert np.array_equal(~np.isfinite(got_out).all(axis=-1), rows_nan.transpose(0, 2, 1))
    assert np.all(np.isfinite(got_lse) | rows_nan)
    fin = ~rows_nan
    assert np.abs(got_out[fin.transpose(0, 2, 1)] - ref_out[fin.transpose(0, 2, 1)]).max(initial=0.0) <= 1e-5
    assert np.all(np.abs(got_lse[fin] - ref_lse[fin]) <= 1e-4 + 1e-5 * np.abs(ref_lse[fin]))
    return rows_nan


@pytest.mark.parametrize("scale", [1e38, 1e300])
def test_huge_scale_gives_nan_rows_or_the_right_answer(rng, backend, scale):
    """scale * q.k overflows float32 for most rows: those are NaN; rows that do not overflow are one-hot on their
    largest score, as in float64. (The float64 reference overflows nowhere.)"""
    q, k, v, _ = random_inputs(rng, (1, 9, 11, 2, 1, 8))
    out, lse = run_forward(backend, q, k, v, softmax_scale=scale)
    ref_out, ref_lse = attention_ref(q, k, v, softmax_scale=scale)
    rows_nan = _check_rows_nan_or_exact(out, lse, ref_out, ref_lse)
    if backend != "reference" and scale > float(np.finfo(np.float32).max):
        assert rows_nan.all(), "a scale float32 cannot hold makes every score non-finite"


def test_huge_q_row(rng, backend):
    """One q row of 3e38: its scores overflow float32 (a NaN row, whose gradients then follow the rule for a
    poisoned row) or, where none does, give the right answer; every other row is bitwise the clean run's."""
    shape = (1, 9, 11, 2, 1, 64)  # D = 64: a score of 3e38 * scale * sum(k) all but always overflows float32
    clean_inputs = random_inputs(rng, shape)
    at = (0, 5, 1, 0)
    q, k, v, dout = poke(clean_inputs, "q", at, 0.0)
    q[0, 5, 1, :] = 3e38
    clean = run(backend, *clean_inputs, causal=True)
    got = run(backend, q, k, v, dout, causal=True)
    ref = reference(q, k, v, dout, causal=True)
    rows_nan = _check_rows_nan_or_exact(got["out"], got["lse"], ref["out"], ref["lse"])
    others = np.ones(rows_nan.shape, bool)
    others[0, 1, 5] = False
    assert not rows_nan[others].any()
    if backend == "reference":
        assert not rows_nan.any()  # float64 does not overflow here
    if not rows_nan[0, 1, 5]:
        return  # no score overflowed: the row matched the reference above
    for name, (touched, nonfinite) in expected(shape, "q", at).items():
        g = got[name]
        assert np.array_equal(~np.isfinite(g), nonfinite), name
        assert np.all(np.isnan(g[nonfinite])), name
        assert np.array_equal(g[~touched], clean[name][~touched]), name


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_finite_inputs_give_no_nan_and_empty_rows_zero(rng, backend, dtype):
    """The other half of the rule: finite inputs give no NaN anywhere; a row that sees no key gets 0, lse = +inf and
    gradient 0 (window (2, 1) with Sq > Sk leaves rows that see nothing)."""
    shape = (2, 23, 9, 4, 2, 10)
    q, k, v, dout = random_inputs(rng, shape, dtype)
    kw = dict(window_size=(2, 1), softcap=1.5)
    got = run(backend, q, k, v, dout, **kw)
    ref = reference(q, k, v, dout, **kw)
    empty = _empty_rows(shape, causal=False, window=(2, 1))
    assert empty.any() and not empty.all()
    for name, g in got.items():
        assert not np.isnan(g).any(), name
    assert np.all(got["out"][:, empty] == 0) and np.all(np.isposinf(got["lse"][:, :, empty]))
    assert np.all(np.isfinite(got["lse"][:, :, ~empty]))
    assert np.all(got["dq"][:, empty] == 0)
    assert np.abs(got["out"] - ref["out"]).max() <= 1e-5
    assert np.abs(got["lse"][:, :, ~empty] - ref["lse"][:, :, ~empty]).max() <= 1e-4
    for name in ("dq", "dk", "dv"):
        assert np.linalg.norm(got[name] - ref[name]) <= 1e-5 * np.linalg.norm(ref[name]), name


def test_cpu_kernels_strided_outputs(rng):
    """The CPU kernels write outputs of any strides (a last axis that is not unit-stride takes a plain loop): the
    same NaN pattern and values as into contiguous arrays (to rounding: with a strided out, numpy's einsum sums
    delta = dout . out in another order)."""
    from numba_flash.cpu import flash_backward, flash_forward

    shape = SHAPES["tiles_gqa"]
    clean_inputs = random_inputs(rng, shape)
    q, k, v, dout = poke(clean_inputs, "k", place_bad(rng, shape, "k", PLACES["tiles_gqa"]), np.inf)
    scale = shape[5] ** -0.5
    results = []
    for strided in (False, True):
        def alloc(like):
            if not strided:
                return np.empty(like.shape, np.float32)
            return np.full(like.shape[:-1] + (2 * like.shape[-1],), 7.0, np.float32)[..., ::2]

        out, dq, dk, dv = alloc(q), alloc(q), alloc(k), alloc(v)
        lse = np.empty((shape[0], shape[3], shape[1]), np.float32)
        flash_forward(q, k, v, out, lse, scale, -1, 0, 0.0)
        flash_backward(dout, q, k, v, out, lse, dq, dk, dv, scale, -1, 0, 0.0)
        results.append((out, lse, dq, dk, dv))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert np.isnan(a).any(), name
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.isfinite(b[~np.isnan(b)]).all(), name
        np.testing.assert_allclose(a[~np.isnan(a)], b[~np.isnan(b)], rtol=1e-5, atol=1e-6, err_msg=name)
