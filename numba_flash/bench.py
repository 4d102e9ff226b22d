"""``numba-flash bench``: time every attention backend against naive attention and torch SDPA.

    numba-flash bench                                   # the README's main job: CPU backend vs numpy naive vs SDPA
    python -m numba_flash.bench --config llama_med --causal
    numba-flash bench --seqlen 512,1024,2048 --no-grad --plot tflops.png --csv sweep.csv

For each backend (default: every one ``backend_registry.available("flash")`` lists) and each peer of ``--compare``
it prints min / median / max milliseconds per pass (fwd, bwd), TFLOP/s (``numba_flash.semantics.attention_flops``
over the median), the peak extra memory the call allocated and how much less that is than naive attention, the
speedup over naive attention and over torch SDPA on the same device, and the max abs error against the float64
reference (``numba_flash.reference``). Every function is called once before timing: the first call compiles.

What "peak memory" measures:
  CPU: the rise of the process's peak resident set size during one call (the kernel's ``VmHWM`` counter is reset
       through ``/proc/self/clear_refs`` and freed heap is returned with ``malloc_trim`` first). It sees every
       allocation the call touches, numpy, torch and Numba NRT alike, at page granularity; arrays allocated but
       never written are not counted. Where ``clear_refs`` is not writable it falls back to ``tracemalloc``, which
       sees numpy allocations only (the header says which one ran).
  GPU: torch's ``max_memory_allocated`` rise for torch tensors, or the drop of the device's free memory (numba's
       ``get_memory_info``) across the call with its results alive, whichever is larger.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import bench_peers
from .reference import attention_ref, attention_ref_backward
from .semantics import attention_flops

# (batch, nheads, seqlen, headdim): FlashAttention's minimal_benchmark sizes plus two long sequences.
CONFIGS: dict[str, tuple[int, int, int, int]] = {
    "tiny": (2, 4, 8, 64),
    "small": (2, 4, 64, 64),
    "medium": (2, 8, 128, 64),
    "llama_small": (1, 12, 256, 64),
    "llama_med": (1, 32, 512, 128),
    "s2048": (1, 8, 2048, 64),
    "s4096": (1, 8, 4096, 64),
}
DEFAULT_CONFIG = "llama_small"
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
          "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
PASSES = ("fwd", "bwd")

CSV_COLUMNS = ("config", "batch", "nheads", "nheads_kv", "seqlen", "headdim", "causal", "dtype", "layout",
               "name", "kind", "device", "pass", "status", "repeats", "min_ms", "median_ms", "max_ms", "flops",
               "tflops", "peak_mem_bytes", "mem_saved_vs_naive", "speedup_vs_naive", "speedup_vs_sdpa", "max_err")


class Skip(Exception):
    """A backend or peer that cannot run this case; the message says why."""


@dataclass(frozen=True)
class Case:
    """One problem size. Shapes follow ``layout``: q (B, S, Hq, D) for "bshd", (B, Hq, S, D) for "bhsd"."""

    config: str
    batch: int
    nheads: int
    nheads_kv: int
    seqlen: int
    headdim: int
    causal: bool
    dtype: str      # 'float32', 'float16', 'bfloat16'
    layout: str

    def shape(self, heads: int) -> tuple[int, int, int, int]:
        if self.layout == "bhsd":
            return (self.batch, heads, self.seqlen, self.headdim)
        return (self.batch, self.seqlen, heads, self.headdim)

    def flops(self, pass_: str) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen, self.seqlen, self.headdim, self.causal,
                               mode=pass_)


@dataclass
class Row:
    """One line of the report: a runner's pass on a case."""

    case: Case
    name: str
    kind: str           # 'backend' or 'peer'
    device: str
    pass_: str
    status: str = "ok"  # 'ok', 'skipped: ...', 'error: ...'
    times_ms: list[float] | None = None
    peak_mem_bytes: int | None = None
    max_err: float | None = None
    speedup_vs_naive: float | None = None
    speedup_vs_sdpa: float | None = None
    mem_saved_vs_naive: float | None = None

    @property
    def median_ms(self) -> float | None:
        return float(np.median(self.times_ms)) if self.times_ms else None

    @property
    def tflops(self) -> float | None:
        med = self.median_ms
        return self.case.flops(self.pass_) / (med * 1e-3) / 1e12 if med else None

    def record(self) -> dict[str, Any]:
        c = self.case
        t = self.times_ms or []
        return {
            "config": c.config, "batch": c.batch, "nheads": c.nheads, "nheads_kv": c.nheads_kv, "seqlen": c.seqlen,
            "headdim": c.headdim, "causal": c.causal, "dtype": c.dtype, "layout": c.layout, "name": self.name,
            "kind": self.kind, "device": self.device, "pass": self.pass_, "status": self.status,
            "repeats": len(t), "min_ms": min(t) if t else None, "median_ms": self.median_ms,
            "max_ms": max(t) if t else None, "flops": c.flops(self.pass_), "tflops": self.tflops,
            "peak_mem_bytes": self.peak_mem_bytes, "mem_saved_vs_naive": self.mem_saved_vs_naive,
            "speedup_vs_naive": self.speedup_vs_naive, "speedup_vs_sdpa": self.speedup_vs_sdpa,
            "max_err": self.max_err,
        }


# --------------------------------------------------------------------------------------------------- inputs


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def torch_cuda_available() -> bool:
    torch = _torch()
    return bool(torch is not None and torch.cuda.is_available())


class Inputs:
    """Fresh N(0, 1) q, k, v, dout for one case, drawn in float32 on the host and rounded once to the case's
    dtype; every runner and the float64 reference see the same rounded values."""

    def __init__(self, case: Case, rng: np.random.Generator):
        self.case = case
        draw = lambda heads: rng.standard_normal(case.shape(heads), dtype=np.float32)  # noqa: E731
        self.f32 = {"q": draw(case.nheads), "k": draw(case.nheads_kv), "v": draw(case.nheads_kv),
                    "dout": draw(case.nheads)}
        self._cache: dict[tuple[str, str], dict[str, Any]] = {}

    def numpy(self) -> dict[str, np.ndarray]:
        """Host numpy arrays in the case's dtype (float32 / float16); Skip for bfloat16, which numpy lacks."""
        if self.case.dtype == "bfloat16":
            raise Skip("numpy has no bfloat16")
        key = ("numpy", "cpu")
        if key not in self._cache:
            self._cache[key] = {n: a.astype(self.case.dtype) for n, a in self.f32.items()}
        return self._cache[key]

    def torch(self, device: str) -> dict[str, Any]:
        torch = _torch()
        if torch is None:
            raise Skip("torch not installed")
        key = ("torch", device)
        if key not in self._cache:
            dt = getattr(torch, self.case.dtype)
            self._cache[key] = {n: torch.from_numpy(a).to(device=device, dtype=dt) for n, a in self.f32.items()}
        return self._cache[key]

    def numba_cuda(self) -> dict[str, Any]:
        from numba import cuda

        key = ("numba", "cuda")
        if key not in self._cache:
            self._cache[key] = {n: cuda.to_device(a) for n, a in self.numpy().items()}
        return self._cache[key]

    def reference_inputs(self) -> dict[str, Any]:
        """The rounded inputs the reference must see (torch for bfloat16)."""
        return self.torch("cpu") if self.case.dtype == "bfloat16" else self.numpy()


class Reference:
    """Float64 reference results for one case, computed on first use (the backward one costs a few seconds at
    S = 4096) and shared by every runner."""

    def __init__(self, inputs: Inputs):
        self.inputs = inputs
        self._out: np.ndarray | None = None
        self._grads: tuple[np.ndarray, ...] | None = None

    def _kw(self) -> dict[str, Any]:
        return {"causal": self.inputs.case.causal, "layout": self.inputs.case.layout}

    def out(self) -> np.ndarray:
        if self._out is None:
            a = self.inputs.reference_inputs()
            self._out = attention_ref(a["q"], a["k"], a["v"], **self._kw())[0]
        return self._out

    def grads(self) -> tuple[np.ndarray, ...]:
        if self._grads is None:
            a = self.inputs.reference_inputs()
            self._grads = attention_ref_backward(a["dout"], a["q"], a["k"], a["v"], **self._kw())
        return self._grads


def to_host64(x: Any) -> np.ndarray:
    from .arrays import as_float64

    return as_float64(x)


# --------------------------------------------------------------------------------------------------- timing, memory


class Clock:
    """Times one call in milliseconds: wall clock on the host, CUDA events (then a synchronize) on a GPU."""

    def __init__(self, device_api: str):
        self.device_api = device_api    # 'host', 'torch-cuda' or 'numba-cuda'

    def sync(self) -> None:
        if self.device_api == "torch-cuda":
            _torch().cuda.synchronize()
        elif self.device_api == "numba-cuda":
            from numba import cuda

            cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        if self.device_api == "torch-cuda":
            torch = _torch()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end)), result
        if self.device_api == "numba-cuda":
            from numba import cuda

            start, end = cuda.event(timing=True), cuda.event(timing=True)
            start.record()
            result = fn()
            end.record()
            end.synchronize()
            return float(cuda.event_elapsed_time(start, end)), result
        t0 = time.perf_counter()
        result = fn()
        return (time.perf_counter() - t0) * 1e3, result


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _read_status_kib("VmHWM")
        return True
    except OSError:
        return False


_RSS_OK: bool | None = None


def host_memory_method() -> str:
    global _RSS_OK
    if _RSS_OK is None:
        _RSS_OK = _can_reset_peak_rss()
    return "peak RSS rise (VmHWM reset via /proc/self/clear_refs)" if _RSS_OK else \
        "tracemalloc (numpy allocations only; Numba NRT allocations not seen)"


def _malloc_trim() -> None:
    # Heap memory that glibc kept after earlier calls would be reused without raising RSS: hand it back first.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _release_scratch() -> None:
    # The CPU kernels keep scratch buffers between calls; a call measured with them already resident would look
    # smaller than it is, so they are freed first and the measured call allocates (and counts) them again.
    kernels = sys.modules.get("numba_flash.cpu.kernels")
    if kernels is not None:
        kernels.clear_workspace()


def measure_host_peak(fn: Callable[[], Any]) -> tuple[int, Any]:
    """Peak extra host bytes while ``fn`` runs (see the module docstring), and its result."""
    host_memory_method()
    _release_scratch()
    if _RSS_OK:
        _malloc_trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _read_status_kib("VmRSS")
        result = fn()
        return max(0, _read_status_kib("VmHWM") - before) * 1024, result
    import tracemalloc

    tracemalloc.start()
    try:
        result = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak, result


def measure_gpu_peak(fn: Callable[[], Any], device_api: str) -> tuple[int, Any]:
    """Peak extra GPU bytes while ``fn`` runs: torch's allocator peak, or the fall of free device memory."""
    torch = _torch()
    use_torch = torch is not None and torch.cuda.is_available()
    ctx = None
    if _numba_cuda_available():
        from numba import cuda

        ctx = cuda.current_context()
    if use_torch:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    free_before = ctx.get_memory_info()[0] if ctx is not None else 0
    result = fn()
    Clock(device_api).sync()
    free_drop = free_before - ctx.get_memory_info()[0] if ctx is not None else 0
    torch_peak = torch.cuda.max_memory_allocated() - base if use_torch else 0
    return max(torch_peak, free_drop, 0), result


def available_host_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (``MemAvailable``), or None where unknown."""
    try:
        return _read_meminfo_kib("MemAvailable") * 1024
    except (OSError, ValueError):
        return None


def _read_meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"{field} not in /proc/meminfo")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


# Live (Sq, Sk) arrays at the peak of each S x S computation, counted from the code: the textbook backward keeps
# P, dP and dS plus a temporary; the float64 reference's backward keeps scores, softcap factor, mask, P, dP, dS.
NAIVE_SCORE_COPIES = 4
REFERENCE_SCORE_COPIES = 8


def fits_in_memory(needed: int, available: int | None) -> bool:
    """False only when ``needed`` bytes surely do not fit: overcommitting Linux would rather kill the process
    than raise MemoryError, so the S x S peers and the reference check before they allocate."""
    return available is None or needed <= available


def reference_bytes(case: Case) -> int:
    """Peak bytes of the float64 reference for ``case`` (it works one (batch, head) at a time)."""
    return REFERENCE_SCORE_COPIES * case.seqlen * case.seqlen * 8


def naive_bytes(case: Case, itemsize: int) -> int:
    """Peak bytes of textbook attention: every head's (Sq, Sk) scores at once, in the case's dtype."""
    return NAIVE_SCORE_COPIES * case.batch * case.nheads * case.seqlen * case.seqlen * itemsize


# --------------------------------------------------------------------------------------------------- runners


class Runner:
    """Runs one backend or peer on one case. ``prepare`` raises Skip when it cannot."""

    kind = "backend"

    def __init__(self, name: str):
        self.name = name
        self.device = "cpu"
        self.device_api = "host"

    def prepare(self, case: Case, inputs: Inputs) -> None:
        raise NotImplementedError

    def forward(self) -> Any:
        raise NotImplementedError

    def before_backward(self) -> None:
        """Untimed work the next ``backward`` needs (torch must record a fresh graph)."""

    def backward(self) -> Any:
        raise NotImplementedError

    def release(self) -> None:
        """Drop the arrays kept between calls."""


class BackendRunner(Runner):
    """A registry backend, fed the first array kind it accepts: GPU arrays first (where a GPU exists), then numpy,
    then torch CPU tensors (the only host kind that holds bfloat16)."""

    def prepare(self, case: Case, inputs: Inputs) -> None:
        from backends import backend_registry
        from numba_flash.validation import validate_forward

        be = next((b for b in backend_registry.backends("flash") if b.name == self.name), None)
        if be is None:
            raise Skip("not registered")
        reasons = be.unavailable_reasons(forced=True)
        if reasons:
            raise Skip("; ".join(reasons))
        forms: list[tuple[str, str, Callable[[], dict[str, Any]]]] = []
        if torch_cuda_available():
            forms.append(("cuda", "torch-cuda", lambda: inputs.torch("cuda")))
        if "cuda_array" in be.SUPPORTED_KINDS and _numba_cuda_available():
            forms.append(("cuda", "numba-cuda", inputs.numba_cuda))
        forms.append(("cpu", "host", inputs.numpy))
        forms.append(("cpu", "host", lambda: inputs.torch("cpu")))
        why: list[str] = []
        for device, api, make in forms:
            try:
                arrays = make()
            except Skip as exc:
                why.append(str(exc))
                continue
            call = validate_forward(arrays["q"], arrays["k"], arrays["v"], causal=case.causal, layout=case.layout)
            reasons = be.not_supported_reasons(call, forced=True)
            if not reasons:
                self.device, self.device_api, self.arrays = device, api, arrays
                break
            why.extend(r for r in reasons if r not in why)
        else:
            raise Skip("; ".join(why))
        self.op = backend_registry.get("flash", backend=self.name)
        self.kw = {"causal": case.causal, "layout": case.layout}
        self.out, self.lse = None, None

    def forward(self) -> Any:
        a = self.arrays
        out, lse = self.op.forward(a["q"], a["k"], a["v"], return_lse=True, **self.kw)
        self.out, self.lse = out, lse
        return out

    def before_backward(self) -> None:
        if self.out is None:
            self.forward()

    def backward(self) -> Any:
        a = self.arrays
        return self.op.backward(a["dout"], a["q"], a["k"], a["v"], self.out, self.lse, **self.kw)

    def release(self) -> None:
        self.arrays, self.out, self.lse = {}, None, None


def _numba_cuda_available() -> bool:
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing or broken: no numba GPU path
        return False


class NaiveNumpyRunner(Runner):
    kind = "peer"

    def prepare(self, case: Case, inputs: Inputs) -> None:
        self.arrays = inputs.numpy()
        self.case = case
        needed, available = naive_bytes(case, self.arrays["q"].itemsize), available_host_bytes()
        if not fits_in_memory(needed, available):
            raise Skip(f"the S x S scores need about {_gib(needed)}, {_gib(available)} available")

    def forward(self) -> Any:
        a = self.arrays
        return bench_peers.naive_forward_numpy(a["q"], a["k"], a["v"], self.case.causal, self.case.layout)

    def backward(self) -> Any:
        a = self.arrays
        return bench_peers.naive_backward_numpy(a["dout"], a["q"], a["k"], a["v"], self.case.causal,
                                                self.case.layout)

    def release(self) -> None:
        self.arrays = {}


class TorchRunner(Runner):
    """torch SDPA (``naive=False``) or textbook torch attention on torch's default device."""

    kind = "peer"

    def __init__(self, name: str, naive: bool):
        super().__init__(name)
        self.naive = naive

    def prepare(self, case: Case, inputs: Inputs) -> None:
        torch = _torch()
        if torch is None:
            raise Skip("torch not installed")
        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device_api = "torch-cuda" if self.device == "cuda" else "host"
        if self.device == "cpu" and case.dtype == "bfloat16" and self.naive:
            raise Skip("bfloat16 matmul on CPU is not a meaningful baseline")
        if self.naive:
            needed = naive_bytes(case, torch.finfo(getattr(torch, case.dtype)).bits // 8)
            available = torch.cuda.mem_get_info()[0] if self.device == "cuda" else available_host_bytes()
            if not fits_in_memory(needed, available):
                raise Skip(f"the S x S scores need about {_gib(needed)}, {_gib(available)} available")
        self.arrays = {n: t.detach().clone() for n, t in inputs.torch(self.device).items()}
        self.case = case
        self.fn = bench_peers.naive_torch if self.naive else bench_peers.sdpa_torch
        self.graph: tuple[Any, tuple[Any, ...]] | None = None

    def forward(self) -> Any:
        a = self.arrays
        with self.torch.no_grad():
            return self.fn(a["q"], a["k"], a["v"], self.case.causal, self.case.layout)

    def before_backward(self) -> None:
        leaves = tuple(self.arrays[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
        out = self.fn(*leaves, self.case.causal, self.case.layout)
        self.graph = (out, leaves)

    def backward(self) -> Any:
        out, leaves = self.graph
        self.graph = None
        return self.torch.autograd.grad(out, leaves, self.arrays["dout"])

    def release(self) -> None:
        self.arrays, self.graph = {}, None


def make_runner(name: str, kind: str) -> Runner:
    if kind == "backend":
        return BackendRunner(name)
    if name == "naive":
        return NaiveNumpyRunner(name)
    return TorchRunner(name, naive=(name == "torch_naive"))


# --------------------------------------------------------------------------------------------------- running


def run_pass(runner: Runner, case: Case, pass_: str, repeats: int, ref: Reference | None) -> Row:
    """Warm up, time ``repeats`` calls, then measure memory and error on one more call."""
    row = Row(case, runner.name, runner.kind, runner.device, pass_)
    clock = Clock(runner.device_api)
    if pass_ == "fwd":
        fn, before = runner.forward, (lambda: None)
    else:
        fn, before = runner.backward, runner.before_backward
    before()
    clock.time(fn)  # warm-up: the first call compiles
    times = []
    for _ in range(repeats):
        before()
        ms, result = clock.time(fn)
        times.append(ms)
        del result
    row.times_ms = times
    before()
    if runner.device == "cpu":
        row.peak_mem_bytes, result = measure_host_peak(fn)
    else:
        row.peak_mem_bytes, result = measure_gpu_peak(fn, runner.device_api)
    if ref is not None:
        if pass_ == "fwd":
            row.max_err = float(np.max(np.abs(to_host64(result) - ref.out())))
        else:
            row.max_err = max(float(np.max(np.abs(to_host64(g) - r))) for g, r in zip(result, ref.grads()))
    return row


def run_case(case: Case, runners: Sequence[Runner], passes: Sequence[str], repeats: int, check: bool,
             rng: np.random.Generator, progress: Callable[[], None] = lambda: None,
             notes: list[str] | None = None) -> list[Row]:
    """Every runner's passes on one case, with speedups filled in. Lines worth printing under the table (a
    reference too big to compute) are appended to ``notes``."""
    inputs = Inputs(case, rng)
    ref = Reference(inputs) if check else None
    if ref is not None and not fits_in_memory(reference_bytes(case), available_host_bytes()):
        ref = None
        if notes is not None:
            notes.append(f"max err not computed at S={case.seqlen}: the float64 reference needs about "
                         f"{_gib(reference_bytes(case))} of host memory (more than is available)")
    rows = []
    for runner in runners:
        try:
            runner.prepare(case, inputs)
        except Skip as exc:
            rows.extend(Row(case, runner.name, runner.kind, runner.device, p, status=f"skipped: {exc}")
                        for p in passes)
            for _ in passes:
                progress()
            continue
        for p in passes:
            try:
                rows.append(run_pass(runner, case, p, repeats, ref))
            except Skip as exc:
                rows.append(Row(case, runner.name, runner.kind, runner.device, p, status=f"skipped: {exc}"))
            except MemoryError:
                # Running out of memory is what naive attention does at long sequences: a result for a peer, a
                # failure for a backend.
                status = "skipped: out of memory" if runner.kind == "peer" else "error: MemoryError"
                rows.append(Row(case, runner.name, runner.kind, runner.device, p, status=status))
            except Exception as exc:  # report and go on: one broken backend must not hide the others' figures
                msg = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
                rows.append(Row(case, runner.name, runner.kind, runner.device, p, status=f"error: {msg}"))
            progress()
        runner.release()
    _add_ratios(rows)
    return rows


def _add_ratios(rows: list[Row]) -> None:
    """Speedups and memory saved against the peers on the same device and pass (naive on a GPU is torch_naive)."""
    ok = {(r.name, r.device, r.pass_): r for r in rows if r.status == "ok"}
    for r in rows:
        if r.status != "ok":
            continue
        naive = ok.get(("naive" if r.device == "cpu" else "torch_naive", r.device, r.pass_))
        sdpa = ok.get(("torch", r.device, r.pass_))
        if naive is not None:
            r.speedup_vs_naive = naive.median_ms / r.median_ms
            # Memory is measured in whole pages: below 1 MiB the ratio is noise, not a saving.
            if naive.peak_mem_bytes and naive.peak_mem_bytes >= 2**20:
                r.mem_saved_vs_naive = 1.0 - (r.peak_mem_bytes or 0) / naive.peak_mem_bytes
        if sdpa is not None:
            r.speedup_vs_sdpa = sdpa.median_ms / r.median_ms


# --------------------------------------------------------------------------------------------------- report


def machine_info() -> dict[str, Any]:
    import numba

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    from . import __version__

    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in getattr(sys, "orig_argv", sys.argv)),
        "host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
        "numba_flash": __version__, "numba_threads": numba.get_num_threads(),
        "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default",
        "host_memory": host_memory_method(),
    }
    torch = _torch()
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(rows: Sequence[Row]) -> str:
    head = ("seqlen", "name", "device", "pass", "min ms", "median ms", "max ms", "TFLOP/s", "peak MiB",
            "mem saved", "x naive", "x sdpa", "max err")
    lines = []
    for r in rows:
        if r.status != "ok":
            lines.append((str(r.case.seqlen), r.name, r.device, r.pass_, r.status))
            continue
        t = r.times_ms
        lines.append((str(r.case.seqlen), r.name, r.device, r.pass_, _fmt(min(t), ".3f"), _fmt(r.median_ms, ".3f"),
                      _fmt(max(t), ".3f"), _fmt(r.tflops, ".4f"),
                      _fmt(None if r.peak_mem_bytes is None else r.peak_mem_bytes / 2**20, ".1f"),
                      _fmt(None if r.mem_saved_vs_naive is None else 100 * r.mem_saved_vs_naive, ".0f") +
                      ("%" if r.mem_saved_vs_naive is not None else ""),
                      _fmt(r.speedup_vs_naive, ".2f"), _fmt(r.speedup_vs_sdpa, ".2f"), _fmt(r.max_err, ".1e")))
    widths = [max([len(h)] + [len(ln[i]) for ln in lines if len(ln) == len(head)]) for i, h in enumerate(head)]
    out = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    for ln in lines:
        if len(ln) == len(head):
            out.append("  ".join(c.rjust(w) for c, w in zip(ln, widths)))
        else:
            out.append("  ".join(c.rjust(w) for c, w in zip(ln[:4], widths)) + "  " + ln[4])
    return "\n".join(out)


def write_csv(path: str, rows: Sequence[Row]) -> None:
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.record().items()})


def write_json(path: str, rows: Sequence[Row], meta: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.record() for r in rows]}, f, indent=1)


def write_plot(path: str, rows: Sequence[Row], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.status == "ok" and r.tflops:
            series.setdefault(f"{r.name} ({r.device}) {r.pass_}", []).append((r.case.seqlen, r.tflops))
    for label, pts in sorted(series.items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- command line


def _positive_ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or a comma-separated list, got {text!r}")
    if not values or any(x < 1 for x in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    values = _positive_ints(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, got {text!r}")
    return values[0]


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _output_problem(path: str) -> str | None:
    """Why ``path`` cannot be written, checked before the run so that a typo does not cost the results."""
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return "not writable"
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="numba-flash bench",
        description="Time numba-flash's attention backends against numpy naive attention and torch SDPA, "
                    "forward and backward, with TFLOP/s, peak memory and max error vs the float64 reference.",
        epilog="configs (B, H, S, D): " + ", ".join(f"{n} {c}" for n, c in CONFIGS.items()) +
               f". Default: {DEFAULT_CONFIG}, every available backend, --compare naive,torch.")
    size = p.add_argument_group("problem size (flags override the --config's values)")
    size.add_argument("--config", choices=sorted(CONFIGS), help=f"a seed size (default {DEFAULT_CONFIG})")
    size.add_argument("--batch", type=_positive_int)
    size.add_argument("--seqlen", type=_positive_ints, help="one length, or a comma-separated sweep: 512,1024,2048")
    size.add_argument("--nheads", type=_positive_int)
    size.add_argument("--nheads-kv", type=_positive_int, help="key/value heads (GQA); default --nheads")
    size.add_argument("--headdim", type=_positive_int)
    size.add_argument("--causal", action="store_true")
    size.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    size.add_argument("--layout", default="bshd", choices=("bshd", "bhsd"))
    what = p.add_argument_group("what to run")
    what.add_argument("--backend", help="comma-separated backends (default: every available one)")
    what.add_argument("--compare",
                      help="comma-separated peers from naive (numpy), torch (SDPA), torch_naive; 'none' for none "
                           "(default: naive,torch, plus torch_naive where torch sees a GPU)")
    what.add_argument("--no-grad", action="store_true", help="forward only (default: forward and backward)")
    what.add_argument("--repeats", type=_positive_int, default=10, help="timed calls per pass (default 10)")
    what.add_argument("--no-check", action="store_true", help="skip the max error vs the float64 reference")
    what.add_argument("--seed", type=_seed, help="seed of the random inputs (default: fresh)")
    out = p.add_argument_group("output")
    out.add_argument("--csv", metavar="FILE")
    out.add_argument("--json", metavar="FILE")
    out.add_argument("--plot", metavar="FILE.png", help="TFLOP/s vs sequence length per backend (matplotlib)")
    return p


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[Case], list[tuple[str, str]]]:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # `numba-flash bench ...`: the console script's only subcommand
        argv = argv[1:]
    args = parser.parse_args(argv)
    b, h, s, d = CONFIGS[args.config or DEFAULT_CONFIG]
    batch = args.batch or b
    nheads = args.nheads or h
    nheads_kv = args.nheads_kv or nheads
    headdim = args.headdim or d
    if nheads % nheads_kv:
        parser.error(f"--nheads {nheads} must be a multiple of --nheads-kv {nheads_kv}")
    if headdim > 256:
        parser.error(f"--headdim {headdim} is larger than 256, the most any backend supports")
    seqlens = args.seqlen or [s]
    name = args.config or ("custom" if any((args.batch, args.nheads, args.headdim, args.seqlen))
                           else DEFAULT_CONFIG)
    cases = [Case(name, batch, nheads, nheads_kv, sl, headdim, args.causal, DTYPES[args.dtype], args.layout)
             for sl in seqlens]

    from backends import backend_registry

    registered = backend_registry.names("flash")
    if args.backend is None:
        chosen = backend_registry.available("flash")
    else:
        chosen = [x.strip() for x in args.backend.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in registered]
        if unknown or not chosen:
            parser.error(f"--backend: unknown backend {', '.join(unknown) or repr(args.backend)}; "
                         f"registered: {', '.join(registered)}")
    compare = args.compare
    if compare is None:
        compare = "naive,torch,torch_naive" if torch_cuda_available() else "naive,torch"
    peers = [x.strip() for x in compare.split(",") if x.strip()]
    if peers == ["none"]:
        peers = []
    bad = [x for x in peers if x not in bench_peers.PEERS]
    if bad:
        parser.error(f"--compare: unknown peer {', '.join(bad)}; choose from {', '.join(bench_peers.PEERS)} or none")
    for flag, path in (("--csv", args.csv), ("--json", args.json), ("--plot", args.plot)):
        problem = path is not None and _output_problem(path)
        if problem:
            parser.error(f"{flag} {path}: {problem}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError:
            parser.error("--plot needs matplotlib (pip install matplotlib)")
        formats = FigureCanvasBase.get_supported_filetypes()
        ext = os.path.splitext(args.plot)[1].lstrip(".").lower()
        if ext not in formats:
            parser.error(f"--plot {args.plot}: the file name must end in one of "
                         f"{', '.join('.' + f for f in sorted(formats))} (it picks the image format)")
    runners = [(n, "backend") for n in chosen] + [(n, "peer") for n in peers]
    if not runners:
        parser.error("nothing to run: no backend available and --compare none")
    return args, cases, runners


def _set_torch_threads() -> None:
    """Give torch the threads Numba uses, so both sides of the comparison get the same cores."""
    torch = _torch()
    if torch is not None:
        import numba

        torch.set_num_threads(numba.get_num_threads())


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    bar = None
    if enabled:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, file=sys.stderr, unit="pass", desc="bench")
        except ImportError:
            bar = None
    try:
        yield (bar.update if bar is not None else (lambda *a: None))
    finally:
        if bar is not None:
            bar.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``numba-flash bench`` and ``python -m numba_flash.bench``; returns the exit status: 0, 1
    when a backend or peer raised an error, 2 for a bad argument or an output file that cannot be written, 130
    when interrupted."""
    try:
        return _run(*parse_args(argv))
    except KeyboardInterrupt:
        print("numba-flash bench: interrupted", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace, cases: list[Case], runner_specs: list[tuple[str, str]]) -> int:
    _set_torch_threads()
    meta = machine_info()
    passes = ("fwd",) if args.no_grad else PASSES
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    meta.update(seed=seed, repeats=args.repeats)
    rng = np.random.default_rng(seed)

    c0 = cases[0]
    print(f"numba-flash {meta['numba_flash']} bench | {meta['date']}")
    print(f"machine: {meta['cpu']}, {meta['cpu_count']} cores" + (f", GPU {meta['gpu']}" if "gpu" in meta else ""))
    print(f"versions: python {meta['python']}, numpy {meta['numpy']}, numba {meta['numba']}"
          + (f", torch {meta['torch']}" if "torch" in meta else ", torch not installed"))
    print(f"threads: numba {meta['numba_threads']}" + (f", torch {meta['torch_threads']}" if "torch" in meta else "")
          + f", numpy BLAS {meta['blas_threads']}")
    print(f"command: {meta['command']}")
    print(f"case: {c0.config} B={c0.batch} H={c0.nheads} Hkv={c0.nheads_kv} "
          f"S={','.join(str(c.seqlen) for c in cases)} D={c0.headdim} causal={c0.causal} {c0.dtype} {c0.layout}; "
          f"seed {seed}")
    print(f"timing: {args.repeats} calls per pass after one warm-up call (the first call compiles); "
          f"CUDA events on GPUs. peak memory: {meta['host_memory']} on the CPU. "
          f"max err: max abs vs float64 reference" + (" (skipped)" if args.no_check else ""))
    sys.stdout.flush()

    rows: list[Row] = []
    notes: list[str] = []
    total = len(cases) * len(runner_specs) * len(passes)
    with _progress(total, enabled=len(cases) > 1) as tick:
        for case in cases:
            runners = [make_runner(n, k) for n, k in runner_specs]
            rows.extend(run_case(case, runners, passes, args.repeats, not args.no_check, rng, tick, notes))
    print()
    print(format_table(rows))
    for note in notes:
        print(note)

    title = f"{c0.config} B={c0.batch} H={c0.nheads} D={c0.headdim} causal={c0.causal} {c0.dtype} | {meta['cpu']}"
    writers = ((args.csv, lambda p: write_csv(p, rows)), (args.json, lambda p: write_json(p, rows, meta)),
               (args.plot, lambda p: write_plot(p, rows, title)))
    for path, write in writers:
        if not path:
            continue
        try:
            write(path)
        except OSError as exc:  # the paths were checked before the run; the disk may still fill up
            print(f"numba-flash bench: error: cannot write {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}")
    return 1 if any(r.status.startswith("error") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
