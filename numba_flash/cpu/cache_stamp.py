"""numba's on-disk cache of the CPU kernels, keyed by every source file they are built from.

numba invalidates a cached function when the file that defines it changes, but the kernels here inline helpers
from other files (``tiles``, ``passes``, ``microkernels``, ``numba_flash.dropout``...): edit one of those and numba
would go on loading the kernels compiled from the old helper, silently. ``stamp_kernels`` gives each kernel's cache
a stamp made from the contents of all of those files instead, so that any edit recompiles every kernel once.
This sets a private attribute of numba's cache (``_cache._cache_file._source_stamp``, numba 0.5x-0.6x); where a
numba has no such attribute the kernels keep numba's own rule.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def source_files() -> list[Path]:
    """The files the CPU kernels are compiled from: this package's modules, the dropout generator and the score
    pipeline."""
    return sorted(_HERE.glob("*.py")) + [_HERE.parent / "dropout.py", _HERE.parent / "score_pipeline.py"]


def sources_stamp() -> tuple[str, str]:
    """A stamp that changes whenever any of ``source_files`` does: a SHA-256 of their names and contents."""
    digest = hashlib.sha256()
    for path in source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return ("numba_flash.cpu sources", digest.hexdigest())


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
