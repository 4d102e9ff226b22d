"""The driver call a planned launch makes, and the recording stub that stands in for it without a GPU.

A planned launch (``launch_plan.KernelLaunch``) calls ``cuLaunchKernel`` through cuda-bindings' driver module
(``cuda.bindings.driver``), with numba's compiled function handle and the address of its packed ``kernelParams``
(``abi.ArgBuffer``): the same call numba-cuda's ``driver.launch_kernel`` makes at the end of its dispatch, without
the dispatch. ``RecordingDriver`` has the same call and records it instead, so that the host path can be timed and
checked on a machine with no GPU; any other driver function the hot path touched (a synchronise, a copy, an
allocation) is recorded too, by name, which is how the tests see that the hot path makes none.
"""

from __future__ import annotations

import functools
from typing import Any

#: Driver functions that wait for the GPU or for a copy: none may appear on a planned call's path.
SYNCHRONISING = ("cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize", "cuMemcpy", "cuMemcpyHtoD",
                 "cuMemcpyDtoH", "cuMemAlloc", "cuMemFree", "cuStreamQuery")


class LaunchFailed(RuntimeError):
    """The driver refused a planned launch (its ``CUresult`` in the message)."""


@functools.lru_cache(maxsize=None)
def real_driver() -> Any:
    """cuda-bindings' driver module (imported on first use: ``import numba_flash`` needs none of it)."""
    from cuda.bindings import driver

    return driver


class RecordingDriver:
    """A stand-in for ``cuda.bindings.driver`` on the hot path: ``cuLaunchKernel`` records its arguments (or only
    counts them, ``keep=False``, for timing) and returns success as the real one does (a one-tuple of CUresult 0);
    any other attribute is a driver function that records its name when called (``others``).

    ``launches``: (handle, grid, block, shared bytes, stream, kernelParams address, snapshot) per launch, where
    snapshot is ``snapshot(kernelParams address)`` when given (the parameter bytes as the driver would copy them
    at that moment: a test's way to see what each launch really got), else None."""

    def __init__(self, keep: bool = True, snapshot: Any = None):
        self.keep = keep
        self.snapshot = snapshot
        self.count = 0
        self.launches: list[tuple] = []
        self.others: list[str] = []

    def cuLaunchKernel(self, f: Any, gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int,
                       stream: Any, params: int, extra: Any) -> tuple[int]:
        self.count += 1
        if self.keep:
            taken = self.snapshot(params) if self.snapshot is not None else None
            self.launches.append((f, (gx, gy, gz), (bx, by, bz), shared, stream, params, taken))
        return (0,)

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> tuple[int]:
            self.others.append(name)
            return (0,)

        return call


def launch(driver: Any, handle: Any, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
           stream: Any, params_address: int) -> None:
    """One ``cuLaunchKernel`` of ``handle`` on ``stream`` (a CUstream handle or its integer address; 0 the legacy
    default stream) with the packed parameters at ``params_address``. Raises ``LaunchFailed`` on an error code:
    asynchronous errors show at the stream's next synchronisation, as with numba's own launch."""
    err = driver.cuLaunchKernel(handle, grid[0], grid[1], grid[2], block[0], block[1], block[2], shared, stream,
                                params_address, 0)[0]
    if err:
        raise LaunchFailed(f"cuLaunchKernel: {err!r}")
