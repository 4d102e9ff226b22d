"""Watching numba's dispatcher launch a call, once, to learn what a plan must replay.

A launch plan is not a second copy of the launch code: the first call of a signature goes through the dispatcher
path as always (config choice, self-check, specialisation, the opt-in past 48 KiB of shared memory), and
``recording()`` notes every kernel launch it makes: the compiled kernel, grid, block, dynamic shared memory and
the argument values. ``launch_plan`` then binds each array argument to the call's arrays by address and keeps the
rest as constants.

With a GPU the hook is ``CUDADispatcher.call`` (every ``kernel[grid, block, stream, smem](*args)``, specialised
dispatchers included, ends there). Under the simulator (tests, the host-overhead bench) it is
``FakeCUDAKernel.__call__``, and ``execute=False`` records without running the kernel, which is what lets a plan be
built in milliseconds where the simulator would take minutes. Only launches made by the recording thread are
noted; others pass through untouched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Iterator

_LOCK = threading.RLock()   # re-entrant: a recorded call that records again must not deadlock


@dataclasses.dataclass
class RecordedLaunch:
    """One kernel launch as the dispatcher path made it. ``compiled``: numba-cuda's compiled kernel (``_Kernel``,
    with ``argument_types`` and the handle) on a GPU, None under the simulator; grid and block as 3-tuples."""

    dispatcher: Any
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared: int
    stream: Any
    args: tuple
    compiled: Any = None
    problem: str | None = None   # why the compiled kernel could not be found (the launch itself went ahead)


def _dims(dims: Any) -> tuple[int, int, int]:
    """A launch dimension (an int or a tuple of 1-3 ints) as (x, y, z)."""
    if isinstance(dims, int):
        return (dims, 1, 1)
    dims = tuple(int(d) for d in dims)
    return dims + (1,) * (3 - len(dims))


def compiled_overload(dispatcher: Any, args: tuple) -> Any:
    """The compiled kernel ``dispatcher`` ran for ``args`` (after the launch, so compiled): a specialised
    dispatcher's only overload, else the one typed from the arguments as the dispatcher types them."""
    if dispatcher.specialized:
        return next(iter(dispatcher.overloads.values()))
    return dispatcher.overloads[tuple(dispatcher.typeof_pyval(a) for a in args)]


#: numba's device-memory transfers: a call whose dispatcher path makes one (other than a self-check's) cannot be
#: replayed by launches alone.
TRANSFERS = ("host_to_device", "device_to_host", "device_to_device", "device_memset")


class Recording(list):
    """The recorded launches, in order, and ``transfers``: the names of numba's memory transfers this thread made
    meanwhile (a GPU only; the simulator's are plain numpy)."""

    transfers: list[str]


@contextlib.contextmanager
def _transfers_watched(into: list[str], me: int) -> Iterator[None]:
    """numba's transfer functions, each noting its name in ``into`` when thread ``me`` calls it."""
    from numba.cuda.cudadrv import driver as numba_driver

    real = {name: getattr(numba_driver, name) for name in TRANSFERS}

    def watch(name: str, fn: Any) -> Any:
        def watched(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                into.append(name)
            return fn(*args, **kwargs)
        return watched

    for name, fn in real.items():
        setattr(numba_driver, name, watch(name, fn))
    try:
        yield
    finally:
        for name, fn in real.items():
            setattr(numba_driver, name, fn)


@contextlib.contextmanager
def recording(execute: bool = True) -> Iterator[Recording]:
    """Within the block, every kernel launch of this thread is appended to the yielded list (and every numba
    memory transfer to its ``transfers``); ``execute=False`` (simulator only) records without running the
    kernels."""
    from numba import config

    records = Recording()
    records.transfers = []
    me = threading.get_ident()
    with _LOCK:
        if config.ENABLE_CUDASIM:
            from numba.cuda.simulator.kernel import FakeCUDAKernel as owner

            real = owner.__call__

            def hook(self: Any, *args: Any) -> Any:
                if threading.get_ident() != me or self._device:
                    return real(self, *args)
                records.append(RecordedLaunch(self, _dims(self.grid_dim), _dims(self.block_dim),
                                              int(self.dynshared_size), self.stream, args))
                return real(self, *args) if execute else None

            name = "__call__"
        else:
            if not execute:
                raise ValueError("execute: recording without running needs the simulator")
            from numba.cuda.dispatcher import CUDADispatcher as owner

            real = owner.call

            def hook(self: Any, args: tuple, griddim: Any, blockdim: Any, stream: Any, sharedmem: int) -> Any:
                result = real(self, args, griddim, blockdim, stream, sharedmem)
                if threading.get_ident() == me:
                    # never let the watching break the call: a kernel not found is a reason not to plan, only
                    record = RecordedLaunch(self, _dims(griddim), _dims(blockdim), int(sharedmem), stream,
                                            tuple(args))
                    try:
                        record.compiled = compiled_overload(self, tuple(args))
                    except Exception as exc:
                        record.problem = f"the compiled kernel numba launched was not found ({exc!r})"
                    records.append(record)
                return result

            name = "call"
        setattr(owner, name, hook)
        try:
            with contextlib.nullcontext() if config.ENABLE_CUDASIM else _transfers_watched(records.transfers, me):
                yield records
        finally:
            setattr(owner, name, real)
