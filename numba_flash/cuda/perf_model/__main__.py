"""``python -m numba_flash.cuda.perf_model``: see the package's docstring."""

import sys

from numba_flash.cuda.perf_model import main

sys.exit(main())
