"""Native checks and timings of the cuda backend on a real NVIDIA GPU, in one call that fits a short lease.

    python tools/gpu_check.py --out DIR [--budget SECONDS] [--device cuda|cpu] [--perf-only | --checks-only]
                              [--only JOBS]

(``tools/gpu_session.sh`` runs it with the machine's description first; ``docs/gpu-runs/`` keeps what it printed.)

Worker processes (spawned, one per dtype x head dim, plus feature workers) each run their correctness cases
(``tools/gpu_cases.py``) against the float64 reference; that also compiles the kernels their timings need (numba
compiles per process, and a tensor-core kernel takes seconds to build). Then all wait at a barrier, and one at a
time (a lock) time the cuda backend against torch SDPA (default choice, and FlashAttention-2 / memory-efficient
forced) at S = 4096, B = 4, H = 2048 / D: forward, and backward alone, causal and not, min / median wall time of
synchronised calls (host work included, as one call from a notebook sees it), then per-call time of 10 calls
queued back to back (the host's work overlaps the GPU's, as in a training loop; 3 batches), TFLOP/s with FLOPs
4 B H S^2 D (half with causal; backward 2.5x the forward), the error of the first two heads against float64 on the
device, and the peak memory torch's allocator saw. Results go to DIR/results.jsonl line by line as they come
(nothing is lost when the lease ends), a log to DIR/log.txt, a summary table to stdout at the end.
``--device cpu`` runs the same code on the cpu backend (a dry run). ``--warm-cache`` first measures a new process's
first call with a warm disk cache of compiled kernels (``tools/gpu_warm_cache.py``; ``--only warm-cache`` for that
alone).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from typing import Any

import gpu_warm_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQLEN, MODEL_DIM = 4, 4096, 2048


def jobs(device: str) -> list[dict[str, Any]]:
    """Each worker's cases (by name, built inside the worker) and whether it times."""
    dtypes = ("float32", "float16", "bfloat16")
    out = [dict(name=f"{dt}-D{d}", dense=(dt, d), perf=(dt, d)) for dt in dtypes for d in (64, 128)]
    out += [dict(name="headdims", extra=["d256-float32", "d256-float16", "d256-bfloat16", "d40-float32",
                                          "d96-float16"]),
            dict(name="headdims-b", extra=["mla-float16", "mla-float32", "d512-float32", "d300-bfloat16"]),
            dict(name="headdims-c", extra=["dv-float16", "dv-bfloat16", "dv-float32", "mla-bfloat16"]),
            dict(name="features-a", extra=["varlen-float32", "varlen-float16", "kvcache-float16",
                                           "kvcache-float32", "kvcache-bfloat16-flat"]),
            dict(name="features-b", extra=["bias-float32", "bias-float16", "dropout-float16", "dropout-float32"]),
            dict(name="features-c", extra=["mods-float32", "mods-bfloat16", "nonfinite-float32",
                                           "nonfinite-float16", "threads-float16", "largescores-float32-d64",
                                           "largescores-float32-d128"]
                 + (["foreign-float32"] if device == "cuda" else [])),
            dict(name="dbias-a", extra=["dbias-float32-full", "dbias-float32-rows", "dbias-float32-keys",
                                        "dbias-float32-heads-dropout", "dbias-float16-full"]),
            dict(name="dbias-b", extra=["dbias-float32-full-mods", "dbias-float32-rows-mods"]),
            dict(name="dbias-c", extra=["dbias-float32-keys-mods", "dbias-bfloat16-heads-mods-dropout"]),
            dict(name="tf32", extra=["tf32-d64", "tf32-d128", "tf32-d64-noncausal"]),
            # Hopper's wgmma forward (opt-in, issue 46): right first; its timings ride along the dense jobs' perf
            dict(name="wgmma", extra=["wgmma-float16-d64", "wgmma-bfloat16-d128", "wgmma-float16-d128-noncausal"]),
            # the simulator's wgmma lane tests on the hardware: its reading of the ISA, checked (tools/gpu_hopper_cases)
            dict(name="hopper-lanes", extra=["lanes-f16", "lanes-bf16", "lanes-e4m3", "lanes-e5m2"]),
            # thin launch path vs numba's dispatcher, bit for bit, and host us per call (tools/gpu_thin_cases.py);
            # one worker per dtype: each compiles its own forward, backward and decode kernels (~2 min)
            *(dict(name=f"thin-{dt}", extra=[f"thin-{dt}"]) for dt in ("float16", "float32", "bfloat16"))]
    return out


def extra_case(name: str):
    import gpu_cases as gc

    what, dtype = name.split("-", 1)
    if what.startswith("d") and what[1:].isdigit():
        d = int(what[1:])
        return lambda c: gc.dense(c, dtype, d, sq=131, sk=150, causal=True)
    table = {"mla": lambda c: gc.big_head_dims(c, dtype),
             "varlen": lambda c: gc.varlen(c, dtype),
             "kvcache": lambda c: gc.kvcache(c, dtype.split("-")[0], paged="flat" not in dtype),
             "bias": lambda c: gc.variants(c, dtype, "attn_bias+alibi"),
             "dropout": lambda c: gc.variants(c, dtype, "dropout"),
             "mods": lambda c: gc.variants(c, dtype, "mods"),
             "nonfinite": lambda c: gc.nonfinite(c, dtype),
             "largescores": lambda c: gc.large_scores(c, 128 if dtype.endswith("d128") else 64),
             "threads": lambda c: gc.threads(c, dtype),
             "foreign": lambda c: gc.foreign_arrays(c, dtype),
             # Dv != D below 256: the tensor cores' forward for 16-bit inputs
             "dv": lambda c: gc.big_head_dims(c, dtype, 128, 96)}
    if what == "thin":
        import gpu_thin_cases

        return lambda c: gpu_thin_cases.thin_launch(c, dtype)
    if what == "lanes":   # lanes-<wgmma kind>
        import gpu_hopper_cases

        return lambda c: gpu_hopper_cases.lanes(c, dtype)
    if what == "wgmma":   # wgmma-<dtype>-d<D>[-noncausal]
        dt, d, *opts = dtype.split("-")
        return lambda c: gc.wgmma(c, dt, int(d[1:]), causal="noncausal" not in opts)
    if what == "tf32":   # float32 inputs with precision="tf32"
        d, *opts = dtype.split("-")
        return lambda c: gc.tf32(c, int(d[1:]), causal="noncausal" not in opts)
    if what == "dbias":
        dtype, broadcast, *opts = dtype.split("-")
        return lambda c: gc.dbias(c, dtype, broadcast, with_mods="mods" in opts, dropout="dropout" in opts)
    return table[what]


class Sink:
    """Appends one JSON line per result and text lines to the log, flushed at once (the lease may end)."""

    def __init__(self, out_dir: str, job: str):
        self.job = job
        self.results = open(os.path.join(out_dir, "results.jsonl"), "a", buffering=1)
        self.log = open(os.path.join(out_dir, "log.txt"), "a", buffering=1)

    def say(self, text: str) -> None:
        self.log.write(f"[{time.strftime('%H:%M:%S')} {self.job}] {text}\n")

    def put(self, record: dict[str, Any]) -> None:
        record["job"] = self.job
        self.results.write(json.dumps(record, default=str) + "\n")


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def synced_times(fn, device: str, reps: int, prep=None) -> list[float]:
    times = []
    for _ in range(reps):
        if prep is not None:
            prep()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def queued_times(fn, device: str, calls: int = 10, batches: int = 3) -> list[float]:
    """Per-call time of ``calls`` back-to-back calls between two synchronisations, ``batches`` times: the host's
    per-call work overlaps the GPU's (a training step's steady state), unlike ``synced_times``' synchronised calls."""
    out = []
    for _ in range(batches):
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        out.append((time.perf_counter() - t0) / calls)
    return out


def errors(rec: dict[str, Any], label: str, out: Any, ref: Any) -> None:
    """``label``'s max abs and relative L2 error of ``out`` against the float64 ``ref`` (torch tensors)."""
    diff = out.double() - ref
    rec[f"{label}_out_max_abs"] = float(diff.abs().max())
    rec[f"{label}_out_rel_l2"] = float(diff.norm() / ref.norm())


def error_cell(r: dict[str, Any]) -> str:
    """The summary's error column: ours and torch's against float64, and the floor that rounding the float64
    result to the output dtype sets (a max error at the floor says nothing of which is closer)."""
    def g(key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key]:.2e}"
    return (f"err max {g('ours_out_max_abs')} vs torch {g('torch_out_max_abs')} (rounding {g('rounding_out_max_abs')}),"
            f" rel l2 {g('ours_out_rel_l2')} vs torch {g('torch_out_rel_l2')} (rounding {g('rounding_out_rel_l2')})")


def perf(sink: Sink, dtype: str, d: int, device: str, backend: str, seq: int) -> None:
    """Times at S = seq for one (dtype, head dim): ours and torch's, causal and not, forward and backward."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import numba_flash

    op = numba_flash.backend_registry.get("flash", backend=backend)
    tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    h = MODEL_DIM // d
    gen = torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(4), "little"))
    q, k, v, dout = (torch.randn(BATCH, seq, h, d, device=device, dtype=tdt, generator=gen) for _ in range(4))
    forced = SDPBackend.FLASH_ATTENTION if dtype != "float32" else SDPBackend.EFFICIENT_ATTENTION
    for causal in (False, True):
        flops = 4 * BATCH * h * seq * seq * d / (2 if causal else 1)
        rec: dict[str, Any] = dict(kind="perf", dtype=dtype, D=d, S=seq, B=BATCH, H=h, causal=causal,
                                   fwd_tflop=flops / 1e12)
        reps = 5 if dtype == "float32" else 10
        try:
            res: dict[str, Any] = {}

            def ours_fwd():
                res["o"] = op.forward(q, k, v, causal=causal, return_lse=True)

            ours_fwd()                       # compiled already by the correctness cases; warm anyway
            rec["ours_fwd_s"] = synced_times(ours_fwd, device, reps)
            if device == "cuda" and dtype != "float32" and torch.cuda.get_device_capability() == (9, 0):
                # Hopper's wgmma forward beside mma.sync's, same inputs and process (opt-in, issue 46); its
                # first call compiles it (not timed)
                from numba_flash.cuda import tile_config_override

                try:
                    with tile_config_override(wgmma=True):
                        ours_fwd()
                        rec["ours_wgmma_fwd_s"] = synced_times(ours_fwd, device, reps)
                except Exception as exc:
                    rec["ours_wgmma_error"] = f"{type(exc).__name__}: {exc}"[:300]
            out, lse = res["o"]
            rec["ours_bwd_s"] = synced_times(lambda: op.backward(dout, q, k, v, out, lse, causal=causal), device, reps)
            grads = op.backward(dout, q, k, v, out, lse, causal=causal)
            rec["ours_fwdq_s"] = queued_times(lambda: op.forward(q, k, v, causal=causal, return_lse=True), device)

            def ours_train():
                o, l_ = op.forward(q, k, v, causal=causal, return_lse=True)
                op.backward(dout, q, k, v, o, l_, causal=causal)
            rec["ours_trainq_s"] = queued_times(ours_train, device)
            if device == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                op.forward(q, k, v, causal=causal)
                rec["ours_fwd_peak_bytes"] = torch.cuda.max_memory_allocated() - base
            # error of heads 0-1 of batch 0 against float64 on the device, with torch SDPA's for scale
            sl = [x[:1, :, :2].transpose(1, 2).double().requires_grad_(True) for x in (q, k, v)]
            ref = F.scaled_dot_product_attention(*sl, is_causal=causal)
            ref_grads = torch.autograd.grad(ref, sl, dout[:1, :, :2].transpose(1, 2).double())
            ref = ref.transpose(1, 2)
            # The max error of a float16/bfloat16 output is the rounding of the reference to that dtype, for ours and
            # torch's alike (the 2026-11-27 run printed one number on both sides): the floor is recorded beside it,
            # and the relative L2 error, which averages over the output and so tells the two apart.
            errors(rec, "ours", out[:1, :, :2], ref)
            errors(rec, "rounding", ref.to(tdt), ref)
            rec["ours_grad_rel_l2"] = [float((g[:1, :, :2].double().transpose(1, 2) - r).norm() / r.norm())
                                       for g, r in zip(grads, ref_grads)]
            del res["o"], out, lse, grads
            qt, kt, vt, dt_ = (x.transpose(1, 2) for x in (q, k, v, dout))
            for label, forced_kernel in (("torch", None), ("torch_forced", forced)):
                def run(args, kernel=forced_kernel):
                    if kernel is None:
                        return F.scaled_dot_product_attention(*args, is_causal=causal)
                    with sdpa_kernel([kernel]):
                        return F.scaled_dot_product_attention(*args, is_causal=causal)

                def fwd():
                    with torch.no_grad():
                        run((qt, kt, vt))
                try:
                    fwd()
                    rec[f"{label}_fwd_s"] = synced_times(fwd, device, reps)
                    state: dict[str, Any] = {}

                    def prep():
                        leaves = [x.detach().requires_grad_(True) for x in (qt, kt, vt)]
                        state["o"], state["l"] = run(leaves), leaves

                    def bwd():
                        torch.autograd.grad(state["o"], state["l"], dt_)
                    rec[f"{label}_bwd_s"] = synced_times(bwd, device, reps, prep)
                    rec[f"{label}_fwdq_s"] = queued_times(fwd, device)

                    def train():
                        prep()
                        bwd()
                    rec[f"{label}_trainq_s"] = queued_times(train, device)
                    state.clear()
                    with torch.no_grad():
                        o = run([x[:1, :2] for x in (qt, kt, vt)]).transpose(1, 2)
                    errors(rec, label, o, ref)
                except Exception as exc:   # a forced torch kernel may not take this case
                    rec[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
            if device == "cuda" and not causal and d == 128:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                with torch.no_grad():
                    s = (qt @ kt.transpose(-1, -2)) * d ** -0.5
                    (torch.softmax(s, -1) @ vt)
                del s
                rec["naive_fwd_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        except Exception as exc:
            rec["error"] = traceback.format_exc()[-1500:]
        for key in [k for k in rec if k.endswith("_s")]:
            rec[key.replace("_s", "_med_s")] = float(np.median(rec[key]))
            rec[key.replace("_s", "_min_s")] = float(np.min(rec[key]))
        sink.put(rec)
        sink.say(f"perf {dtype} D={d} causal={causal}: ours fwd {rec.get('ours_fwd_med_s')} bwd "
                 f"{rec.get('ours_bwd_med_s')}; torch fwd {rec.get('torch_fwd_med_s')} {rec.get('error', '')}")


def worker(spec: dict[str, Any], out_dir: str, device: str, barrier: Any, lock: Any, deadline: float,
           seq: int, perf_only: bool = False) -> None:
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tools")]
    sink = Sink(out_dir, spec["name"])
    logging.basicConfig(stream=sink.log, level=logging.INFO, format=f"[{spec['name']}] %(name)s %(message)s")
    import warnings

    warnings.simplefilter("default")
    logging.captureWarnings(True)
    try:
        import gpu_cases as gc
        seed = int.from_bytes(os.urandom(4), "little")
        backend = "cuda" if device == "cuda" else "cpu"
        ctx = gc.Ctx(device, backend, seed)
        cases = gc.dense_cases(*spec["dense"]) if "dense" in spec else []
        if perf_only:
            cases = cases[:2]
        cases += [(n, extra_case(n)) for n in spec.get("extra", [])]
        sink.say(f"seed {seed}, {len(cases)} cases")
        for name, fn in cases:
            if time.time() > deadline:
                sink.put(dict(kind="check", case=name, ok=None, skipped="correctness deadline passed"))
                continue
            t0 = time.time()
            try:
                rec = dict(kind="check", case=name, **fn(ctx))
            except Exception:
                rec = dict(kind="check", case=name, ok=False, error=traceback.format_exc()[-2000:])
            rec["seconds"] = round(time.time() - t0, 2)
            sink.put(rec)
            sink.say(f"{'ok  ' if rec.get('ok') else 'FAIL'} {name} ({rec['seconds']} s) "
                     f"{rec.get('errors', '')} {rec.get('failed', '')} {rec.get('error', '')[-300:]}")
        if device == "cuda":
            from numba_flash.cuda import selfcheck

            bad = [v.reason for v in selfcheck.verdicts().values() if not v.passed]
            sink.put(dict(kind="selfcheck", checked=len(selfcheck.verdicts()), failures=bad))
    except Exception:
        sink.put(dict(kind="worker_error", error=traceback.format_exc()[-2000:]))
    try:
        barrier.wait(timeout=max(1.0, deadline - time.time()))
    except threading.BrokenBarrierError:
        sink.say("barrier broken: timing anyway")
    if "perf" in spec:
        with lock:
            sink.say("timing")
            perf(sink, *spec["perf"], device, "cuda" if device == "cuda" else "cpu", seq)


def summary(out_dir: str) -> str:
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "results.jsonl"))]
    lines = ["== correctness (cuda backend vs float64 reference) =="]
    checks = [r for r in rows if r.get("kind") == "check"]
    for r in checks:
        flag = "ok  " if r.get("ok") else ("skip" if r.get("ok") is None else "FAIL")
        errs = " ".join(f"{k}={v:.2e}" for k, v in (r.get("errors") or {}).items())
        lines.append(f"{flag} {r['case']:<42} {errs} {r.get('failed') or ''} {(r.get('error') or '')[-200:]}")
        if r.get("host_us"):   # thin-launch cases: host us per call
            lines.append(f"     host us/call: " + " ".join(f"{k}={v}" for k, v in r["host_us"].items()))
    lines.append(f"{sum(1 for r in checks if r.get('ok'))} ok of {len(checks)}")
    for r in rows:
        if r.get("kind") in ("selfcheck", "worker_error") and (r.get("failures") or r.get("error")):
            lines.append(f"{r['job']}: {r}")
    lines += [gpu_warm_cache.describe(r) for r in rows if r.get("kind") == "warm_cache"]
    lines.append("== timings: median ms (TFLOP/s), B=%d H=2048/D ==" % BATCH)
    for r in sorted((r for r in rows if r.get("kind") == "perf"), key=lambda r: (r["dtype"], r["D"], r["causal"])):
        def cell(name: str, factor: float = 1.0) -> str:
            t = r.get(f"{name}_med_s")
            return "-" if t is None else f"{t * 1e3:8.2f}ms ({r['fwd_tflop'] * factor / t:6.1f})"
        lines.append(f"{r['dtype']:<8} S={r['S']} D={r['D']:<3} causal={int(r['causal'])} fwd ours {cell('ours_fwd')} torch "
                     f"{cell('torch_fwd')} forced {cell('torch_forced_fwd')} | bwd ours {cell('ours_bwd', 2.5)} "
                     f"torch {cell('torch_bwd', 2.5)} forced {cell('torch_forced_bwd', 2.5)} | {error_cell(r)} "
                     f"{(r.get('error') or '')[-200:]}")
        if r.get("ours_fwdq_med_s"):
            lines.append(f"{'':<8}   queued:         fwd ours {cell('ours_fwdq')} torch {cell('torch_fwdq')} forced "
                         f"{cell('torch_forced_fwdq')} | fwd+bwd ours {cell('ours_trainq', 3.5)} torch "
                         f"{cell('torch_trainq', 3.5)} forced {cell('torch_forced_trainq', 3.5)}")
    return "\n".join(lines)


def markdown(results: str) -> str:
    """The timings of a results.jsonl as a Markdown table: per-call ms (min / median) of the queued calls and
    TFLOP/s at the median, ours against torch SDPA's FlashAttention-2 (memory-efficient for float32) and torch's
    default choice, with ours / FA2 as a ratio of TFLOP/s; then the synchronised single calls."""
    rows = [json.loads(line) for line in open(results)]
    rows = sorted((r for r in rows if r.get("kind") == "perf" and "ours_fwdq_s" in r),
                  key=lambda r: (r["dtype"], r["D"], r["causal"]))
    head = ("| dtype | D | causal | pass | ours ms (min / med) | TFLOP/s | FA2* ms | TFLOP/s | torch default ms | "
            "TFLOP/s | ours / FA2* | ours synced ms | torch synced ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        for what, key, factor in (("fwd", "fwdq", 1.0), ("fwd+bwd", "trainq", 3.5)):
            flop = r["fwd_tflop"] * factor
            ours, fa2, torch_ = (r[f"{name}_{key}_med_s"] for name in ("ours", "torch_forced", "torch"))
            synced = ("fwd",) if what == "fwd" else ("bwd",)
            sync_ms = [r[f"{name}_{synced[0]}_med_s"] * 1e3 for name in ("ours", "torch")]
            lines.append(f"| {r['dtype']} | {r['D']} | {'yes' if r['causal'] else 'no'} | {what} | "
                         f"{r[f'ours_{key}_min_s'] * 1e3:.2f} / {ours * 1e3:.2f} | {flop / ours:.1f} | "
                         f"{fa2 * 1e3:.2f} | {flop / fa2:.1f} | {torch_ * 1e3:.2f} | {flop / torch_:.1f} | "
                         f"{fa2 / ours:.2f} | {sync_ms[0]:.2f} | {sync_ms[1]:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for the results (required unless --markdown)")
    p.add_argument("--markdown", metavar="RESULTS_JSONL", help="print the timings of a results.jsonl as a table")
    p.add_argument("--budget", type=float, default=240.0, help="seconds for the correctness phase")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--only", help="comma-separated job names")
    p.add_argument("--seqlen", type=int, default=SEQLEN)
    p.add_argument("--perf-only", action="store_true",
                   help="timings only (each worker first runs its plain and causal dense cases, which compile them)")
    p.add_argument("--checks-only", action="store_true", help="correctness only, no timings")
    p.add_argument("--warm-cache", action="store_true",
                   help="first, a new process's first call with a cold, then a warm disk cache of compiled kernels "
                        "(goal <= 0.5 s warm, self-check included), and one after numba-flash warmup --cuda")
    a = p.parse_args(argv)
    if a.markdown:
        print(markdown(a.markdown))
        return 0
    if not a.out:
        p.error("--out is required")
    os.makedirs(a.out, exist_ok=True)
    specs = [s for s in jobs(a.device) if (not a.only or s["name"] in a.only.split(","))
             and (not a.perf_only or "perf" in s)]
    if a.checks_only:
        specs = [{k: v for k, v in s.items() if k != "perf"} for s in specs]
    if a.warm_cache or "warm-cache" in (a.only or "").split(","):
        run_warm_cache(a.out, a.device)
    deadline = time.time() + a.budget
    if specs:
        run_workers(worker, [lambda barrier, lock, s=s: (s, a.out, a.device, barrier, lock, deadline, a.seqlen,
                                                          a.perf_only) for s in specs])
    write_summary(os.path.join(a.out, "summary.txt"), summary(a.out))
    return 0


def run_warm_cache(out_dir: str, device: str) -> list[dict[str, Any]]:
    """The warm-cache case (tools/gpu_warm_cache.py: cold, warm, after a warmup), its records in results.jsonl."""
    sink = Sink(out_dir, "warm-cache")
    records = gpu_warm_cache.measure(out_dir, device=device, warmup=device == "cuda")
    for rec in records:
        sink.put(rec)
        sink.say(gpu_warm_cache.describe(rec))
    return records


def run_workers(target: Any, args_of: list) -> None:
    """One spawned process per entry of ``args_of`` (each a function of the shared barrier and lock that gives
    ``target``'s arguments), all of them sharing one barrier and one lock; returns when every process has ended."""
    ctx = mp.get_context("spawn")
    barrier, lock = ctx.Barrier(len(args_of)), ctx.Lock()
    procs = [ctx.Process(target=target, args=args(barrier, lock)) for args in args_of]
    for pr in procs:
        pr.start()
    for pr in procs:
        pr.join()


def write_summary(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    sys.exit(main())
