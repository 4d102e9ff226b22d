"""The bench's text: the machine it ran on (threadpoolctl names the BLAS and OpenMP libraries in use), the table
(tabulate), the notes under it, and the CSV and JSON files."""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import sys
from typing import Any, Sequence

import numpy as np

from .memory import host_memory_method
from .rows import CSV_COLUMNS, Row

HEADERS = ("seqlen", "name", "device", "pass", "min ms", "p50 ms", "p95 ms", "p99 ms", "max ms", "TFLOP/s",
           "peak MiB", "mem saved", "x naive", "x sdpa", "max err")


def thread_pools() -> list[dict[str, Any]]:
    """The BLAS and OpenMP libraries loaded in this process with their thread counts (threadpoolctl), or [] when
    threadpoolctl is missing."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    # OpenMP runtimes all report internal_api 'openmp'; their prefix (libgomp, libiomp5, libomp) says which.
    return [{"library": d.get("prefix") if d.get("internal_api") == "openmp" else d.get("internal_api"),
             "api": d.get("user_api"),
             "version": d.get("version"), "threads": d.get("num_threads"),
             "file": os.path.basename(d.get("filepath") or "")} for d in threadpool_info()]


def describe_pools(pools: Sequence[dict[str, Any]]) -> str:
    """``thread_pools()`` in one line for the header."""
    if not pools:
        return ("unknown (pip install threadpoolctl to list them); OPENBLAS_NUM_THREADS="
                f"{os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
                f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    return ", ".join(f"{p['library']}{' ' + p['version'] if p['version'] else ''} ({p['threads']} threads, "
                     f"{p['file']})" for p in pools)


def machine_info() -> dict[str, Any]:
    """Where and with what a run happens: date, command, CPU, versions, thread counts, memory method."""
    import numba

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    from .. import __version__

    pools = thread_pools()
    info: dict[str, Any] = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in getattr(sys, "orig_argv", sys.argv)),
        "host": platform.node(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "python": platform.python_version(), "numpy": np.__version__, "numba": numba.__version__,
        "numba_flash": __version__, "numba_threads": numba.get_num_threads(),
        "thread_pools": pools, "blas_threads": describe_pools(pools),
        "host_memory": host_memory_method(),
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
    return info


def header_lines(meta: dict[str, Any], case_text: str, repeats: int, check: bool) -> list[str]:
    """The lines printed above the table."""
    return [
        f"numba-flash {meta['numba_flash']} bench | {meta['date']}",
        f"machine: {meta['cpu']}, {meta['cpu_count']} cores" + (f", GPU {meta['gpu']}" if "gpu" in meta else ""),
        f"versions: python {meta['python']}, numpy {meta['numpy']}, numba {meta['numba']}"
        + (f", torch {meta['torch']}" if "torch" in meta else ", torch not installed"),
        f"threads: numba {meta['numba_threads']}"
        + (f", torch {meta['torch_threads']} (matched to numba's for the run)" if "torch" in meta else ""),
        f"BLAS/OpenMP in use: {meta['blas_threads']}",
        f"command: {meta['command']}",
        f"case: {case_text}; seed {meta.get('seed')}",
        f"timing: {repeats} calls per pass after one warm-up call (the first call compiles); CUDA events on GPUs. "
        f"peak memory: {meta['host_memory']} on the CPU. max err: max abs vs float64 reference"
        + ("" if check else " (skipped)"),
    ]


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def format_table(rows: Sequence[Row], tablefmt: str = "simple") -> str:
    """The measured rows as a table, then one line per skipped or failed row."""
    try:
        from tabulate import tabulate
    except ImportError:
        raise ImportError("the bench's table needs tabulate: pip install 'numba-flash[bench]'") from None
    body = []
    for r in rows:
        s = r.stats
        if r.status != "ok" or s is None:
            continue
        body.append((r.case.seqlen, r.name, r.device, r.pass_, _fmt(s.min_ms, ".3f"), _fmt(s.p50_ms, ".3f"),
                     _fmt(s.p95_ms, ".3f"), _fmt(s.p99_ms, ".3f"), _fmt(s.max_ms, ".3f"), _fmt(r.tflops, ".4f"),
                     _fmt(None if r.peak_mem_bytes is None else r.peak_mem_bytes / 2**20, ".1f"),
                     "-" if r.mem_saved_vs_naive is None else f"{100 * r.mem_saved_vs_naive:.0f}%",
                     _fmt(r.speedup_vs_naive, ".2f"), _fmt(r.speedup_vs_sdpa, ".2f"), _fmt(r.max_err, ".1e")))
    text = tabulate(body, headers=HEADERS, tablefmt=tablefmt, disable_numparse=True,
                    colalign=("right",) * len(HEADERS)) if body else "(nothing measured)"
    others = [f"{r.name} ({r.device}) {r.pass_} S={r.case.seqlen}: {r.status}" for r in rows if r.status != "ok"]
    if tablefmt == "html":
        from html import escape

        return text + "".join(f"<p>{escape(line)}</p>" for line in others)
    return "\n".join([text] + others)


def write_csv(path: str, rows: Sequence[Any], columns: Sequence[str] = CSV_COLUMNS) -> None:
    """One line per row (anything with ``record()``: the dense bench's ``Row``, the decode and varlen rows),
    ``columns`` (default ``CSV_COLUMNS``); empty where nothing was measured."""
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns))
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if v is None else v) for k, v in r.record().items()})


def write_json(path: str, rows: Sequence[Row], meta: dict[str, Any]) -> None:
    """``{"meta": ..., "results": [record, ...]}``."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": [r.record() for r in rows]}, f, indent=1)


DECODE_HEADERS = ("cache len", "name", "device", "min ms", "p50 ms", "p95 ms", "p99 ms", "GB/s", "% of copy",
                  "x sdpa", "max err")


def format_decode_table(rows: Sequence[Any]) -> str:
    """``--decode``'s measured rows (``decode.DecodeRow``) as a table, then one line per skipped or failed row."""
    from tabulate import tabulate

    body = [(r.case.cache_len, r.name, r.device, _fmt(r.stats.min_ms, ".3f"), _fmt(r.stats.p50_ms, ".3f"),
             _fmt(r.stats.p95_ms, ".3f"), _fmt(r.stats.p99_ms, ".3f"), _fmt(r.gbps, ".3g"),
             "-" if r.frac_of_copy is None else f"{100 * r.frac_of_copy:.3g}%", _fmt(r.speedup_vs_sdpa, ".2f"),
             _fmt(r.max_err, ".1e")) for r in rows if r.status == "ok"]
    text = tabulate(body, headers=DECODE_HEADERS, disable_numparse=True, colalign=("right",) * len(DECODE_HEADERS))
    return "\n".join([text] + [f"{r.label}: {r.status}" for r in rows if r.status != "ok"])


VARLEN_HEADERS = ("name", "form", "seqs", "tokens", "min ms", "p50 ms", "p95 ms", "p99 ms", "TFLOP/s",
                  "Mtok/s", "work time / dense", "max err")


def format_varlen_table(rows: Sequence[Any]) -> str:
    """``--varlen``'s measured rows (``varlen.VarlenRow``) as a table, then one line per skipped or failed row."""
    from tabulate import tabulate

    body = []
    for r in rows:
        if r.status != "ok":
            continue
        rec = r.record()
        body.append((r.name, r.form, rec["n_seqs"], rec["tokens"], _fmt(rec["min_ms"], ".2f"),
                     _fmt(rec["median_ms"], ".2f"), _fmt(rec["p95_ms"], ".2f"), _fmt(rec["p99_ms"], ".2f"),
                     _fmt(r.tflops, ".4f"), _fmt(r.tokens_per_s and r.tokens_per_s / 1e6, ".3f"),
                     _fmt(r.work_time_vs_dense, ".2f"), _fmt(r.max_err, ".1e")))
    text = tabulate(body, headers=VARLEN_HEADERS, disable_numparse=True, colalign=("right",) * len(VARLEN_HEADERS))
    return "\n".join([text] + [f"{r.label}: {r.status}" for r in rows if r.status != "ok"])
