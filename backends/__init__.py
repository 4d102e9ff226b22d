"""Where attention runs: the registry (``backends.backend_registry``) and one module per backend.

The modules of this directory are imported as ``numba_flash.backends.<name>`` (see that package for why) and the
registry as ``numba_flash.backend_registry``; this package hands out those same module objects under their old
names, so ``from backends import backend_registry`` and ``from backends.base import Backend`` keep working and
give the classes the library itself uses. Importing this package imports neither torch nor numba.cuda; a backend
module imports its device library on first use.
"""

import importlib
import sys

from numba_flash import backend_registry
from numba_flash import backends as _builtin

sys.modules[__name__ + ".backend_registry"] = backend_registry
for _name in _builtin.BUILTIN_MODULES:
    # Loaded once, as numba_flash.backends.<name>; a second copy under this name would define a second Backend.
    _module = importlib.import_module(f"numba_flash.backends.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module
del _name, _module

__all__ = ["backend_registry"]
