"""The CPU backend against torch, flash-attn's way (issue 16): on the same inputs, our max abs error against the
float64 reference is at most twice that of PyTorch in the same dtype, plus ``2 * max|(ref + 0.3 - 0.3) - ref|``.

The grid and the rule are our own port of flash-attn's tests (Dao-AILab/flash-attention, tests/test_flash_attn.py
at commit 765fbd9, ``test_flash_attn_output``; the slack term and the softcap / local variants from its later
tests); ``tools/accuracy_vs_torch.py`` holds it and prints the ratios. The fast subset runs here; the whole grid
runs with ``NUMBA_FLASH_ACCURACY_GRID=full`` (913 cases, tens of minutes on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

_TOOL = Path(__file__).resolve().parents[3] / "tools" / "accuracy_vs_torch.py"


def _load_tool():
    name = "numba_flash_accuracy_vs_torch"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _TOOL)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules[name]


acc = _load_tool()
FULL = os.environ.get("NUMBA_FLASH_ACCURACY_GRID", "") == "full"


def _check(case, rng, dtype="float32", factor=2.0):
    """The rule on fresh inputs. It compares two maxima of random errors, so a case at a third of the bound still
    crosses it now and then (measured: about 1 draw in 350 over the fast grid, at 1.4x, where P's rounding is
    all there is: one query, D = 16); a case fails when two independent draws both break it, which a kernel
    that is really worse than the rule does every time."""
    failures = []
    for _ in range(2):
        seed = int(rng.integers(2**31))
        res = acc.measure(case, seed, dtype)
        bad = {n: e for n, e in res.items() if acc.verdict(*e, factor=factor) > 1}
        if not bad:
            return
        failures.append(f"seed {seed}: {bad}")
    pytest.fail(f"{case.label()} {dtype}: errors (ours, torch's, slack) over {factor:g} x torch's + slack in two "
                f"draws: " + "; ".join(failures))


@pytest.mark.parametrize("case", acc.fast_grid(), ids=lambda c: c.slug())
def test_float32_within_twice_torch(case, rng):
    _check(case, rng)


@pytest.mark.parametrize("case", acc.LONG[:2], ids=lambda c: c.slug())
def test_float32_long_sequences_within_twice_torch(case, rng):
    """Sums over 131072 keys (forward) and 20000 queries (dK, dV) are formed tile by tile, not one long chain."""
    _check(case, rng)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", acc.fast_grid()[::4], ids=lambda c: c.slug())
def test_half_precision_within_twice_torch(case, dtype, rng):
    """flash-attn's own rule in its own dtypes: torch runs in float16 / bfloat16, we compute in float32 and round."""
    _check(case, rng, dtype)


# The cells where issue 47 saw the cpu dq at 1.04-1.05x the bound on one seed (a fresh seed of another port of the
# grid, Sq and Sk the other way round): dS = P (dP - delta) cancels over few keys (window) or at a causal edge.
DQ_EDGE_CASES = [acc.Case(217, 128, 32, batch=2, nheads=4, nheads_kv=2, causal=True, tags=("causal",)),
                 acc.Case(799, 3, 32, batch=2, nheads=4, nheads_kv=1, window=(2, 0), tags=("local",))]


@pytest.mark.parametrize("case", DQ_EDGE_CASES, ids=lambda c: c.slug())
def test_float32_dq_edge_cells_within_twice_torch(case, rng):
    """Several fresh draws of each cell, every output (dq among them) within the rule."""
    for _ in range(3):
        _check(case, rng)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("nheads_kv", [3, 1])
def test_rows_with_one_visible_key_are_exact(softcap, nheads_kv, rng):
    """P = 1 where a row sees one key: its output row is that key's v, and dS = P (dP - dO . O) is exactly 0, so
    dq and dk are 0 and dv is the sum of dO over the rows that see the key, as torch computes them."""
    from backends import backend_registry

    op = backend_registry.get("flash", backend="cpu")
    sq, d = 77, 59
    q, k, v, dout = (rng.standard_normal((2, sq, h, d)).astype(np.float32) * 3 for h in (3, nheads_kv, nheads_kv, 3))
    kw = dict(window_size=(0, 0), softcap=softcap)  # query i sees key i alone
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, **kw)
    group = 3 // nheads_kv
    np.testing.assert_array_equal(out, np.repeat(v, group, axis=2))
    assert not dq.any() and not dk.any()
    expected_dv = dout.reshape(2, sq, nheads_kv, group, d)[:, :, :, 0]
    for g in range(1, group):  # summed over the group's heads in float32, head by head
        expected_dv = expected_dv + dout.reshape(2, sq, nheads_kv, group, d)[:, :, :, g]
    np.testing.assert_array_equal(dv, expected_dv)


def test_one_key_many_queries_is_exact(rng):
    """flash-attn's (339, 1) cell: every row sees the one key."""
    from backends import backend_registry

    op = backend_registry.get("flash", backend="cpu")
    q, dout = (rng.standard_normal((1, 339, 2, 40)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 2, 40)).astype(np.float32) for _ in range(2))
    out, lse = op.forward(q, k, v, return_lse=True, softcap=50.0)
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, softcap=50.0)
    np.testing.assert_array_equal(out, np.broadcast_to(v, out.shape))
    assert not dq.any() and not dk.any()
    # P = 1 for every row: dv is the sum of dout over the 339 rows, to the rounding of a float32 sum
    bound = 339 * 2.0**-24 * np.abs(dout.astype(np.float64)).sum(axis=1, keepdims=True)
    assert (np.abs(dv - dout.astype(np.float64).sum(axis=1, keepdims=True)) <= bound).all()


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the whole grid takes tens of minutes: NUMBA_FLASH_ACCURACY_GRID=full")
@pytest.mark.parametrize("case", acc.full_grid() if FULL else [], ids=lambda c: c.slug())
def test_full_grid_float32_within_twice_torch(case, rng):
    _check(case, rng)
