"""``numba-flash bench``: time every attention backend against naive attention and torch SDPA.

From Python (a notebook, a script)::

    from numba_flash import bench
    res = bench.run("llama_small", seqlen=[256, 512, 1024], causal=True, compare=["naive", "torch"])
    res                      # the table (P50/P95/P99 ms, TFLOP/s, peak memory, speedups, max error)
    res.to_dataframe()       # with pandas
    res.plot()               # TFLOP/s vs sequence length, log y, error bars; a matplotlib Figure

From a shell::

    numba-flash bench                                   # the README's main job: backends vs numpy naive vs SDPA
    python -m numba_flash.bench --config llama_med --causal
    numba-flash bench --seqlen 512,1024,2048 --no-grad --plot tflops.png --csv sweep.csv

For each backend (default: every one ``backend_registry.available("flash")`` lists) and each peer it measures
min / P50 / P95 / P99 / max milliseconds per pass (fwd, bwd), TFLOP/s (``numba_flash.semantics.attention_flops``
over the median), the peak extra memory the call allocated (``memory``) and how much less that is than naive
attention, the speedup over naive attention and over torch SDPA on the same device, and the max abs error against
the float64 reference. Every function is called once before timing: the first call compiles. A pass whose slowest
call took more than ``harness.BUSY_SPREAD`` times its fastest is reported as noisy (the machine was busy).

Two other modes: ``--decode`` (``decode``: one KV-cache decoding step per cache length against torch SDPA and a
memory copy of the same bytes, in GB/s and as a fraction of the copy's) and ``--varlen`` (``varlen``: the packed
forward over a long-tailed mix of lengths against a dense forward of the same work).

Modules: ``cases`` (sizes, inputs, reference), ``harness`` (clocks, timing loop, statistics; shared with the asv
suite), ``memory``, ``runners`` (how each backend and peer is called), ``engine`` (``run``), ``decode``,
``varlen``, ``results``, ``report`` (tables, files), ``plot``, ``cli``. Importing this package imports neither torch
nor matplotlib, pandas, tqdm, tabulate or threadpoolctl; each is imported where it is used.
"""

from __future__ import annotations

from typing import Sequence

from .cases import (CONFIGS, DEFAULT_CONFIG, DTYPES, PASSES, BenchArgumentError, Case, Inputs, Reference, Skip,
                    make_cases, to_host64)
from .cli import build_parser, parse_args
from .decode import (DecodeCase, DecodeInputs, DecodeRow, Step, backend_step, copy_step, execute_decode,
                     make_decode_cases, run_decode_case, sdpa_step)
from .engine import execute, resolve_runners, run, run_case, run_pass
from .harness import BUSY_SPREAD, Clock, TimingStats, matched_torch_threads, time_calls
from .memory import (available_host_bytes, fits_in_memory, host_memory_method, measure_gpu_peak,
                     measure_host_peak, naive_bytes, reference_bytes)
from .plot import plot_rows, write_plot
from .report import format_table, machine_info, write_csv, write_json
from .results import BenchResults, NoisyTimingWarning
from .rows import CSV_COLUMNS, Row
from .runners import BackendRunner, NaiveNumpyRunner, Runner, TorchRunner, make_runner, torch_cuda_available
from .varlen import (VarlenCase, VarlenInputs, VarlenRow, draw_lengths, execute_varlen, make_varlen_case,
                     varlen_calls)



def main(argv: Sequence[str] | None = None) -> int:
    """``python -m numba_flash.bench [bench] ARGS`` from Python; returns the exit status. The command line lives in
    ``numba_flash.cli`` (``bench_main``), which builds on ``bench.cli``; this facade only hands over."""
    from ..cli import bench_main

    return bench_main(argv)


__all__ = [
    "CONFIGS", "DEFAULT_CONFIG", "DTYPES", "PASSES", "CSV_COLUMNS", "BUSY_SPREAD",
    "run", "BenchResults", "Row", "NoisyTimingWarning", "BenchArgumentError",
    "Case", "Inputs", "Reference", "Skip", "make_cases", "to_host64",
    "Clock", "TimingStats", "time_calls", "matched_torch_threads",
    "measure_host_peak", "measure_gpu_peak", "host_memory_method", "available_host_bytes", "fits_in_memory",
    "naive_bytes", "reference_bytes",
    "Runner", "BackendRunner", "NaiveNumpyRunner", "TorchRunner", "make_runner", "torch_cuda_available",
    "run_pass", "run_case", "execute", "resolve_runners",
    "format_table", "machine_info", "write_csv", "write_json", "plot_rows", "write_plot",
    "build_parser", "parse_args", "main",
    "DecodeCase", "DecodeInputs", "DecodeRow", "Step", "backend_step", "sdpa_step", "copy_step",
    "make_decode_cases", "run_decode_case", "execute_decode",
    "VarlenCase", "VarlenInputs", "VarlenRow", "varlen_calls", "draw_lengths", "make_varlen_case", "execute_varlen",
]
