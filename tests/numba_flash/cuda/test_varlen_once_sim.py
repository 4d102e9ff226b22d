"""Packed sequences in one launch per kernel (``numba_flash.cuda.device.sequences``): the block table against a brute-force
listing, a spy proving one launch of each kernel whatever the number of sequences, and the packed launch giving,
bit for bit, what one dense launch per sequence gives (the SIMT kernels in float32, the tensor-core kernels in
float16 and bfloat16), within the contract's bounds of the float64 reference. Empty sequences, sequences spanning
several tiles each way, causal with Sq != Sk, window, softcap, GQA and ALiBi. The varlen semantics themselves are
tested in test_varlen_sim.py and test_dropout_sim.py, which now run through these launches too.

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest
from varlen_cases import NAMES, packed_inputs, reference, rel_l2

from backends import backend_registry
from numba_flash.cuda import tile_config_override

pytestmark = pytest.mark.cudasim

SIMT_TILES = dict(block_m=8, block_n=8, threads=16)
TC_TILES = dict(block_m=16, block_n=16, threads=32, tensor_cores=True)
# No keys, no rows, 1 x 1, more rows than keys (causal rows that see nothing), several tiles each way.
LENS_Q, LENS_K = [5, 0, 1, 20, 3, 17], [0, 4, 1, 9, 35, 18]


def test_block_table_lists_every_tile_of_every_live_sequence_once(rng):
    from numba_flash.cuda.device.sequences import block_table

    for _ in range(20):
        n = int(rng.integers(1, 9))
        lens_q, lens_k = rng.integers(0, 40, n), rng.integers(0, 40, n)
        lens_q[rng.random(n) < 0.2] = 0
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (lens_q, lens_k))
        block = int(rng.choice([8, 16, 64]))
        for along, lens in (("q", lens_q), ("k", lens_k)):
            table = block_table(cu_q, cu_k, block, along)
            assert table.dtype == np.int32 and table.shape[1] == 6
            want = {(b, t, cu_q[b], lens_q[b], cu_k[b], lens_k[b]) for b in range(n) if lens_q[b] and lens_k[b]
                    for t in range(-(-lens[b] // block))}
            got = [tuple(int(x) for x in row) for row in table]
            assert len(got) == len(set(got)) and set(got) == want
            # Longest key ranges first, so that long blocks start before short ones.
            assert list(table[:, 5]) == sorted(table[:, 5], reverse=True)


def _f32(x):
    """A result or input as float32 numpy (bfloat16 torch tensors widened exactly)."""
    return x.float().numpy() if hasattr(x, "float") else np.asarray(x, np.float32)


def _run(tiles, q, k, v, dout, **kw):
    with tile_config_override(**tiles):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        grads = op.backward(dout, q, k, v, out, lse, **kw)
    return [_f32(x) for x in (out, lse, *grads)]


def _per_sequence(tiles, q, k, v, dout, cu_q, cu_k, alibi_slopes=None, **kw):
    """The packed results assembled from one dense call (B = 1) per sequence with rows and keys."""
    out, dq = np.zeros(q.shape, np.float32), np.zeros(q.shape, np.float32)
    lse = np.full((q.shape[1], q.shape[0]), np.inf, np.float32)
    dk, dv = np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if rows.stop == rows.start or keys.stop == keys.start:
            continue
        extra = {} if alibi_slopes is None else dict(alibi_slopes=alibi_slopes[b:b + 1])
        got = _run(tiles, *(x[None] for x in (q[rows], k[keys], v[keys], dout[rows])), **kw, **extra)
        out[rows], lse[:, rows], dq[rows], dk[keys], dv[keys] = (x[0] for x in got)
    return [out, lse, dq, dk, dv]


@pytest.fixture
def launches(monkeypatch):
    """(kernel name, grid) of every tiled-kernel launch."""
    from numba_flash.cuda.host import launch

    seen = []
    real = launch._run

    def spy(kernel, grid, cfg, stream, args):
        seen.append((cfg.kernel, tuple(grid)))
        return real(kernel, grid, cfg, stream, args)

    monkeypatch.setattr(launch, "_run", spy)
    return seen


SLOPES = np.linspace(0.1, 0.9, 2 * len(LENS_Q), dtype=np.float32).reshape(len(LENS_Q), 2)
CASES = [
    pytest.param("float32", SIMT_TILES, (2, 1, 7), dict(causal=True, softcap=1.5), id="simt-causal-softcap-gqa"),
    pytest.param("float32", SIMT_TILES, (2, 1, 5), dict(window_size=(6, 2), alibi_slopes=SLOPES),
                 id="simt-window-alibi"),
    pytest.param("float16", TC_TILES, (2, 1, 16), dict(causal=True), id="tc-float16-causal-gqa"),
    pytest.param("bfloat16", TC_TILES, (1, 1, 16), dict(window_size=(9, 3), softcap=2.0), id="tc-bfloat16-window"),
]


@pytest.mark.parametrize("dtype,tiles,heads,kw", CASES)
def test_one_launch_per_kernel_equals_one_call_per_sequence(rng, launches, dtype, tiles, heads, kw):
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, LENS_Q, LENS_K, *heads,
                                              np.float16 if dtype == "float16" else np.float32)
    if dtype == "bfloat16":   # bfloat16 arrives as torch tensors
        torch = pytest.importorskip("torch")
        q, k, v, dout = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v, dout))
    before = [_f32(x).copy() for x in (q, k, v, dout)]
    got = _run(tiles, q, k, v, dout, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **kw)

    kernels = sorted(name for name, _ in launches)
    assert len(kernels) == 3 and len(set(kernels)) == 3, launches   # forward, dK/dV, dQ: one launch each
    assert all(grid[2] == 1 for _, grid in launches)
    assert kernels[0].startswith("tc_") == tiles.get("tensor_cores", False)
    for x, was in zip((q, k, v, dout), before):
        np.testing.assert_array_equal(_f32(x), was)

    per_seq = _per_sequence(tiles, q, k, v, dout, cu_q, cu_k, **kw)
    for name, a, b in zip(NAMES, got, per_seq):
        np.testing.assert_array_equal(a, b, err_msg=name)

    ref = reference(*before, cu_q, cu_k, **kw)
    bound = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}[dtype]
    for name, x in zip(NAMES, got):
        want = ref[name]
        if name == "lse":
            fin = np.isfinite(want)
            np.testing.assert_array_equal(np.isposinf(x), ~fin)
            x, want = x[fin], want[fin]
        assert rel_l2(x, want) <= bound, name
