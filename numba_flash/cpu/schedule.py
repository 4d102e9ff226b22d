"""Which sequences a CPU kernel call covers and in which order its threads take the work.

One kernel call serves any number of sequences: the B batch entries of a dense (B, S, H, D) call, or the packed
sequences of a "thd" call (q ``(total_q, Hq, D)`` seen as ``(1, total_q, Hq, D)``). ``Sequences.table`` says where
each lies, one row per sequence, columns:

    BATCH   index into the arrays' batch axis (b for a dense call, 0 for a packed one)
    Q0, K0  its first row of q (and out, dout, dq, lse) and first key of k (and v, dk, dv)
    P0      its first row in the per-row statistics (row max, 1 / sum, delta, the fused dQ accumulator)
    SQ, SK  its lengths; either may be 0 (packed): a sequence without keys gets out 0, lse +inf, dq 0, and keys
            without rows dk = dv = 0, written by the kernels like any other row or key

The statistics give each sequence whole query tiles (P0 advances by Sq rounded up to BLOCK_M), because the kernels
read and write a tile's BLOCK_M rows there, padding included: packed back to back, a short sequence's padding rows
would be the next sequence's rows, owned by another thread.

A kernel's work is a list of units (flat ids the kernel decodes, e.g. (sequence, head, query tile)). Its prange
runs one iteration per thread, and each takes the next unit from a shared atomic counter (``next_unit``) until none
is left: numba's OpenMP layer splits a prange into equal contiguous runs of iterations, whatever
``numba.set_parallel_chunksize`` says (measured), which leaves units of very different cost (a packed batch of 8- and
2048-token sequences) unbalanced. Packed units go longest first, by (sequence, head) so that units reading the same
K and V stay together, so the long ones start early and the short ones fill in at the end; dense ones keep their
natural order (units of one head in a row share K and V in cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .simd import BLOCK_M, BLOCK_N

BATCH, Q0, K0, P0, SQ, SK = range(6)


def work_counter() -> np.ndarray:
    """A kernel call's ``counter``: (the next unit to take, how many threads take them)."""
    return np.array([0, numba.get_num_threads()], np.int64)


@intrinsic
def _claim(typingctx, counter):
    """The next unit index: an atomic fetch-and-add of 1 on counter[0] (``work_counter``)."""
    if not (isinstance(counter, types.Array) and counter.dtype == types.int64 and counter.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.atomic_rmw("add", arr.data, ir.Constant(ir.IntType(64), 1), "monotonic")

    return types.int64(counter), codegen


@njit(inline="always", cache=True)
def next_unit(counter, units, n_units):
    """The id of the next unit a thread takes (``units[i]`` where the call orders them, else ``i``); -1 once all
    ``n_units`` are taken."""
    u = _claim(counter)
    if u >= n_units:
        return -1
    return units[u] if units.shape[0] > 0 else u


@njit(inline="always", cache=True)
def max_tiles(seqs, column, size):
    """The most tiles of ``size`` any sequence has along ``column`` (SQ or SK) of a ``Sequences.table``."""
    longest = 0
    for s in range(seqs.shape[0]):
        longest = max(longest, seqs[s, column])
    return (longest + size - 1) // size


def _tiles(n: np.ndarray | int, size: int) -> np.ndarray:
    return -(-np.asarray(n, np.int64) // size)


@dataclass(frozen=True)
class Sequences:
    """The sequences of one kernel call (see the module docstring). ``stat_len``: statistics rows per batch entry;
    ``packed``: whether the rows of the statistics differ from those of q (``stat_rows``)."""

    table: np.ndarray
    stat_len: int
    packed: bool

    @property
    def stash_tag(self) -> bytes | None:
        """What, beside the lse, says which statistics rows belong to which rows of q (``stash``): None for a
        dense call, the sequences for a packed one."""
        return self.table.tobytes() if self.packed else None

    @property
    def max_q_tiles(self) -> int:
        return int(_tiles(self.table[:, SQ].max(), BLOCK_M))

    @property
    def max_k_tiles(self) -> int:
        return int(_tiles(self.table[:, SK].max(), BLOCK_N))

    def stat_rows(self) -> np.ndarray:
        """For a packed call, the statistics row of each row of q, (total_q,) int64."""
        t = self.table
        return np.repeat(t[:, P0] - t[:, Q0], t[:, SQ]) + np.arange(int(t[:, SQ].sum()))


def dense_sequences(batch: int, seqlen_q: int, seqlen_k: int) -> Sequences:
    """A dense (B, S, H, D) call: sequence b is batch entry b, with the statistics rows it always had."""
    table = np.zeros((batch, 6), np.int64)
    table[:, BATCH] = np.arange(batch)
    table[:, SQ], table[:, SK] = seqlen_q, seqlen_k
    return Sequences(table, int(_tiles(seqlen_q, BLOCK_M)) * BLOCK_M, False)


def call_sequences(q: np.ndarray, k: np.ndarray, cu_seqlens_q: np.ndarray | None,
                   cu_seqlens_k: np.ndarray | None) -> Sequences:
    """The sequences of a kernel call: dense (q (B, Sq, Hq, D), k (B, Sk, Hkv, D)) without cu_seqlens, packed with
    both."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k: give both (packed sequences) or neither")
    if cu_seqlens_q is None:
        return dense_sequences(q.shape[0], q.shape[1], k.shape[1])
    return packed_sequences(cu_seqlens_q, cu_seqlens_k)


def packed_sequences(cu_seqlens_q: np.ndarray, cu_seqlens_k: np.ndarray) -> Sequences:
    """Packed sequences at the prefix sums' offsets in a batch of 1, each given whole query tiles of statistics."""
    cq, ck = np.asarray(cu_seqlens_q, np.int64), np.asarray(cu_seqlens_k, np.int64)
    table = np.zeros((len(cq) - 1, 6), np.int64)
    table[:, Q0], table[:, K0] = cq[:-1], ck[:-1]
    table[:, SQ], table[:, SK] = np.diff(cq), np.diff(ck)
    padded = _tiles(table[:, SQ], BLOCK_M) * BLOCK_M
    table[1:, P0] = np.cumsum(padded)[:-1]
    return Sequences(table, max(int(padded.sum()), BLOCK_M), True)


def _band(rows_lo, rows_hi, seqlen_q, seqlen_k, left, right):
    """Keys [lo, hi) that query rows [rows_lo, rows_hi) may see (arrays, one entry per tile; empty where lo >= hi):
    from the first row's lowest key to the last row's highest, the band's key ranges growing with the row. A cost
    estimate for ordering units: where the first rows see nothing (causal, Sq > Sk), it counts from key 0."""
    centre_lo = rows_lo + seqlen_k - seqlen_q
    centre_hi = rows_hi - 1 + seqlen_k - seqlen_q
    lo = np.zeros_like(rows_lo) if left < 0 else np.maximum(0, centre_lo - left)
    hi = seqlen_k if right < 0 else np.minimum(seqlen_k, centre_hi + right + 1)
    return lo, np.maximum(lo, hi) * (rows_hi > rows_lo)


def _query_tile_costs(seqs: Sequences, left: int, right: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, query tile, key tiles it visits) of every query tile of every sequence, in order."""
    t = seqs.table
    n_qt = _tiles(t[:, SQ], BLOCK_M)
    seq = np.repeat(np.arange(len(t)), n_qt)
    qt = np.arange(int(n_qt.sum())) - np.repeat(np.cumsum(n_qt) - n_qt, n_qt)
    sq, sk = t[seq, SQ], t[seq, SK]
    lo, hi = _band(qt * BLOCK_M, np.minimum(sq, (qt + 1) * BLOCK_M), sq, sk, left, right)
    visits = np.where(hi > lo, _tiles(hi, BLOCK_N) - lo // BLOCK_N, 0)
    return seq, qt, visits


NATURAL = np.zeros(0, np.int64)   # units: every unit the kernel's decoding covers, in order (a dense call)


def _longest_first(units: np.ndarray, cost: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``units`` by group (the units of one sequence and head, which read the same K and V), the costliest groups
    first, and within a group the costliest units first. Sorting the units alone would interleave heads: each
    unit of a long sequence would then bring its own head's K and V into cache, where the units of one group in a
    row find them there."""
    group_cost = np.bincount(group, weights=cost)
    return units[np.lexsort((-cost, group, -group_cost[group]))]


def query_tile_units(seqs: Sequences, nheads_q: int, left: int, right: int) -> np.ndarray:
    """Units (sequence, query head, query tile) as ``(s * Hq + h) * max_q_tiles + qt``: the forward's and the dQ
    pass's. ``NATURAL`` for a dense call. A packed sequence without keys keeps its units (they write its rows'
    zeros); one without rows has none."""
    if not seqs.packed:
        return NATURAL
    seq, qt, visits = _query_tile_costs(seqs, left, right)
    group = seq[:, None] * nheads_q + np.arange(nheads_q)
    units = group * seqs.max_q_tiles + qt[:, None]
    return _longest_first(units.ravel(), np.repeat(visits + 1, nheads_q), group.ravel())


def _pairs_per_sequence(seqs: Sequences, left: int, right: int) -> np.ndarray:
    seq, _, visits = _query_tile_costs(seqs, left, right)
    return np.bincount(seq, weights=visits, minlength=len(seqs.table))


def key_tile_units(seqs: Sequences, nheads_kv: int, left: int, right: int, kt_per_unit: int) -> np.ndarray:
    """Units of the key-tile pass, (sequence, kv head, run of ``kt_per_unit`` key tiles), as
    ``(s * Hkv + hk) * runs + run`` with ``runs`` the most runs a sequence has; ``kt_per_unit`` covering every key
    tile makes one unit per (sequence, kv head). ``NATURAL`` for a dense call. A packed sequence without rows keeps
    its units (they write its keys' zeros)."""
    if not seqs.packed:
        return NATURAL
    t = seqs.table
    runs = -(-seqs.max_k_tiles // kt_per_unit)
    n_runs = _tiles(t[:, SK], BLOCK_N * kt_per_unit)
    s = np.repeat(np.arange(len(t)), n_runs)
    run = np.arange(int(n_runs.sum())) - np.repeat(np.cumsum(n_runs) - n_runs, n_runs)
    # a run's share of its sequence's tile pairs, by its share of the keys (exact enough to order by)
    share = np.minimum(t[s, SK], (run + 1) * BLOCK_N * kt_per_unit) - run * BLOCK_N * kt_per_unit
    cost = _pairs_per_sequence(seqs, left, right)[s] * share / np.maximum(t[s, SK], 1) + 1
    group = s[:, None] * nheads_kv + np.arange(nheads_kv)
    units = group * runs + run[:, None]
    return _longest_first(units.ravel(), np.repeat(cost, nheads_kv), group.ravel())


def fuse_dq(seqs: Sequences, nheads_kv: int, left: int, right: int, threads: int) -> bool:
    """Whether the backward sums dQ in its key-tile pass, which then has one unit per (sequence, kv head) owning
    all of that sequence's key tiles (the only writer of its dQ rows; no second pass recomputing P and dS). Only
    when those units can keep every thread busy: at least two per thread, and (packed) none longer than a thread's
    share of the whole, else one long sequence would run on one thread while the others wait. For a dense call,
    whose units cost the same, this is the first condition alone."""
    units = len(seqs.table) * nheads_kv
    if not seqs.packed:
        return units >= 2 * threads
    pairs = _pairs_per_sequence(seqs, left, right) + 1
    return units >= 2 * threads and pairs.max() * threads <= pairs.sum()
