"""What a score_mod costs in the CPU kernels against the plain forward and the built-in softcap, in one run:
B=1, H=8, S=4096, D=64, float32 (BENCHMARKS.md, "bias_mod, mask_mod and score_mod inside the CPU kernels").

    .venv/bin/python tools/score_mod_cost.py [--repeats 5]

Prints min and median ms per variant and the median's ratio to the plain forward's; each variant is called once
first (a new score_mod compiles a kernel of its own, 20-30 s), then the variants take turns so that a busy moment
falls on all of them."""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import numpy as np

from numba_flash import backend_registry


def time_in_turns(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """ms per call of each of ``calls``: each called once first (compiles), then ``repeats`` rounds in which they
    take turns, so that a busy moment of the machine falls on all of them."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return times


def print_against(times: dict[str, list[float]], base: str = "plain", label: str = "") -> None:
    """min and median ms of each entry of ``times`` and its median's ratio to ``base``'s."""
    ref = statistics.median(times[base])
    for name, ts in times.items():
        print(f"{label}{name:26s} min {min(ts):7.1f} ms  median {statistics.median(ts):7.1f} ms  "
              f"x{statistics.median(ts) / ref:.2f}")


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
    print_against(time_in_turns({name: (lambda kw=kw: op.forward(*qkv, **kw)) for name, kw in calls.items()},
                                args.repeats))


if __name__ == "__main__":
    main()
