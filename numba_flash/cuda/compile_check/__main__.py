"""``python -m numba_flash.cuda.compile_check``: see the package's docstring."""

import sys

from numba_flash.cuda.compile_check import main

sys.exit(main())
