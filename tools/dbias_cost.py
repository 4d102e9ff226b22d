"""What the gradient of ``attn_bias`` costs in the CPU backward: the backward without a bias, with one, and with
one and ``return_dbias``, for biases of several broadcast shapes, alternated call by call in one process.

    python tools/dbias_cost.py                       # B=1, Hq=8, Hkv=1, S=2048, D=64, float32, 7 repeats
    python tools/dbias_cost.py --nheads-kv 8 --repeats 9

Kernel calls only (``numba_flash.cpu.flash_backward``), after one untimed call each. Prints min / median ms and
each median over the no-bias median.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--nheads", type=int, default=8)
    ap.add_argument("--nheads-kv", type=int, default=1)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--headdim", type=int, default=64)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    from numba_flash.cpu import flash_backward, flash_forward

    rng = np.random.default_rng(0)
    b, hq, hkv, s, d = args.batch, args.nheads, args.nheads_kv, args.seqlen, args.headdim
    q = rng.standard_normal((b, s, hq, d), dtype=np.float32)
    k, v = (rng.standard_normal((b, s, hkv, d), dtype=np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape, dtype=np.float32)
    scale, right = d ** -0.5, (0 if args.causal else -1)
    shapes = {"(S, S)": (s, s), "(Hq, S, S)": (hq, s, s), "(B, 1, 1, S)": (b, 1, 1, s)}

    def backward(bias: np.ndarray | None, dbias: bool):
        out, lse = np.empty_like(q), np.empty((b, hq, s), np.float32)
        kw = {} if bias is None else {"attn_bias": bias}
        flash_forward(q, k, v, out, lse, scale, -1, right, 0.0, **kw)
        grads = np.empty_like(q), np.empty_like(k), np.empty_like(v)
        if dbias:
            kw["return_dbias"] = True
        return lambda: flash_backward(dout, q, k, v, out, lse, *grads, scale, -1, right, 0.0, **kw)

    cases = {"no bias": backward(None, False)}
    for label, shape in shapes.items():
        bias = rng.standard_normal(shape).astype(np.float32)
        cases[f"bias {label}"] = backward(bias, False)
        cases[f"bias {label} + dbias"] = backward(bias, True)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for run in cases.values():
        run()
    for _ in range(args.repeats):
        for name, run in cases.items():
            t0 = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["no bias"])
    print(f"B={b} Hq={hq} Hkv={hkv} S={s} D={d} causal={args.causal} float32, {args.repeats} repeats")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:28s} min {min(ts):8.1f}  median {med:8.1f} ms  {med / base:5.2f}x")


if __name__ == "__main__":
    main()
