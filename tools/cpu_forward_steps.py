"""Where the CPU forward's time goes, step by step, and how fast its two products run where their operands live.

    python tools/cpu_forward_steps.py --repeats 9            # (B, H, S, D) = (1, 32, 512, 128), non-causal
    python tools/cpu_forward_steps.py --shape 1 8 2048 64

Part 1: copies of ``cpu/forward.py`` with one step left out (the score product K Q^T, the P V product, or the
softmax's max and exp passes), compiled side by side (not cached) and timed in turns on the same inputs, float32,
numba's threads. What a copy saves against the whole forward is what that step costs in place (the results of a
copy are wrong, of course: they are timings only).
Part 2: the same products (``mm_dot`` 64 x 64 x D, ``mm_at_rescale``), one thread, on K and V tiles that stay hot
in L1, on one head's K/V (L2-sized at S = 512, D = 128), and on every head's in turn (as the forward walks them from
L3): the rate a product keeps when its operands come from further away.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = {
    "score product": [("mm_dot(st, k_seq[j0:j0 + BLOCK_N, hk], q_t, head_dim)", "pass"),
                      # without the product the block keeps its last exp values; start it finite
                      ("st = np.empty((BLOCK_N, BLOCK_M), q.dtype)", "st = np.full((BLOCK_N, BLOCK_M), 0.5, q.dtype)")],
    "P V product": [("mm_at_rescale(acc, st, v_rows, nk, alpha)", "pass")],
    "softmax passes": [("column_max(st, nk, m_use, not masked)", "pass"),
                       ("column_exp2_sum(st, nk, l_tile, m_use)", "pass")],
}


def _variant(name: str, edits: list[tuple[str, str]], folder: str):
    src = open(os.path.join(ROOT, "numba_flash", "cpu", "forward.py")).read()
    src = src.replace("from ..", "from numba_flash.").replace("from .", "from numba_flash.cpu.")
    src = src.replace("cache=True", "cache=False").replace("stamp_kernels(globals())", "")
    for old, new in edits:
        if src.count(old) != 1:
            raise SystemExit(f"forward.py changed: {old!r} is not there once; update STEPS")
        src = src.replace(old, new)
    path = os.path.join(folder, f"forward_{name.replace(' ', '_')}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def steps(shape: tuple[int, int, int, int], repeats: int) -> None:
    batch, heads, seqlen, head_dim = shape
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((batch, seqlen, heads, head_dim)).astype(np.float32) for _ in range(3))
    out, lse = np.empty_like(q), np.empty((batch, heads, seqlen), np.float32)
    with tempfile.TemporaryDirectory() as folder:
        mods = {"whole forward": _variant("whole", [], folder)}
        mods.update({f"without {n}": _variant(n, e, folder) for n, e in STEPS.items()})
        for m in mods.values():   # compile
            m.flash_forward(q, k, v, out, lse, head_dim ** -0.5, -1, -1, 0.0)
        times = {n: [] for n in mods}
        for _ in range(repeats):
            for n, m in mods.items():
                t0 = time.perf_counter()
                for _ in range(5):
                    m.flash_forward(q, k, v, out, lse, head_dim ** -0.5, -1, -1, 0.0)
                times[n].append((time.perf_counter() - t0) / 5 * 1e3)
    whole = statistics.median(times["whole forward"])
    print(f"forward {shape} float32 non-causal, {repeats} turns of 5 calls, ms")
    for n, ts in times.items():
        saved = "" if n == "whole forward" else f"   the step: {whole - statistics.median(ts):6.2f} ms (median)"
        print(f"  {n:24s} min {min(ts):7.2f}  median {statistics.median(ts):7.2f}{saved}")


def products(head_dim: int, seqlen: int, heads: int, repeats: int) -> None:
    import numba
    from numba import njit

    from numba_flash.cpu.microkernels import mm_at_rescale, mm_dot

    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    kbuf = rng.standard_normal((heads, seqlen, head_dim)).astype(np.float32)
    q_t = rng.standard_normal((head_dim, 64)).astype(np.float32)
    st = (rng.random((64, 64)) * 0.01).astype(np.float32)
    acc = np.zeros((64, head_dim), np.float32)
    alpha = np.ones(64, np.float32)

    # the tiles are arguments: arrays a jitted function closes over are frozen into it as read-only constants.
    # One loop per product, not one loop with a flag choosing the product: that version ran K Q^T at 62 GFLOP/s
    # where this one runs it at 83 (same machine, minutes apart), so it timed its own code, not the product.
    @njit
    def score_loop(kbuf, n_heads, reps, hot, st, q_t, acc, alpha):
        for _ in range(reps):
            for h in range(n_heads):
                for j0 in range(0, kbuf.shape[1], 64):
                    j = 0 if hot else j0
                    mm_dot(st, kbuf[h, j:j + 64], q_t, q_t.shape[0])

    @njit
    def pv_loop(kbuf, n_heads, reps, hot, st, q_t, acc, alpha):
        for _ in range(reps):
            for h in range(n_heads):
                for j0 in range(0, kbuf.shape[1], 64):
                    j = 0 if hot else j0
                    mm_at_rescale(acc, st, kbuf[h, j:j + 64], 64, alpha)

    flop = 2 * 64 * 64 * head_dim
    print(f"products, 1 thread, 64 x 64 x {head_dim} tiles over K/V of {heads} heads x {seqlen} keys, GFLOP/s (best)")
    for name, fn in (("K Q^T", score_loop), ("P V", pv_loop)):
        tiles_args = (st, q_t, acc, alpha)
        fn(kbuf, 1, 1, True, *tiles_args)
        for where, n_heads, reps, hot in (("one tile, hot", 1, 64, True), ("one head", 1, 64, False),
                                          (f"{heads} heads in turn", heads, 2, False)):
            best = min(_timed(lambda: fn(kbuf, n_heads, reps, hot, *tiles_args)) for _ in range(repeats))
            tiles = n_heads * reps * (seqlen // 64)
            print(f"  {name:6s} {where:18s} {tiles * flop / best / 1e9:6.1f}")


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=int, nargs=4, default=(1, 32, 512, 128), metavar=("B", "H", "S", "D"))
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    steps(tuple(args.shape), args.repeats)
    products(args.shape[3], args.shape[2], args.shape[1], args.repeats)


if __name__ == "__main__":
    main()
