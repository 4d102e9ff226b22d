"""Packaging: the library works when a user's project has a ``backends`` package of its own, the licence file
matches the metadata, and the wheel carries ``py.typed``."""

from __future__ import annotations

import configparser
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def test_a_foreign_backends_package_first_on_sys_path_does_not_break_the_library(tmp_path):
    """A project of the user's with its own top-level ``backends/`` (a common name) first on sys.path: numba-flash
    still dispatches, numpy and torch alike, and the user's package is the one ``import backends`` gives."""
    fake = tmp_path / "backends"
    fake.mkdir()
    (fake / "__init__.py").write_text("MARK = 'the user project'\n")
    (fake / "cpu.py").write_text("raise ImportError('the user project has no CPU backend')\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        import numpy as np
        import backends
        assert backends.MARK == 'the user project', backends.__file__

        import numba_flash
        from numba_flash import backend_registry

        rng = np.random.default_rng(int(sys.argv[1]))
        q = rng.standard_normal((1, 9, 2, 16), dtype=np.float32)
        k = rng.standard_normal((1, 11, 1, 16), dtype=np.float32)
        v = rng.standard_normal((1, 11, 1, 16), dtype=np.float32)
        out = backend_registry.get("flash").forward(q, k, v, causal=True)
        ref = numba_flash.attention_ref(q, k, v, causal=True)[0]
        assert np.max(np.abs(out - ref)) < 1e-5
        assert "chosen: cpu" in backend_registry.get("flash").explain(q, k, v)

        import torch
        tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
        o = numba_flash.flash_attn_func(tq, tk, tv, causal=True)
        assert np.max(np.abs(o.detach().numpy() - ref)) < 1e-5
        o.sum().backward()
        assert tk.grad is not None and torch.isfinite(tk.grad).all()
        assert sys.modules["backends"].MARK == 'the user project'
        print("ok")
    """)
    seed = int(__import__("numpy").random.SeedSequence().entropy % 2**32)
    proc = subprocess.run([sys.executable, "-c", code, str(seed)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (seed, proc.stdout + proc.stderr)


def test_old_import_paths_give_the_library_s_own_objects():
    """``backends.*`` stays importable and is the very modules the library uses (one Backend class, not two)."""
    import backends
    import backends.base
    import backends.cpu
    import numba_flash.backend_registry
    import numba_flash.backends.base
    import numba_flash.backends.cpu
    from backends import backend_registry

    assert backend_registry is numba_flash.backend_registry
    assert backends.base.Backend is numba_flash.backends.base.Backend
    assert backends.cpu.CpuBackend is numba_flash.backends.cpu.CpuBackend
    cpu = next(b for b in backend_registry.backends("flash") if b.name == "cpu")
    assert isinstance(cpu, backends.base.Backend)


def test_licence_file_matches_the_metadata():
    text = (REPO / "LICENSE").read_text()
    assert _setup_cfg()["metadata"]["license"] == "BSD-3-Clause"
    assert text.startswith("BSD 3-Clause License")
    assert "the numba-flash developers" in text.splitlines()[2]
    assert "Neither the name of the copyright holder" in text   # the third clause, which BSD-2 lacks


def test_wheel_carries_licence_type_marker_and_classifiers(tmp_path):
    """Built from a copy of the tree (the build writes build/ and egg-info next to its sources)."""
    import shutil
    import zipfile

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    src = tmp_path / "src"
    for name in files:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("numba_flash-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "numba_flash/py.typed" in names
    assert "numba_flash/backends/__init__.py" in names and "backends/__init__.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names), names
    assert "BSD-3-Clause" in metadata
    for minor in (10, 11, 12, 13):
        assert f"Classifier: Programming Language :: Python :: 3.{minor}\n" in metadata
    assert "Classifier: Typing :: Typed" in metadata
    assert "Requires-Python: >=3.10" in metadata


def test_readme_and_docs_point_at_things_that_exist():
    """Every `make` target, local link and numba-flash subcommand the README and the docs pages name exists."""
    import re

    pages = [REPO / "README.md"] + [p for p in (REPO / "docs").rglob("*.md") if "gpu-runs" not in p.parts]
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z0-9-]+):", makefile, flags=re.M))
    named: set[str] = set()
    subs: list[str] = []
    for page in pages:
        text = page.read_text()
        named |= set(re.findall(r"`make ([a-z0-9-]+)", text)) | set(re.findall(r"^make ([a-z0-9-]+)", text, re.M))
        for link in re.findall(r"\]\(([^)#:]+)\)", text):
            assert (page.parent / link).exists(), (page, link)
        # In commands only: a code line or a backticked span that starts with the command.
        subs += re.findall(r"(?:^|`)numba-flash ([a-z]+)\b", text, flags=re.M)
    assert {"bench", "test", "dashboard", "dashboard-assets", "install", "docs"} <= named, named
    assert named <= targets, named - targets
    # The README itself gives the two commands a fresh machine needs (CI runs the README's `make test`).
    readme = (REPO / "README.md").read_text()
    assert "make bench" in readme and "make test" in readme
    from numba_flash.cli import SUBCOMMANDS

    assert {"bench", "warmup", "explain"} <= set(subs), subs
    assert set(subs) <= set(SUBCOMMANDS), subs
