"""The checked arrays kernel code sees under the simulator checker (see simcheck.py).

Shared arrays record, per element, which thread wrote it and which threads read it since the block's last barrier,
and raise on a conflict; global arrays record which block stored to each element in the launch (stores are few);
local arrays only check their indices, which keeps the checker cheap where kernels spend most accesses
(register-blocked accumulators are local arrays). Every proxy checks each integer of an
index against its axis before numpy sees it, so a negative index fails instead of wrapping.

The records take no lock (``SharedArray`` says why a racing pair is still seen).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
from numba.cuda.simulator.cudadrv.devicearray import (
    FakeCUDAArray,
    FakeWithinKernelCUDAArray,
)

from numba_flash.cuda.simcheck import SimulatorCheckError

_current_thread = threading.current_thread
_INTEGERS = (int, np.integer)
_NUMPY_INTEGERS = frozenset(np.dtype(c).type for c in "bBhHiIlLqQ")
#: Files whose frames are the checker's or the simulator's own, never the kernel's (simcheck_hooks adds its own).
SKIP_FILES = {__file__, sys.modules[FakeCUDAArray.__module__].__file__}


def element(idx: Any, shape: tuple[int, ...]) -> int | None:
    """C-order position of the element ``idx`` names in an array of ``shape``; -1 when one of its integers is out
    of bounds (negative included); None when ``idx`` is not one integer per axis (a slice, a row, an ellipsis, an
    index array), which the callers' general path handles."""
    # Plain ints into 1-D and 2-D arrays (every shared and local array of the kernels) skip the general loop: it
    # would cost more than the numpy access it guards. The kernels index their flat shared buffers with numba's
    # uint32/uint64, numpy scalars under the simulator: those take a short path too.
    cls = idx.__class__
    if cls is tuple:
        if len(idx) == 2 and len(shape) == 2:
            i, j = idx
            if i.__class__ is int and j.__class__ is int:
                n0, n1 = shape
                return i * n1 + j if 0 <= i < n0 and 0 <= j < n1 else -1
    elif len(shape) == 1:
        if cls is int:
            return idx if 0 <= idx < shape[0] else -1
        if cls in _NUMPY_INTEGERS:
            i = int(idx)
            return i if 0 <= i < shape[0] else -1
    return _element(idx, shape)


def _element(idx: Any, shape: tuple[int, ...]) -> int | None:
    if idx.__class__ is not tuple:
        idx = (idx,)
    if len(idx) != len(shape):
        return None
    flat = 0
    for i, n in zip(idx, shape):
        if i.__class__ is not int and not isinstance(i, _INTEGERS):
            return None
        if i < 0 or i >= n:
            return -1
        flat = flat * n + i
    return flat


def bad_integer(idx: Any, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(axis, value) of the first integer of a general index (slices, ellipsis, newaxis) outside its axis."""
    items = idx if isinstance(idx, tuple) else (idx,)
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    axis = 0
    for i in items:
        if i is None:
            continue
        if i is Ellipsis:
            axis += len(shape) - used
            continue
        if isinstance(i, _INTEGERS) and not isinstance(i, (bool, np.bool_)) and axis < len(shape):
            if not 0 <= i < shape[axis]:
                return axis, int(i)
        axis += 1
    return None


def _where() -> str:
    """'kernel K, block B, thread T, barrier epoch E' of the calling simulated thread."""
    th = _current_thread()
    block = getattr(th, "block", None)
    if block is None:
        return "outside a simulated kernel"
    return f"kernel {block.kernel!r}, block {block.block_idx}, thread {th.idx}, {block.epoch_text()}"


def caller_site() -> tuple[str, int]:
    """(file, line) of the kernel code that called into the checker or the simulator's cuda module."""
    f = sys._getframe(1)
    while f.f_back is not None and f.f_code.co_filename in SKIP_FILES:
        f = f.f_back
    return f.f_code.co_filename, f.f_lineno


def format_site(site: tuple[str, int]) -> str:
    """'file.py:LINE' of a (file, line) site."""
    return f"{os.path.basename(site[0])}:{site[1]}"


def raise_out_of_bounds(kind: str, name: str, idx: Any, shape: tuple[int, ...]) -> None:
    """Raise SimulatorCheckError for ``idx`` outside a ``kind`` array ``name`` of ``shape``."""
    items = idx if isinstance(idx, tuple) else (idx,)
    bad = bad_integer(idx, shape)
    which = f" (axis {bad[0]}: {bad[1]})" if bad else ""
    neg = " negative index: numpy would wrap it to the end of the axis;" if bad and bad[1] < 0 else ""
    raise SimulatorCheckError(
        f"out-of-bounds index{which} into {kind} array {name!r}:{neg} index {tuple(items)} for shape {tuple(shape)}"
        f" at {format_site(caller_site())}; {_where()}")


class LocalArray:
    """A thread's ``cuda.local.array``: indices checked, nothing recorded (no other thread can see it)."""

    __slots__ = ("_a", "_shape", "name")
    kind = "local"

    def __init__(self, data: np.ndarray, name: str):
        self._a, self._shape, self.name = data, data.shape, name

    # The register-blocked accumulators take most of a kernel's accesses: a plain int pair or int inside the
    # bounds goes straight to numpy (``element``'s test, written out: the call cost a sixth of a checked run).
    def __getitem__(self, idx: Any) -> Any:
        shape = self._shape
        if idx.__class__ is tuple:
            if len(idx) == 2 and len(shape) == 2:
                i, j = idx
                if i.__class__ is int and j.__class__ is int and 0 <= i < shape[0] and 0 <= j < shape[1]:
                    return self._a[idx]
        elif idx.__class__ is int and len(shape) == 1 and 0 <= idx < shape[0]:
            return self._a[idx]
        key = element(idx, shape)
        if key is None:
            return self._general(idx)
        if key < 0:
            raise_out_of_bounds(self.kind, self.name, idx, shape)
        return self._a[idx]

    def __setitem__(self, idx: Any, value: Any) -> None:
        shape = self._shape
        if idx.__class__ is tuple:
            if len(idx) == 2 and len(shape) == 2:
                i, j = idx
                if i.__class__ is int and j.__class__ is int and 0 <= i < shape[0] and 0 <= j < shape[1]:
                    self._a[idx] = value
                    return
        elif idx.__class__ is int and len(shape) == 1 and 0 <= idx < shape[0]:
            self._a[idx] = value
            return
        key = element(idx, shape)
        if key is None:
            if bad_integer(idx, shape):
                raise_out_of_bounds(self.kind, self.name, idx, shape)
        elif key < 0:
            raise_out_of_bounds(self.kind, self.name, idx, shape)
        self._a[idx] = value

    def _general(self, idx: Any) -> Any:
        if bad_integer(idx, self._shape):
            raise_out_of_bounds(self.kind, self.name, idx, self._shape)
        got = self._a[idx]
        return LocalArray(got, f"{self.name}[{idx}]") if isinstance(got, np.ndarray) else got

    def check(self, idx: Any) -> np.ndarray:
        """The raw array, after checking ``idx`` (for atomics, which bypass the records)."""
        if element(idx, self._shape) == -1 or bad_integer(idx, self._shape):
            raise_out_of_bounds(self.kind, self.name, idx, self._shape)
        return self._a

    def raw(self) -> np.ndarray:
        """The numpy array behind the proxy, for the simulator's emulation of asynchronous units (wgmma, bulk
        copies), which read and write it as hardware does, outside any thread's records."""
        return self._a

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Iterator[Any]:   # without it Python would iterate until the index check fails
        return (self[i] for i in range(len(self._a)))

    def __getattr__(self, name: str) -> Any:   # shape, size, dtype, ndim...
        return getattr(self._a, name)

    def __repr__(self) -> str:
        return f"<{self.kind} array {self.name!r} {self._a!r}>"


class SharedArray(LocalArray):
    """A block's ``cuda.shared.array``. ``_w`` maps an element (C-order position in the allocation) to the first
    thread that wrote it in the current epoch, ``_r`` to the first thread that read it and ``_r2`` to the first other
    thread that read it. Views (rows, slices) share their allocation's records through ``_flat``, the positions of
    their elements in it.

    The records take no lock: a block's threads all contend for one, and with 64-128 Python threads waiting on it
    the checked simulator ran about as slowly as the lock's hand-offs (py-spy: 79% of thread samples at its
    ``acquire``). Each record is one ``dict.setdefault`` (atomic under the GIL for int keys), and an access records
    itself before it looks at the other kind of record: whichever of a racing read and write comes second sees
    the first."""

    __slots__ = ("_async_r", "_async_w", "_base_shape", "_flat", "_r", "_r2", "_w")
    kind = "shared"

    def __init__(self, data: np.ndarray, name: str, base: SharedArray | None = None,
                 flat: np.ndarray | None = None):
        super().__init__(data, name)
        if base is None:
            self._w, self._r, self._r2, self._flat, self._base_shape = {}, {}, {}, None, data.shape
            self._async_r, self._async_w = {}, {}
        else:
            self._w, self._r, self._r2 = base._w, base._r, base._r2
            self._flat, self._base_shape = flat, base._base_shape
            self._async_r, self._async_w = base._async_r, base._async_w

    def reset(self) -> None:
        """Forget every access: a barrier, or a new block (the simulator reuses one allocation for all blocks)."""
        self._w.clear()
        self._r.clear()
        self._r2.clear()

    def __getitem__(self, idx: Any) -> Any:
        key = element(idx, self._shape)
        if key is None:
            return self._general(idx)
        if key < 0:
            raise_out_of_bounds(self.kind, self.name, idx, self._shape)
        if self._flat is not None:
            key = int(self._flat[key])
        self._record_read(key, _current_thread())
        return self._a[idx]

    def _record_read(self, key: int, th: Any) -> None:
        if self._async_w and key in self._async_w:
            self._async_race(key, self._async_w[key], "reads")
        tid = th.tid
        if self._r.setdefault(key, tid) != tid:   # a second reader; more add nothing a write could not see
            self._r2.setdefault(key, tid)
        w = self._w.get(key)
        if w is not None and w != tid:
            self._race(key, w, "wrote", tid, "reads")

    def __setitem__(self, idx: Any, value: Any) -> None:
        key = element(idx, self._shape)
        if key is None:
            if bad_integer(idx, self._shape):
                raise_out_of_bounds(self.kind, self.name, idx, self._shape)
            for k in self._positions()[idx].ravel().tolist():
                self._record_write(k, _current_thread())
        else:
            if key < 0:
                raise_out_of_bounds(self.kind, self.name, idx, self._shape)
            if self._flat is not None:
                key = int(self._flat[key])
            self._record_write(key, _current_thread())
        self._a[idx] = value

    def _record_write(self, key: int, th: Any) -> None:
        if (self._async_w and key in self._async_w) or (self._async_r and key in self._async_r):
            self._async_race(key, self._async_w.get(key) or self._async_r[key][1], "writes")
        tid = th.tid
        w = self._w.setdefault(key, tid)
        if w != tid:
            self._race(key, w, "wrote", tid, "writes")
        r = self._r.get(key)
        if r is not None and r != tid:
            self._race(key, r, "read", tid, "writes")
        r = self._r2.get(key)   # differs from _r's thread: set only by a reader that was not the first
        if r is not None and r != tid:
            self._race(key, r, "read", tid, "writes")

    def begin_async(self, indices: np.ndarray, writes: bool, what: str) -> None:
        """Elements ``indices`` of this 1-D view are in use by an asynchronous unit until ``end_async``: written by
        a bulk copy (``writes``) or read by a wgmma. A thread's access that conflicts with them, a copy onto
        elements still read or written, or a wgmma reading elements a copy has not finished, raises."""
        for key in self._keys(indices):
            if key in self._async_w:
                self._async_race(key, self._async_w[key], what)
            if writes:
                if key in self._async_r:
                    self._async_race(key, self._async_r[key][1], what)
                self._async_w[key] = what
            else:
                count, first = self._async_r.get(key, (0, what))
                self._async_r[key] = (count + 1, first)

    def end_async(self, indices: np.ndarray, writes: bool) -> None:
        """The asynchronous use ``begin_async`` recorded is over (the copy landed, the wgmma was waited for)."""
        for key in self._keys(indices):
            if writes:
                self._async_w.pop(key, None)
            else:
                count, first = self._async_r.get(key, (1, ""))
                if count <= 1:
                    self._async_r.pop(key, None)
                else:
                    self._async_r[key] = (count - 1, first)

    def _keys(self, indices: np.ndarray) -> list[int]:
        flat = np.asarray(indices, np.int64).ravel()
        if flat.size and (flat.min() < 0 or flat.max() >= self._a.size):
            raise_out_of_bounds(self.kind, self.name, int(flat.max() if flat.max() >= self._a.size
                                                          else flat.min()), self._shape)
        return (flat if self._flat is None else self._flat[flat]).tolist()

    def _async_race(self, key: int, what: str, does: str) -> None:
        block = _current_thread().block
        where = np.unravel_index(key, self._base_shape)
        raise SimulatorCheckError(
            f"asynchronous-unit race on {self.name!r}[{', '.join(str(int(i)) for i in where)}] in kernel "
            f"{block.kernel!r}, block {block.block_idx}: {what} has not completed when this {does} it (at "
            f"{format_site(caller_site())}); wait on its mbarrier phase (a bulk copy) or its wgmma_wait (a wgmma) "
            "first")

    def _positions(self) -> np.ndarray:
        """Each element's position in the allocation, shaped like this view."""
        if self._flat is None:
            return np.arange(self._a.size).reshape(self._shape)
        return self._flat.reshape(self._shape)

    def _general(self, idx: Any) -> Any:
        if bad_integer(idx, self._shape):
            raise_out_of_bounds(self.kind, self.name, idx, self._shape)
        got = self._a[idx]
        pos = self._positions()[idx]
        if isinstance(got, np.ndarray):
            return SharedArray(got, self.name, self, np.ascontiguousarray(pos).ravel())
        self._record_read(int(pos), _current_thread())
        return got

    def _race(self, key: int, first: int, did: str, second: int, does: str) -> None:
        th = _current_thread()
        block = th.block
        where = np.unravel_index(key, self._base_shape)
        raise SimulatorCheckError(
            f"shared-memory race on {self.name!r}[{', '.join(str(int(i)) for i in where)}] in kernel "
            f"{block.kernel!r}, block {block.block_idx}, {block.epoch_text()}: thread {block.thread_idx(first)} "
            f"{did} it and thread {block.thread_idx(second)} {does} it (at {format_site(caller_site())}) with no "
            "syncthreads() between them")


class DeviceArray(FakeWithinKernelCUDAArray):
    """A global (device) array argument, as the simulator hands it to kernel code, with its indices checked and
    its stores recorded per launch (``_record_write``)."""

    def __init__(self, item: FakeCUDAArray, name: str | None = None):
        super().__init__(item)
        ary = item._ary
        self.__dict__["_simcheck_shape"] = ary.shape
        self.__dict__["_simcheck_name"] = name
        # Where each element lives: two views of one buffer (a head sliced out by the host, a row by the kernel)
        # name an element by its address.
        self.__dict__["_simcheck_base"] = ary.__array_interface__["data"][0]
        self.__dict__["_simcheck_strides"] = ary.strides

    def _simcheck_fail(self, idx: Any) -> None:
        raise_out_of_bounds("global", self._simcheck_name or "argument", idx, self._simcheck_shape)

    def __getitem__(self, idx: Any) -> Any:
        key = element(idx, self._simcheck_shape)
        if key == -1 or (key is None and bad_integer(idx, self._simcheck_shape)):
            self._simcheck_fail(idx)
        got = self._item.__getitem__(idx)
        if isinstance(got, FakeCUDAArray):
            return DeviceArray(got, f"{self._simcheck_name}[{idx}]")
        return got

    def __setitem__(self, idx: Any, value: Any) -> None:
        key = element(idx, self._simcheck_shape)
        if key == -1 or (key is None and bad_integer(idx, self._simcheck_shape)):
            self._simcheck_fail(idx)
        if key is not None:
            self._record_write(idx)
        self._item.__setitem__(idx, value)

    def _record_write(self, idx: Any) -> None:
        """Two blocks of one launch storing to one element race (the order of blocks decides what stays; a sum
        kept with ``+=`` loses one of the terms): raise on the second. Atomics (``check``) are not stores."""
        th = _current_thread()
        writes = getattr(getattr(th, "block", None), "global_writes", None)
        if writes is None:   # not a checked block's thread
            return
        at = self._simcheck_base
        for i, stride in zip(idx if isinstance(idx, tuple) else (idx,), self._simcheck_strides):
            at += int(i) * stride
        block = th.block
        first = writes.setdefault(at, block.block_idx)
        if first != block.block_idx:
            raise SimulatorCheckError(
                f"global-memory race on {self._simcheck_name or 'argument'!r}[{idx}] in kernel {block.kernel!r}: "
                f"blocks {first} and {block.block_idx} both store to it in one launch (at "
                f"{format_site(caller_site())}); only atomics may share an element across blocks")

    def check(self, idx: Any) -> np.ndarray:
        """The raw array, after checking ``idx`` (for atomics)."""
        if element(idx, self._simcheck_shape) == -1 or bad_integer(idx, self._simcheck_shape):
            self._simcheck_fail(idx)
        return self._item._ary
