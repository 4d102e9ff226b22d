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
