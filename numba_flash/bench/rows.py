"""One line of a bench report: ``Row``, a runner's pass on a case, and ``CSV_COLUMNS``, its fields as a record.

Apart from ``results`` (which gathers rows and shows them through ``report`` and ``plot``) so that those two read
rows without importing the module that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cases import Case
from .harness import TimingStats

CSV_COLUMNS = ("config", "batch", "nheads", "nheads_kv", "seqlen", "headdim", "causal", "dtype", "layout",
               "precision", "name", "kind", "device", "pass", "status", "repeats", "min_ms", "median_ms",
               "p95_ms", "p99_ms", "max_ms", "spread", "flops", "tflops", "peak_mem_bytes", "mem_saved_vs_naive",
               "speedup_vs_naive", "speedup_vs_sdpa", "max_err")


@dataclass
class Row:
    """One line of the report: a runner's pass on a case. ``status`` is 'ok', 'skipped: ...' or 'error: ...'."""

    case: Case
    name: str
    kind: str           # 'backend' or 'peer'
    device: str
    pass_: str
    status: str = "ok"
    times_ms: list[float] | None = None
    peak_mem_bytes: int | None = None
    max_err: float | None = None
    speedup_vs_naive: float | None = None
    speedup_vs_sdpa: float | None = None
    mem_saved_vs_naive: float | None = None

    @property
    def stats(self) -> TimingStats | None:
        """Min, P50, P95, P99 and max of the timed calls; None when nothing was timed."""
        return TimingStats.of(self.times_ms) if self.times_ms else None

    @property
    def median_ms(self) -> float | None:
        """P50 of the timed calls."""
        return self.stats.p50_ms if self.times_ms else None

    @property
    def tflops(self) -> float | None:
        """TFLOP/s at the median time."""
        med = self.median_ms
        return self.case.flops(self.pass_) / (med * 1e-3) / 1e12 if med else None

    def tflops_at(self, ms: float) -> float:
        """TFLOP/s of this pass at a call time of ``ms``."""
        return self.case.flops(self.pass_) / (ms * 1e-3) / 1e12

    @property
    def label(self) -> str:
        """``cpu (cpu) fwd S=256``: the row in the notes."""
        return f"{self.name} ({self.device}) {self.pass_} S={self.case.seqlen}"

    def record(self) -> dict[str, Any]:
        """The row as a flat dict with the keys of ``CSV_COLUMNS`` (None where nothing was measured)."""
        c, s = self.case, self.stats
        return {
            "config": c.config, "batch": c.batch, "nheads": c.nheads, "nheads_kv": c.nheads_kv, "seqlen": c.seqlen,
            "headdim": c.headdim, "causal": c.causal, "dtype": c.dtype, "layout": c.layout,
            "precision": c.precision, "name": self.name,
            "kind": self.kind, "device": self.device, "pass": self.pass_, "status": self.status,
            "repeats": s.n if s else 0, "min_ms": s.min_ms if s else None, "median_ms": s.p50_ms if s else None,
            "p95_ms": s.p95_ms if s else None, "p99_ms": s.p99_ms if s else None, "max_ms": s.max_ms if s else None,
            "spread": s.spread if s else None, "flops": c.flops(self.pass_), "tflops": self.tflops,
            "peak_mem_bytes": self.peak_mem_bytes, "mem_saved_vs_naive": self.mem_saved_vs_naive,
            "speedup_vs_naive": self.speedup_vs_naive, "speedup_vs_sdpa": self.speedup_vs_sdpa,
            "max_err": self.max_err,
        }


__all__ = ["CSV_COLUMNS", "Row"]
