"""The simulator's mbarriers and bulk copies (``numba_flash.cuda.device.hopper`` under ``NUMBA_ENABLE_CUDASIM=1``):
phases and parity as the PTX ISA defines them, a ring of bulk copies under full/empty barriers, and the checker's
bulk-copy hazard. Random data, fresh each run.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_hopper_barriers_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from hopper_sim_cases import launch
from numba import cuda, uint16, uint32, uint64

from numba_flash.cuda import SimulatorCheckError, simcheck
from numba_flash.cuda.device import hopper

pytestmark = pytest.mark.cudasim


@pytest.fixture(autouse=True)
def checker():
    with simcheck.checking():
        yield


# ---- mbarriers and bulk copies ----

TILE = 40   # 16-bit elements a tile: 80 bytes, five 16-byte chunks


def make_ring_kernel(stages, tiles):
    """Thread 0 streams ``tiles`` tiles of ``src`` through a ring of ``stages`` shared buffers (full/empty mbarriers,
    one bulk copy a tile); threads 32..63 wait for each tile, sum it, and release its buffer."""
    @cuda.jit
    def kernel(src, sums):
        t = cuda.threadIdx.x
        ring = cuda.shared.array(stages * TILE, uint16)
        full = cuda.shared.array(stages, uint64)
        empty = cuda.shared.array(stages, uint64)
        if t == 0:
            for s in range(stages):
                hopper.mbarrier_init(full, s, 1)
                hopper.mbarrier_init(empty, s, 32)
            hopper.fence_mbarrier_init()
        cuda.syncthreads()
        if t == 0:
            for i in range(tiles):
                s, phase = i % stages, (i // stages) & 1
                hopper.mbarrier_wait(empty, s, phase ^ 1)
                hopper.mbarrier_arrive_expect_tx(full, s, 2 * TILE)
                hopper.bulk_copy_g2s(ring, s * TILE, src, i * 2 * TILE, 2 * TILE, full, s)
        elif t >= 32:
            for i in range(tiles):
                s, phase = i % stages, (i // stages) & 1
                hopper.mbarrier_wait(full, s, phase)
                acc = uint32(0)
                for e in range(t - 32, TILE, 32):
                    acc += uint32(ring[s * TILE + e])
                sums[i, t - 32] = acc
                hopper.mbarrier_arrive(empty, s)

    return kernel


@pytest.mark.parametrize("stages,tiles", [(2, 7), (3, 3), (1, 4)])
def test_bulk_copies_through_an_mbarrier_ring_arrive_in_order(stages, tiles, rng):
    src = rng.integers(0, 1 << 16, tiles * TILE, dtype=np.uint16)
    sums = np.zeros((tiles, 32), np.uint32)
    launch(make_ring_kernel(stages, tiles), 64, src, sums)
    tiles_of = src.reshape(tiles, TILE).astype(np.uint32)
    for lane in range(32):
        np.testing.assert_array_equal(sums[:, lane], tiles_of[:, lane::32].sum(axis=1))


@cuda.jit
def copy_then_read(src, out, wait):
    t = cuda.threadIdx.x
    buf = cuda.shared.array(TILE, uint16)
    bar = cuda.shared.array(1, uint64)
    if t == 0:
        hopper.mbarrier_init(bar, 0, 1)
        hopper.fence_mbarrier_init()
    cuda.syncthreads()
    if t == 0:
        hopper.mbarrier_arrive_expect_tx(bar, 0, 2 * TILE)
        hopper.bulk_copy_g2s(buf, 0, src, 0, 2 * TILE, bar, 0)
    cuda.syncthreads()   # orders the issue, not the copy's landing
    if wait[0]:
        hopper.mbarrier_wait(bar, 0, 0)
    out[t] = buf[t]


def test_reading_a_buffer_before_its_phase_completes_is_a_race(rng):
    src = rng.integers(0, 1 << 16, TILE, dtype=np.uint16)
    out = np.zeros(TILE, np.uint16)
    launch(copy_then_read, TILE, src, out, np.ones(1, np.int64))
    np.testing.assert_array_equal(out, src)
    with pytest.raises(SimulatorCheckError, match="bulk copy issued at .* has not completed when this reads it"):
        launch(copy_then_read, TILE, src, out, np.zeros(1, np.int64))


def test_mbarrier_parity_is_the_completed_phase():
    @cuda.jit
    def kernel(seen):
        t = cuda.threadIdx.x
        bar = cuda.shared.array(1, uint64)
        if t == 0:
            hopper.mbarrier_init(bar, 0, 2)
        cuda.syncthreads()
        if t == 0:
            seen[0] = hopper.mbarrier_try_wait_parity(bar, 0, 1)   # the phase before the first: complete
            seen[1] = hopper.mbarrier_try_wait_parity(bar, 0, 0)   # phase 0: one of two arrivals missing
            hopper.mbarrier_arrive(bar, 0)
            seen[2] = hopper.mbarrier_try_wait_parity(bar, 0, 0)
        cuda.syncthreads()
        if t == 1:
            hopper.mbarrier_arrive(bar, 0)
        cuda.syncthreads()
        if t == 0:
            seen[3] = hopper.mbarrier_try_wait_parity(bar, 0, 0)   # both in: phase 0 complete
            seen[4] = hopper.mbarrier_try_wait_parity(bar, 0, 1)   # phase 1 just began

    seen = np.full(5, 9, np.uint32)
    launch(kernel, 2, seen)
    np.testing.assert_array_equal(seen, [1, 0, 0, 1, 0])
