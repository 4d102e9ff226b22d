"""Keeps numba-cuda working with numpy releases newer than it knows.

numba-cuda 0.30.4 (the newest release as of 2026-11) registers an overload for ``np.row_stack`` when it first
compiles a kernel; numpy 2.5 removed that alias of ``np.vstack``, so every kernel compile then fails with
``AttributeError: module 'numpy' has no attribute 'row_stack'`` (seen on an H200 with numpy 2.5.2; numba itself
guards the same line by numpy version). Until numba-cuda does too, the alias is put back, pointing where it always
pointed, before any kernel is compiled. Nothing else in numpy is touched, and nothing at all on numpy < 2.5.
"""

from __future__ import annotations

import numpy as np


def restore_row_stack() -> bool:
    """Give numpy back ``row_stack = vstack`` where it lacks it; True if it had to."""
    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    return True
