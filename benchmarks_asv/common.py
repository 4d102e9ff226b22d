"""Shared pieces of the asv suite: the seed sizes, the parameter grid, one ``Target`` per backend or peer, and the
base class whose ``setup`` skips (raises ``NotImplementedError``) what this machine cannot run, as scipy's
``benchmarks/common.py`` does.

asv starts one process per benchmark and parameter combination, so everything a skip needs is decided from cheap
facts (device nodes, the grid rules below) before numpy, numba or torch is imported.

Every backend and peer is a parameter on every machine (cpu, cuda, rocm, numpy_naive, torch_sdpa), so that results
from different machines line up; one this machine cannot run (no GPU, numba-cuda missing, a dtype it lacks) skips
in ``setup`` with the reason, which costs a process start (about 0.2 s) per point. The dtypes follow the machine,
because low precision on the host would cost far more than skips: float32, float16 and bfloat16 on a GPU machine,
float32 alone on a host-only one (``NUMBA_FLASH_ASV_DTYPES`` adds the others).

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

import os
from typing import Any

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
DTYPES = ["float32", "float16", "bfloat16"]
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
    on_host = backend in ("cpu", "numpy_naive") or (
        backend == "torch_sdpa" and not (nvidia_gpu_present() or amd_gpu_present()))
    if on_host and not full_grid():
        if dtype != "float32" and config not in HOST_LOW_PRECISION_CONFIGS:
            return f"CPU budget: {dtype} only up to llama_small (NUMBA_FLASH_ASV_FULL=1 runs it)"
        if backend == "numpy_naive" and dtype == "float16" and config not in NAIVE_FP16_CONFIGS:
            return "CPU budget: numpy float16 naive attention only on tiny and small (NUMBA_FLASH_ASV_FULL=1)"
    return None


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise NotImplementedError("torch not installed")
    return torch


def _bhsd(a: Any) -> Any:
    """(B, S, H, D) -> (B, H, S, D) view, numpy or torch."""
    return a.transpose(0, 2, 1, 3) if hasattr(a, "__array_interface__") else a.transpose(1, 2)


class Target:
    """One backend or peer bound to one problem: q, k, v, dout (B, S, H, D), N(0, 1), in the benchmark's dtype and
    on the target's device. ``forward``/``backward`` end with a device synchronize so wall-clock timing is honest.
    ``gpu`` is 'torch', 'numba' or None (host)."""

    gpu: str | None = None

    def __init__(self, backend: str, config: str, causal: bool, dtype: str, seed: int = 0):
        import numpy as np

        self.backend, self.config, self.causal, self.dtype = backend, config, causal, dtype
        b, h, s, d = CONFIGS[config]
        rng = np.random.default_rng(seed)
        self.host32 = {n: rng.standard_normal((b, s, h, d), dtype=np.float32) for n in ("q", "k", "v", "dout")}
        self.flops_fwd = 4.0 * b * h * s * s * d / (2 if causal else 1)
        self.build()

    # subclasses ------------------------------------------------------------------------------------------
    def build(self) -> None:
        raise NotImplementedError

    def forward(self) -> Any:
        raise NotImplementedError

    def prepare_backward(self) -> None:
        """Untimed work before each timed ``backward`` (a fresh autograd graph for torch)."""

    def backward(self) -> Any:
        raise NotImplementedError

    # shared ----------------------------------------------------------------------------------------------
    def sync(self) -> None:
        if self.gpu == "torch":
            _torch().cuda.synchronize()
        elif self.gpu == "numba":
            from numba import cuda

            cuda.synchronize()

    def numpy_inputs(self) -> dict[str, Any]:
        if self.dtype == "bfloat16":
            raise NotImplementedError("numpy has no bfloat16")
        return {n: a.astype(self.dtype) for n, a in self.host32.items()}

    def torch_inputs(self, device: str) -> dict[str, Any]:
        torch = _torch()
        return {n: torch.from_numpy(a).to(device=device, dtype=getattr(torch, self.dtype))
                for n, a in self.host32.items()}

    def reference_inputs(self) -> dict[str, Any]:
        return self.torch_inputs("cpu") if self.dtype == "bfloat16" else self.numpy_inputs()

    def gpu_ms(self, fn: Any, before: Any = None, repeats: int = 5) -> float:
        """Median milliseconds of ``fn`` between two CUDA events (the kernels' time, not Python's)."""
        import statistics

        times = []
        for _ in range(repeats):
            if before is not None:
                before()
            self.sync()
            if self.gpu == "torch":
                torch = _torch()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                from numba import cuda

                start, end = cuda.event(timing=True), cuda.event(timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(cuda.event_elapsed_time(start, end))
        return float(statistics.median(times))


class RegistryTarget(Target):
    """A numba-flash backend through the public registry, fed the first array kind it accepts."""

    def build(self) -> None:
        from backends import backend_registry
        from numba_flash.validation import validate_forward

        be = next((x for x in backend_registry.backends("flash") if x.name == self.backend), None)
        if be is None:
            raise NotImplementedError(f"backend {self.backend!r} not registered")
        reasons = be.unavailable_reasons(forced=False)
        if reasons:
            raise NotImplementedError("; ".join(reasons))
        forms = []
        if self.backend in ("cuda", "rocm"):
            torch = None
            try:
                torch = _torch()
            except NotImplementedError:
                pass
            if torch is not None and torch.cuda.is_available():
                forms.append(("torch", lambda: self.torch_inputs("cuda")))
            if self.backend == "cuda":
                forms.append(("numba", self._numba_inputs))
        else:
            forms.append((None, self.numpy_inputs))
            forms.append((None, lambda: self.torch_inputs("cpu")))
        why = []
        for gpu, make in forms:
            try:
                arrays = make()
            except NotImplementedError as exc:
                why.append(str(exc))
                continue
            call = validate_forward(arrays["q"], arrays["k"], arrays["v"], causal=self.causal)
            reasons = be.not_supported_reasons(call, forced=True)
            if not reasons:
                self.gpu, self.arrays = gpu, arrays
                break
            why.extend(reasons)
        else:
            raise NotImplementedError("; ".join(why) or "no usable array kind")
        self.op = backend_registry.get("flash", backend=self.backend)
        self.forward()  # warm-up: the first call compiles (the backward compiles in prepare_backward)
        self.backward_ready = False

    def _numba_inputs(self) -> dict[str, Any]:
        from numba import cuda

        if not cuda.is_available():
            raise NotImplementedError("no CUDA GPU")
        return {n: cuda.to_device(a) for n, a in self.numpy_inputs().items()}

    def forward(self) -> Any:
        a = self.arrays
        self.out, self.lse = self.op.forward(a["q"], a["k"], a["v"], causal=self.causal, return_lse=True)
        self.sync()
        return self.out

    def prepare_backward(self) -> None:
        if not self.backward_ready:
            self.backward()
            self.backward_ready = True

    def backward(self) -> Any:
        a = self.arrays
        grads = self.op.backward(a["dout"], a["q"], a["k"], a["v"], self.out, self.lse, causal=self.causal)
        self.sync()
        return grads


class NumpyNaiveTarget(Target):
    """softmax(q k^T * scale) v in numpy with the (B, H, S, S) scores in memory, and its textbook backward: the
    same peer as ``numba-flash bench --compare naive`` (``numba_flash.bench_peers``)."""

    def build(self) -> None:
        self.arrays = self.numpy_inputs()
        self.forward()  # warm-up (page faults, BLAS threads)

    def forward(self) -> Any:
        from numba_flash.bench_peers import naive_forward_numpy

        a = self.arrays
        return naive_forward_numpy(a["q"], a["k"], a["v"], self.causal, "bshd")

    def backward(self) -> Any:
        from numba_flash.bench_peers import naive_backward_numpy

        a = self.arrays
        return naive_backward_numpy(a["dout"], a["q"], a["k"], a["v"], self.causal, "bshd")


class TorchSdpaTarget(Target):
    """``torch.nn.functional.scaled_dot_product_attention`` on the GPU if torch sees one, else on the CPU with
    as many threads as Numba uses."""

    def build(self) -> None:
        torch = _torch()
        self.torch = torch
        if torch.cuda.is_available():
            self.gpu, device = "torch", "cuda"
        else:
            import numba

            torch.set_num_threads(numba.get_num_threads())
            device = "cpu"
        self.arrays = {n: _bhsd(t) for n, t in self.torch_inputs(device).items()}
        self.forward()  # warm-up

    def _attn(self, q: Any, k: Any, v: Any) -> Any:
        import torch.nn.functional as F

        return F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)

    def forward(self) -> Any:
        with self.torch.no_grad():
            out = self._attn(self.arrays["q"], self.arrays["k"], self.arrays["v"])
        self.sync()
        return _bhsd(out)

    def prepare_backward(self) -> None:
        self.leaves = tuple(self.arrays[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        self.graph_out = self._attn(*self.leaves)
        self.sync()

    def backward(self) -> Any:
        grads = self.torch.autograd.grad(self.graph_out, self.leaves, self.arrays["dout"])
        self.sync()
        return tuple(_bhsd(g) for g in grads)


TARGETS = {"cpu": RegistryTarget, "cuda": RegistryTarget, "rocm": RegistryTarget,
           "numpy_naive": NumpyNaiveTarget, "torch_sdpa": TorchSdpaTarget}

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
            target = TARGETS[backend](backend, config, causal, dtype)
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
