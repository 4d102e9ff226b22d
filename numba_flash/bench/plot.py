"""TFLOP/s against sequence length, one line per backend or peer and pass.

The figure is a bare ``matplotlib.figure.Figure`` (or the caller's axes), never one from pyplot and never after
``matplotlib.use``: a bench run inside a notebook leaves the notebook's inline backend, and its figures, alone.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

from .cases import Case
from .rows import Row


def title_for(cases: Sequence[Case], meta: dict[str, Any]) -> str:
    """The whole case (heads, kv heads, head dim, causal, dtype, layout), the threads and the CPU, in one line."""
    if not cases:
        return "no cases"
    c = cases[0]
    threads = f"numba {meta.get('numba_threads', '?')} threads"
    if "torch_threads" in meta:
        threads += f", torch {meta['torch_threads']}"
    return (f"{c.describe([x.seqlen for x in cases])} | {threads} | {meta.get('cpu', '?')}"
            + (f" | {meta['gpu']}" if "gpu" in meta else ""))


def plot_rows(rows: Sequence[Row], ax: Any = None, title: str = "") -> Any:
    """Draw the measured rows into ``ax`` (a new figure when None) and return the figure. Each point is the
    TFLOP/s at the median time; its bar runs from the TFLOP/s at the P95 time (bottom) to that of the fastest call
    (top). The y axis is logarithmic: backends and peers differ by orders of magnitude."""
    if ax is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(8, 4.8))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    series: dict[str, list[Row]] = {}
    for r in rows:
        if r.status == "ok" and r.times_ms and r.tflops:
            series.setdefault(f"{r.name} ({r.device}) {r.pass_}", []).append(r)
    for label, pts in sorted(series.items()):
        pts.sort(key=lambda r: r.case.seqlen)
        x = [r.case.seqlen for r in pts]
        y = [r.tflops for r in pts]
        low = [r.tflops - r.tflops_at(r.stats.p95_ms) for r in pts]
        high = [r.tflops_at(r.stats.min_ms) - r.tflops for r in pts]
        ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=label)
    ax.set_xscale("log", base=2)
    lengths = sorted({r.case.seqlen for pts in series.values() for r in pts})
    if lengths:
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_xticks(lengths)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("TFLOP/s (median; bars: P95 to fastest call)")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def supported_formats() -> dict[str, str]:
    """Image formats matplotlib can write, by file extension; importing it does not select a backend."""
    from matplotlib.backend_bases import FigureCanvasBase

    return FigureCanvasBase.get_supported_filetypes()


def plot_format_problem(path: str) -> str | None:
    """Why ``path`` cannot be a plot file (no matplotlib, or an extension it cannot write), else None."""
    try:
        formats = supported_formats()
    except ImportError:
        return "needs matplotlib (pip install matplotlib)"
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext not in formats:
        return (f"the file name must end in one of {', '.join('.' + f for f in sorted(formats))} "
                f"(it picks the image format)")
    return None


def write_plot(path: str, rows: Sequence[Row], title: str) -> None:
    """Save the plot of ``rows`` to ``path``; the extension picks the format."""
    plot_rows(rows, title=title).savefig(path, dpi=120)
