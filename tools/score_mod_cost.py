"""What a score_mod costs in the CPU kernels against the plain forward and the built-in softcap, in one run:
B=1, H=8, S=4096, D=64, float32 (BENCHMARKS.md, "bias_mod, mask_mod and score_mod inside the CPU kernels").

    .venv/bin/python tools/score_mod_cost.py [--repeats 5]

Prints min and median ms per variant and the median's ratio to the plain forward's; each variant is called once
first (a new score_mod compiles a kernel of its own, 20-30 s), then the variants take turns so that a busy moment
falls on all of them."""

from __future__ import annotations

import argparse
import math
import time

import numpy as np

from numba_flash import backend_registry


def affine(score, b, h, q_idx, kv_idx):
    return 0.9 * score + 0.01 * (kv_idx % 7)


def tanh_cap(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    qkv = [rng.standard_normal((1, 4096, 8, 64), dtype=np.float32) for _ in range(3)]
    op = backend_registry.get("flash", backend="cpu")
    calls = {"plain": {}, "score_mod affine": {"score_mod": affine}, "score_mod 30*tanh(s/30)": {"score_mod": tanh_cap},
             "softcap=30 (built in)": {"softcap": 30.0}}
    for kw in calls.values():
        op.forward(*qkv, **kw)
    times: dict[str, list[float]] = {n: [] for n in calls}
    for _ in range(args.repeats):
        for name, kw in calls.items():
            t0 = time.perf_counter()
            op.forward(*qkv, **kw)
            times[name].append(time.perf_counter() - t0)
    plain = float(np.median(times["plain"]))
    for name, ts in times.items():
        print(f"{name:26s} min {1e3 * min(ts):7.1f} ms  median {1e3 * float(np.median(ts)):7.1f} ms  "
              f"x{float(np.median(ts)) / plain:.2f}")


if __name__ == "__main__":
    main()
