"""First use: a cold numba cache says so (once), ``warmup`` makes every CPU kernel ready, and the per-thread
scratch the CPU kernels keep has a cap that can be set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

from numba_flash import compile_notice

REPO = Path(__file__).resolve().parents[2]

# A real numba-flash kernel (the smallest: about 2 s to compile) and a trivial function that numba-flash's listener
# takes for one of its own, each compiled in a fresh process. The log goes to stdout, the note to stderr.
PROBE = textwrap.dedent("""
    import logging, sys
    import numba, numpy as np
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="LOG %(name)s %(message)s")
    from numba_flash.cpu import workspace
    if "kernel" in sys.argv[1:]:
        workspace.kernel_entry(workspace._pack_kernel, np.float32)
    def probe(x):
        return x + 1
    probe.__module__ = "numba_flash.probe"
    assert numba.njit(probe)(41) == 42
""")


def _run(cache_dir: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != compile_notice.QUIET_ENV}
    full_env.update(NUMBA_CACHE_DIR=str(cache_dir), PYTHONPATH=str(REPO), **env)
    proc = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_a_cold_cache_says_so_once_and_a_warm_one_says_nothing(tmp_path):
    cold = _run(tmp_path, "kernel")
    assert cold.stderr.count("numba-flash: compiling the CPU kernels") == 1, cold.stderr   # two compiles, one note
    assert "starting with numba_flash.cpu.workspace._pack_kernel" in cold.stderr, cold.stderr   # what compiles
    assert "numba-flash warmup" in cold.stderr and compile_notice.QUIET_ENV in cold.stderr
    assert cold.stdout.count("LOG numba_flash compiling CPU kernels") == 1, cold.stdout
    assert "LOG numba_flash compiled numba_flash.cpu.workspace._pack_kernel in" in cold.stdout
    assert "LOG numba_flash compiled numba_flash.probe.probe in" in cold.stdout

    warm = _run(tmp_path, "kernel")   # the kernel now loads from the cache: only the uncached probe compiles
    assert "compiled numba_flash.cpu.workspace._pack_kernel" not in warm.stdout, warm.stdout
    assert "compiled numba_flash.probe.probe in" in warm.stdout


def test_quiet_drops_the_note_but_keeps_the_log(tmp_path):
    proc = _run(tmp_path, "kernel", **{compile_notice.QUIET_ENV: "1"})
    assert "numba-flash: compiling" not in proc.stderr, proc.stderr
    assert "LOG numba_flash compiling CPU kernels" in proc.stdout, proc.stdout


def test_a_helper_compiling_is_not_announced_as_the_kernels(tmp_path):
    """A small numba-flash function (block_mask's tile states, a mod's evaluation loop: a fraction of a second)
    compiling alone, with the kernels loaded from the cache or not used, was announced as the CPU kernels' "about
    2 min per dtype". It is logged with its time, and nothing is printed."""
    proc = _run(tmp_path)
    assert "numba-flash: compiling" not in proc.stderr, proc.stderr
    assert "compiling CPU kernels" not in proc.stdout, proc.stdout
    assert "LOG numba_flash compiled numba_flash.probe.probe in" in proc.stdout, proc.stdout


def test_the_note_names_what_compiles_and_estimates_only_the_kernel_set():
    cpu = compile_notice.note_for("numba_flash.cpu.forward._forward_kernel")
    assert "CPU kernels" in cpu and "_forward_kernel" in cpu and "2 min per dtype" in cpu, cpu
    cuda = compile_notice.note_for("numba_flash.cuda.kernels.forward.flash_fwd")
    assert "CUDA kernels" in cuda and "flash_fwd" in cuda and "min" not in cuda, cuda
    for helper in ("numba_flash.mods._tile_states", "numba_flash.mods._index_block", "numba_flash.probe.probe"):
        assert compile_notice.note_for(helper) is None, helper


def test_warmup_makes_every_parallel_kernel_ready(rng):
    """Every ``parallel=True`` kernel of the CPU module is compiled or loaded for float32 after a warmup, the
    attention kernels also in their variant for mods, and the warmup checked its results against the reference."""
    from numba_flash.cpu import backward, forward, workspace
    from numba_flash.warmup import warmup

    lines: list[str] = []
    (step,) = warmup(["float32"], mods=True, report=lines.append, seed=int(rng.integers(2**32)))
    assert step.dtype == "float32" and step.ok and 0 <= step.max_err < 1e-4 and step.seconds > 0
    assert lines[-1] == step.describe() and "float32: forward and backward ready in" in lines[-1]
    parallel = {name for module in (forward, backward, workspace) for name, obj in vars(module).items()
                if isinstance(obj, numba.core.registry.CPUDispatcher) and obj.targetoptions.get("parallel")}
    assert len(parallel) >= 4, parallel
    ready = {(kernel.py_func.__name__, hooks) for kernel, dtype, hooks in workspace._entries
             if np.dtype(dtype) == np.float32}
    assert {(name, False) for name in parallel} <= ready, parallel
    # and the variant of the forward and backward kernels that runs any mods (``modhooks``)
    assert {name for name, hooks in ready if hooks} == {"forward_kernel", "backward_kv_kernel",
                                                       "backward_dq_kernel"}, ready
    with pytest.raises(ValueError, match="float16"):
        warmup(["float16"])


def test_scratch_cap_is_settable_and_frees_what_it_no_longer_allows(rng):
    from numba_flash import backend_registry
    from numba_flash.cpu import clear_workspace, set_workspace_limit, workspace_bytes

    op = backend_registry.get("flash", backend="cpu")
    q = rng.standard_normal((1, 512, 4, 40), dtype=np.float32)   # packed K, V: 4 x 512 x 48 x 4 B = 384 KiB each
    k, v = (rng.standard_normal((1, 512, 4, 40), dtype=np.float32) for _ in range(2))
    previous = set_workspace_limit(256 << 10)
    try:
        clear_workspace()
        op.forward(q, k, v)
        assert workspace_bytes() < 2 * (384 << 10), workspace_bytes()       # K and V were not kept
        assert set_workspace_limit(64 << 20) == 256 << 10
        op.forward(q, k, v)
        assert workspace_bytes() >= 2 * (384 << 10), workspace_bytes()      # now they are
        set_workspace_limit(100 << 10)
        assert workspace_bytes() <= 100 << 10                                # and dropped at once
        with pytest.raises(ValueError):
            set_workspace_limit(-1)
    finally:
        set_workspace_limit(previous)
        clear_workspace()


def test_scratch_cap_from_the_environment():
    code = "from numba_flash.cpu import workspace; print(workspace.WORKSPACE_MAX_BYTES)"
    env = dict(os.environ, PYTHONPATH=str(REPO), NUMBA_FLASH_CPU_SCRATCH_MIB="0.5")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert int(out.stdout) == 512 << 10
    env["NUMBA_FLASH_CPU_SCRATCH_MIB"] = "lots"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "NUMBA_FLASH_CPU_SCRATCH_MIB: expected a number of MiB" in bad.stderr
