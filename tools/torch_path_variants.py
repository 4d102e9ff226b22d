"""Time the torch path (``backend="rocm"``, forced, CPU tensors) on the score variants, forward and backward.

For an A/B of two revisions, run it from each tree in turn (their ``numba_flash`` and ``backends`` first on the
path), a few times each, on an idle machine:

    git worktree add /tmp/base <rev>
    for tree in /tmp/base . /tmp/base . /tmp/base .; do
        (cd $tree && PYTHONPATH=$tree NUMBA_FLASH_QUIET=1 python /path/to/tools/torch_path_variants.py --repeats 8)
    done

B=1, H=8, S=1024, D=64, float32, causal; fresh N(0, 1) inputs; min and median over ``--repeats`` calls after a first,
untimed one. "careful" is the plain call with one NaN in q (the path that keeps non-finite values apart).
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def main() -> None:
    import torch

    from numba_flash import backend_registry

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    rng = np.random.default_rng(args.seed)
    B, S, H, D = 1, 1024, 8, 64
    q, k, v, dout = (torch.from_numpy(rng.standard_normal((B, S, H, D)).astype(np.float32)) for _ in range(4))
    bias = torch.from_numpy(rng.standard_normal((1, H, S, S)).astype(np.float32))

    def scaled(score, b, h, i, j):
        return 0.9 * score

    def scaled_grad(score, b, h, i, j):
        return 0.9

    cases = {"softcap": dict(softcap=20.0), "alibi": dict(alibi_slopes=torch.linspace(0.1, 1.0, H)),
             "attn_bias": dict(attn_bias=bias), "score_mod": dict(score_mod=scaled), "careful": {}}
    op = backend_registry.get("flash")
    for name, kw in cases.items():
        qq = q.clone()
        if name == "careful":
            qq[0, 3, 0, 0] = float("nan")
        back_kw = dict(kw, score_mod_grad=scaled_grad) if "score_mod" in kw else kw
        times = []
        for _ in range(args.repeats + 1):
            t0 = time.perf_counter()
            out, lse = op.forward(qq, k, v, return_lse=True, backend="rocm", causal=True, **kw)
            t1 = time.perf_counter()
            op.backward(dout, qq, k, v, out, lse, backend="rocm", causal=True, **back_kw)
            times.append((t1 - t0, time.perf_counter() - t1))
        ms = np.array(times[1:]) * 1e3
        print(f"{name:10s} fwd min {ms[:, 0].min():7.1f} med {np.median(ms[:, 0]):7.1f}  "
              f"bwd min {ms[:, 1].min():7.1f} med {np.median(ms[:, 1]):7.1f} ms")


if __name__ == "__main__":
    main()
