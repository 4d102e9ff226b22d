"""The kernel registry: one entry per kernel, the only place a kernel's name is written, light to import, and
what the tile configs, the picker, the plan and the compile check read."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from numba_flash.cuda.host.config import FlashAttentionConfig
from numba_flash.cuda.host.picker import TileOverride, tile_config_for
from numba_flash.cuda.kernels.registry import AUX_KERNELS, REGISTRY, SPECS, find, kernel_name, kernel_spec, names
from numba_flash.cuda.kernels.spec import KINDS, ROLE_ARRAYS

ROOT = Path(__file__).resolve().parents[3]
ROLES = set(ROLE_ARRAYS) | {"decode"}


def _string_constants(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string literal in ``path`` that is not a docstring."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
            docstrings.add(id(body[0].value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def kernel_names_written_outside_the_registry(root: Path = ROOT) -> list[str]:
    """Where a registered kernel's name is a string literal in numba_flash/ or backends/ outside registry.py.
    Names that are also a role's ("forward", "decode": the SIMT forward and the decode kernel share their role's
    name) cannot be told from the role, so they are not looked for."""
    wanted = (set(REGISTRY) | set(AUX_KERNELS)) - ROLES
    registry_file = root / "numba_flash" / "cuda" / "kernels" / "registry.py"
    found = []
    for folder in ("numba_flash", "backends"):
        for path in sorted((root / folder).rglob("*.py")):
            if path == registry_file:
                continue
            found += [f"{path.relative_to(root)}:{line}: {value!r}" for line, value in _string_constants(path)
                      if value in wanted]
    return found


def test_a_kernel_name_is_written_only_in_its_registry_entry():
    assert kernel_names_written_outside_the_registry() == []


def test_the_name_scan_finds_a_name_written_elsewhere(tmp_path):
    # The bug the test above is for, planted in a copy of a module: a kernel chosen by its name.
    (tmp_path / "numba_flash" / "cuda" / "kernels").mkdir(parents=True)
    (tmp_path / "backends").mkdir()
    name = kernel_name("dkdv", "mma")
    (tmp_path / "backends" / "planted.py").write_text(f'"""doc {name}"""\nKERNEL = "{name}"\n')
    assert kernel_names_written_outside_the_registry(tmp_path) == [f"backends/planted.py:2: {name!r}"]


def test_every_role_and_kind_names_one_kernel_and_every_name_one_spec():
    pairs = [(spec.role, spec.kind) for spec in SPECS]
    assert len(pairs) == len(set(pairs)) and len(REGISTRY) == len(SPECS)
    for spec in SPECS:
        assert spec.kind in KINDS and spec.role in ROLES
        assert find(spec.role, spec.kind) is spec and kernel_spec(spec.name) is spec
    assert set(names()) == set(REGISTRY)
    assert sorted(name for kind in KINDS for name in names(kind=kind)) == sorted(REGISTRY)
    with pytest.raises(ValueError, match="expected one of"):
        kernel_spec("no_such_kernel")
    with pytest.raises(ValueError, match="no tf32 kernel of role 'dq'"):
        find("dq", "tf32")


def test_every_entry_builds_from_its_own_file_and_refuses_another_kernels_config():
    import importlib

    for spec in SPECS:
        home = importlib.import_module(f"numba_flash.cuda.kernels.{spec.module}")
        assert callable(home.build)
        other = next(s for s in SPECS if s is not spec)
        cfg = tile_config_for(64, other.dtypes[0], (9, 0), kernel=other.name, override=TileOverride())
        with pytest.raises(ValueError, match=f"expected a {spec.name} tile config"):
            spec.build(cfg, None)
    for aux in AUX_KERNELS.values():
        assert callable(getattr(importlib.import_module(f"numba_flash.cuda.kernels.{aux.module}"), aux.factory))


def test_the_picker_serves_each_entrys_tiles_and_head_dims():
    for spec in SPECS:
        for bucket, (bm, bn, nt) in spec.tiles.items():
            cfg = tile_config_for(bucket, spec.dtypes[0], (9, 0), kernel=spec.name, override=TileOverride())
            assert cfg == FlashAttentionConfig(spec.name, bm, bn, nt, bucket) and cfg.spec is spec
            assert cfg.smem_floats() == spec.smem_words(cfg)
        if spec.max_head_dim < 576:
            from numba_flash.errors import AttentionInputError

            with pytest.raises(AttentionInputError, match=f"{spec.name} kernel takes D <= {spec.max_head_dim}"):
                tile_config_for(spec.max_head_dim + 1, spec.dtypes[0], (9, 0), kernel=spec.name)
        # Only kernels with tiles past 48 KiB may take dynamic shared memory.
        assert spec.dynamic_smem == bool(spec.wide_tiles)


def test_the_registry_the_tile_configs_and_the_plan_import_no_numba_cuda():
    code = ("import sys\n"
            "import numba_flash.cuda.kernels.registry, numba_flash.cuda.host.config, numba_flash.cuda.host.picker\n"
            "import numba_flash.cuda.host.plan\n"
            "print(sorted(m for m in sys.modules if m == 'numba.cuda' or m.startswith('numba.cuda.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout
