"""The cpu backend's forward against torch SDPA on the CPU at wide head dims (Gemma's 512, MLA's 576 / 512) and at
64 for scale, in one run: B=1, H=8, S=1024, float32, non-causal (BENCHMARKS.md, "Head dims past 256 on the CPU").

    .venv/bin/python tools/head_dim_speed.py [--repeats 5]

Each call once first (compiles, warms the caches), then the two alternate so that a busy moment falls on both;
torch runs on as many threads as numba."""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np
import torch

from numba_flash import backend_registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(numba.get_num_threads())
    op = backend_registry.get("flash", backend="cpu")
    rng = np.random.default_rng(0)
    batch, heads, seqlen = 1, 8, 1024
    for d, dv in ((64, 64), (512, 512), (576, 512)):
        q, k = (rng.standard_normal((batch, seqlen, heads, d), dtype=np.float32) for _ in range(2))
        v = rng.standard_normal((batch, seqlen, heads, dv), dtype=np.float32)
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v))
        calls = {"cpu": lambda: op.forward(q, k, v),
                 "torch": lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)}
        times: dict[str, list[float]] = {n: [] for n in calls}
        for fn in calls.values():
            fn()
        for _ in range(args.repeats):
            for name, fn in calls.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        ours, theirs = (np.median(times[n]) for n in ("cpu", "torch"))
        print(f"D={d:3d} Dv={dv:3d}  cpu min {1e3 * min(times['cpu']):7.1f} median {1e3 * ours:7.1f} ms  "
              f"torch SDPA min {1e3 * min(times['torch']):7.1f} median {1e3 * theirs:7.1f} ms  "
              f"torch / cpu {theirs / ours:.2f}")


if __name__ == "__main__":
    main()
