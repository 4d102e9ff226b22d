"""Checks that ``with_kvcache``'s append lands in the caller's cache, and lands there once.

The KV cache is the one argument written in place, so what is harmless for a read-only input is data loss for it:

* torch's lazy negation (or conjugation) bit: validation resolves it into a copy, and the append would go there;
* elements that share memory within a cache (a stride-0 axis from ``expand()`` or ``as_strided``, any other
  self-overlapping layout): one sequence's or head's new key overwrites another's, as duplicate ``cache_batch_idx``
  rows would;
* k_cache and v_cache sharing elements: each new position is written twice, the value over the key. Whether they
  do is decided from the arrays' addresses, shapes and strides, exactly and without reading either, for every
  kind of array (a torch or device array's first address alone misses two views at an offset of one buffer).

* a torch inference tensor outside inference mode: torch refuses the write, after the other cache's.

Each check raises ``AttentionInputError`` naming the cache; nothing is written before they pass. New keys and
values that are views of a cache are copied before the append (``apart_from``), so that it lands as given.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import array_kind
from .errors import AttentionInputError


def _memory_layout(x: Any) -> tuple[int, tuple[int, ...], tuple[int, ...], int] | None:
    """(address of element 0, shape, strides in bytes, itemsize) of an array of any kind, or None where it cannot
    be known without copying (the CUDA simulator's arrays, an exporter of DLPack alone)."""
    kind = array_kind(x)
    if kind == "numpy":
        return x.__array_interface__["data"][0], tuple(x.shape), tuple(x.strides), x.itemsize
    if kind == "torch":
        size = x.element_size()
        return x.data_ptr(), tuple(x.shape), tuple(s * size for s in x.stride()), size
    interface = getattr(x, "__cuda_array_interface__", None)
    if interface is None:
        return None
    size = np.dtype(interface["typestr"]).itemsize
    shape = tuple(interface["shape"])
    strides = interface.get("strides")
    if strides is None:  # C-contiguous
        strides, step = [], size
        for n in reversed(shape):
            strides.insert(0, step)
            step *= n
    return interface["data"][0], shape, tuple(strides), size


class _AddressOnly:
    """A numpy view description of memory at an address (host or device) that is never read: ``np.shares_memory``
    decides overlap from bounds and strides alone."""

    def __init__(self, address: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> None:
        self.__array_interface__ = {"version": 3, "data": (address, True), "shape": shape, "strides": strides,
                                    "typestr": f"|V{itemsize}"}


def shares_elements(a: Any, b: Any) -> bool:
    """Whether arrays ``a`` and ``b`` (of one kind, on one device) have some element's memory in common: exact,
    from their addresses and strides (two interleaved halves of one packed buffer share none); where the layout is
    unknown, whether their first elements coincide."""
    la, lb = _memory_layout(a), _memory_layout(b)
    if la is None or lb is None:
        ia, ib = getattr(a, "__cuda_array_interface__", None), getattr(b, "__cuda_array_interface__", None)
        return a is b or (None not in (ia, ib) and ia["data"][0] == ib["data"][0])
    va, vb = (np.asarray(_AddressOnly(*layout)) for layout in (la, lb))
    try:
        return bool(np.shares_memory(va, vb, max_work=10**6))
    except np.exceptions.TooHardError:  # bounds overlap and the exact answer is too costly: assume the worst
        return bool(np.may_share_memory(va, vb))


def _span(layout: tuple[int, tuple[int, ...], tuple[int, ...], int]) -> tuple[int, int]:
    """The byte range [first, end) an array's elements lie in."""
    address, shape, strides, itemsize = layout
    if 0 in shape:
        return address, address
    low = address + sum(s * (n - 1) for s, n in zip(strides, shape) if s < 0)
    high = address + sum(s * (n - 1) for s, n in zip(strides, shape) if s > 0) + itemsize
    return low, high


def apart_from(x: Any, *arrays: Any) -> Any:
    """``x``, or a copy of it where it shares memory with one of ``arrays`` (new keys or values that are views of
    the cache they are appended to: written one sequence at a time, a later write would read what an earlier one
    wrote). A byte-range test first, the exact one only where the ranges meet: a decode step calls this four times."""
    lx = span_x = None
    for a in arrays:
        if type(x) is np.ndarray and type(a) is np.ndarray:   # host arrays: numpy's exact test, in C
            if _numpy_overlap(x, a):
                return np.array(x, copy=True)
            continue
        if lx is None:
            lx = _memory_layout(x)
            span_x = None if lx is None else _span(lx)
        la = _memory_layout(a)
        if span_x is None or la is None:
            continue
        (x0, x1), (a0, a1) = span_x, _span(la)
        if x0 < a1 and a0 < x1 and shares_elements(x, a):
            return x.clone() if array_kind(x) == "torch" else np.array(x, copy=True)
    return x


def _numpy_overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """``shares_elements`` for two numpy arrays, asked of numpy directly (the same test on the same layouts)."""
    try:
        return bool(np.shares_memory(a, b, max_work=10**6))
    except np.exceptions.TooHardError:  # bounds overlap and the exact answer is too costly: assume the worst
        return bool(np.may_share_memory(a, b))


def overlaps_itself(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two elements of an array may share memory. Axes in order of stride: each stride must step past
    everything the smaller ones span; this holds for every slice, transpose or packed half, and fails for a stride
    of 0 (``expand``, ``broadcast_to``) and other self-overlapping layouts (and for rare interleavings that would
    not overlap, which are refused all the same)."""
    span = itemsize
    for stride, n in sorted((abs(s), n) for s, n in zip(strides, shape) if n > 1):
        if stride < span:
            return True
        span += stride * (n - 1)
    return False


def check_inference_write(name: str, x: Any) -> None:
    """AttentionInputError unless torch lets this call write torch tensor ``x`` in place: an inference tensor
    only inside ``torch.inference_mode()``. Not in an array signature, so a kept plan asks it each step (the
    append writes through a numpy view, which torch would not stop)."""
    if x.is_inference():
        import torch

        if not torch.is_inference_mode_enabled():   # torch refuses the write only after the other cache's
            raise AttentionInputError(
                f"{name}: expected a cache torch lets this call write in place when k/v are appended, got an "
                f"inference tensor outside torch.inference_mode() (make the cache outside inference mode, or call "
                f"inside it)")


def first_address(x: Any) -> int | None:
    """The address of element 0 of a numpy array or torch tensor, else None. With a shape, strides and dtype
    known equal (an array signature), it decides where every element lies: what ``shares_elements`` answers."""
    if type(x) is np.ndarray:
        return x.__array_interface__["data"][0]
    if array_kind(x) == "torch":
        return x.data_ptr()
    return None


def check_append_target(name: str, x: Any) -> None:
    """AttentionInputError unless the cache ``x`` (the caller's own array, before validation) can take an append
    in place: no pending torch negation/conjugation bit, no two elements in one place."""
    if array_kind(x) == "torch" and (x.is_neg() or x.is_conj()):
        bit = "negation" if x.is_neg() else "conjugation"
        raise AttentionInputError(
            f"{name}: expected a tensor without torch's lazy {bit} bit when k/v are appended (the cache is written "
            f"in place; resolving the bit makes a copy, which the caller would then have to keep as its cache), "
            f"got a tensor with {name}.is_{bit[:3]}() True")
    if array_kind(x) == "torch":
        check_inference_write(name, x)
    layout = _memory_layout(x)
    if layout is None:  # the simulator's device arrays: numba's strides are in bytes
        layout = (0, tuple(x.shape), getattr(x, "strides", None), getattr(getattr(x, "dtype", None), "itemsize", 0))
    shape, strides, itemsize = layout[1:]
    if strides is not None and itemsize and overlaps_itself(shape, strides, itemsize):
        raise AttentionInputError(
            f"{name}: expected a cache whose elements each have memory of their own when k/v are appended (an "
            f"append to one would overwrite another's), got shape {shape} with strides {strides} (bytes), whose "
            f"elements overlap (a stride of 0, from expand() or as_strided?)")
