"""``python -m numba_flash.bench``: the bench (or, given as the first argument, another ``numba-flash``
subcommand)."""

import sys

from ..cli import bench_main

sys.exit(bench_main())
