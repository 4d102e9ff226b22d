"""Race, bounds and barrier checker for kernels run by the Numba CUDA simulator.

With ``NUMBA_ENABLE_CUDASIM=1`` and ``NUMBA_FLASH_SIMCHECK=1``, every kernel the simulator launches (numba-flash's
or any other ``@cuda.jit`` kernel in the process) raises :class:`SimulatorCheckError` on

* a shared-memory race: two threads of a block touch one shared element between two barriers and one of them
  writes (broadcast reads, a thread re-writing its own element, and accesses in different barrier epochs are fine);
* a global-memory race: two blocks of one launch storing to one element of a global array (a sum kept with
  ``+=`` across blocks loses terms on a GPU, whatever order the simulator ran them in; atomics are fine);
* an out-of-bounds or negative index into a shared, local or global array (numpy, and numba, would wrap a negative
  index to the end of the axis, which on a GPU is always an indexing bug);
* a barrier that not every thread of the block reaches: threads waiting at ``syncthreads()`` while others have
  finished the kernel, or threads of one block waiting at different ``syncthreads()`` calls.

The checker wraps the arrays kernel code sees in thin proxies (shared arrays record who read and wrote each element
in the current barrier epoch; global arrays record which block stored to each element in the launch; local arrays
only check indices) and replaces the simulator's block
runner with one whose barrier advances the epoch and notices divergence. It is switched on by :func:`install` (or
the :func:`checking` context manager), by the test suite's conftest when the variable is set, and by
``numba_flash.cuda.host.launch`` on the first launch of a kernel when the variable is set. Atomics are not modelled.

This module does not import ``numba.cuda``: ``numba_flash.cuda`` exports :class:`SimulatorCheckError` from here,
and the hooks (``simcheck_hooks.py``) load only when the checker is installed.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator

ENV_VAR = "NUMBA_FLASH_SIMCHECK"
#: Seconds a block may run before the checker calls it hung (a thread spinning forever, say). Override with
#: NUMBA_FLASH_SIMCHECK_TIMEOUT.
DEFAULT_BLOCK_TIMEOUT = 600.0


class SimulatorCheckError(RuntimeError):
    """A kernel run by the CUDA simulator under the checker raced on shared memory, indexed out of bounds, or hit
    a barrier that not every thread of its block reached. The message names the kernel, the block, the array, the
    index, the threads involved and the barrier epoch (how many ``syncthreads()`` the block had passed)."""


_lock = threading.Lock()
_installed: dict[str, Any] | None = None   # the simulator attributes the hooks replaced, while installed
_env_checked = False


def env_requested() -> bool:
    """Whether ``NUMBA_FLASH_SIMCHECK`` asks for the checker (any value but empty, '0', 'false', 'no', 'off')."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no", "off")


def _simulator_on() -> bool:
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def is_installed() -> bool:
    """Whether the checker's hooks are in place."""
    return _installed is not None


def install() -> None:
    """Put the checker's hooks into the simulator; every kernel launched afterwards is checked. Idempotent.

    Raises RuntimeError unless the simulator is on (``NUMBA_ENABLE_CUDASIM=1`` before ``numba.cuda`` is imported):
    on a real GPU the kernels never run through Python, so there is nothing to hook.
    """
    global _installed
    if not _simulator_on():
        raise RuntimeError("the simulator checker needs NUMBA_ENABLE_CUDASIM=1 (set before numba.cuda is imported)")
    with _lock:
        if _installed is None:
            from numba_flash.cuda.simcheck import hooks as simcheck_hooks

            _installed = simcheck_hooks.patch_simulator()


def uninstall() -> None:
    """Restore the simulator's own classes. Idempotent."""
    global _installed
    with _lock:
        if _installed is not None:
            from numba_flash.cuda.simcheck import hooks as simcheck_hooks

            simcheck_hooks.unpatch_simulator(_installed)
            _installed = None


@contextlib.contextmanager
def checking() -> Iterator[None]:
    """Check every simulated kernel launched inside the block; leaves the checker as it found it."""
    was = is_installed()
    install()
    try:
        yield
    finally:
        if not was:
            uninstall()


def install_from_env() -> bool:
    """Install the checker if ``NUMBA_FLASH_SIMCHECK`` asks for it and the simulator is on. The environment is
    read on the first call only, so that calling this on every launch costs a flag test. Returns whether the
    checker is installed."""
    global _env_checked
    if not _env_checked:
        _env_checked = True
        if env_requested() and _simulator_on():
            install()
    return is_installed()


def block_timeout() -> float:
    """Seconds a simulated block may run under the checker before it is reported as hung."""
    try:
        return float(os.environ.get("NUMBA_FLASH_SIMCHECK_TIMEOUT", DEFAULT_BLOCK_TIMEOUT))
    except ValueError:
        return DEFAULT_BLOCK_TIMEOUT
