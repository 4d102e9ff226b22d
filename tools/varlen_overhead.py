"""What one kernel call per sequence costs on the CPU: B packed sequences of length S against one dense
(B, S, H, D) call doing exactly the same work, forward and backward, causal, float32. Best of several runs; on a
shared machine, run it twice.

    PYTHONPATH=. python tools/varlen_overhead.py
"""

import time

import numpy as np

from backends import backend_registry

H, D = 8, 64
CASES = [(1, 2048), (8, 256), (64, 64), (256, 16), (1024, 4), (2048, 1)]


def best(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    rng = np.random.default_rng(0)
    op = backend_registry.get("flash", backend="cpu")
    print(f"{'B':>5} {'S':>5} | {'fwd dense':>9} {'packed':>8} {'ratio':>5} {'us/seq':>6} | "
          f"{'bwd dense':>9} {'packed':>8} {'ratio':>5} {'us/seq':>6}   (ms; us/seq: extra time per sequence)")
    for batch, seqlen in CASES:
        q, k, v = (rng.standard_normal((batch, seqlen, H, D), dtype=np.float32) for _ in range(3))
        qp, kp, vp = (x.reshape(batch * seqlen, H, D) for x in (q, k, v))
        packing = dict(cu_seqlens_q=(np.arange(batch + 1) * seqlen).astype(np.int32))
        packing["cu_seqlens_k"] = packing["cu_seqlens_q"]
        out, lse = op.forward(q, k, v, causal=True, return_lse=True)
        out_p, lse_p = op.forward(qp, kp, vp, causal=True, return_lse=True, **packing)
        row = [f"{batch:5d} {seqlen:5d}"]
        for dense, packed in (
            (lambda: op.forward(q, k, v, causal=True, return_lse=True),
             lambda: op.forward(qp, kp, vp, causal=True, return_lse=True, **packing)),
            (lambda: op.backward(out, q, k, v, out, lse, causal=True),
             lambda: op.backward(out_p, qp, kp, vp, out_p, lse_p, causal=True, **packing)),
        ):
            t_dense, t_packed = best(dense, 9), best(packed, 9)
            row.append(f"{t_dense * 1e3:9.2f} {t_packed * 1e3:8.2f} {t_packed / t_dense:5.2f} "
                       f"{(t_packed - t_dense) / batch * 1e6:6.1f}")
        print(" | ".join(row))


if __name__ == "__main__":
    main()
