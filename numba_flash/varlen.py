"""Packed sequences (layout "thd"): the checks of ``cu_seqlens_q/k`` and ``max_seqlen_q/k``, and ``Packing``, the
description of where each sequence lies that every backend iterates over.

A packed batch stores B sequences one after another: q is ``(total_q, Hq, D)``, k and v ``(total_k, Hkv, D)``, and
sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and keys ``cu_seqlens_k[b]:cu_seqlens_k[b + 1]``
of k and v. Each sequence attends only within itself, with causal masks and windows aligned to the bottom-right
corner of its own ``(Sq_b, Sk_b)`` block; lse is ``(Hq, total_q)``. A sequence may be empty on either side: with no
rows it has nothing to compute, with no keys its rows see nothing (out 0, lse +inf, gradients 0). With
``block_table`` the keys are read from paged caches instead (``numba_flash.paged_keys``, which gathers them into
this layout before any backend sees the call).

What is accepted, and why:

* ``cu_seqlens_*``: 1-D arrays of any kind (numpy, torch on any device, numba/CuPy device arrays) of dtype int32,
  flash-attn's, or int64, which is what ``np.cumsum`` and ``torch.cumsum`` return, so that a prefix sum computed
  the obvious way needs no cast. They are read once on the host (a device copy for GPU arrays): the backends loop
  over sequences on the host. Never modified.
* ``max_seqlen_*``: None (worked out here) or an int at least as long as every sequence. As in flash-attn it is an
  upper bound, not required to be exact; the backends use the true longest length.
* Totals of 0 (no rows at all, or no keys at all) are refused like any empty dimension of a dense call.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import numpy as np

from .arrays import array_kind, dtype_name, is_meta_tensor, to_numpy
from .errors import bad_arg

CU_SEQLENS_DTYPES = ("int32", "int64")



class SequenceSpan(NamedTuple):
    """One packed sequence: rows ``[q0, q1)`` of q and keys ``[k0, k1)`` of k and v."""

    index: int
    q0: int
    q1: int
    k0: int
    k1: int

    @property
    def seqlen_q(self) -> int:
        return self.q1 - self.q0

    @property
    def seqlen_k(self) -> int:
        return self.k1 - self.k0


@dataclass(frozen=True, eq=False)
class Packing:
    """Where the sequences of a validated packed call lie.

    cu_seqlens_q, cu_seqlens_k: (B + 1,) int64 host copies (read-only) of the caller's arrays.
    max_seqlen_q, max_seqlen_k: the longest sequence on each side, whatever bound the caller gave.
    """

    cu_seqlens_q: np.ndarray
    cu_seqlens_k: np.ndarray
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def batch(self) -> int:
        return len(self.cu_seqlens_q) - 1

    @property
    def total_q(self) -> int:
        return int(self.cu_seqlens_q[-1])

    @property
    def total_k(self) -> int:
        return int(self.cu_seqlens_k[-1])

    def sequences(self) -> Iterator[SequenceSpan]:
        """Every sequence in order, empty ones included."""
        cq, ck = self.cu_seqlens_q.tolist(), self.cu_seqlens_k.tolist()
        for b in range(self.batch):
            yield SequenceSpan(b, cq[b], cq[b + 1], ck[b], ck[b + 1])


def check_cu_seqlens(name: str, x: Any, total: int | None = None, total_name: str = "") -> np.ndarray:
    """The prefix sums in ``x`` (B + 1,) as a read-only int64 host array, or AttentionInputError naming ``name``.
    With ``total`` the last one must equal it (the rows of the array ``total_name`` counts); paged keys
    (``numba_flash.paged_keys``) have no such total: their last prefix sum says how many keys are read."""
    what = "a 1-D int32 array (B + 1,) of prefix sums"
    kind = array_kind(x)
    if kind is None:
        raise bad_arg(name, f"{what} (numpy, torch, or a device array)", f"an object of type {type(x).__name__}")
    if is_meta_tensor(x):
        raise bad_arg(name, f"{what} with values to read", "a meta tensor (shapes only)")
    shape = tuple(int(s) for s in x.shape)
    if len(shape) != 1:
        raise bad_arg(name, what, f"shape {shape}")
    dt = dtype_name(x)
    if dt not in CU_SEQLENS_DTYPES:
        raise bad_arg(name, "dtype int32 (or int64)", f"dtype {dt}")
    if shape[0] < 2:
        raise bad_arg(name, "at least 2 entries (B + 1 with B >= 1 sequences)", f"shape {shape}")
    values = np.array(to_numpy(x), dtype=np.int64, copy=True)
    values.flags.writeable = False
    if values[0] != 0:
        raise bad_arg(name, f"{name}[0] == 0", f"{name}[0] = {values[0]}")
    drops = np.flatnonzero(np.diff(values) < 0)
    if drops.size:
        b = int(drops[0])
        raise bad_arg(name, "non-decreasing values (every sequence length >= 0)",
                      f"{name}[{b + 1}] = {values[b + 1]} < {name}[{b}] = {values[b]}")
    if total is not None and values[-1] != total:
        raise bad_arg(name, f"{name}[-1] == {total_name} = {total}", f"{name}[-1] = {values[-1]}")
    return values


def _check_max_seqlen(name: str, value: Any, longest: int, side: str) -> None:
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise bad_arg(name, "None or an int", repr(value))
    if int(value) < longest:
        raise bad_arg(name, f"an int >= the longest {side} sequence ({longest})", int(value))


def check_arguments(layout: str, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any, max_seqlen_k: Any) -> None:
    """The packed-sequence arguments that go with ``layout`` (already resolved and checked): all four None for a
    dense layout, both cu_seqlens for "thd". Checked before the arrays, whose expected shapes follow from it."""
    given = {"cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k, "max_seqlen_q": max_seqlen_q,
             "max_seqlen_k": max_seqlen_k}
    if layout != "thd":
        for name, value in given.items():
            if value is not None:
                got = f"shape {tuple(value.shape)}" if hasattr(value, "shape") else repr(value)
                raise bad_arg(name, f"None for layout {layout!r} (packed sequences take layout 'thd')", got)
        return
    for name, other in (("cu_seqlens_q", "cu_seqlens_k"), ("cu_seqlens_k", "cu_seqlens_q")):
        if given[name] is None:
            raise bad_arg(name, f"an int32 array of prefix sums (layout 'thd' needs both {name} and {other})", "None")


def check_packing(total_q: int, total_k: int, cu_seqlens_q: Any, cu_seqlens_k: Any, max_seqlen_q: Any,
                  max_seqlen_k: Any) -> Packing:
    """The ``Packing`` of a "thd" call whose q holds ``total_q`` rows and k ``total_k`` keys, after
    ``check_arguments``; AttentionInputError naming the first argument that does not fit."""
    cq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, "total_q")
    ck = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, "total_k")
    if len(ck) != len(cq):
        raise bad_arg("cu_seqlens_k", f"B + 1 = {len(cq)} entries like cu_seqlens_q (one per sequence, plus one)",
                      f"{len(ck)} entries")
    longest_q, longest_k = int(np.diff(cq).max()), int(np.diff(ck).max())
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, longest_q, "query")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, longest_k, "key")
    return Packing(cq, ck, longest_q, longest_k)
