"""The compile check's recorded table (numba_flash/cuda/compile_check/table.py): its fingerprint changes with the code
the kernels are built from and not with their comments, docstrings or the modules no kernel is built from, and the
table reads back what was written. Whether the table agrees with the compiler is test_cuda_compile.py's part."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from numba_flash.cuda.compile_check import table as compile_table

PACKAGE = Path(compile_table.__file__).resolve().parents[2]


@pytest.fixture
def package(tmp_path):
    """A copy of the sources the fingerprint reads, and of one module it leaves out."""
    for path in compile_table.kernel_sources(PACKAGE) + [PACKAGE / "cuda" / "host" / "launch.py"]:
        (tmp_path / path.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, tmp_path / path.relative_to(PACKAGE))
    return tmp_path


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def test_the_copy_has_the_package_fingerprint(package):
    assert compile_table.fingerprint(package) == compile_table.fingerprint()


def test_comments_and_docstrings_do_not_count(package):
    before = compile_table.fingerprint(package)
    forward = package / "cuda" / "kernels" / "forward.py"
    _edit(forward, '"""', '"""A reworded docstring. ')
    forward.write_text(forward.read_text() + "\n# a closing comment\n")
    _edit(package / "dropout.py", "def split_seed(seed: int) -> tuple[int, int]:\n",
          "def split_seed(seed: int) -> tuple[int, int]:\n    # why, not what\n")
    assert compile_table.fingerprint(package) == before


@pytest.mark.parametrize("where", ["cuda/kernels/forward.py", "cuda/host/config.py", "dropout.py", "cuda/kernels/a_new_kernel.py",
                                   "cuda/device/a_new_helper.py"])
def test_code_counts(package, where):
    before = compile_table.fingerprint(package)
    path = package / where
    path.write_text((path.read_text() if path.exists() else "") + "\nBLOCK_EXTRA = 1\n")
    assert compile_table.fingerprint(package)["kernel_code_sha256"] != before["kernel_code_sha256"]


def test_modules_no_kernel_is_built_from_do_not_count(package):
    before = compile_table.fingerprint(package)
    path = package / "cuda" / "host" / "launch.py"
    path.write_text(path.read_text() + "\nLAUNCH_EXTRA = 1\n")
    assert compile_table.fingerprint(package) == before


def test_the_table_reads_back_what_was_written(tmp_path):
    table = compile_table.load()
    assert table is not None and len(table.rows) > 100
    path = tmp_path / "table.json"
    compile_table.save(table.rows, path)
    again = compile_table.load(path)
    assert again.rows == table.rows and again.fingerprint == compile_table.fingerprint()
    assert compile_table.load(tmp_path / "missing.json") is None
    # The wgmma kernels' rows keep their target, sm_90a, as the 3-tuple the compiler takes (not sm_90's pair).
    assert {r.kernel for r in again.rows if r.cc == (9, 0, "a")} == {"wgmma_forward", "wgmma_forward+mods",
                                                                      "wgmma_forward+varlen"}
    assert '"cc": [9, 0, "a"]' in path.read_text()
