"""The sum that takes the backward kernels' per-row or per-key sums of attn_bias's gradient to a bias's broadcast
shape (``launch_dbias.launch_dbias_sum``), under the Numba CUDA simulator: against numpy's float64 sums for every
way a bias broadcasts, added into what dst holds, and a long sum kept to a few roundings by its compensation.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_dbias_sum_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("dst_shape", [(2, 3, 5, 1), (1, 3, 5, 1), (2, 1, 1, 1), (1, 1, 1, 1), (1, 3, 1, 1),
                                       (2, 3, 1, 1)])
def test_sums_over_the_broadcast_axes_and_adds_into_dst(rng, dst_shape):
    from numba import cuda

    from numba_flash.cuda.host.launch_dbias import launch_dbias_sum

    src = rng.standard_normal((2, 3, 5, 1)).astype(np.float32)
    start = rng.standard_normal(dst_shape).astype(np.float32)
    dst = cuda.to_device(start)
    launch_dbias_sum(cuda.to_device(src), dst)
    axes = tuple(a for a in range(4) if dst_shape[a] == 1 < src.shape[a])
    want = start.astype(np.float64) + src.astype(np.float64).sum(axis=axes, keepdims=True)
    np.testing.assert_allclose(dst.copy_to_host(), want, rtol=1e-6, atol=1e-6)


def test_a_long_sum_stays_within_a_few_roundings():
    """100,000 terms around 1000: a plain float32 running sum of them in the same order is off by about 16 units
    in the last place (asserted: the test would not tell otherwise), the compensated one by at most 2."""
    from numba import cuda

    from numba_flash.cuda.host.launch_dbias import launch_dbias_sum

    rng = np.random.default_rng(2026)   # fixed: the plain sum's error is a random walk
    src = (1000 + rng.standard_normal((1, 1, 1, 100_000))).astype(np.float32)
    dst = cuda.to_device(np.zeros((1, 1, 1, 1), np.float32))
    launch_dbias_sum(cuda.to_device(src), dst)
    exact = src.astype(np.float64).sum()
    got = float(dst.copy_to_host()[0, 0, 0, 0])
    assert abs(got - exact) <= 2 * np.spacing(np.float32(exact))
    naive = np.float32(0)
    for x in src.ravel():   # what the sum would be without the compensation, in the same order
        naive = np.float32(naive + x)
    assert abs(float(naive) - exact) > 8 * np.spacing(np.float32(exact))
