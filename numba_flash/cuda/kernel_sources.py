"""What the CUDA kernels are compiled from, as one fingerprint: the code of every module a kernel is built from
(parsed, so comments and docstrings do not count) and the versions of Python and of the compiler toolchain.

Two things key on it: the compile check's recorded table (compile_check/table.py), and the compiled kernels kept on
disk (host/kernel_cache.py); it lives here, beside neither, because the runtime does not import the tooling.
"""

from __future__ import annotations

import ast
import hashlib
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parents[1]
#: What the kernels are built from, inside numba_flash/cuda: the kernel factories and their device helpers (these
#: folders, whatever files they gain), and the tile geometry and picker that decide which specialisations exist.
#: The runtime (host launches, self-checks) and the tooling (the compile check, the model, the simulator checker)
#: do not count.
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
