"""Packed sequences on the CPU: the single kernel call per pass (what the backend runs) against the per-sequence
path (``backends.varlen``, one dense kernel call per sequence) and against one dense (B, S, H, D) call of about the
same work, forward and forward + backward, causal, float32.

Each case draws its lengths once; the dense call has B = the number of sequences and S = the root mean square of
their lengths, so that its causal area (the work) is about the packed batch's. Times go through the same host
path for all three (validation, then the backend's kernel runner), calls interleaved, and are reported as the min
and median of REPEATS runs; "per token" divides by the visible (query, key) pairs, so the dense column is
comparable though its work differs by rounding. Run with 2 threads and with 1 (numba.set_num_threads):

    PYTHONPATH=. python tools/varlen_overhead.py [--repeats 7] [--threads 2 1]
    PYTHONPATH=. python tools/varlen_overhead.py --threads 1 --cpu-time   # on a machine busy with other work
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from backends import varlen
from backends.cpu import _run_backward, _run_forward
from numba_flash import validate_backward, validate_forward

HQ, HKV, D = 12, 12, 64


def cases(rng):
    """name -> (query lengths): keys as many as queries per sequence."""
    return {
        "200 x 8-128": rng.integers(8, 129, 200),
        "100 x 8-128 + 3 x 1024-2048": np.concatenate([rng.integers(8, 129, 100), rng.integers(1024, 2049, 3)]),
        "8 x 512-2048": rng.integers(512, 2049, 8),
    }


def visible_pairs(lengths):
    return int(sum(n * (n + 1) // 2 for n in lengths))   # causal, Sq = Sk


def runners(lengths, rng):
    """(forward, forward + backward) callables for 'single', 'per-seq' and 'dense'."""
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    q, k, v, dout = (rng.standard_normal((total, h, D), dtype=np.float32) for h in (HQ, HKV, HKV, HQ))
    packing = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    s_eq = int(round(np.sqrt(np.mean(np.asarray(lengths, np.float64) ** 2))))
    dq_, dk_, dv_, ddo = (rng.standard_normal((len(lengths), s_eq, h, D), dtype=np.float32)
                          for h in (HQ, HKV, HKV, HQ))

    def packed(per_sequence):
        def fwd():
            call = validate_forward(q, k, v, return_lse=True, **packing)
            out, lse = np.empty(q.shape, np.float32), np.empty(call.lse_shape, np.float32)
            if per_sequence:
                varlen.forward(call, _run_forward, q, k, v, out, lse)
            else:
                _run_forward(call, q, k, v, out, lse, packing=call.packing)
            return out, lse

        def fwd_bwd():
            out, lse = fwd()
            call = validate_backward(dout, q, k, v, out, lse, **packing)
            grads = [np.empty(x.shape, np.float32) for x in (q, k, v)]
            if per_sequence:
                varlen.backward(call, _run_backward, dout, q, k, v, out, lse, *grads)
            else:
                _run_backward(call, dout, q, k, v, out, lse, *grads, packing=call.packing)
        return fwd, fwd_bwd

    def dense_fwd():
        call = validate_forward(dq_, dk_, dv_, return_lse=True, causal=True)
        out, lse = np.empty(dq_.shape, np.float32), np.empty(call.lse_shape, np.float32)
        _run_forward(call, dq_, dk_, dv_, out, lse)
        return out, lse

    def dense_fwd_bwd():
        out, lse = dense_fwd()
        call = validate_backward(ddo, dq_, dk_, dv_, out, lse, causal=True)
        grads = [np.empty(x.shape, np.float32) for x in (dq_, dk_, dv_)]
        _run_backward(call, ddo, dq_, dk_, dv_, out, lse, *grads)

    return {"single": packed(False), "per-seq": packed(True), "dense": (dense_fwd, dense_fwd_bwd)}, \
        visible_pairs(lengths), visible_pairs([s_eq] * len(lengths))


def measure(fns, repeats, clock):
    """name -> times, the calls interleaved (one of each per round) after one warm-up call each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = clock()
            fn()
            times[name].append(clock() - t)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --threads 1 only: time with this thread's CPU clock (time.thread_time), leaving out "
                             "the time the OS gave other processes on a shared machine")
    parser.add_argument("--only", default="", help="run only the cases whose name contains this, e.g. '8 x'")
    args = parser.parse_args()
    if args.cpu_time and args.threads != [1]:
        parser.error("--cpu-time needs --threads 1 (the kernels then run on the calling thread)")
    clock = time.thread_time if args.cpu_time else time.perf_counter
    print(f"Hq = Hkv = {HQ}, D = {D}, causal, float32; ms as min / median of {args.repeats} "
          f"({'thread CPU time' if args.cpu_time else 'wall time'}); ns/pair: median per visible (query, key) pair "
          "and head")
    for threads in args.threads:
        numba.set_num_threads(threads)
        rng = np.random.default_rng(0)
        for name, lengths in cases(rng).items():
            if args.only not in name:
                continue
            fns, pairs, dense_pairs = runners(lengths, rng)
            for stage, index in (("fwd", 0), ("fwd+bwd", 1)):
                times = measure({n: f[index] for n, f in fns.items()}, args.repeats, clock)
                med = {n: float(np.median(t)) for n, t in times.items()}
                per_pair = {n: med[n] / (dense_pairs if n == "dense" else pairs) / HQ * 1e9 for n in med}
                cells = "  ".join(f"{n} {min(t) * 1e3:7.2f} / {med[n] * 1e3:7.2f} ms ({per_pair[n]:.3f} ns/pair)"
                                  for n, t in times.items())
                # the median of each round's ratio too: a round's calls ran back to back, under the same load
                paired = float(np.median(np.array(times["single"]) / np.array(times["per-seq"])))
                print(f"threads={threads} {name:28s} {stage:7s} {cells}  single/per-seq "
                      f"{med['single'] / med['per-seq']:.2f} (per round {paired:.2f})  single/dense per pair "
                      f"{per_pair['single'] / per_pair['dense']:.2f}")


if __name__ == "__main__":
    main()
