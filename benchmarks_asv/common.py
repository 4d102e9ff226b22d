"""Shared pieces of the asv suite: the seed sizes, the parameter grid, one ``Target`` per backend or peer, and the
base class whose ``setup`` skips (raises ``NotImplementedError``) what this machine cannot run, as scipy's
``benchmarks/common.py`` does. A ``Target`` is ``numba_flash.bench``'s own case, inputs, runner and clock, so asv
and ``numba-flash bench`` call and time attention the same way.

asv starts one process per benchmark and parameter combination, so everything a skip needs is decided from cheap
facts (device nodes, the grid rules below) before numpy, numba or torch is imported.

Every backend and peer is a parameter on every machine (cpu, cuda, rocm, numpy_naive, torch_sdpa), so that results
from different machines line up; one this machine cannot run (no GPU, numba-cuda missing, a dtype it lacks) skips
in ``setup`` with the reason, which costs a process start (about 0.2 s) per point. The dtypes follow the machine,
because low precision on the host would cost far more than skips: float32, float16, bfloat16 and tf32 (float32
inputs with ``precision="tf32"``: the cuda backend's TF32 forward, torch with allow_tf32; skipped elsewhere) on a
GPU machine, float32 alone on a host-only one (``NUMBA_FLASH_ASV_DTYPES`` adds the others).

Environment variables:
  NUMBA_FLASH_ASV_CONFIGS    comma-separated configs (default: all seven), e.g. ``tiny`` for CI.
  NUMBA_FLASH_ASV_BACKENDS   comma-separated backends (default: all five), e.g. ``cpu,numpy_naive`` for a quick look.
  NUMBA_FLASH_ASV_DTYPES     comma-separated dtypes, overriding the machine's default (e.g. ``float32,float16``).
  NUMBA_FLASH_ASV_FULL=1     lift the CPU budget below.

CPU budget (so that ``asv run`` of the whole suite stays under 10 minutes on a 2-core machine): on the host,
float16 and bfloat16 run only on the sizes up to ``llama_small``, and numpy naive attention in float16 (numpy has no
float16 BLAS) only on ``tiny`` and ``small``; and on a machine without a GPU the accuracy table leaves out s4096,
whose float64 reference alone takes about a minute.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

# (batch, nheads, seqlen, headdim), as in numba_flash.bench (kept here so the suite runs against old commits too).
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 4, 8, 64),
    "small": (2, 4, 64, 64),
    "medium": (2, 8, 128, 64),
    "llama_small": (1, 12, 256, 64),
    "llama_med": (1, 32, 512, 128),
    "s2048": (1, 8, 2048, 64),
    "s4096": (1, 8, 4096, 64),
}
BACKENDS = ["cpu", "cuda", "rocm", "numpy_naive", "torch_sdpa"]
CAUSAL = [False, True]
DTYPES = ["float32", "float16", "bfloat16", "tf32"]   # tf32: float32 inputs that allow TF32 products
HOST_LOW_PRECISION_CONFIGS = {"tiny", "small", "medium", "llama_small"}
NAIVE_FP16_CONFIGS = {"tiny", "small"}


def _from_env(var: str, known: list[str], default: list[str]) -> list[str]:
    """The comma-separated names in ``var``, or ``default``. An unknown name fails ``asv check`` loudly."""
    text = os.environ.get(var, "").strip()
    if not text:
        return default
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{var}: unknown name(s) {unknown}; known: {known}")
    return names


def selected_configs() -> list[str]:
    return _from_env("NUMBA_FLASH_ASV_CONFIGS", list(CONFIGS), list(CONFIGS))


def selected_backends() -> list[str]:
    return _from_env("NUMBA_FLASH_ASV_BACKENDS", BACKENDS, BACKENDS)


def selected_dtypes() -> list[str]:
    default = DTYPES if (nvidia_gpu_present() or amd_gpu_present()) else ["float32"]
    return _from_env("NUMBA_FLASH_ASV_DTYPES", DTYPES, default)


def full_grid() -> bool:
    return os.environ.get("NUMBA_FLASH_ASV_FULL", "") not in ("", "0")


def nvidia_gpu_present() -> bool:
    """A cheap hint, read without importing anything; the real check follows when a target is built."""
    return os.path.exists("/dev/nvidiactl") or os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def amd_gpu_present() -> bool:
    return os.path.exists("/dev/kfd")


def cheap_skip(config: str, backend: str, causal: bool, dtype: str) -> str | None:
    """Why this combination is skipped on this machine, decided without heavy imports; None to go on."""
    if backend == "cuda" and not nvidia_gpu_present():
        return "no NVIDIA GPU"
    if backend == "rocm" and not amd_gpu_present():
        return "no AMD GPU (ROCm)"
    if backend == "numpy_naive" and dtype == "bfloat16":
        return "numpy has no bfloat16"
    if dtype == "tf32" and (backend not in ("cuda", "torch_sdpa") or not nvidia_gpu_present()):
        return "TF32 runs only on an NVIDIA GPU (the cuda backend, torch); elsewhere it is the float32 point again"
    on_host = backend in ("cpu", "numpy_naive") or (
        backend == "torch_sdpa" and not (nvidia_gpu_present() or amd_gpu_present()))
    if on_host and not full_grid():
        if dtype != "float32" and config not in HOST_LOW_PRECISION_CONFIGS:
            return f"CPU budget: {dtype} only up to llama_small (NUMBA_FLASH_ASV_FULL=1 runs it)"
        if backend == "numpy_naive" and dtype == "float16" and config not in NAIVE_FP16_CONFIGS:
            return "CPU budget: numpy float16 naive attention only on tiny and small (NUMBA_FLASH_ASV_FULL=1)"
    return None


# asv's backend names -> numba_flash.bench runners: (name, kind).
RUNNERS = {"cpu": ("cpu", "backend"), "cuda": ("cuda", "backend"), "rocm": ("rocm", "backend"),
           "numpy_naive": ("naive", "peer"), "torch_sdpa": ("torch", "peer")}


def _bench() -> Any:
    """``numba_flash.bench`` of the commit under test: its runners, clocks and memory measurement are the ones
    ``numba-flash bench`` uses, so asv and the bench time the same calls the same way."""
    try:
        from numba_flash import bench
    except ImportError as exc:   # a commit from before the bench existed
        raise NotImplementedError(f"numba_flash.bench not importable at this commit: {exc}")
    return bench


@contextlib.contextmanager
def _matched_torch_threads(bench: Any) -> Iterator[None]:
    """The bench's own thread matching; commits from before it was shared get the same effect inline."""
    shared = getattr(bench, "matched_torch_threads", None)
    if shared is not None:
        with shared():
            yield
        return
    import numba
    import torch

    torch.set_num_threads(numba.get_num_threads())
    yield


class Target:
    """One backend or peer bound to one problem through ``numba_flash.bench``: a ``Case`` (layout bshd), its fresh
    N(0, 1) ``Inputs``, the bench's ``Runner`` for it and the ``Clock`` of the runner's device. ``forward`` and
    ``backward`` end with a device synchronize so that asv's wall-clock timing is honest. ``gpu`` is 'torch',
    'numba' or None (host). Raises NotImplementedError (asv: skipped) when this machine cannot run it."""

    def __init__(self, backend: str, config: str, causal: bool, dtype: str, seed: int = 0):
        import numpy as np

        bench = self.bench = _bench()
        self.backend, self.config, self.causal, self.dtype = backend, config, causal, dtype
        b, h, s, d = CONFIGS[config]
        inputs_dtype, precision = ("float32", "tf32") if dtype == "tf32" else (dtype, "ieee")
        self.case = bench.Case(config, b, h, h, s, d, causal, inputs_dtype, "bshd", precision)
        self.inputs = bench.Inputs(self.case, np.random.default_rng(seed))
        self.flops_fwd = 4.0 * b * h * s * s * d / (2 if causal else 1)
        self.runner = bench.make_runner(*RUNNERS[backend])
        self._threads = contextlib.ExitStack()
        if self.runner.kind == "peer" and RUNNERS[backend][0] != "naive":
            self._threads.enter_context(_matched_torch_threads(bench))
        try:
            self.runner.prepare(self.case, self.inputs)
        except bench.Skip as exc:
            raise NotImplementedError(str(exc))
        self.clock = bench.Clock(self.runner.device_api)
        self.gpu = {"torch-cuda": "torch", "numba-cuda": "numba"}.get(self.runner.device_api)
        self.forward()  # warm-up: the first call compiles (the backward's warm-up is in prepare_backward)
        self._backward_warm = False

    def sync(self) -> None:
        self.clock.sync()

    def reference_inputs(self) -> dict[str, Any]:
        return self.inputs.reference_inputs()

    def forward(self) -> Any:
        out = self.runner.forward()
        self.clock.sync()
        return out

    def prepare_backward(self) -> None:
        """Untimed work before each timed ``backward``: a fresh autograd graph for torch; the first time, one
        untimed backward, because it compiles."""
        if not self._backward_warm:
            self.runner.before_backward()
            self.runner.backward()
            self._backward_warm = True
        self.runner.before_backward()

    def backward(self) -> Any:
        grads = self.runner.backward()
        self.clock.sync()
        return grads

    def gpu_ms(self, fn: Any, before: Any = None, repeats: int = 5) -> float:
        """Median milliseconds of ``fn`` between two CUDA events (the kernels' time, not Python's)."""
        import statistics

        times = []
        for _ in range(repeats):
            if before is not None:
                before()
            times.append(self.clock.time(fn)[0])
        return float(statistics.median(times))

    def peak_bytes(self, fn: Any) -> int:
        """The extra memory one call of ``fn`` allocates, measured as the bench does (host: the rise of the
        peak resident set during the call; GPU: the allocator's peak), not the size of the whole process."""
        if self.runner.device == "cpu":
            return int(self.bench.measure_host_peak(fn)[0])
        return int(self.bench.measure_gpu_peak(fn, self.runner.device_api)[0])


# One target per process is kept between asv's calls of setup (asv re-runs setup before every timed sample).
_current: dict[str, Any] = {"key": None, "target": None}


def get_target(config: str, backend: str, causal: bool, dtype: str) -> Target:
    """The target for these parameters, built (inputs drawn, warm-up calls made) once per process.
    Raises NotImplementedError, which asv reports as a skip, when this machine cannot run it."""
    reason = cheap_skip(config, backend, causal, dtype)
    if reason:
        raise NotImplementedError(reason)
    key = (config, backend, causal, dtype)
    if _current["key"] != key:
        _current["key"], _current["target"] = None, None
        try:
            target = Target(backend, config, causal, dtype)
        except NotImplementedError:
            raise
        except Exception as exc:
            # "Cannot serve this call" from the registry is a skip; anything else is a real failure.
            if type(exc).__name__ == "NoBackendError":
                raise NotImplementedError(str(exc))
            raise
        _current["key"], _current["target"] = key, target
    return _current["target"]


class AttentionBenchmark:
    """Base class: the full grid of parameters; ``setup`` builds (or reuses) the target or skips."""

    params = [selected_configs(), selected_backends(), CAUSAL, selected_dtypes()]
    param_names = ["config", "backend", "causal", "dtype"]
    timeout = 300.0

    def setup(self, config: str, backend: str, causal: bool, dtype: str) -> None:
        self.target = get_target(config, backend, causal, dtype)
