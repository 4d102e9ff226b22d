"""Say so when numba-flash's kernels compile, instead of sitting silent for minutes.

With a cold cache the CPU kernels take about 2 minutes per dtype to compile on first use (``numba-flash warmup``
with the 2-vCPU Intel VM to itself, 2026-11-28: float32 119 s, float64 102 s; 188 s and 210 s before the kernels'
parallel loops called their workers, ``cpu.forward._forward_worker``); numba then caches them on disk
(``__pycache__`` beside the sources, or ``NUMBA_CACHE_DIR``) and later processes load them in a fraction of a
second. The first compilation of a CPU kernel in a process (and likewise of a CUDA kernel) logs one INFO line on the
``numba_flash`` logger and prints one note on stderr naming it; the 2-minute estimate is given only there, for the
CPU kernel set. numba-flash's small helpers (``mods``' evaluation loops, ``block_mask``'s tile states: a fraction
of a second each) print nothing, since no estimate of the kernels is true of them. Every compiled function then logs
its time at INFO.

The trigger is numba's own ``numba:compile`` event, which numba fires only for a real compilation, never for a
load from its cache, so a warm cache prints nothing. ``NUMBA_FLASH_QUIET=1`` (or ``quiet()``) drops the stderr
note; the log lines stay. ``numba-flash warmup`` compiles everything ahead of time (``numba_flash.warmup``).

``install()`` registers the listener; ``numba_flash.cpu`` calls it on import, before anything can compile.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any

QUIET_ENV = "NUMBA_FLASH_QUIET"
NOTE = ("numba-flash: compiling the CPU kernels for this machine, starting with {name} (first use with a cold "
        "cache; the full set takes about 2 min per dtype on 2 cores, once: numba caches it on disk). "
        "`numba-flash warmup` compiles everything ahead of time; {quiet}=1 silences this note.")
CUDA_NOTE = "numba-flash: compiling the CUDA kernels for this GPU, starting with {name}; {quiet}=1 silences this note."

logger = logging.getLogger("numba_flash")

_lock = threading.Lock()
_state: dict[str, Any] = {"installed": False, "announced": set(), "quiet": False, "compiled": []}


def quiet(value: bool = True) -> None:
    """Drop (or, with False, restore) the stderr note for the rest of the process; the INFO log lines stay."""
    _state["quiet"] = value


def compiled() -> list[tuple[str, float]]:
    """``(function, seconds)`` for every numba-flash function compiled (not loaded from cache) in this process."""
    with _lock:
        return list(_state["compiled"])


def _ours(event: Any) -> str | None:
    """The qualified name of the numba-flash function this compile event is for, or None for anyone else's."""
    dispatcher = (event.data or {}).get("dispatcher")
    func = getattr(dispatcher, "py_func", None)
    module = getattr(func, "__module__", "") or ""
    if module == "numba_flash" or module.startswith("numba_flash."):
        return f"{module}.{func.__qualname__}"
    return None


def _is_quiet() -> bool:
    return _state["quiet"] or os.environ.get(QUIET_ENV, "") not in ("", "0")


def announce(text: str) -> None:
    """Log ``text`` at INFO and print it on stderr unless quiet: for compilations numba cannot cache, e.g. the
    hooks built around a user's mods (``numba_flash.cpu.modhooks``), which the cold-cache note does not cover."""
    logger.info("%s", text)
    if not _is_quiet():
        print(text, file=sys.stderr, flush=True)


def _what(name: str) -> str | None:
    """Which kernel set the function ``name`` belongs to ("CPU kernels", "CUDA kernels"), or None for a helper."""
    if name.startswith("numba_flash.cpu."):
        return "CPU kernels"
    if name.startswith("numba_flash.cuda."):
        return "CUDA kernels"
    return None


def note_for(name: str) -> str | None:
    """The stderr note for the first compilation of numba-flash's function ``name`` in its kernel set, naming it;
    None for a helper, which is only logged."""
    what = _what(name)
    if what is None:
        return None
    return (NOTE if what == "CPU kernels" else CUDA_NOTE).format(name=name, quiet=QUIET_ENV)


def _install_listener() -> None:
    from numba.core import event

    class _Listener(event.Listener):
        def __init__(self) -> None:
            self._started: dict[int, float] = {}

        def on_start(self, ev: Any) -> None:
            name = _ours(ev)
            if name is None:
                return
            self._started[id(ev.data)] = time.perf_counter()
            if name.endswith("[mods]"):   # a mod's hooks: announced by modhooks; never in numba's disk cache
                return
            what = _what(name)
            if what is None:   # a helper: its time is logged at the end, and no kernel estimate is true of it
                return
            with _lock:
                first = what not in _state["announced"]
                _state["announced"].add(what)
            if first:
                logger.info("compiling %s (%s): first use with a cold numba cache", what, name)
                if not _is_quiet():
                    print(note_for(name), file=sys.stderr, flush=True)

        def on_end(self, ev: Any) -> None:
            name = _ours(ev)
            start = self._started.pop(id(ev.data), None)
            if name is None or start is None:
                return
            seconds = time.perf_counter() - start
            with _lock:
                _state["compiled"].append((name, seconds))
            logger.info("compiled %s in %.1f s", name, seconds)

    event.register("numba:compile", _Listener())


def install() -> None:
    """Listen for numba compiling numba-flash's functions; idempotent, cheap after the first call."""
    if _state["installed"]:
        return
    with _lock:
        if _state["installed"]:
            return
        _install_listener()
        _state["installed"] = True
