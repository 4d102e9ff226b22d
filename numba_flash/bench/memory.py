"""The extra memory one call allocates, and whether an S x S computation fits before it is tried.

Host: the rise of the process's peak resident set size during one call (the kernel's ``VmHWM`` counter is reset
through ``/proc/self/clear_refs`` and freed heap is returned with ``malloc_trim`` first). It sees every allocation
the call touches, numpy, torch and Numba NRT alike, at page granularity; arrays allocated but never written are not
counted. Where ``clear_refs`` is not writable it falls back to ``tracemalloc``, which sees numpy allocations only.
GPU: torch's ``max_memory_allocated`` rise for torch tensors, or the drop of the device's free memory (numba's
``get_memory_info``) across the call with its results alive, whichever is larger.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from typing import Any, Callable

from .cases import Case
from .harness import Clock, optional_torch

# Live (Sq, Sk) arrays at the peak of each S x S computation, counted from the code: the textbook backward keeps
# P, dP and dS plus a temporary; the float64 reference's backward keeps scores, softcap factor, mask, P, dP, dS.
NAIVE_SCORE_COPIES = 4
REFERENCE_SCORE_COPIES = 8


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
    """Which of the two host measurements this process uses, in words."""
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
    workspace = sys.modules.get("numba_flash.cpu.workspace")
    if workspace is not None:
        workspace.clear_workspace()


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


def numba_cuda_available() -> bool:
    """Whether numba can see a CUDA GPU (False when numba-cuda is missing or broken)."""
    try:
        from numba import cuda

        return bool(cuda.is_available())
    except Exception:  # numba-cuda missing or broken: no numba GPU path
        return False


def measure_gpu_peak(fn: Callable[[], Any], device_api: str) -> tuple[int, Any]:
    """Peak extra GPU bytes while ``fn`` runs: torch's allocator peak, or the fall of free device memory."""
    torch = optional_torch()
    use_torch = torch is not None and torch.cuda.is_available()
    ctx = None
    if numba_cuda_available():
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


def measure_peak(fn: Callable[[], Any], device: str, device_api: str) -> tuple[int, Any]:
    """``measure_host_peak`` on the CPU, ``measure_gpu_peak`` elsewhere."""
    return measure_host_peak(fn) if device == "cpu" else measure_gpu_peak(fn, device_api)


def _read_meminfo_kib(field: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise ValueError(f"{field} not in /proc/meminfo")


def available_host_bytes() -> int | None:
    """Memory the kernel says can be allocated without swapping (``MemAvailable``), or None where unknown."""
    try:
        return _read_meminfo_kib("MemAvailable") * 1024
    except (OSError, ValueError):
        return None


def gib(n: float) -> str:
    """Bytes as GiB with one decimal."""
    return f"{n / 2**30:.1f} GiB"


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
