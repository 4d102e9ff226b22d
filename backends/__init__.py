"""Where attention runs: the registry (``backends.backend_registry``) and one module per backend.

Importing this package imports neither torch nor numba.cuda; a backend module imports its device library on
first use.
"""

from . import backend_registry

__all__ = ["backend_registry"]
