"""Packed sequences on the CPU backend in one kernel call per pass (``numba_flash.cpu.schedule``): every sequence
of a "thd" call in one forward kernel call and one call of each backward pass, dQ fused into the key-tile pass
where the schedule allows it.

Against the float64 reference on fresh N(0, 1) inputs of odd sizes (the contract's float32 bounds), against the
per-sequence path (``backends.varlen``, one dense kernel call per sequence) where the reference has no form
(dropout's mask per sequence, a caller's lse that is not the forward's), and against one dense call where every
sequence has the same lengths (bit for bit: the units compute the same thing in another order). A spy counts the
kernel calls. The schedule's own rules (statistics rows, units longest first, when dQ is fused) are checked on
the host.
"""

from __future__ import annotations

import numpy as np
import pytest

from varlen_cases import check_empty_sequences, check_float32, packed_inputs, reference, rel_l2

from backends import backend_registry, varlen
from backends.cpu import _run_backward, _run_forward
from numba_flash import attention_ref, attention_ref_backward, validate_backward, validate_forward
from numba_flash.cpu import BLOCK_M, backward, forward, schedule, stash
from numba_flash.semantics import key_range

# (query lengths, key lengths): odd sizes; sequences without rows, without keys, without either; Sq != Sk in both
# directions (causal rows that see nothing); lengths across a CPU tile (64) and its partial last tile.
LENGTHS = {
    "odd_empty": ([5, 0, 1, 9, 4, 0, 3, 17], [8, 3, 1, 6, 0, 0, 11, 2]),
    "tiles": ([70, 1, 0, 131, 64, 65], [65, 2, 5, 140, 129, 63]),
}
OPTIONS = {
    "plain": dict(),
    "causal": dict(causal=True),
    "window": dict(window_size=(5, 2)),
    "causal_window_softcap": dict(causal=True, window_size=(3, -1), softcap=1.5, softmax_scale=0.4),
    "alibi_causal": dict(causal=True, alibi=True),
}
HEADS = {"gqa": (4, 2), "mqa": (3, 1)}


@pytest.fixture(scope="module")
def op():
    return backend_registry.get("flash", backend="cpu")


def _with_alibi(rng, opts, lens_q, hq):
    opts = dict(opts)
    if opts.pop("alibi", False):
        opts["alibi_slopes"] = rng.uniform(0.05, 0.8, (len(lens_q), hq))   # a row of slopes per sequence
    return opts


def _run(op, q, k, v, dout, cu_q, cu_k, **opts):
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = op.forward(q, k, v, return_lse=True, **packing, **opts)
    dq, dk, dv = op.backward(dout, q, k, v, out, lse, **packing, **opts)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)


def _per_sequence(q, k, v, dout, cu_q, cu_k, lse=None, **opts):
    """The per-sequence path: one dense kernel call per sequence (``backends.varlen``), on the same inputs."""
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    call = validate_forward(q, k, v, return_lse=True, **packing, **opts)
    out = np.empty(q.shape[:-1] + (v.shape[-1],), np.float32)
    own_lse = np.empty(call.lse_shape, np.float32)
    varlen.forward(call, _run_forward, q, k, v, out, own_lse)
    lse = own_lse if lse is None else lse
    bcall = validate_backward(dout, q, k, v, out, lse, **packing, **opts)
    grads = [np.empty(x.shape, np.float32) for x in (q, k, v)]
    varlen.backward(bcall, _run_backward, dout, q, k, v, out, lse, *grads)
    return dict(out=out, lse=own_lse, dq=grads[0], dk=grads[1], dv=grads[2])


@pytest.mark.parametrize("opts", OPTIONS.values(), ids=OPTIONS.keys())
@pytest.mark.parametrize("heads", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
def test_matches_reference(op, rng, lengths, heads, opts):
    lens_q, lens_k = lengths
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, *heads, d=7)
    opts = _with_alibi(rng, opts, lens_q, heads[0])
    inputs = [x.copy() for x in (q, k, v, dout, cu_q, cu_k)]
    got = _run(op, q, k, v, dout, cu_q, cu_k, **opts)
    for before, after in zip(inputs, (q, k, v, dout, cu_q, cu_k)):
        np.testing.assert_array_equal(before, after)   # inputs never modified
    assert got["lse"].shape == (heads[0], q.shape[0])
    check_float32(got, reference(q, k, v, dout, cu_q, cu_k, **opts))
    check_empty_sequences(got["out"], got["lse"], (got["dq"], got["dk"], got["dv"]), cu_q, cu_k)


@pytest.mark.parametrize("causal", [False, True])
def test_many_short_sequences(op, rng, causal):
    """Hundreds of units of one tile each, many sequences empty on one side: fused dQ, all sequences in one call."""
    lens_q = rng.integers(0, 12, 61)
    lens_k = rng.integers(0, 12, 61)
    lens_q[[3, 17]], lens_k[[3, 40]] = 0, 0
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, 6, 3, d=13)
    got = _run(op, q, k, v, dout, cu_q, cu_k, causal=causal, softcap=2.0)
    ref = reference(q, k, v, dout, cu_q, cu_k, causal=causal, softcap=2.0)
    check_float32(got, ref)
    check_empty_sequences(got["out"], got["lse"], (got["dq"], got["dk"], got["dv"]), cu_q, cu_k)


def test_equal_lengths_match_one_dense_call_bit_for_bit(op, rng):
    """Packed sequences of equal lengths are the dense batch: the same units, so the same bits."""
    batch, sq, sk, hq, hkv, d = 5, 37, 45, 4, 2, 24
    q, dout = (rng.standard_normal((batch, sq, hq, d)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((batch, sk, hkv, d)).astype(np.float32) for _ in range(2))
    slopes = rng.uniform(0.1, 0.5, (batch, hq))
    opts = dict(causal=True, window_size=(20, -1), alibi_slopes=slopes)
    dense_out, dense_lse = op.forward(q, k, v, return_lse=True, **opts)
    dense_grads = op.backward(dout, q, k, v, dense_out, dense_lse, **opts)
    cu_q, cu_k = (np.arange(batch + 1, dtype=np.int32) * n for n in (sq, sk))
    got = _run(op, *(x.reshape((-1,) + x.shape[2:]) for x in (q, k, v, dout)), cu_q, cu_k, **opts)
    np.testing.assert_array_equal(got["out"], dense_out.reshape(got["out"].shape))
    np.testing.assert_array_equal(got["lse"], dense_lse.transpose(1, 0, 2).reshape(hq, -1))
    for name, want in zip(("dq", "dk", "dv"), dense_grads):
        np.testing.assert_array_equal(got[name], want.reshape(got[name].shape), err_msg=name)


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_is_the_per_sequence_mask(op, rng, causal):
    """Sequence b takes the mask of batch index b with rows and keys counted within it: the same as the
    per-sequence path with the same seed, and as the reference given that mask."""
    lens_q, lens_k = [13, 0, 21, 9, 70], [17, 5, 11, 24, 66]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, 3, 1, d=16)
    opts = dict(causal=causal, dropout_p=0.3, dropout_seed=2 ** 63 + 977)
    got = _run(op, q, k, v, dout, cu_q, cu_k, **opts)
    per_seq = _per_sequence(q, k, v, dout, cu_q, cu_k, **opts)
    for name in ("out", "lse", "dq", "dk", "dv"):
        np.testing.assert_allclose(got[name], per_seq[name], rtol=2e-6, atol=2e-6, err_msg=name)
    for b, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if not nq:
            continue
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])

        def alone(x, sl):   # sequence b as entry b of a dense batch: the reference then draws batch b's mask
            return np.concatenate([np.zeros((b,) + x[sl].shape, np.float32), x[sl][None]])

        ins = (alone(q, rows), alone(k, keys), alone(v, keys))
        want_out = attention_ref(*ins, **opts)[0][b]
        assert np.abs(got["out"][rows] - want_out).max() <= 1e-5
        want = attention_ref_backward(alone(dout, rows), *ins, **opts)
        for name, sl, w in zip(("dq", "dk", "dv"), (rows, keys, keys), want):
            assert rel_l2(got[name][sl], w[b]) <= 1e-5, (b, name)


def test_caller_lse_that_is_not_the_forwards(op, rng):
    """A caller's lse over more keys (ring attention) makes P = exp(score - lse) on those rows: the packed
    backward gathers the statistics rows of q's rows and puts back the ones that change, as the per-sequence
    path does on its own."""
    lens_q, lens_k = [9, 70, 0, 33], [12, 64, 3, 1]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, 4, 2, d=8)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = op.forward(q, k, v, return_lse=True, causal=True, **packing)
    ring_lse = lse.copy()
    ring_lse[:, 5:60] += np.float32(0.75)   # rows of the first two sequences saw more keys elsewhere
    got = op.backward(dout, q, k, v, out, ring_lse, causal=True, **packing)
    want = _per_sequence(q, k, v, dout, cu_q, cu_k, lse=ring_lse, causal=True)
    for name, g in zip(("dq", "dk", "dv"), got):
        assert rel_l2(g, want[name].astype(np.float64)) <= 1e-6, name
    own = op.backward(dout, q, k, v, out, lse, causal=True, **packing)
    assert rel_l2(got[2], own[2].astype(np.float64)) > 1e-2   # the ring lse did change the gradient


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of each CPU kernel through the forward's and backward's entry points."""
    calls: dict[str, int] = {}

    def counting(getter):
        def get(kernel, *args, **kwargs):
            compiled = getter(kernel, *args, **kwargs)
            name = kernel.py_func.__name__

            def call(*a):
                calls[name] = calls.get(name, 0) + 1
                return compiled(*a)
            return call
        return get

    for module in (forward, backward):
        monkeypatch.setattr(module, "kernel_with_mods", counting(module.kernel_with_mods))
    monkeypatch.setattr(backward, "kernel_entry", counting(backward.kernel_entry))
    return calls


def test_one_kernel_call_per_pass(op, rng, kernel_calls):
    lens = rng.integers(1, 40, 25)
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens, lens[::-1], 4, 2, d=16)
    packing = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out, lse = op.forward(q, k, v, return_lse=True, **packing)
    assert kernel_calls == {"forward_kernel": 1}
    kernel_calls.clear()
    passes = stash.stats_passes
    op.backward(dout, q, k, v, out, lse, **packing)
    assert stash.stats_passes == passes   # the forward's statistics, found by its lse and its sequences
    # 25 sequences x 2 kv heads: dQ fused into the key-tile pass, stored once
    assert kernel_calls == {"row_dot_kernel": 1, "pack_scaled_kernel": 1, "backward_kv_kernel": 1,
                            "store_dq_kernel": 1}


def test_one_long_sequence_does_not_fuse_dq(op, rng, kernel_calls):
    """One sequence holding most of the work would run on one thread if it were one unit: dQ gets its own pass,
    still one call for every sequence."""
    lens_q, lens_k = [300, 3, 5, 2, 7, 1], [290, 4, 5, 2, 6, 1]
    q, k, v, dout, cu_q, cu_k = packed_inputs(rng, lens_q, lens_k, 2, 1, d=8)
    got = _run(op, q, k, v, dout, cu_q, cu_k, causal=True)
    assert kernel_calls["backward_kv_kernel"] == 1 and kernel_calls["backward_dq_kernel"] == 1
    check_float32(got, reference(q, k, v, dout, cu_q, cu_k, causal=True))


# ---------------------------------------------------------------------------------------------------------------
# The schedule, on the host


def test_statistics_rows_give_each_sequence_whole_tiles():
    seqs = schedule.packed_sequences(np.array([0, 5, 5, 75, 76]), np.array([0, 2, 9, 9, 20]))
    np.testing.assert_array_equal(seqs.table[:, schedule.P0], [0, BLOCK_M, BLOCK_M, 3 * BLOCK_M])
    assert seqs.stat_len == 4 * BLOCK_M
    rows = seqs.stat_rows()
    np.testing.assert_array_equal(rows[:5], np.arange(5))
    np.testing.assert_array_equal(rows[5:75], BLOCK_M + np.arange(70))
    assert rows[75] == 3 * BLOCK_M


def test_units_cover_every_tile_once_longest_first():
    cu_q, cu_k = np.array([0, 3, 3, 200, 270]), np.array([0, 0, 9, 150, 400])
    seqs = schedule.packed_sequences(cu_q, cu_k)
    units = schedule.query_tile_units(seqs, 3, -1, 0)   # causal
    n_qt = seqs.max_q_tiles
    decoded = sorted((u // (3 * n_qt), (u // n_qt) % 3, u % n_qt) for u in units)
    want = sorted((s, h, t) for s, n in enumerate(np.diff(cu_q)) for h in range(3) for t in range(-(-n // BLOCK_M)))
    assert decoded == want   # the keyless sequence 0 keeps its units: they write its zeros
    # the units of one (sequence, head) in one run, the runs by their key tiles visited, most first
    groups = units // n_qt
    starts = np.flatnonzero(np.diff(groups)) + 1
    assert len(set(groups.tolist())) == len(starts) + 1
    visited = [_key_tiles_visited(u // (3 * n_qt), u % n_qt, cu_q, cu_k) + 1 for u in units]
    run_costs = [sum(c) for c in np.split(np.array(visited), starts)]
    assert run_costs == sorted(run_costs, reverse=True) and run_costs[0] > run_costs[-1]
    k_units = schedule.key_tile_units(seqs, 2, -1, 0, 1)
    runs = -(-seqs.max_k_tiles // 1)
    decoded = sorted((u // (2 * runs), (u // runs) % 2, u % runs) for u in k_units)
    want = sorted((s, h, t) for s, n in enumerate(np.diff(cu_k)) for h in range(2) for t in range(-(-n // 64)))
    assert decoded == want   # the rowless sequence 1 keeps its units: they write its zero dk, dv


def _key_tiles_visited(seq, qt, cu_q, cu_k, left=-1, right=0):
    """Key tiles a query tile's rows see some key of (causal by default), from ``semantics.key_range``."""
    sq, sk = cu_q[seq + 1] - cu_q[seq], cu_k[seq + 1] - cu_k[seq]
    ranges = [key_range(i, sq, sk, left, right) for i in range(qt * BLOCK_M, min(sq, (qt + 1) * BLOCK_M))]
    return len({j // 64 for lo, hi in ranges for j in range(lo, hi)})


def test_fuse_rule():
    threads = 2
    even = schedule.packed_sequences(np.arange(9) * 20, np.arange(9) * 20)
    assert schedule.fuse_dq(even, 1, -1, 0, threads)
    assert not schedule.fuse_dq(schedule.packed_sequences(np.arange(3) * 20, np.arange(3) * 20), 1, -1, 0, threads)
    one_long = schedule.packed_sequences(np.array([0, 1000, 1010, 1020, 1030, 1040]),
                                         np.array([0, 1000, 1010, 1020, 1030, 1040]))
    assert not schedule.fuse_dq(one_long, 2, -1, 0, threads)
    dense = schedule.dense_sequences(2, 100, 100)   # the dense rule: (batch, kv head) units >= 2 per thread
    assert schedule.fuse_dq(dense, 2, -1, -1, threads) and not schedule.fuse_dq(dense, 1, -1, -1, threads)
