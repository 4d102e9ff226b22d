"""Shared by the simulator tests of the first-use self-check (``tests/numba_flash/cuda/test_selfcheck_sim.py``,
``test_selfcheck_varlen_sim.py``, ``test_decode_selfcheck_sim.py``, ``test_dbias_sim.py``): the check switched on
with one toy fallback config, and kernel factories that hand out spoiled kernels.
Imported by the test files (pytest puts ``tests/`` on sys.path).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np


def checked_runs(monkeypatch: Any, fallback: tuple[int, int, int]) -> Iterator[list]:
    """For a fixture: the check on, verdicts fresh, ``fallback`` (block_m, block_n, threads) the only fallback
    config; yields the list of specialisations the check actually runs."""
    from numba_flash.cuda import selfcheck

    monkeypatch.setenv(selfcheck.ENV_VAR, "1")
    monkeypatch.setattr(selfcheck, "FALLBACK_TILES", (fallback,))
    selfcheck.reset()
    seen = []
    real = selfcheck._run

    def counted(spec, like):
        seen.append(spec)
        return real(spec, like)

    monkeypatch.setattr(selfcheck, "_run", counted)
    yield seen
    selfcheck.reset()


def tiles(cfg: Any) -> tuple[int, int, int]:
    """(block_m, block_n, threads) of a tile config."""
    return (cfg.block_m, cfg.block_n, cfg.threads)


class _Spoiled:
    """Launches like a kernel: runs the real one, then scales argument ``out_arg`` by 1.001 (or adds 0.001 to it,
    ``how="shift"``: a sum that should be about 0 barely moves when scaled), or raises instead of running
    (``how="raise"``)."""

    def __init__(self, kernel: Any, out_arg: int, how: str):
        self.kernel, self.out_arg, self.how = kernel, out_arg, how

    def __getitem__(self, launch_config: Any) -> Callable[..., None]:
        def run(*args):
            if self.how == "raise":
                raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED (pretend)")
            self.kernel[launch_config](*args)
            out = args[self.out_arg]
            host = out.copy_to_host()
            out[...] = host + np.float32(0.001) if self.how == "shift" else host * np.float32(1.001)
        return run


def spoil(monkeypatch: Any, factory_name: str, out_arg: int, which: Callable[[Any, dict], bool],
          how: str = "scale") -> None:
    """Make the kernel factory ``factory_name`` (where ``cuda_sim_cases.factory_home`` finds it) hand out, for the builds
    ``which(cfg, factory keywords)`` picks, a kernel that spoils argument ``out_arg`` after running (or raises,
    ``how="raise"``); every other build is real."""
    from cuda_sim_cases import factory_home

    module = factory_home(factory_name)
    real = getattr(module, factory_name)

    def factory(cfg, *flags, **kw):
        kernel = real(cfg, *flags, **kw)
        return _Spoiled(kernel, out_arg, how) if which(cfg, kw) else kernel

    monkeypatch.setattr(module, factory_name, factory)
