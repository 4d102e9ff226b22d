"""numba-flash's built-in backends (``base``, ``cpu``, ``cuda``, ``rocm``; ``varlen`` and ``kvcache``, their
shared drivers for packed sequences and KV-cache decoding; ``cuda_io``, the cuda backend's arrays) under a name the
library owns.

The modules themselves live in the top-level ``backends`` directory installed beside ``numba_flash``, where users
and third-party backends know them as ``backends.cpu``, ``backends.base`` and so on. The library never imports them
by that name: a project with a ``backends`` package of its own first on ``sys.path`` would hide ours, and every
call would fail to find a backend. This package's ``__path__`` points at that directory instead, found from this
file's location, so ``numba_flash.backends.cpu`` is ours whatever ``sys.path`` holds; the top-level ``backends``
package, when it is ours, hands out these same module objects (one ``Backend`` class, not two).
"""

from __future__ import annotations

import os

BUILTIN_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "backends")
__path__.append(BUILTIN_DIR)  # noqa: F821 -- a package's __path__ is defined by the import system

BUILTIN_MODULES = ("base", "varlen", "kvcache", "cpu", "cuda_io", "cuda", "rocm")
