"""numba's on-disk cache of the CPU kernels, keyed by every source file they are built from.

numba invalidates a cached function when the file that defines it changes, but the kernels here inline helpers
from other files (``tiles``, ``passes``, ``microkernels``, ``numba_flash.dropout``...): edit one of those and numba
would go on loading the kernels compiled from the old helper, silently. ``stamp_kernels`` gives each kernel's cache
a stamp made from the contents of all of those files instead, so that any edit recompiles every kernel once.
The stamp also carries the vector width the kernels are written for (``simd.LANES``): numba keys its cache by
the CPU it compiles for, not by that choice, so ``NUMBA_FLASH_CPU_SIMD=256`` on an AVX-512 CPU would otherwise load
the 512-bit kernels an earlier process left and silently run them.
This sets a private attribute of numba's cache (``_cache._cache_file._source_stamp``, numba 0.5x-0.6x); where a
numba has no such attribute the kernels keep numba's own rule.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from . import simd

_HERE = Path(__file__).resolve().parent


def source_files() -> list[Path]:
    """The files the CPU kernels are compiled from: this package's modules, the dropout generator and the score
    pipeline."""
    return sorted(_HERE.glob("*.py")) + [_HERE.parent / "dropout.py", _HERE.parent / "score_pipeline.py"]


def sources_stamp() -> tuple[str, str]:
    """A stamp that changes whenever any of ``source_files`` does, or the vector width: a SHA-256 of their names
    and contents, and the width."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return ("numba_flash.cpu sources", f"{digest.hexdigest()} lanes={simd.LANES}")


_process_stamp: tuple[str, str] | None = None


def stamp_kernels(namespace: dict[str, Any]) -> list[str]:
    """Stamp the cache of every cached numba function defined in the module whose ``globals()`` is ``namespace``
    with ``sources_stamp()``, computed once per process (four modules call this on import). Returns the names
    stamped."""
    global _process_stamp
    if _process_stamp is None:
        _process_stamp = sources_stamp()
    stamp = _process_stamp
    module = namespace.get("__name__")
    stamped = []
    for name, obj in namespace.items():
        py_func = getattr(obj, "py_func", None)
        cache_file = getattr(getattr(obj, "_cache", None), "_cache_file", None)
        if py_func is None or getattr(py_func, "__module__", None) != module or cache_file is None:
            continue
        if hasattr(cache_file, "_source_stamp"):
            cache_file._source_stamp = stamp
            stamped.append(name)
    return stamped
