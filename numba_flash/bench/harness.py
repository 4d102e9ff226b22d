"""The timing harness that ``numba-flash bench`` and the asv suite share: one clock per device API, the
timed-call loop, the statistics of its samples, the busy-machine check, and the torch thread count matched to
Numba's for the length of a run.

A host call is timed with ``time.perf_counter``; a GPU call between two CUDA events, after a synchronize, so the
figure is the device's time and not Python's.
"""

from __future__ import annotations

import contextlib
import math
import sys
import textwrap
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

# A run whose slowest timed call took this many times its fastest was disturbed: on an idle machine the spread of
# these calls stays well under 2x, while another process on the same cores can stall OpenMP's spin-waiting
# threads (one tiny call on a loaded 2-core machine took 200x its usual time).
BUSY_SPREAD = 3.0


def optional_torch() -> Any:
    """The torch module, or None where torch is not installed (the bench runs its numpy and numba parts alone)."""
    try:
        import torch
    except ImportError:
        return None
    return torch


class Clock:
    """Times one call in milliseconds: wall clock on the host, CUDA events (then a synchronize) on a GPU.
    ``device_api`` is 'host', 'torch-cuda' or 'numba-cuda'."""

    def __init__(self, device_api: str):
        self.device_api = device_api

    def sync(self) -> None:
        """Wait for the device's queued work (nothing on the host)."""
        if self.device_api == "torch-cuda":
            optional_torch().cuda.synchronize()
        elif self.device_api == "numba-cuda":
            from numba import cuda

            cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        """Milliseconds ``fn`` took, and its result."""
        self.sync()
        if self.device_api == "torch-cuda":
            torch = optional_torch()
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


def time_calls(fn: Callable[[], Any], repeats: int, clock: Clock, *, before: Callable[[], Any] | None = None,
               warmup: int = 1) -> list[float]:
    """Milliseconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (the first call compiles).
    ``before`` runs untimed ahead of every call (torch's backward needs a fresh graph each time)."""
    for _ in range(warmup):
        if before is not None:
            before()
        clock.time(fn)
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        ms, result = clock.time(fn)
        del result
        times.append(ms)
    return times


@dataclass(frozen=True)
class TimingStats:
    """Order statistics of a list of call times in ms. Percentiles interpolate linearly between samples, so with
    the default 10 calls P99 lies between the two slowest calls; ask for 100 or more for a P99 of its own."""

    n: int
    min_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, times_ms: Sequence[float]) -> "TimingStats":
        """The statistics of ``times_ms`` (at least one sample)."""
        t = np.asarray(times_ms, dtype=np.float64)
        if t.size == 0:
            raise ValueError("times_ms: no samples")
        p50, p95, p99 = np.percentile(t, [50, 95, 99])
        return cls(int(t.size), float(t.min()), float(p50), float(p95), float(p99), float(t.max()))

    @property
    def spread(self) -> float:
        """Slowest over fastest call: far above 1 means something else ran on the machine meanwhile."""
        return self.max_ms / self.min_ms if self.min_ms > 0 else math.inf

    @property
    def busy(self) -> bool:
        """Whether the spread says the machine was busy (``BUSY_SPREAD``)."""
        return self.spread > BUSY_SPREAD


def timing_fields(stats: TimingStats | None) -> dict[str, Any]:
    """The timing columns of a report record (repeats, min/median/P95/P99/max ms, spread); None where nothing was
    timed. The decode and varlen rows use it; the sweep's ``Row.record`` spells the same keys out."""
    if stats is None:
        return {"repeats": 0, "min_ms": None, "median_ms": None, "p95_ms": None, "p99_ms": None, "max_ms": None,
                "spread": None}
    return {"repeats": stats.n, "min_ms": stats.min_ms, "median_ms": stats.p50_ms, "p95_ms": stats.p95_ms,
            "p99_ms": stats.p99_ms, "max_ms": stats.max_ms, "spread": stats.spread}


#: What a disturbed measurement means and what to do about it, said once however many measurements were disturbed.
BUSY_ADVICE = ("the machine was probably busy (another process on these cores stalls OpenMP's spin-waiting "
               "threads). Trust min and P50 over P95/P99 and max, or rerun on an idle machine.")


def busy_measurement(label: str, stats: TimingStats) -> str:
    """What was disturbed in one measurement, about 90 characters: its label, spread and range."""
    return (f"{label}: the slowest of {stats.n} calls took {stats.spread:.1f}x the fastest "
            f"({stats.min_ms:.3g} ms to {stats.max_ms:.3g} ms)")


def busy_note(label: str, stats: TimingStats) -> str:
    """The warning printed under the table for a disturbed measurement."""
    return f"noisy: {busy_measurement(label, stats)}; {BUSY_ADVICE}"


def busy_warning(measurements: Sequence[tuple[str, TimingStats]]) -> str:
    """One message for every disturbed ``(label, stats)``: the advice once, wrapped, then a line per measurement
    (a warning prints its message as it is, and one line per measurement joined together ran to ~1000
    characters)."""
    head = f"{len(measurements)} noisy measurement{'s' if len(measurements) > 1 else ''}: {BUSY_ADVICE}"
    return "\n".join(textwrap.wrap(head, width=100) + [f"  {busy_measurement(*m)}" for m in measurements])


@contextlib.contextmanager
def matched_torch_threads() -> Iterator[int | None]:
    """For the block, give torch as many intra-op threads as Numba uses, so both sides of a comparison get the
    same cores; torch's own setting comes back afterwards (a notebook keeps its thread count). Yields the count,
    or None when torch is not installed."""
    torch = sys.modules.get("torch") or optional_torch()
    if torch is None:
        yield None
        return
    import numba

    before = torch.get_num_threads()
    threads = numba.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)
