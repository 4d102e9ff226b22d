"""numba-cuda 0.30.4 with numpy >= 2.5: its array lowering registers ``np.row_stack``, which numpy 2.5 removed, so
every kernel compile failed on an H200 whose image had numpy 2.5.2 (2026-11-27) and the cuda backend declined every
call. ``numba_flash.cuda`` puts the alias back before anything compiles. Our CI's numpy (2.4) still has it, so the
tests take it away in a fresh interpreter to reproduce the newer numpy."""

import subprocess
import sys

import pytest

pytest.importorskip("numba.cuda")

WITHOUT_ROW_STACK = "import numpy as np\ndel np.row_stack\n"
# What a kernel compile imports first (numba-cuda's array lowering), without needing a GPU.
LOWERING = "import numba.cuda.np.arrayobj\n"


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_numba_flash_cuda_restores_row_stack_before_numba_cuda_lowers_arrays():
    done = _run(WITHOUT_ROW_STACK + "import numba_flash.cuda\n" + LOWERING +
                "assert np.row_stack is np.vstack\nprint('lowered')\n")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lowered" in done.stdout


def test_without_it_numba_cuda_fails_on_such_a_numpy():
    # The control: the same interpreter state without numba_flash.cuda. When a numba-cuda release guards its
    # row_stack line by numpy version (as numba does), this skips, and compat.py can go.
    done = _run(WITHOUT_ROW_STACK + LOWERING)
    if done.returncode == 0:
        pytest.skip("this numba-cuda no longer needs np.row_stack: numba_flash/cuda/compat.py can be removed")
    assert "row_stack" in done.stderr


def test_nothing_changes_where_numpy_has_row_stack():
    from numba_flash.cuda.compat import restore_row_stack
    import numpy as np

    before = np.row_stack
    assert restore_row_stack() is False
    assert np.row_stack is before
