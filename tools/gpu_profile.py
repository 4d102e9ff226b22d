"""One forward and one backward per (dtype, head dim) at S = 4096, B = 4, H = 2048 / D, for a profiler to watch:

    NUMBA_FLASH_SELFCHECK=0 ncu --clock-control none -k regex:flash_ --section SpeedOfLight ... \
        python3 tools/gpu_profile.py float16:128 float32:64

Each kernel is launched once at full size (the self-check off, so its small launches do not take the profiler's
first slots); compiling happens in the same process before the launches.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numba_flash  # noqa: E402

op = numba_flash.backend_registry.get("flash", backend="cuda")
for item in sys.argv[1:] or ["float16:128", "float32:64"]:
    dtype, d = item.split(":")
    d = int(d)
    q, k, v, dout = (torch.randn(4, 4096, 2048 // d, d, device="cuda", dtype=getattr(torch, dtype)) for _ in range(4))
    out, lse = op.forward(q, k, v, return_lse=True)
    op.backward(dout, q, k, v, out, lse)
    torch.cuda.synchronize()
    print(item, "done", flush=True)
