"""The simulator side of the checker (see simcheck.py): a block runner with a checking barrier, and a fake ``cuda``
module whose shared and local arrays are checked proxies.

numba-cuda's simulator launches a kernel in ``FakeCUDAKernel.__call__``, which builds a ``FakeCUDAModule`` (what
kernel code sees as ``cuda``), wraps device-array arguments in ``FakeWithinKernelCUDAArray`` and runs each block
with a ``BlockManager``: one Python thread per CUDA thread. It looks those three names up in its module's globals
at every launch, so replacing them there hooks every launch, ours and anyone else's, and putting them back unhooks.

The simulator's own barrier releases the threads that wait once every thread still alive waits, so a barrier that
some threads never reach passes silently when the others have finished. The barrier here counts arrivals against
the whole block instead, names the call site each thread waits at, and fails the block on any mismatch.
"""

from __future__ import annotations

import inspect
import linecache
import re
import sys
import threading
import time
from typing import Any

import numpy as np
from numba.core import types as numba_types
from numba.cuda.simulator import kernel as sim_kernel
from numba.cuda.simulator import kernelapi

from numba_flash.cuda.simcheck import SimulatorCheckError, block_timeout
from numba_flash.cuda.simcheck.arrays import (SKIP_FILES, DeviceArray, LocalArray, SharedArray, caller_site,
                                              format_site)

SKIP_FILES.update({__file__, kernelapi.__file__, sim_kernel.__file__})
_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*=\s*[\w.]*\b(shared|local)\.array\b")
_names: dict[tuple[str, int], str] = {}


class _Aborted(BaseException):
    """Unwinds a simulated thread once its block has failed (BaseException: kernel code's ``except Exception``
    must not swallow it)."""


def _array_name(site: tuple[str, int], kind: str) -> str:
    """The variable a ``cuda.shared.array`` / ``cuda.local.array`` call is assigned to, read from its source line."""
    name = _names.get(site)
    if name is None:
        m = _ASSIGNED.match(linecache.getline(*site))
        name = m.group(1) if m else f"{kind} array at {format_site(site)}"
        _names[site] = name
    return name


def _as_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, kernelapi.types.Type):
        return kernelapi.numpy_support.as_dtype(dtype)
    return np.dtype(dtype)


class CheckedShared:
    """``cuda.shared``: one checked array per allocation site, shared by every thread (and, as in the simulator,
    reused by every block of the launch)."""

    def __init__(self, dynshared_size: int):
        self._dynshared = np.zeros(dynshared_size, dtype=np.byte)
        self._allocations: dict[Any, SharedArray] = {}
        self._lock = threading.Lock()   # the simulator's check-then-create could hand two threads two arrays

    def array(self, shape: Any, dtype: Any, alignment: Any = None) -> SharedArray:
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        dtype = _as_dtype(dtype)
        site = caller_site()
        key = ("dynamic", dtype.str) if shape == 0 else site
        with self._lock:
            arr = self._allocations.get(key)
            if arr is None:
                if shape == 0:   # dynamic shared memory: one buffer, viewed as each dtype asked for
                    data = np.frombuffer(self._dynshared.data, dtype=dtype,
                                         count=self._dynshared.size // dtype.itemsize)
                else:
                    data = np.empty(shape, dtype)
                arr = self._allocations[key] = SharedArray(data, _array_name(site, "shared"))
        return arr

    def reset(self) -> None:
        """Forget every recorded access (a barrier, or the next block)."""
        for arr in list(self._allocations.values()):
            arr.reset()


class CheckedLocal:
    """``cuda.local.array``: a fresh checked array per call (per thread)."""

    def array(self, shape: Any, dtype: Any, alignment: Any = None) -> LocalArray:
        if alignment is not None:
            raise RuntimeError("Array alignment is not supported in cudasim")
        return LocalArray(np.empty(shape, _as_dtype(dtype)), _array_name(caller_site(), "local"))


class CheckedAtomic(kernelapi.FakeCUDAAtomic):
    """``cuda.atomic``: indices checked, but no race records (concurrent atomics on one element are no race)."""

    def __getattribute__(self, name: str) -> Any:
        op = super().__getattribute__(name)
        if name.startswith("_") or not callable(op):
            return op

        def checked(array: Any, *rest: Any) -> Any:
            if isinstance(array, (LocalArray, DeviceArray)):
                # compare_and_swap(array, old, val) works on element 0
                array = array.check((0,) * array.ndim if name == "compare_and_swap" else rest[0])
            return op(array, *rest)
        return checked


class CheckedCUDAModule(kernelapi.FakeCUDAModule):
    """What kernel code sees as ``cuda`` under the checker."""

    def __init__(self, grid_dim: Any, block_dim: Any, dynshared_size: int):
        super().__init__(grid_dim, block_dim, dynshared_size)
        self._shared = CheckedShared(dynshared_size)
        self._local = CheckedLocal()
        self._atomic = CheckedAtomic()
        self._global_writes: dict[int, tuple[int, ...]] = {}   # element address -> the block that stored to it


class _Block:
    """One block's run: its barrier, barrier epoch and first failure. The shared-array records take no lock
    (simcheck_arrays.SharedArray); they are reset only while no thread of the block runs kernel code."""

    def __init__(self, kernel: str, block_idx: tuple[int, ...], nthreads: int, shared: CheckedShared,
                 global_writes: dict[int, tuple[int, ...]] | None = None):
        self.kernel = kernel
        self.block_idx = block_idx
        self.nthreads = nthreads
        self.shared = shared
        self.global_writes = {} if global_writes is None else global_writes   # the launch's, shared by its blocks
        self.cond = threading.Condition()     # barrier state below
        self.epoch = 0
        self.waiting: dict[int, tuple[str, int]] = {}   # thread -> barrier site it waits at
        self.finished: list[int] = []
        self.votes: dict[int, Any] = {}
        self.threads: list[_Thread] = []
        self.error: tuple[BaseException, Any, _Thread | None] | None = None

    def thread_idx(self, tid: int) -> tuple[int, int, int]:
        return self.threads[tid].idx

    def epoch_text(self) -> str:
        if self.epoch == 0:
            return "barrier epoch 0 (before the first syncthreads())"
        return f"barrier epoch {self.epoch} (after syncthreads() number {self.epoch})"

    def _fail(self, exc: BaseException, tb: Any = None, thread: _Thread | None = None) -> None:
        """Record the block's first failure and wake every waiting thread (caller holds ``cond``)."""
        if self.error is None:
            self.error = (exc, tb, thread)
        self.cond.notify_all()

    def fail(self, exc: BaseException, tb: Any = None, thread: _Thread | None = None) -> None:
        with self.cond:
            self._fail(exc, tb, thread)

    def _divergence(self, site: tuple[str, int], what: str) -> SimulatorCheckError:
        return SimulatorCheckError(
            f"barrier not reached by every thread of the block: kernel {self.kernel!r}, block {self.block_idx}, "
            f"syncthreads() at {format_site(site)}, {self.epoch_text()}: {what}")

    def barrier(self, th: _Thread, site: tuple[str, int]) -> None:
        with self.cond:
            if self.error is not None:
                raise _Aborted
            if self.finished:
                self._fail(self._divergence(site, f"thread {th.idx} waits there, but thread "
                                                  f"{self.thread_idx(self.finished[0])} already finished the "
                                                  f"kernel ({len(self.finished)} finished)"))
                raise _Aborted
            self.waiting[th.tid] = site
            if len(self.waiting) == self.nthreads:
                sites = {}
                for tid, s in self.waiting.items():
                    sites.setdefault(s, tid)
                if len(sites) > 1:
                    (s1, t1), (s2, t2) = list(sites.items())[:2]
                    self._fail(self._divergence(s1, f"thread {self.thread_idx(t1)} waits there while thread "
                                                    f"{self.thread_idx(t2)} waits at {format_site(s2)}"))
                    raise _Aborted
                self.shared.reset()
                self.epoch += 1
                self.waiting = {}
                self.cond.notify_all()
                return
            epoch = self.epoch
            while self.epoch == epoch and self.error is None:
                self.cond.wait()
            if self.error is not None:
                raise _Aborted

    def finish(self, th: _Thread) -> None:
        with self.cond:
            self.finished.append(th.tid)
            if self.waiting and self.error is None:
                tid, site = next(iter(self.waiting.items()))
                self._fail(self._divergence(site, f"thread {th.idx} finished the kernel while "
                                                  f"{len(self.waiting)} thread(s) wait there, e.g. thread "
                                                  f"{self.thread_idx(tid)}"))


class _Thread(threading.Thread):
    """One simulated CUDA thread; provides what the simulator's ``cuda`` module asks of the current thread."""

    def __init__(self, fn: Any, args: tuple, block: _Block, block_idx: tuple, thread_idx: tuple,
                 block_dim: tuple, debug: bool):
        super().__init__(daemon=True)
        self._fn, self._args, self.block, self._debug = fn, args, block, debug
        self.blockIdx = kernelapi.Dim3(*block_idx)
        self.threadIdx = kernelapi.Dim3(*thread_idx)
        self.idx = tuple(int(i) for i in thread_idx)
        x, y, z = self.idx
        self.tid = self.thread_id = x + block_dim[0] * (y + block_dim[1] * z)

    def run(self) -> None:
        if self._debug:
            np.seterr(divide="raise")
        try:
            self._fn(*self._args)
        except _Aborted:
            return
        except BaseException as exc:
            self.block.fail(exc, sys.exc_info()[2], self)
            return
        self.block.finish(self)

    def syncthreads(self) -> None:
        self.block.barrier(self, caller_site())

    def _vote(self, value: Any, combine: Any) -> Any:
        site = caller_site()
        self.block.votes[self.tid] = value
        self.block.barrier(self, site)
        result = combine(list(self.block.votes.values()))
        self.block.barrier(self, site)   # nobody may vote again before everyone has counted
        return result

    def syncthreads_count(self, value: Any) -> int:
        return self._vote(value, lambda v: int(np.count_nonzero(v)))

    def syncthreads_and(self, value: Any) -> int:
        return self._vote(value, lambda v: 1 if all(v) else 0)

    def syncthreads_or(self, value: Any) -> int:
        return self._vote(value, lambda v: 1 if any(v) else 0)


def _name_arguments(fn: Any, args: tuple) -> None:
    """Give each global-array argument its parameter's name, for messages."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    for i, arg in enumerate(args):
        if isinstance(arg, DeviceArray) and arg._simcheck_name is None:
            arg.__dict__["_simcheck_name"] = params[i] if i < len(params) else f"argument {i}"


class CheckedBlockManager(sim_kernel.BlockManager):
    """Runs one block of a launch under the checker (the simulator makes one per block)."""

    def run(self, grid_point: tuple, *args: Any) -> None:
        module = sim_kernel._get_kernel_context()
        if not isinstance(module, CheckedCUDAModule):   # a launch that began before install()
            return super().run(grid_point, *args)
        _name_arguments(self._f, args)
        block_dim = tuple(self._block_dim)
        block = _Block(getattr(self._f, "__name__", "kernel"), tuple(int(i) for i in grid_point),
                       int(np.prod(block_dim)), module._shared, module._global_writes)
        module._shared.reset()
        threads = [_Thread(self._f, args, block, grid_point, point, block_dim, self._debug)
                   for point in np.ndindex(*block_dim)]
        block.threads = sorted(threads, key=lambda t: t.tid)
        for t in threads:
            t.start()
        timeout = block_timeout()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                with block.cond:
                    stuck = [u.idx for u in threads if u.is_alive() and u.tid not in block.waiting]
                    block._fail(SimulatorCheckError(
                        f"kernel {block.kernel!r}, block {block.block_idx} did not finish within {timeout:g} s "
                        f"(NUMBA_FLASH_SIMCHECK_TIMEOUT): {len(block.waiting)} thread(s) wait at a barrier, "
                        f"{len(stuck)} still run, e.g. {stuck[:4]}; a deadlock or an endless loop"))
                break
        _raise(block)


def _raise(block: _Block) -> None:
    """Re-raise the block's first failure in the launching thread, as the simulator does."""
    if block.error is None:
        return
    exc, tb, th = block.error
    if th is not None and not isinstance(exc, SimulatorCheckError):
        # The simulator's own format for an exception in kernel code.
        prefix = f"tid={list(th.idx)} ctaid={list(block.block_idx)}"
        try:
            exc = type(exc)(f"{prefix}: {exc}" if str(exc) else prefix)
        except Exception:
            pass
    raise exc.with_traceback(tb)


_HOOKS = {"BlockManager": CheckedBlockManager, "FakeCUDAModule": CheckedCUDAModule,
          "FakeWithinKernelCUDAArray": DeviceArray}


_numba_type_call = numba_types.Type.__call__
# numba's scalar types (uint32, float32...) called on a value cast it with numpy: ``cast_python_value`` is
# ``getattr(np, name)(value)`` for every integer and float type. The kernels make such casts in their inner loops
# (index arithmetic in uint32/uint64), and numba's generic ``Type.__call__`` (an import, an ABC isinstance, a
# getattr) cost about a tenth of a checked simulator run (py-spy). Same casts, looked up by the type's identity.
_CASTS = {id(t): getattr(np, t.name)
          for t in (*numba_types.integer_domain, *numba_types.real_domain, numba_types.float16)}
_PLAIN = frozenset((int, float, *(np.dtype(c).type for c in "bBhHiIlLqQefd")))


def _cast_call(self: Any, *args: Any) -> Any:
    if len(args) == 1 and args[0].__class__ in _PLAIN:
        cast = _CASTS.get(id(self))
        if cast is not None:
            return cast(args[0])
    return _numba_type_call(self, *args)


def patch_simulator() -> dict[str, Any]:
    """Replace the simulator's block runner, fake ``cuda`` module and argument wrapper, and take numba's scalar
    casts on a short path (``_cast_call``); returns what was there."""
    missing = [name for name in _HOOKS if not hasattr(sim_kernel, name)]
    if missing:
        raise RuntimeError(f"this numba-cuda simulator has no {missing} in {sim_kernel.__name__}; the checker "
                           "does not know how to hook it")
    saved = {name: getattr(sim_kernel, name) for name in _HOOKS}
    for name, hook in _HOOKS.items():
        setattr(sim_kernel, name, hook)
    numba_types.Type.__call__ = _cast_call
    return saved


def unpatch_simulator(saved: dict[str, Any]) -> None:
    """Put back what ``patch_simulator`` replaced."""
    for name, value in saved.items():
        setattr(sim_kernel, name, value)
    numba_types.Type.__call__ = _numba_type_call
