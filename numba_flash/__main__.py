"""``python -m numba_flash``: the ``numba-flash`` command (bench, warmup, explain)."""

import sys

from .cli import main

sys.exit(main())
