"""``numba-flash bench --host-overhead``: what a tiny call costs on the host, against torch SDPA on the same call.

Tiny calls (decode steps, small heads, short sequences) are where a library's own Python shows: checks, dispatch,
argument conversion, thread pools woken. Each row times one call kind on one path, and torch SDPA on the same
inputs in the same run, interleaved in rounds so that a neighbour's load falls on both sides alike:

* backend ``cpu``: ``backend_registry.get("flash", backend="cpu")`` on numpy arrays (``op.forward``,
  ``op.forward`` then ``op.backward``, ``op.with_kvcache``);
* backend ``torch``: the torch faces on CPU tensors (``flash_attn_func``, with ``loss.backward()``,
  ``flash_attn_with_kvcache``), on whichever backend the registry picks for them;
* backend ``cuda``: the cuda backend's planned calls with torch tensors and the driver's launch replaced by a
  recording stub (``host_overhead_cuda``, float16, run in a subprocess under the simulator); no GPU, so no SDPA:
  their goal is a P95 in microseconds (``host_overhead_cuda.GOALS_US``), not a ratio.

Calls: ``forward``; ``forward_backward`` (a training step's attention: forward, then backward; SDPA's the same
through autograd); ``decode`` (one query token appended to a KV cache at a fixed position, so every call does the
same work). Sizes are the contract's tiny call: B = 1, H = 8, D = 64, float32, "bshd", with Sq = 1, Sk = 16 and
Sq = Sk = 64.

The cases are a table (``host_cases``): a row is a ``HostCase`` whose ``setup`` returns the timed callable and
whose ``sdpa`` (optional) returns torch SDPA's on the same inputs. Another device's rows (the cuda backend with
the driver's launch replaced by a recording stub, which has no SDPA to compare with) are ``HostCase`` rows with
``sdpa=None``, passed to ``measure`` with the others. Goals live here, not in tests: a tiny call's P50 at most
``GOAL_RATIO`` x torch SDPA's on this CPU (design.md, "host path").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

GOAL_RATIO = 3.0
SIZES = ((1, 16), (64, 64))   # (Sq, Sk): a decode step's shape, a short sequence
BATCH, NHEADS, HEADDIM = 1, 8, 64
CALLS = ("forward", "forward_backward", "decode")


@dataclass(frozen=True)
class HostCase:
    """One row: ``setup(rng)`` prepares inputs and returns the call to time (no arguments); ``sdpa(rng)``, when
    given, does the same for torch SDPA on the same call (the same seed gives it the same inputs)."""

    backend: str
    call: str
    seqlen_q: int
    seqlen_k: int
    setup: Callable[[np.random.Generator], Callable[[], Any]]
    sdpa: Callable[[np.random.Generator], Callable[[], Any]] | None = None

    def describe(self) -> str:
        return f"{self.backend} {self.call} B={BATCH} H={NHEADS} D={HEADDIM} Sq={self.seqlen_q} Sk={self.seqlen_k}"


def _arrays(rng: np.random.Generator, sq: int, sk: int) -> tuple[np.ndarray, ...]:
    """q (1, Sq, 8, 64), k, v (1, Sk, 8, 64), dout like q: float32 N(0, 1), "bshd"."""
    q = rng.standard_normal((BATCH, sq, NHEADS, HEADDIM), dtype=np.float32)
    k, v = (rng.standard_normal((BATCH, sk, NHEADS, HEADDIM), dtype=np.float32) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape, dtype=np.float32)


def _cache(rng: np.random.Generator, sk: int) -> tuple[np.ndarray, ...]:
    """A decode step: q (1, 1, 8, 64), caches (1, Sk + 1, 8, 64) holding Sk - 1 keys, one new key and value."""
    q, k_new, v_new, _ = _arrays(rng, 1, 1)
    k_cache, v_cache = (rng.standard_normal((BATCH, sk + 1, NHEADS, HEADDIM), dtype=np.float32) for _ in range(2))
    return q, k_cache, v_cache, k_new, v_new


def _cpu_setup(call: str, sq: int, sk: int) -> Callable[[np.random.Generator], Callable[[], Any]]:
    def setup(rng: np.random.Generator) -> Callable[[], Any]:
        from numba_flash import backend_registry

        op = backend_registry.get("flash", backend="cpu")
        if call == "decode":
            q, k_cache, v_cache, k_new, v_new = _cache(rng, sk)
            return lambda: op.with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=sk - 1)
        q, k, v, dout = _arrays(rng, sq, sk)
        if call == "forward":
            return lambda: op.forward(q, k, v)

        def step() -> Any:
            out, lse = op.forward(q, k, v, return_lse=True)
            return op.backward(dout, q, k, v, out, lse)
        return step
    return setup


def _torch_inputs(rng: np.random.Generator, call: str, sq: int, sk: int) -> tuple[Any, ...]:
    import torch

    if call == "decode":
        return tuple(torch.from_numpy(a) for a in _cache(rng, sk))
    q, k, v, dout = (torch.from_numpy(a) for a in _arrays(rng, sq, sk))
    if call == "forward_backward":
        q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    return q, k, v, dout


def _torch_setup(call: str, sq: int, sk: int) -> Callable[[np.random.Generator], Callable[[], Any]]:
    def setup(rng: np.random.Generator) -> Callable[[], Any]:
        import numba_flash

        inputs = _torch_inputs(rng, call, sq, sk)
        if call == "decode":
            q, k_cache, v_cache, k_new, v_new = inputs
            return lambda: numba_flash.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                                               cache_seqlens=sk - 1)
        q, k, v, dout = inputs
        if call == "forward":
            return lambda: numba_flash.flash_attn_func(q, k, v)
        return lambda: numba_flash.flash_attn_func(q, k, v).backward(dout)
    return setup


def _sdpa_setup(call: str, sq: int, sk: int) -> Callable[[np.random.Generator], Callable[[], Any]]:
    """torch SDPA on the same inputs ("bhsd" views of the same memory, as a caller converting would pass)."""
    def setup(rng: np.random.Generator) -> Callable[[], Any]:
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        inputs = _torch_inputs(rng, call, sq, sk)
        if call == "decode":
            q, k_cache, v_cache, k_new, v_new = inputs

            def step() -> Any:   # the same work: write the new key and value, attend over the Sk keys
                k_cache[:, sk - 1] = k_new[:, 0]
                v_cache[:, sk - 1] = v_new[:, 0]
                return sdpa(q.transpose(1, 2), k_cache[:, :sk].transpose(1, 2), v_cache[:, :sk].transpose(1, 2))
            return step
        q, k, v, dout = inputs
        if call == "forward":
            return lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return lambda: sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).backward(
            dout.transpose(1, 2))
    return setup


def host_cases(backends: Sequence[str] = ("cpu", "torch"), calls: Sequence[str] = CALLS,
               sizes: Sequence[tuple[int, int]] = SIZES, torch_available: bool = True) -> list[HostCase]:
    """The table of rows: each backend x call x size (decode steps take Sk as the cache length and Sq = 1, once
    per Sk). ``torch_available`` False drops the torch rows and the SDPA comparison."""
    rows = []
    for backend in backends:
        if backend == "torch" and not torch_available:
            continue
        setup = {"cpu": _cpu_setup, "torch": _torch_setup}[backend]
        for call in calls:
            for sq, sk in sizes:
                sq = 1 if call == "decode" else sq
                if call == "decode" and any(r.call == "decode" and r.backend == backend and r.seqlen_k == sk
                                            for r in rows):
                    continue
                rows.append(HostCase(backend, call, sq, sk, setup(call, sq, sk),
                                     _sdpa_setup(call, sq, sk) if torch_available else None))
    return rows


def _percentile_us(samples: Sequence[float], pct: float) -> float:
    return float(np.percentile(np.asarray(samples), pct)) * 1e6


def _time_into(fn: Callable[[], Any], n: int, samples: list[float]) -> None:
    clock = time.perf_counter
    for _ in range(n):
        t0 = clock()
        fn()
        samples.append(clock() - t0)


def measure(case: HostCase, repeats: int = 300, rounds: int = 5, seed: int = 0, warmup: int = 20) -> dict[str, Any]:
    """Time ``case``: ``rounds`` alternating blocks of ``repeats // rounds`` calls of it and of its SDPA call after
    ``warmup`` untimed calls each (the first compiles). Returns the record: backend, call, sizes, p50_us, p95_us,
    min_us, and with an SDPA call torch_sdpa_p50_us, torch_sdpa_p95_us, torch_sdpa_min_us, ratio (P50 / SDPA's
    P50) and ratio_min (fastest / SDPA's fastest: on a machine other work shares, the figure least moved by it;
    a parallel region there waits for a descheduled thread, torch's included); status "ok" or "error: ...".
    """
    record: dict[str, Any] = dict(backend=case.backend, call=case.call, batch=BATCH, nheads=NHEADS,
                                  headdim=HEADDIM, seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k)
    try:
        fn = case.setup(np.random.default_rng(seed))
        peer = case.sdpa(np.random.default_rng(seed)) if case.sdpa is not None else None
        for _ in range(warmup):
            fn()
            if peer is not None:
                peer()
        ours: list[float] = []
        theirs: list[float] = []
        per_round = max(1, math.ceil(repeats / rounds))
        for _ in range(rounds):
            _time_into(fn, per_round, ours)
            if peer is not None:
                _time_into(peer, per_round, theirs)
    except Exception as exc:  # one failing row must not lose the others'
        record.update(status=f"error: {type(exc).__name__}: {exc}")
        return record
    record.update(p50_us=_percentile_us(ours, 50), p95_us=_percentile_us(ours, 95), min_us=min(ours) * 1e6,
                  status="ok")
    if theirs:
        sdpa_p50 = _percentile_us(theirs, 50)
        record.update(torch_sdpa_p50_us=sdpa_p50, torch_sdpa_p95_us=_percentile_us(theirs, 95),
                      torch_sdpa_min_us=min(theirs) * 1e6, ratio=record["p50_us"] / sdpa_p50,
                      ratio_min=min(ours) / min(theirs), goal_ratio=GOAL_RATIO)
    return record


def run_host_overhead(cases: Sequence[HostCase], repeats: int = 300, seed: int = 0,
                      tick: Callable[[], Any] = lambda: None) -> list[dict[str, Any]]:
    """``measure`` every case (torch's threads matched to numba's for the run); ``tick`` after each."""
    from .harness import matched_torch_threads

    records = []
    with matched_torch_threads():
        for case in cases:
            records.append(measure(case, repeats=repeats, seed=seed))
            tick()
    return records


def format_host_table(records: Sequence[dict[str, Any]]) -> str:
    """The records as a text table: P50/P95 in us, SDPA's P50, the ratio and whether it meets ``GOAL_RATIO``."""
    from tabulate import tabulate

    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    body = []
    for r in records:
        ratio = r.get("ratio")
        goal = "-" if meets_goal(r) is None else ("yes" if meets_goal(r) else "no")
        body.append((r["backend"], r["call"], f"{r['seqlen_q']}x{r['seqlen_k']}", fmt(r.get("p50_us"), ".1f"),
                     fmt(r.get("p95_us"), ".1f"), fmt(r.get("min_us"), ".1f"), fmt(r.get("torch_sdpa_p50_us"), ".1f"),
                     fmt(r.get("torch_sdpa_min_us"), ".1f"), fmt(ratio, ".2f"), fmt(r.get("ratio_min"), ".2f"), goal,
                     r["status"] if r["status"] != "ok" else ""))
    return tabulate(body, headers=("backend", "call", "Sq x Sk", "p50 us", "p95 us", "min us", "sdpa p50", "sdpa min",
                                   "x sdpa", "x sdpa (min)", "goal met", "status"))


def meets_goal(record: dict[str, Any]) -> bool | None:
    """Whether a row meets its goal: P50 <= ``GOAL_RATIO`` x SDPA's where SDPA ran beside it, else P95 <= the
    row's ``goal_p95_us`` (the cuda stub's rows); None for a row with neither (or one that failed)."""
    if record.get("ratio") is not None:
        return record["ratio"] <= GOAL_RATIO
    if record.get("goal_p95_us") is not None and record.get("p95_us") is not None:
        return record["p95_us"] <= record["goal_p95_us"]
    return None


def cuda_stub_records(calls: int) -> list[dict[str, Any]]:
    """The cuda backend's host path (``host_overhead_cuda.host_overhead_records``: planned calls, a recording stub
    for the driver's launch) as rows of this table, each with ``seqlen_q``, ``seqlen_k`` and ``status``; one
    failed row naming the error when it cannot run."""
    from . import host_overhead_cuda as stub

    sizes = {"forward": (stub.SEQLEN, stub.SEQLEN), "backward": (stub.SEQLEN, stub.SEQLEN),
             "decode": (1, stub.CACHE_LEN)}
    try:
        records = stub.host_overhead_records(calls)
    except Exception as exc:   # reported as a row, as measure reports a failing row
        return [dict(backend="cuda", call="forward", seqlen_q=stub.SEQLEN, seqlen_k=stub.SEQLEN,
                     status=f"error: {type(exc).__name__}: {str(exc).splitlines()[-1] if str(exc) else ''}")]
    return [dict(r, seqlen_q=sizes[r["call"]][0], seqlen_k=sizes[r["call"]][1], dtype=stub.DTYPE, status="ok")
            for r in records]


HOST_BACKENDS = ("cpu", "torch", "cuda")


def host_backends(names: str | None) -> list[str]:
    """--backend's comma-separated names for --host-overhead (default: cpu, and torch and the cuda stub where torch
    is installed: the stub's planned calls take torch tensors); ValueError naming the unknown ones."""
    from .harness import optional_torch

    chosen = [n.strip() for n in names.split(",") if n.strip()] if names else list(HOST_BACKENDS)
    unknown = [n for n in chosen if n not in HOST_BACKENDS]
    if unknown:
        raise ValueError(f"--backend: --host-overhead times cpu, torch (the torch faces on CPU tensors) and cuda "
                         f"(its host path with a stub for the driver's launch), got {', '.join(unknown)}")
    if names is None and optional_torch() is None:
        chosen = ["cpu"]
    return chosen


def run_command(args: Any) -> int:
    """``numba-flash bench --host-overhead``: the header, a progress bar ticked per row, the table, and with --json
    ``{"meta": ..., "results": [record, ...]}``. Exit 0, or 1 when a row failed."""
    import json
    import sys

    from .engine import progress_bar
    from .harness import optional_torch
    from .report import machine_info

    torch_ok = optional_torch() is not None
    backends = host_backends(args.backend)
    cases = host_cases([b for b in backends if b != "cuda"], torch_available=torch_ok)
    repeats = 30 * args.repeats
    meta = machine_info()
    meta.update(mode="host-overhead", repeats=repeats, seed=args.seed, goal_ratio=GOAL_RATIO)
    print(f"numba-flash {meta['numba_flash']} bench --host-overhead | {meta['date']}")
    print(f"machine: {meta['cpu']}, {meta['cpu_count']} cores; numba {meta['numba']}"
          + (f", torch {meta['torch']}" if "torch" in meta else ", torch not installed (no SDPA column)"))
    print(f"timing: {repeats} calls per row (30 x --repeats) in 5 rounds alternating with torch SDPA on the same "
          f"call, after 20 untimed calls; goal: P50 <= {GOAL_RATIO:g}x SDPA's")
    if "cuda" in backends:
        from .host_overhead_cuda import GOALS_US

        goals = ", ".join(f"{call} {us:g}" for call, us in GOALS_US.items())
        print(f"cuda rows: float16, the driver's launch a recording stub, {200 * args.repeats} calls each (200 x "
              f"--repeats); goal: P95 <= {goals} us")
    sys.stdout.flush()
    with progress_bar(len(cases) + ("cuda" in backends), enabled=True) as tick:
        records = run_host_overhead(cases, repeats=repeats, seed=args.seed or 0, tick=tick)
        if "cuda" in backends:
            records += cuda_stub_records(200 * args.repeats)
            tick()
    print()
    print(format_host_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": records}, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if any(r["status"] != "ok" for r in records) else 0


__all__ = ["HostCase", "host_cases", "measure", "run_host_overhead", "format_host_table", "host_backends",
           "run_command", "meets_goal", "cuda_stub_records", "GOAL_RATIO", "CALLS", "SIZES", "HOST_BACKENDS"]
