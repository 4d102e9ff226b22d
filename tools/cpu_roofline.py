"""How close the CPU kernels and torch SDPA run to this machine's float32 multiply-add peak, and whether "1.2x torch"
fits under it.

    python tools/cpu_roofline.py --repeats 7

The peak is measured, not looked up: torch's float32 GEMM (MKL or whatever BLAS torch carries) on 2048 x 2048 at
the thread count numba uses, best of the repeats. Then, for each contract case ((B, H, S, D) = (1, 32, 512, 128) and
(1, 8, 2048, 64), causal and not, float32, "bshd"), our CPU kernels and torch SDPA forward and backward, interleaved
call by call so the machine's load hits both alike. Work is counted as FlashAttention-2 counts it: forward 4 B H S^2
D multiply-add FLOPs (half of that when causal), backward 2.5x the forward (the recomputed scores included). A
speed goal of R x torch needs R x torch's FLOP rate; the last column says whether that rate is below the GEMM peak.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

CASES = [(1, 32, 512, 128), (1, 8, 2048, 64)]


def _time(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def gemm_peak(threads: int, repeats: int, n: int = 2048) -> float:
    """Best float32 GEMM rate in GFLOP/s of torch.mm on fresh random n x n matrices."""
    import torch
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    torch.mm(a, b)
    return 2 * n ** 3 / min(_time(lambda: torch.mm(a, b), repeats)) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--goal", type=float, default=1.2, help="the speed goal as a multiple of torch (default 1.2)")
    args = ap.parse_args()
    import numba
    import torch
    import torch.nn.functional as F

    import numba_flash.cpu as cpu

    threads = numba.get_num_threads()
    torch.set_num_threads(threads)
    peak = gemm_peak(threads, args.repeats)
    print(f"threads {threads}; torch float32 GEMM 2048^3: {peak:.0f} GFLOP/s (best of {args.repeats})")
    print("| (B, H, S, D) | causal | pass | ours ms (min / median) | torch ms (min / median) | torch / ours (median) "
          f"| ours % of GEMM peak | torch % of GEMM peak | {args.goal:g}x torch needs | under the peak? |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch, heads, seqlen, dim in CASES:
        for causal in (False, True):
            rng = np.random.default_rng(seqlen + dim + causal)
            q, k, v, do = (rng.standard_normal((batch, seqlen, heads, dim)).astype(np.float32) for _ in range(4))
            scale, right = 1 / math.sqrt(dim), (0 if causal else -1)
            out, lse = np.empty_like(q), np.empty((batch, heads, seqlen), np.float32)
            dq, dk, dv = (np.empty_like(q) for _ in range(3))
            tq, tk, tv = (torch.from_numpy(x).transpose(1, 2).requires_grad_() for x in (q, k, v))
            tdo = torch.from_numpy(do).transpose(1, 2)
            tout = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            def torch_fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            calls = {
                "ours fwd": lambda: cpu.flash_forward(q, k, v, out, lse, scale, -1, right, 0.0),
                "torch fwd": torch_fwd,
                "ours bwd": lambda: cpu.flash_backward(do, q, k, v, out, lse, dq, dk, dv, scale, -1, right, 0.0),
                "torch bwd": lambda: torch.autograd.grad(tout, (tq, tk, tv), tdo, retain_graph=True),
            }
            for fn in calls.values():
                fn()
            times = {name: [] for name in calls}
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    times[name] += _time(fn, 1)
            fwd_flops = 4 * batch * heads * seqlen * seqlen * dim * (0.5 if causal else 1.0)
            for p, flops in (("fwd", fwd_flops), ("bwd", 2.5 * fwd_flops)):
                ours, theirs = times[f"ours {p}"], times[f"torch {p}"]
                med = statistics.median
                rate = lambda t: flops / t / 1e9  # noqa: E731
                need = args.goal * rate(min(theirs))
                print(f"| {batch}, {heads}, {seqlen}, {dim} | {'yes' if causal else 'no'} | {p} "
                      f"| {min(ours) * 1e3:.1f} / {med(ours) * 1e3:.1f} | {min(theirs) * 1e3:.1f} / "
                      f"{med(theirs) * 1e3:.1f} | {med(theirs) / med(ours):.2f} | {100 * rate(min(ours)) / peak:.0f}% "
                      f"| {100 * rate(min(theirs)) / peak:.0f}% | {need:.0f} GFLOP/s ({100 * need / peak:.0f}%) "
                      f"| {'yes' if need < peak else '**no**'} |", flush=True)


if __name__ == "__main__":
    main()
