"""Where a call's host time goes on a real GPU: cProfile over repeated small calls (kernel time negligible), the
dense forward, backward and a KV-cache decode step, after a warm-up that compiles everything.

    python3 tools/gpu_host_profile.py [--top 35]
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numba_flash  # noqa: E402

top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 35
op = numba_flash.backend_registry.get("flash", backend="cuda")
dev, f16 = "cuda", torch.float16
q, k, v, dout = (torch.randn(1, 128, 4, 128, device=dev, dtype=f16) for _ in range(4))
kc, vc = (torch.randn(2, 4096, 2, 128, device=dev, dtype=f16) for _ in range(2))
qd = torch.randn(2, 1, 8, 128, device=dev, dtype=f16)
lens = torch.tensor([1000, 4000], dtype=torch.int32, device=dev)
calls = {
    "forward": lambda: op.forward(q, k, v, causal=True, return_lse=True),
    "backward": lambda: op.backward(dout, q, k, v, *state["fwd"], causal=True),
    "decode": lambda: op.with_kvcache(qd, kc, vc, cache_seqlens=lens),
}
state = {"fwd": op.forward(q, k, v, causal=True, return_lse=True)}
for name, fn in calls.items():
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    print(f"{name}: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms per call (50 calls, tiny problem)", flush=True)
for name, fn in calls.items():
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    print(f"==== {name}: cumulative ====")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    print(f"==== {name}: own time ====")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)
