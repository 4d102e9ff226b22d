"""Shared by the packed-sequence tests of every backend (``tests/numba_flash/test_varlen.py``,
``tests/numba_flash/cuda/test_varlen_sim.py``, ``tests/backends/test_cpu_varlen_single_call.py``): packed random
inputs, the reference's results, and the contract's float32 bounds and empty-sequence rules. Imported by the test files (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

import numpy as np

from numba_flash import attention_ref_varlen, attention_ref_varlen_backward

NAMES = ("out", "lse", "dq", "dk", "dv")


def cu_seqlens(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def packed_inputs(rng, lens_q, lens_k, hq=4, hkv=2, d=7, dtype=np.float32):
    """q, k, v, dout of N(0, 1) values in ``dtype`` and the int32 cu_seqlens of the lengths."""
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    q, dout = (rng.standard_normal((int(cu_q[-1]), hq, d)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((int(cu_k[-1]), hkv, d)).astype(dtype) for _ in range(2))
    return q, k, v, dout, cu_q, cu_k


def f64(x):
    return np.asarray(x.detach() if hasattr(x, "detach") else x, np.float64)


def rel_l2(got, want):
    return float(np.linalg.norm(f64(got) - want) / max(np.linalg.norm(want), 1e-300))


def sequences(cu_q, cu_k):
    for b in range(len(cu_q) - 1):
        yield slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])


def reference(q, k, v, dout, cu_q, cu_k, **kw):
    out, lse = attention_ref_varlen(q, k, v, cu_q, cu_k, **kw)
    grads = attention_ref_varlen_backward(dout, q, k, v, cu_q, cu_k, **kw)
    return dict(zip(NAMES, (out, lse, *grads)))


def check_float32(got, ref):
    """The contract's float32 bounds: forward max abs error <= 1e-5 (these inputs are far from a sharp softmax),
    backward relative L2 <= 1e-5; lse +inf exactly where the reference has it."""
    assert np.abs(got["out"] - ref["out"]).max() <= 1e-5
    fin = np.isfinite(ref["lse"])
    np.testing.assert_array_equal(np.isposinf(got["lse"]), ~fin)
    assert np.abs(got["lse"][fin] - ref["lse"][fin]).max() <= 1e-5 * (1 + np.abs(ref["lse"][fin]).max())
    for name in ("dq", "dk", "dv"):
        assert rel_l2(got[name], ref[name]) <= 1e-5, name


def check_empty_sequences(out, lse, grads, cu_q, cu_k):
    """Rows of a sequence without keys: out 0, lse +inf, dq 0. Keys of a sequence without rows: dk = dv = 0."""
    dq, dk, dv = grads
    for rows, keys in sequences(cu_q, cu_k):
        if keys.stop == keys.start:
            assert np.all(out[rows] == 0) and np.all(np.isposinf(lse[:, rows])) and np.all(dq[rows] == 0)
        if rows.stop == rows.start:
            assert np.all(dk[keys] == 0) and np.all(dv[keys] == 0)


def page_keys(rng, k, v, cu_k, page_size, spare=3, fill=np.nan, extra_columns=1):
    """Paged caches holding the packed keys and values ``k``, ``v`` (total_k, Hkv, D) of the sequences of ``cu_k``:
    each sequence's keys fill its own pages (shared by no two sequences) in table order, the pages in shuffled block
    order among ``spare`` pages no sequence lists. Every row no sequence reads (the tail of a sequence's last page,
    the spare pages) holds ``fill`` ("garbage": large random values; NaN by default, which poisons whatever reads
    it), and each table row has ``extra_columns`` more entries than it needs, all -1. Returns k_cache, v_cache
    (num_blocks, page_size, Hkv, D) and block_table (B, max_blocks) int32."""
    lengths = np.diff(cu_k)
    pages = [-(-int(n) // page_size) for n in lengths]
    num_blocks = sum(pages) + spare
    order = rng.permutation(num_blocks)
    table = np.full((len(lengths), max(pages) + extra_columns), -1, np.int32)
    caches = []
    for x in (k, v):
        if isinstance(fill, str):
            cache = (rng.standard_normal((num_blocks, page_size) + x.shape[1:]) * 1e3).astype(x.dtype)
        else:
            cache = np.full((num_blocks, page_size) + x.shape[1:], fill, x.dtype)
        caches.append(cache)
    used = 0
    for b, n in enumerate(pages):
        table[b, :n] = order[used:used + n]
        used += n
        for j in range(int(lengths[b])):
            for cache, x in zip(caches, (k, v)):
                cache[table[b, j // page_size], j % page_size] = x[cu_k[b] + j]
    return caches[0], caches[1], table


def unread_rows(table, cu_k, num_blocks, page_size):
    """A (num_blocks, page_size) bool mask of the cache rows no sequence reads."""
    unread = np.ones((num_blocks, page_size), bool)
    for b in range(len(cu_k) - 1):
        for j in range(int(cu_k[b + 1] - cu_k[b])):
            unread[table[b, j // page_size], j % page_size] = False
    return unread
