"""Running the bench: one pass of one runner (``run_pass``), every runner on one case (``run_case``), and the
whole sweep as a Python call (``run``), which the command line wraps."""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from .. import bench_peers
from . import memory
from .cases import PASSES, BenchArgumentError, Case, Inputs, Reference, Skip, make_cases, to_host64
from .harness import Clock, busy_note, matched_torch_threads, time_calls
from .memory import fits_in_memory, gib, measure_peak, reference_bytes
from .results import BenchResults
from .rows import Row
from .runners import Runner, make_runner, torch_cuda_available


def run_pass(runner: Runner, case: Case, pass_: str, repeats: int, ref: Reference | None) -> Row:
    """Warm up, time ``repeats`` calls, then measure memory and error on one more call."""
    row = Row(case, runner.name, runner.kind, runner.device, pass_)
    clock = Clock(runner.device_api)
    if pass_ == "fwd":
        fn, before = runner.forward, None
    else:
        fn, before = runner.backward, runner.before_backward
    row.times_ms = time_calls(fn, repeats, clock, before=before)
    if before is not None:
        before()
    row.peak_mem_bytes, result = measure_peak(fn, runner.device, runner.device_api)
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
    if ref is not None and not fits_in_memory(reference_bytes(case), memory.available_host_bytes()):
        ref = None
        if notes is not None:
            notes.append(f"max err not computed at S={case.seqlen}: the float64 reference needs about "
                         f"{gib(reference_bytes(case))} of host memory (more than is available)")
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


@contextlib.contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """A ``tqdm.auto`` bar (a widget in Jupyter, text on stderr elsewhere) ticked once per pass; a no-op when
    disabled or when tqdm is missing. A widget also prints its final state as a line of text when it closes."""
    bar = None
    if enabled:
        try:
            from tqdm.auto import tqdm

            bar = tqdm(total=total, file=sys.stderr, unit="pass", desc="bench")
        except ImportError:
            bar = None
    try:
        yield (bar.update if bar is not None else (lambda *a: None))
    finally:
        if bar is not None:
            bar.close()
            if _is_widget(bar):
                # A saved notebook keeps a widget's text form as it was first shown (0/total): its later states
                # travel as widget messages, which nbclient, GitHub and the docs do not keep. One line of text
                # keeps where the bar ended.
                print(str(bar), file=sys.stderr, flush=True)


def _is_widget(bar: Any) -> bool:
    """Whether ``bar`` is tqdm's notebook widget (asked without importing tqdm.notebook, which imports IPython)."""
    notebook = sys.modules.get("tqdm.notebook")
    return notebook is not None and isinstance(bar, notebook.tqdm)


def _names(value: str | Sequence[str] | None) -> list[str] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [x.strip() for x in items if x.strip()]


def resolve_runners(backends: str | Sequence[str] | None, compare: str | Sequence[str] | None
                    ) -> list[tuple[str, str]]:
    """``(name, kind)`` of every runner: the named backends (default: every available one) and peers (default:
    naive and torch, plus torch_naive where torch sees a GPU; 'none' for none). BenchArgumentError for an
    unknown name or nothing to run."""
    from numba_flash import backend_registry

    chosen = _names(backends)
    registered = backend_registry.names("flash")
    if chosen is None:
        chosen = backend_registry.available("flash")
    else:
        unknown = [x for x in chosen if x not in registered]
        if unknown or not chosen:
            raise BenchArgumentError(f"backend: unknown backend {', '.join(unknown) or repr(backends)}; "
                                     f"registered: {', '.join(registered)}")
    peers = _names(compare)
    if peers is None:
        peers = ["naive", "torch", "torch_naive"] if torch_cuda_available() else ["naive", "torch"]
    if peers == ["none"]:
        peers = []
    bad = [x for x in peers if x not in bench_peers.PEERS]
    if bad:
        raise BenchArgumentError(f"compare: unknown peer {', '.join(bad)}; choose from "
                                 f"{', '.join(bench_peers.PEERS)} or none")
    runners = [(n, "backend") for n in chosen] + [(n, "peer") for n in peers]
    if not runners:
        raise BenchArgumentError("nothing to run: no backend available and no peer to compare with")
    return runners


def execute(cases: Sequence[Case], runner_specs: Sequence[tuple[str, str]], *, grad: bool = True,
            repeats: int = 10, check: bool = True, seed: int | None = None, progress: bool | None = None,
            on_start: Callable[[dict[str, Any]], None] | None = None) -> BenchResults:
    """Run ``runner_specs`` on ``cases`` with torch's thread count matched to Numba's for the duration.
    ``on_start`` gets the run's metadata before the first call (the command line prints its header then)."""
    from .report import machine_info

    passes = PASSES if grad else ("fwd",)
    seed = seed if seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    rng = np.random.default_rng(seed)
    rows: list[Row] = []
    notes: list[str] = []
    with matched_torch_threads():
        meta = machine_info()
        meta.update(seed=seed, repeats=repeats)
        if on_start is not None:
            on_start(meta)
        total = len(cases) * len(runner_specs) * len(passes)
        with progress_bar(total, enabled=len(cases) > 1 if progress is None else progress) as tick:
            for case in cases:
                runners = [make_runner(n, k) for n, k in runner_specs]
                rows.extend(run_case(case, runners, passes, repeats, check, rng, tick, notes))
    results = BenchResults(rows, meta, notes)
    results.notes.extend(busy_note(r.label, r.stats) for r in results.noisy)
    return results


def run(config: str | None = None, *, batch: int | None = None, nheads: int | None = None,
        nheads_kv: int | None = None, seqlen: int | Sequence[int] | None = None, headdim: int | None = None,
        causal: bool = False, dtype: str = "fp32", layout: str = "bshd", precision: str = "ieee",
        backends: str | Sequence[str] | None = None, compare: str | Sequence[str] | None = None,
        grad: bool = True, repeats: int = 10, check: bool = True, seed: int | None = None,
        progress: bool | None = None) -> BenchResults:
    """Time attention backends against naive attention and torch SDPA; the Python face of ``numba-flash bench``.

    Arguments:
        config: a seed size (``CONFIGS``: tiny, small, medium, llama_small (default), llama_med, s2048, s4096);
            batch, nheads, nheads_kv (GQA), headdim override its fields; seqlen is one length or a sweep.
        causal, dtype ('fp32', 'fp16', 'bf16' or the full names), layout ('bshd' or 'bhsd'): the case.
        precision: 'ieee' (default) or 'tf32': float32 products may run in TF32 where a backend can (the cuda
            backend, docs/guide/cuda.md "TF32") and in torch's matmuls (allow_tf32, for the torch peers).
        backends: names (list or comma-separated) of registry backends; default every available one.
        compare: peers from 'naive', 'torch', 'torch_naive', or 'none'; default naive and torch (and torch_naive
            where torch sees a GPU).
        grad: time the backward too. repeats: timed calls per pass, after one warm-up call. check: max error
            against the float64 reference. seed: of the random N(0, 1) inputs (default fresh).
        progress: a ``tqdm.auto`` bar (a widget in Jupyter); default on for a sweep.

    Returns ``BenchResults``: the rows (P50/P95/P99 times, TFLOP/s, peak memory, speedups, max error) with
    ``records()``, ``to_dataframe()``, ``table()`` and ``plot()``. Emits a ``NoisyTimingWarning`` when some
    timings spread so much that the machine was evidently busy. torch's thread count is matched to Numba's during
    the run and restored afterwards. Raises ``BenchArgumentError`` (a ValueError) for a bad setting.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise BenchArgumentError(f"repeats: expected a positive integer, got {repeats!r}")
    cases = make_cases(config, batch=batch, nheads=nheads, nheads_kv=nheads_kv, seqlen=seqlen, headdim=headdim,
                       causal=causal, dtype=dtype, layout=layout, precision=precision)
    results = execute(cases, resolve_runners(backends, compare), grad=grad, repeats=repeats, check=check,
                      seed=seed, progress=progress)
    results.warn_if_noisy()
    return results
