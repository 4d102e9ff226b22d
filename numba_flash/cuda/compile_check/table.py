"""The compile check's results, recorded beside what they depend on, so that the test suite need not lower every
kernel specialisation on every run.

``compile_check.check_all`` lowers about 150 specialisations through numba and NVVM (a quarter of an hour of CI's
two cores). Its results depend only on the kernels' code and on the toolchain, so ``compile_table.json`` keeps them
with a fingerprint of both: the code of every module the kernels are built from (``kernel_sources``; parsed, so
comments and docstrings do not count) and the versions of Python, numpy, numba, llvmlite, numba-cuda and the CUDA
compiler packages. The test suite uses the table while its fingerprint matches and recompiles a random sample of its
rows to prove it still reads what the compiler says; otherwise it compiles everything, as before.

    python -m numba_flash.cuda.compile_check --write-table    # compile everything, check it, record it
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from numba_flash.cuda.compile_check.resources import KernelResources
from numba_flash.cuda.host.config import FlashAttentionConfig
# The fingerprint is the runtime's too (the kernel cache keys on it), so it lives outside the tooling.
from numba_flash.cuda.kernel_sources import (  # noqa: F401  (re-exported: the table's users read them here)
    KERNEL_SOURCE_DIRS, KERNEL_SOURCE_FILES, OTHER_KERNEL_SOURCES, TOOLCHAIN, fingerprint, kernel_sources,
    toolchain_versions)

TABLE_PATH = Path(__file__).with_name("compile_table.json")


def row_to_dict(row: KernelResources) -> dict[str, Any]:
    d = asdict(row)
    d["cc"] = list(row.cc)
    return d


def row_from_dict(d: dict[str, Any]) -> KernelResources:
    d = dict(d)
    d["cc"] = tuple(d["cc"])
    d["config"] = FlashAttentionConfig(**d["config"]) if d["config"] else None
    return KernelResources(**d)


@dataclass(frozen=True)
class Table:
    fingerprint: dict[str, Any]
    rows: list[KernelResources]

    def current(self) -> bool:
        """Whether the kernels' code and the toolchain are still those the rows were compiled with."""
        return self.fingerprint == fingerprint()


def save(rows: list[KernelResources], path: Path = TABLE_PATH) -> None:
    """Record ``rows`` (all of ``check_all()``'s, nothing narrowed) with today's fingerprint."""
    # One row per line, so that a kernel change shows in a diff as the rows it changed.
    lines = ",\n".join("  " + json.dumps(row_to_dict(r)) for r in rows)
    text = f'{{"fingerprint": {json.dumps(fingerprint())},\n "rows": [\n{lines}\n]}}\n'
    path.write_text(text, encoding="utf-8")


def load(path: Path = TABLE_PATH) -> Table | None:
    """The recorded table, or None where there is none."""
    if not path.exists():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return Table(data["fingerprint"], [row_from_dict(d) for d in data["rows"]])
