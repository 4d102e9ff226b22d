"""The tensor-core kernels' dropout keep mask (``tc_scores.make_keep_bits``) under the simulator, one warp on its
own: every lane's 64-bit mask against ``numba_flash.dropout_mask`` at the fragment positions the PTX ISA gives
that lane (untransposed: rows are query rows, columns keys; transposed, as the dK/dV kernel holds S^T: rows are
keys, columns query rows), and one Philox call per lane and 8-wide tile (each call's four words are shared by
shuffle: two calls per lane and tile before, four transposed).

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest
from numba import cuda   # a global: the simulator swaps it for its own in kernels

from numba_flash.dropout import dropout_mask, dropout_threshold, split_seed

pytestmark = pytest.mark.cudasim


@pytest.mark.parametrize("transposed", [False, True], ids=["scores", "transposed"])
@pytest.mark.parametrize("seed,p,n_tiles", [(2 ** 63 + 12345, 0.3, 3), (977, 0.6, 2)])
def test_every_lane_holds_the_mask_bits_of_its_fragment_with_one_call_per_tile(monkeypatch, transposed, seed, p,
                                                                               n_tiles):
    from numba_flash.cuda.device import tc_scores

    calls = collections.Counter()
    philox = tc_scores._PHILOX

    def counted(*args):
        calls[threading.get_ident()] += 1   # one Python thread per simulated CUDA thread
        return philox(*args)

    monkeypatch.setattr(tc_scores, "_PHILOX", counted)
    keep_bits = tc_scores.make_keep_bits(n_tiles, transposed)
    b, h, row0, col0 = 1, 2, 16, 8            # a warp's rows start at a multiple of 16, its columns at one of 8

    @cuda.jit
    def one_warp(out, seed_lo, seed_hi, threshold):
        lane = cuda.threadIdx.x
        out[lane] = keep_bits(seed_lo, seed_hi, threshold, b, h, row0 + lane // 4, col0 + 2 * (lane % 4))

    lo, hi = split_seed(seed)
    out = np.zeros(32, np.uint64)
    one_warp[1, 32](out, lo, hi, dropout_threshold(p))

    rows, cols = row0 + 16, col0 + 8 * n_tiles
    mask = dropout_mask(seed, b + 1, h + 1, cols if transposed else rows, rows if transposed else cols, p)[b, h]
    if transposed:
        mask = mask.T                          # (key, query row), as the lanes hold it
    for lane in range(32):
        for j in range(n_tiles):
            for r in range(4):
                row, col = row0 + lane // 4 + 8 * (r >> 1), col0 + 2 * (lane % 4) + 8 * j + (r & 1)
                assert bool((int(out[lane]) >> (4 * j + r)) & 1) == mask[row, col], (lane, j, r)
    assert sorted(calls.values()) == [n_tiles] * 32
    assert 0.2 < mask[row0:, col0:].mean() < 0.8   # both kinds of bit were checked
