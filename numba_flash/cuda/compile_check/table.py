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

import ast
import hashlib
import json
import sys
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from numba_flash.cuda.compile_check.resources import KernelResources
from numba_flash.cuda.host.config import FlashAttentionConfig

TABLE_PATH = Path(__file__).with_name("compile_table.json")
_PACKAGE = Path(__file__).resolve().parents[2]
#: What the kernels are built from, inside numba_flash/cuda: the kernel factories and their device helpers (these
#: folders, whatever files they gain), and the tile geometry and picker that decide which specialisations exist.
#: The runtime (host launches, self-checks) and the tooling (this package, the model, the simulator checker) do not
#: count.
KERNEL_SOURCE_DIRS = ("kernels", "device")
KERNEL_SOURCE_FILES = ("host/config.py", "host/picker.py")
#: Modules outside numba_flash/cuda that kernels compile code from (dropout's Philox, a BlockMask's tile states,
#: the score pipeline).
OTHER_KERNEL_SOURCES = ("dropout.py", "mods.py", "score_pipeline.py")
TOOLCHAIN = ("numpy", "numba", "llvmlite", "numba-cuda", "cuda-bindings", "nvidia-nvjitlink", "nvidia-nvvm")


def kernel_sources(package: Path = _PACKAGE) -> list[Path]:
    """The source files the kernels and the compile check are built from, in a fixed order."""
    cuda = package / "cuda"
    found = sorted(p for folder in KERNEL_SOURCE_DIRS for p in (cuda / folder).glob("*.py"))
    return found + [cuda / name for name in KERNEL_SOURCE_FILES] + [package / name for name in OTHER_KERNEL_SOURCES]


def _code(path: Path) -> str:
    """The module's syntax tree without docstrings or line numbers: what compiles, not how it is commented."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def toolchain_versions(distributions: tuple[str, ...] = TOOLCHAIN) -> dict[str, str | None]:
    """The installed version of each distribution (None where it is missing)."""
    found: dict[str, str | None] = {}
    for name in distributions:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def fingerprint(package: Path = _PACKAGE) -> dict[str, Any]:
    """What the compile check's results depend on: the kernels' code (a hash) and the toolchain's versions."""
    digest = hashlib.sha256()
    for path in kernel_sources(package):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + _code(path).encode() + b"\0")
    return {"python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "toolchain": toolchain_versions(),
            "kernel_code_sha256": digest.hexdigest()}


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
