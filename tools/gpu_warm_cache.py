"""A new process's first call with a warm disk cache of compiled kernels, on a real GPU (issue 44: goal <= 0.5 s,
the first-use self-check included). ``tools/gpu_check.py --warm-cache`` runs it; alone:

    python tools/gpu_warm_cache.py --out DIR [--dtype float16] [--head-dim 128] [--warmup]

Each measurement is a fresh Python process (``--child``) that imports torch and numba-flash, makes its inputs on
the GPU, then times its first forward and first backward (synchronised; what numba compiles or loads and the
self-check's launches are inside) and a second forward for scale, and reports the kernel cache's counters
(host/kernel_cache.py ``STATS``). In order, with one cache directory made empty first:

1. cold: the cache is empty, so the process compiles and stores every kernel of the call;
2. warm: the same call again, in a new process: it should load everything (``compiled == 0``) within the goal;
3. with ``--warmup``, a second empty directory filled by ``numba-flash warmup --cuda`` for this GPU's compute
   capability, dtype and head dim (as a container build step would, though here on the GPU machine), then the call:
   whether the warmup's argument types are those of a real launch (``compiled == 0``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL_S = 0.5
SHAPE = dict(batch=2, seqlen=512, heads=8)


def child(dtype: str, head_dim: int, device: str) -> dict[str, Any]:
    """In a fresh process: the first forward and backward of a causal call, and the cache's counters."""
    t0 = time.perf_counter()
    import torch

    import numba_flash
    from numba_flash.cuda.host import kernel_cache

    imported = time.perf_counter() - t0
    tdt = getattr(torch, dtype)
    q, k, v, dout = (torch.randn(SHAPE["batch"], SHAPE["seqlen"], SHAPE["heads"], head_dim, device=device,
                                 dtype=tdt) for _ in range(4))
    op = numba_flash.backend_registry.get("flash", backend="cuda" if device == "cuda" else "cpu")

    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        result = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - t

    (out, lse), first_fwd = timed(lambda: op.forward(q, k, v, causal=True, return_lse=True))
    _, first_bwd = timed(lambda: op.backward(dout, q, k, v, out, lse, causal=True))
    _, second_fwd = timed(lambda: op.forward(q, k, v, causal=True, return_lse=True))
    checked = None
    if device == "cuda":
        from numba_flash.cuda import selfcheck

        checked = len(selfcheck.verdicts())
    return dict(import_s=imported, first_fwd_s=first_fwd, first_bwd_s=first_bwd, second_fwd_s=second_fwd,
                selfchecked=checked, cache=dict(kernel_cache.STATS), cache_dir=str(kernel_cache.cache_dir()))


def run_child(cache_dir: str, dtype: str, head_dim: int, device: str) -> dict[str, Any]:
    """``child`` in a new Python process whose kernel cache is ``cache_dir``; its record, or its error."""
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=cache_dir, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--dtype", dtype, "--head-dim", str(head_dim),
           "--device", device]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return dict(error=f"exit {proc.returncode}: {(proc.stderr or proc.stdout)[-1500:]}")
    return json.loads(lines[-1])


def warm_up(cache_dir: str, dtype: str, head_dim: int) -> dict[str, Any]:
    """``numba-flash warmup --cuda`` for this GPU's compute capability, dtype and head dim, into ``cache_dir``."""
    from numba import cuda

    cc = cuda.get_current_device().compute_capability
    env = dict(os.environ, NUMBA_FLASH_CACHE_DIR=cache_dir)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "numba_flash", "warmup", "--cuda", "--cc", f"{cc[0]}.{cc[1]}",
                           "--dtype", dtype, "--head-dim", str(head_dim)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    return dict(cc=f"{cc[0]}.{cc[1]}", seconds=time.perf_counter() - t, exit=proc.returncode,
                output=proc.stdout[-3000:] + proc.stderr[-1500:])


def judge(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    """The record of one measurement with its verdict: for a warm cache, nothing compiled and the first forward
    (self-check included) within ``GOAL_S``."""
    rec = dict(rec, kind="warm_cache", run=name)
    if name != "cold" and "error" not in rec:
        rec["nothing_compiled"] = rec["cache"]["compiled"] == 0 and rec["cache"]["distrusted"] == 0
        rec["within_goal"] = rec["first_fwd_s"] <= GOAL_S
        rec["ok"] = rec["nothing_compiled"] and rec["within_goal"]
    return rec


def measure(out_dir: str, dtype: str = "float16", head_dim: int = 128, device: str = "cuda", warmup: bool = False,
            runner: Callable[..., dict[str, Any]] = run_child,
            warmer: Callable[..., dict[str, Any]] = warm_up) -> list[dict[str, Any]]:
    """Cold, warm and (with ``warmup``) warmed-up first calls, each a record (``judge``); caches under
    ``out_dir``."""
    import shutil

    records = []
    runs = [("cold", "cache"), ("warm", "cache")] + ([("after_warmup", "cache-warmup")] if warmup else [])
    for name, folder in runs:
        cache = os.path.join(out_dir, folder)
        if name != "warm":
            shutil.rmtree(cache, ignore_errors=True)
        extra = warmer(cache, dtype, head_dim) if name == "after_warmup" else None
        rec = judge(name, runner(cache, dtype, head_dim, device))
        if extra is not None:
            rec["warmup"] = extra
        records.append(rec)
    return records


def describe(rec: dict[str, Any]) -> str:
    """One summary line."""
    if "error" in rec:
        return f"warm cache {rec['run']}: ERROR {rec['error'][-300:]}"
    verdict = "" if "ok" not in rec else (" ok" if rec["ok"] else " MISSED")
    return (f"warm cache {rec['run']}:{verdict} first forward {rec['first_fwd_s']:.3f} s (goal {GOAL_S} s once warm), "
            f"first backward {rec['first_bwd_s']:.3f} s, second forward {rec['second_fwd_s'] * 1e3:.2f} ms, "
            f"import {rec['import_s']:.2f} s, self-checked {rec['selfchecked']}, cache {rec['cache']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="directory for the caches and results.jsonl")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--warmup", action="store_true", help="also a cache filled by numba-flash warmup --cuda")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.dtype, a.head_dim, a.device)))
        return 0
    if not a.out:
        p.error("--out is required")
    os.makedirs(a.out, exist_ok=True)
    records = measure(a.out, a.dtype, a.head_dim, a.device, a.warmup)
    with open(os.path.join(a.out, "results.jsonl"), "a") as f:
        for rec in records:
            f.write(json.dumps(rec, default=str) + "\n")
            print(describe(rec))
    return 0 if all(r.get("ok", True) for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
