"""Bandwidth of the CPU decode kernel (``numba_flash.cpu.decode.decode_forward``) against a numpy copy of the
same bytes and torch SDPA, measured side by side in one run.

For B=1, Hq=32, Hkv=8, D=128, float32, Sq=1 and Sk in 8192, 32768, 65536: the kernel reads the k and v rows of
the cache once, 2 * Sk * Hkv * D * 4 bytes; the copy moves that many bytes with ``np.copyto`` into a preallocated
buffer (reading and writing them, on one thread: numpy's copy is not parallel, so it is a conservative stand-in
for the machine's read bandwidth). GB/s are of the bytes read. Runs interleave the three, see ``_times``.

Usage: ``PYTHONPATH=. python tools/decode_bandwidth.py [--repeats 10] [--splits N] [--threads N] [--alibi]``.
``--alibi`` also times the decode with ALiBi slopes (2^-(h+1) / 4 per head) in the same rounds, and prints its
time over the plain decode's.
"""

from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from numba_flash.cpu.decode import choose_num_splits, decode_forward


def _times(fns, repeats: int) -> list[tuple[float, float]]:
    """(min, median) seconds of each function, timed in turn within each repeat: on a machine shared with other
    work, a slow stretch then hits all of them alike and the ratios of the minima stay fair."""
    for fn in fns:
        fn()
    samples = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return [(min(x), float(np.median(x))) for x in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--splits", type=int, default=0, help="num_splits (0: choose_num_splits)")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--threads", type=int, default=0, help="numba and torch threads (0: their defaults)")
    parser.add_argument("--alibi", action="store_true", help="also time the decode with ALiBi slopes")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None
    if args.threads:
        numba.set_num_threads(args.threads)
        if torch is not None:
            torch.set_num_threads(args.threads)
    batch, hq, hkv, d = 1, 32, 8, 128
    threads = numba.get_num_threads()
    print(f"threads: numba {threads}" + (f", torch {torch.get_num_threads()}" if torch else ""))
    print(f"{'Sk':>6} {'splits':>6} {'MB':>6} | {'copy GB/s':>15} | {'decode GB/s':>15} {'/copy':>6} | "
          f"{'sdpa ms':>13} {'decode ms':>13} {'sdpa/dec':>8}")
    rng = np.random.default_rng(0)
    for sk in args.seqlens:
        q = rng.standard_normal((batch, 1, hq, d), dtype=np.float32)
        k_cache = rng.standard_normal((batch, sk, hkv, d), dtype=np.float32)
        v_cache = rng.standard_normal((batch, sk, hkv, d), dtype=np.float32)
        out = np.empty_like(q)
        lse = np.empty((batch, hq, 1), np.float32)
        rows = np.arange(batch, dtype=np.int64)
        start = np.zeros(batch, np.int64)
        end = np.full(batch, sk, np.int64)
        table = np.zeros((1, 1), np.int64)
        splits = args.splits or choose_num_splits(batch, hkv, sk, threads)
        nbytes = 2 * sk * hkv * d * 4
        src = np.concatenate([k_cache.ravel(), v_cache.ravel()])
        dst = np.empty_like(src)
        fns = [lambda: np.copyto(dst, src),
               lambda: decode_forward(q, k_cache, v_cache, rows, start, end, table, 0, out, lse, d ** -0.5, -1, -1,
                                      0.0, splits)]
        if torch is not None:
            tq = torch.from_numpy(q).permute(0, 2, 1, 3)  # (1, 32, 1, 128) view
            tk = torch.from_numpy(k_cache).permute(0, 2, 1, 3)  # (1, 8, Sk, 128) views of the cache
            tv = torch.from_numpy(v_cache).permute(0, 2, 1, 3)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def run_sdpa():
                with torch.no_grad():
                    return sdpa(tq, tk, tv, enable_gqa=True)
            fns.append(run_sdpa)
        slopes = (2.0 ** -np.arange(1, hq + 1) / 4).reshape(1, hq)
        if args.alibi:
            fns.append(lambda: decode_forward(q, k_cache, v_cache, rows, start, end, table, 0, out, lse, d ** -0.5,
                                              -1, -1, 0.0, splits, slopes))
        copy_t, dec_t, *rest = _times(fns, args.repeats)
        alibi_t = rest.pop() if args.alibi else None
        sdpa_t = rest[0] if rest else (float("nan"), float("nan"))
        if torch is not None:
            fns[1]()  # out from the plain decode again (the ALiBi one ran last)
            ref = run_sdpa().permute(0, 2, 1, 3).numpy()
            assert np.abs(ref - out).max() < 1e-4, np.abs(ref - out).max()

        def gbs(t):
            return f"{nbytes / t[0] / 1e9:6.1f}/{nbytes / t[1] / 1e9:6.1f}"

        print(f"{sk:>6} {splits:>6} {nbytes / 1e6:>6.0f} | {gbs(copy_t):>15} | {gbs(dec_t):>15} "
              f"{copy_t[0] / dec_t[0]:>6.2f} | {sdpa_t[0] * 1e3:6.2f}/{sdpa_t[1] * 1e3:6.2f} "
              f"{dec_t[0] * 1e3:6.2f}/{dec_t[1] * 1e3:6.2f} {sdpa_t[0] / dec_t[0]:>8.2f}")
        if alibi_t is not None:
            print(f"{'':>6} with ALiBi: {alibi_t[0] * 1e3:6.2f}/{alibi_t[1] * 1e3:6.2f} ms, "
                  f"{alibi_t[1] / dec_t[1]:.2f}x the plain decode's median")
    print("GB/s and ms as min/median; /copy and sdpa/dec are ratios of the minima (higher is better for decode).")


if __name__ == "__main__":
    main()
