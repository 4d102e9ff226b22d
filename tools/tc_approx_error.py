"""What the tensor-core kernels' special-function approximations could do to their accuracy, judged as the tests
judge: the simulator computes ``tanh.approx`` and ``ex2.approx`` exactly, so this runs the forward with their
documented worst-case relative errors (2**-10.987 for tanh, 2**-22 for ex2) injected on every call, with a random
sign, on softcap cases, and prints the error against the float64 reference next to the error of attention computed
plainly in the same dtype (flash-attn's yardstick) and the contract's bound.

    NUMBA_ENABLE_CUDASIM=1 PYTHONPATH=.:tests .venv/bin/python tools/tc_approx_error.py
"""

from __future__ import annotations

import os
import sys

import numpy as np

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    sys.exit("run with NUMBA_ENABLE_CUDASIM=1 (the tensor-core kernels run under the simulator here)")

from numba import cuda  # noqa: E402

from numba_flash import attention_ref  # noqa: E402
from numba_flash.cuda.device import warp  # noqa: E402

_noise = np.random.default_rng(7)


@cuda.jit(device=True)
def _tanh_worst(x):
    return np.float32(np.tanh(np.float32(x)) * (1 + _noise.choice([-1, 1]) * 2.0 ** -10.987))


@cuda.jit(device=True)
def _exp2_worst(x):
    y = np.float32(np.exp2(np.float32(x)) * (1 + _noise.choice([-1, 1]) * 2.0 ** -22))
    return np.float32(0.0) if abs(y) < 2.0 ** -126 else y


def main() -> None:
    # The kernels read warp.<name> when they are built: swap before the first build.
    warp.tanh_approx, warp.exp2_approx = _tanh_worst, _exp2_worst
    from tc_sim_cases import BOUND, forward, inputs, naive_same_dtype, rel_l2

    rng = np.random.default_rng(0)
    print(f"{'case':<28}{'error':>10}{'plain same-dtype':>18}{'ratio':>8}{'bound':>8}")
    for cap in (2.5, 30.0):
        for dtype in ("float16", "bfloat16"):
            (q, k, v), (q64, k64, v64) = inputs(rng, dtype, 1, 40, 45, 2, 1, 32, scale=3.0)
            kw = dict(softcap=cap, causal=True)
            out, _ = forward(q, k, v, **kw)
            ref, _ = attention_ref(q64, k64, v64, **kw)
            err, plain = rel_l2(out.double().numpy(), ref), rel_l2(naive_same_dtype(q, k, v, **kw), ref)
            print(f"softcap {cap:<5} {dtype:<14}{err:>10.2e}{plain:>18.2e}{err / plain:>8.2f}{BOUND[dtype]:>8.0e}")


if __name__ == "__main__":
    main()
