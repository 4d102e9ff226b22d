"""The contract's non-finite rule, derived independently of ``numba_flash.reference``, for the tests of every backend
(``tests/numba_flash/test_nonfinite.py``, ``tests/numba_flash/cuda/test_nonfinite_sim.py``).

One bad element (NaN or +-inf) goes into q, k or v of an otherwise random N(0, 1) float32 call with causal masking
(bottom-right aligned), so that some rows see the bad key and some do not. ``expected`` says which entries of out,
lse, dq, dk and dv the bad element may touch and which of those must be NaN:

* q[b0, i0, h0, d0] (a row that sees keys): row (b0, h0, i0) is poisoned: out row and lse NaN, dq row NaN, dk and
  dv NaN for every key it sees.
* k[b0, j0, hk, d0]: every row of the kv group's heads that sees key j0 is poisoned, as above.
* v[b0, j0, hk, d0]: out[., i, h, d0] NaN for the rows that see j0 (the other columns of those rows are touched
  but finite); lse unchanged; through delta = dout . out those rows' dq and the dk of every key they see are NaN;
  dv does not depend on v and stays exactly as in the clean run.
* dout[b0, i0, h0, d0] (backward only): dq row i0 NaN, dk NaN for every key row i0 sees, dv NaN in column d0
  for those keys (dv = P^T dout).

Everything untouched must be bitwise equal to a clean run of the same backend, every non-finite value must be NaN
(lse +inf only for rows that see no key), and the finite values must match the float64 reference.
This module is imported by the test files (pytest puts ``tests/``, the conftest's folder, on sys.path).
"""

from __future__ import annotations

import numpy as np

from numba_flash.semantics import visible_mask

# (B, Sq, Sk, Hq, Hkv, D): small, with rows that see nothing (Sq > Sk, causal); and two that span several CPU tiles
# (64 x 64). B * Hkv of 1 and 8 run the CPU backward with dQ in a pass of its own and fused into the key pass.
SHAPES = {
    "small": (2, 13, 11, 4, 2, 12),
    "tiles": (1, 150, 170, 2, 1, 40),
    "tiles_gqa": (2, 100, 140, 8, 4, 24),
}
# Where the bad element goes, [lo, hi) in rows (q) and keys (k, v), drawn at random inside: for the tiled shapes, a
# key that a full (unmasked) tile sees as well as a masked one, and a row whose first key tile is full. A block with
# no mask takes other code paths than one with a mask (e.g. a -inf score there can only come from the data).
PLACES = {
    "tiles": {"q": (64, 150), "k": (21, 128)},       # query tile 128..149 sees key tiles 0..127 whole
    "tiles_gqa": {"q": (64, 100), "k": (41, 64)},    # query tile 64..99 sees key tile 0..63 whole
}

BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}


def random_inputs(rng, shape, dtype=np.float32):
    b, sq, sk, hq, hkv, d = shape
    q = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    k = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    v = rng.standard_normal((b, sk, hkv, d)).astype(dtype)
    dout = rng.standard_normal((b, sq, hq, d)).astype(dtype)
    return q, k, v, dout


def place_bad(rng, shape, where, places=None):
    """A position for the bad element: (b0, pos, head, d0), pos a query row that sees keys (where "q" or "dout")
    or a key that some rows see and some do not (causal), inside ``places[where kind]`` (see ``PLACES``) if given."""
    b, sq, sk, hq, hkv, d = shape
    mask = visible_mask(sq, sk, -1, 0)
    kind = "k" if where in ("k", "v") else "q"
    lo, hi = (places or {}).get(kind, (0, max(sq, sk)))
    if kind == "q":
        rows = np.flatnonzero(mask.any(axis=1))
        pos, head = int(rng.choice(rows[(rows >= lo) & (rows < hi)])), int(rng.integers(hq))
    else:
        seen_by = mask.sum(axis=0)
        keys = np.flatnonzero((seen_by > 0) & (seen_by < sq))
        pos, head = int(rng.choice(keys[(keys >= lo) & (keys < hi)])), int(rng.integers(hkv))
    return int(rng.integers(b)), pos, head, int(rng.integers(d))


def poke(arrays, where, at, value):
    """Copies of (q, k, v, dout) with ``value`` at ``at`` in the array named ``where``."""
    q, k, v, dout = (a.copy() for a in arrays)
    target = {"q": q, "k": k, "v": v, "dout": dout}[where]
    target[at] = value
    return q, k, v, dout


def expected(shape, where, at, causal=True):
    """{name: (touched, nonfinite)} boolean masks for out, lse, dq, dk, dv ("bshd"; lse (B, Hq, Sq))."""
    b, sq, sk, hq, hkv, d = shape
    group = hq // hkv
    mask = visible_mask(sq, sk, -1, 0 if causal else -1)
    b0, pos, head, d0 = at
    if where in ("q", "dout"):
        rows = np.zeros(sq, bool)
        rows[pos] = mask[pos].any()
        heads, hk = [head], head // group
    else:
        rows = mask[:, pos]
        heads, hk = list(range(head * group, (head + 1) * group)), head
    keys = mask[rows].any(axis=0)
    z = {"out": np.zeros((b, sq, hq, d), bool), "lse": np.zeros((b, hq, sq), bool),
         "dq": np.zeros((b, sq, hq, d), bool), "dk": np.zeros((b, sk, hkv, d), bool),
         "dv": np.zeros((b, sk, hkv, d), bool)}
    touched = {n: m.copy() for n, m in z.items()}
    nonfinite = {n: m.copy() for n, m in z.items()}
    for h in heads:
        touched["dq"][b0, rows, h] = True
        nonfinite["dq"][b0, rows, h] = True
        if where == "dout":
            continue
        touched["out"][b0, rows, h] = True
        if where == "v":
            nonfinite["out"][b0, rows, h, d0] = True
        else:
            nonfinite["out"][b0, rows, h] = True
            touched["lse"][b0, h, rows] = True
            nonfinite["lse"][b0, h, rows] = True
    for name in ("dk",) if where == "v" else ("dk", "dv"):
        touched[name][b0, keys, hk] = True
        if name == "dv" and where == "dout":
            nonfinite[name][b0, keys, hk, d0] = True
        else:
            nonfinite[name][b0, keys, hk] = True
    return {n: (touched[n], nonfinite[n]) for n in z}


def rel_l2(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


TOL = {"out": 1e-5, "lse": 1e-4, "dq": 1e-5, "dk": 1e-5, "dv": 1e-5}


def check(got, clean, ref, exp, empty_rows):
    """got / clean / ref: {name: float64 array}; exp from ``expected``; empty_rows: (Sq,) rows that see no key."""
    for name, (touched, nonfinite) in exp.items():
        g = got[name]
        empty = np.zeros(g.shape, bool)
        if name == "lse":
            empty[:, :, empty_rows] = True
            assert np.all(np.isposinf(g[empty])), "a row that sees no key has lse = +inf"
        assert np.array_equal(~np.isfinite(g), nonfinite | empty), name
        assert np.all(np.isnan(g[nonfinite])), f"{name}: non-finite results are reported as NaN"
        # Untouched entries: exactly the clean run's (so no NaN leaked to a row that does not see the bad key).
        assert np.array_equal(g[~touched], clean[name][~touched]), name
        # Finite entries against the float64 reference on the same (bad) inputs.
        assert np.array_equal(np.isfinite(ref[name]), np.isfinite(g)), f"{name}: the reference's pattern differs"
        ok = np.isfinite(g)
        if name in ("out", "lse"):
            assert np.abs(g[ok] - ref[name][ok]).max(initial=0.0) <= TOL[name], name
        else:
            assert rel_l2(g[ok], ref[name][ok]) <= TOL[name], name
