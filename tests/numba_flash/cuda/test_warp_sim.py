"""The simulator's emulation of the warp primitives (``numba_flash.cuda.device.warp`` under ``NUMBA_ENABLE_CUDASIM=1``).

The fragment layouts are written here a second time, independently of ``warp_sim.py``, the way the PTX ISA states
them (per lane and register, "row = groupID for a_i where ..."), and the emulated primitives must hand each lane
exactly those elements; the emulated mma must equal numpy's product. Random tiles, fresh each run.

Run: NUMBA_ENABLE_CUDASIM=1 .venv/bin/python -m pytest -q -m cudasim tests/numba_flash/cuda/test_warp_sim.py
"""

from __future__ import annotations

import numpy as np
import pytest
from numba import cuda, float32, uint16, uint32

from numba_flash.cuda import SimulatorCheckError
from numba_flash.cuda import simcheck
from numba_flash.cuda.device import warp
from numba_flash.cuda.device import warp_sim
from hopper_sim_cases import bits16, launch, random_values

pytestmark = pytest.mark.cudasim
LANES = np.arange(32)
G, T = LANES // 4, LANES % 4          # PTX's groupID and threadID_in_group


# ---- the PTX ISA's tables (9.7.14.5.8 mma.m16n8k16 for .f16/.bf16, 9.7.14.5.7 m16n8k8 for .tf32, ldmatrix) ----

def a_elements(i):
    """(row, col) of element a_i (i = 0..7; register i // 2, half i % 2) for every lane, m16n8k16 A."""
    row = G if (i < 2 or 4 <= i < 6) else G + 8
    col = T * 2 + (i & 1) + (8 if i >= 4 else 0)
    return row, col


def b_elements(i):
    """(row, col) of element b_i (i = 0..3; register i // 2, half i % 2) for every lane, m16n8k16 B."""
    return T * 2 + (i & 1) + (8 if i >= 2 else 0), G


def c_elements(i):
    """(row, col) of c_i (i = 0..3) for every lane, m16n8 float32 C and D."""
    return (G if i < 2 else G + 8), T * 2 + (i & 1)


def a_tf32_elements(i):
    """(row, col) of a_i (i = 0..3) for every lane, m16n8k8 .tf32 A (16 x 8)."""
    return (G if i in (0, 2) else G + 8), (T if i < 2 else T + 4)


def b_tf32_elements(i):
    """(row, col) of b_i (i = 0..1) for every lane, m16n8k8 .tf32 B (8 x 8)."""
    return (T if i == 0 else T + 4), G


def pack_halves(lo_bits, hi_bits):
    return (lo_bits.astype(np.uint32) | (hi_bits.astype(np.uint32) << 16)).astype(np.uint32)


def a_registers(a, kind):
    """(32, 4) registers of every lane for a 16 x 16 A, by the ISA's table."""
    bits = bits16(a, kind)
    regs = np.empty((32, 4), np.uint32)
    for r in range(4):
        lo, hi = a_elements(2 * r), a_elements(2 * r + 1)
        regs[:, r] = pack_halves(bits[lo], bits[hi])
    return regs


def b_registers(b, kind):
    bits = bits16(b, kind)
    regs = np.empty((32, 2), np.uint32)
    for r in range(2):
        lo, hi = b_elements(2 * r), b_elements(2 * r + 1)
        regs[:, r] = pack_halves(bits[lo], bits[hi])
    return regs


@pytest.fixture(autouse=True)
def checker():
    with simcheck.checking():
        yield


# ---- mma ----

@cuda.jit
def mma_kernel(a_regs, b_regs, c, d, kind):
    lane = cuda.threadIdx.x
    a0, a1, a2, a3 = a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3]
    b0, b1 = b_regs[lane, 0], b_regs[lane, 1]
    c0, c1, c2, c3 = c[lane, 0], c[lane, 1], c[lane, 2], c[lane, 3]
    if kind == 0:
        r = warp.mma_f16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    elif kind == 1:
        r = warp.mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    else:
        r = warp.mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)
    for i in range(4):
        d[lane, i] = r[i]


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_mma_m16n8k16_is_the_product_in_the_isa_layouts(kind, rng):
    a = random_values(rng, (16, 16), kind)
    b = random_values(rng, (16, 8), kind)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    c_regs = np.stack([c[c_elements(i)] for i in range(4)], axis=1).astype(np.float32)
    d_regs = np.zeros((32, 4), np.float32)
    launch(mma_kernel, 32, a_registers(a, kind), b_registers(b, kind), c_regs, d_regs, 0 if kind == "f16" else 1)
    d = np.empty((16, 8), np.float64)
    for i in range(4):
        d[c_elements(i)] = d_regs[:, i]
    want = a @ b + c
    np.testing.assert_allclose(d, want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


def test_mma_m16n8k8_tf32_is_the_product_in_the_isa_layouts(rng):
    def tf32(x):   # exactly representable tf32 values
        return (x.astype(np.float32).view(np.uint32) & 0xFFFFE000).view(np.float32)

    a, b = tf32(rng.standard_normal((16, 8))), tf32(rng.standard_normal((8, 8)))
    c = rng.standard_normal((16, 8)).astype(np.float32)
    a_regs = np.stack([a[a_tf32_elements(i)] for i in range(4)], axis=1).view(np.uint32)
    b_regs = np.stack([b[b_tf32_elements(i)] for i in range(2)], axis=1).view(np.uint32)
    c_regs = np.stack([c[c_elements(i)] for i in range(4)], axis=1).astype(np.float32)
    d_regs = np.zeros((32, 4), np.float32)
    launch(mma_kernel, 32, np.ascontiguousarray(a_regs), np.ascontiguousarray(b_regs), c_regs, d_regs, 2)
    d = np.empty((16, 8), np.float64)
    for i in range(4):
        d[c_elements(i)] = d_regs[:, i]
    want = a.astype(np.float64) @ b + c
    np.testing.assert_allclose(d, want, rtol=2e-7, atol=2e-7 * np.abs(want).max())


# ---- ldmatrix ----

@cuda.jit
def ldmatrix_kernel(tile, rows, out, which):
    """Copy ``tile`` (uint16 bits) into shared memory, then each lane loads with the row address rows[lane]."""
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(512, uint16)
    for e in range(lane, 512, 32):
        smem[e] = tile[e]
    cuda.syncthreads()
    if which == 0:
        r = warp.ldmatrix_x4(smem, rows[lane])
    elif which == 1:
        r = warp.ldmatrix_x4_trans(smem, rows[lane])
    elif which == 2:
        r = warp.ldmatrix_x2(smem, rows[lane])
    else:
        r = warp.ldmatrix_x2_trans(smem, rows[lane])
    for j in range(len(r)):
        out[lane, j] = r[j]


@pytest.mark.parametrize("which,count,trans", [(0, 4, False), (1, 4, True), (2, 2, False), (3, 2, True)])
def test_ldmatrix_hands_each_lane_the_isa_elements(which, count, trans, rng):
    tile = rng.integers(0, 1 << 16, 512, dtype=np.uint16)
    # Any 16-byte aligned row addresses, in any order: 64 rows of 8 elements, lanes pick 32 distinct ones.
    rows = (rng.permutation(64)[:32] * 8).astype(np.int64)
    out = np.zeros((32, 4), np.uint32)
    launch(ldmatrix_kernel, 32, tile, rows, out, which)
    for j in range(count):
        row_of = tile[rows[8 * j: 8 * j + 8, None] + np.arange(8)]   # matrix j, 8 x 8, row r from lane 8j + r
        if trans:   # ISA: with .trans each thread holds a column: rows 2(l % 4), 2(l % 4) + 1 of column l / 4
            want = pack_halves(row_of[2 * T, G], row_of[2 * T + 1, G])
        else:       # ISA: row l / 4, elements 2(l % 4) and 2(l % 4) + 1
            want = pack_halves(row_of[G, 2 * T], row_of[G, 2 * T + 1])
        np.testing.assert_array_equal(out[:, j], want, err_msg=f"matrix {j}")


def test_ldmatrix_x4_of_a_row_major_tile_gives_the_mma_a_fragment(rng):
    """The kernels' addressing: lane 8j + r points at row r + 8 (j % 2), column 8 (j // 2) of a 16 x 16 tile."""
    a = random_values(rng, (16, 16), "f16")
    tile = np.zeros(512, np.uint16)
    tile[:256] = bits16(a, "f16").ravel()
    j, r = LANES // 8, LANES % 8
    rows = ((r + 8 * (j % 2)) * 16 + 8 * (j // 2)).astype(np.int64)
    out = np.zeros((32, 4), np.uint32)
    launch(ldmatrix_kernel, 32, tile, rows, out, 0)
    np.testing.assert_array_equal(out, a_registers(a, "f16"))


def test_unaligned_ldmatrix_address_is_refused(rng):
    rows = (np.arange(32) * 8 + 2).astype(np.int64)
    with pytest.raises(Exception, match="16-byte aligned"):
        launch(ldmatrix_kernel, 32, np.zeros(512, np.uint16), rows, np.zeros((32, 4), np.uint32), 0)


# ---- cp.async ----

@cuda.jit
def cp_async_kernel(src, nbytes, before, after):
    """Lane l copies row l of src (B=1, S=32, H=1, D=8 float16) into smem row l, with nbytes[l] valid bytes; reads
    its own row before the wait (``before``) and after it (``after``)."""
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(256, uint16)
    for e in range(8):
        smem[lane * 8 + e] = uint16(0xABCD)
    warp.cp_async_16(smem, lane * 8, src, (0, lane, 0, 0), nbytes[lane])
    warp.cp_async_commit()
    for e in range(8):
        before[lane, e] = smem[lane * 8 + e]
    warp.cp_async_wait_all()
    for e in range(8):
        after[lane, e] = smem[lane * 8 + e]


def test_cp_async_copies_at_the_wait_and_zero_fills_past_src_bytes(rng):
    src = rng.standard_normal((1, 32, 1, 8)).astype(np.float16)
    nbytes = (rng.integers(0, 9, 32) * 2).astype(np.int64)
    before, after = np.zeros((32, 8), np.uint16), np.zeros((32, 8), np.uint16)
    launch(cp_async_kernel, 32, src, nbytes, before, after)
    assert np.all(before == 0xABCD)   # not there before the wait: a kernel that skips it reads stale data
    bits = src[0, :, 0, :].view(np.uint16)
    want = np.where(np.arange(8)[None, :] * 2 < nbytes[:, None], bits, 0)
    np.testing.assert_array_equal(after, want)


@cuda.jit
def cp_async_at_kernel(src, offsets, nbytes, out):
    """Lane l copies the chunk at byte offset offsets[l] of src (any strides) into smem row l."""
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(256, uint16)
    warp.cp_async_16_at(smem, lane * 8, src, offsets[lane], nbytes[lane])
    warp.cp_async_commit()
    warp.cp_async_wait_one()          # one group committed: nothing older to wait for
    warp.cp_async_wait_all()
    for e in range(8):
        out[lane, e] = smem[lane * 8 + e]


def test_cp_async_at_reads_by_byte_offset_in_any_layout(rng):
    # A (2, 8, 3, 16) array viewed with its head and sequence axes swapped: byte offsets follow the strides.
    base = rng.standard_normal((2, 3, 8, 16)).astype(np.float16)
    src = base.transpose(0, 2, 1, 3)                  # host view, for the offsets and the expected values
    dsrc = cuda.to_device(base).transpose((0, 2, 1, 3))   # the same view on the device (simulated)
    b, s, h, c = rng.integers(0, 2, 32), rng.integers(0, 8, 32), rng.integers(0, 3, 32), rng.integers(0, 2, 32)
    offsets = (b * src.strides[0] + s * src.strides[1] + h * src.strides[2] + 16 * c).astype(np.int64)
    nbytes = (rng.integers(0, 9, 32) * 2).astype(np.int64)
    out = np.zeros((32, 8), np.uint16)
    launch(cp_async_at_kernel, 32, dsrc, offsets, nbytes, out)
    for lane in range(32):
        want = src[b[lane], s[lane], h[lane], 8 * c[lane]: 8 * c[lane] + 8].view(np.uint16)
        n = nbytes[lane] // 2
        np.testing.assert_array_equal(out[lane, :n], want[:n])
        assert not out[lane, n:].any()


def test_cp_async_at_refuses_an_offset_between_elements(rng):
    src = cuda.to_device(rng.standard_normal((1, 4, 1, 8)).astype(np.float16))[:, :, :, ::2]   # every other one
    offsets = np.full(32, 2, np.int64)                                          # the skipped element
    with pytest.raises(Exception, match="not an element"):
        launch(cp_async_at_kernel, 32, src, offsets, np.full(32, 2, np.int64), np.zeros((32, 8), np.uint16))


@cuda.jit
def special_kernel(x, ex2, rcp, tanh, words, out):
    i = cuda.threadIdx.x
    ex2[i] = warp.exp2_approx(x[i])
    rcp[i] = warp.rcp_approx(x[i])
    tanh[i] = warp.tanh_approx(x[i] / float32(40.0))
    smem = cuda.shared.array(64, uint16)
    warp.sts_u32(smem, 2 * i, words[i])
    cuda.syncthreads()
    out[2 * i] = smem[2 * i]
    out[2 * i + 1] = smem[2 * i + 1]


def test_exp2_reciprocal_tanh_and_sts_u32_stores_low_half_first(rng):
    x = (rng.standard_normal(32) * 40).astype(np.float32)
    x[0], x[1], x[2] = -130.0, 0.0, -np.inf          # 2**-130 flushes to 0; 1/0 = inf; 2**-inf = 0
    ex2, rcp, tanh = (np.zeros(32, np.float32) for _ in range(3))
    words = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    out = np.zeros(64, np.uint16)
    with np.errstate(all="ignore"):
        launch(special_kernel, 32, x, ex2, rcp, tanh, words, out)
        want_ex2 = np.exp2(x.astype(np.float64))
        want_rcp = 1.0 / x.astype(np.float64)
    # x is N(0, 40): about one run in 50 has an x past 128, where 2**x overflows float32 to inf (as ex2.approx
    # does); numpy's float32 exp2 is within 2.5 ulp (3e-7) of the float64 one elsewhere.
    tiny, huge = np.abs(want_ex2) < 2.0 ** -126, want_ex2 > np.finfo(np.float32).max
    assert np.all(ex2[tiny] == 0) and ex2[0] == 0 and ex2[2] == 0 and np.all(ex2[huge] == np.inf)
    np.testing.assert_allclose(ex2[~tiny & ~huge], want_ex2[~tiny & ~huge], rtol=3e-7)
    assert rcp[1] == np.inf
    np.testing.assert_allclose(rcp[3:], want_rcp[3:], rtol=2e-7)
    np.testing.assert_allclose(tanh, np.tanh(x.astype(np.float64) / 40.0), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(out[0::2], words & 0xFFFF)
    np.testing.assert_array_equal(out[1::2], words >> 16)


# ---- shuffles and packing ----

@cuda.jit
def shfl_kernel(x, masks, out):
    lane = cuda.threadIdx.x
    for i in range(masks.shape[0]):
        out[i, lane] = warp.shfl_xor(x[lane], masks[i])


def test_shfl_xor_returns_the_partner_lanes_value(rng):
    x = rng.standard_normal(64).astype(np.float32)
    masks = np.array([1, 2, 4, 8, 16, 3], np.int64)
    out = np.zeros((len(masks), 64), np.float32)
    launch(shfl_kernel, 64, x, masks, out)   # two warps: each exchanges within itself
    for i, m in enumerate(masks):
        partner = (np.arange(64) & ~31) | ((np.arange(64) & 31) ^ m)
        np.testing.assert_array_equal(out[i], x[partner])


@cuda.jit
def pack_kernel(x, f16, bf16, tf32, tf32_bits):
    i = cuda.threadIdx.x
    f16[i] = warp.pack_f16x2(x[i, 0], x[i, 1])
    bf16[i] = warp.pack_bf16x2(x[i, 0], x[i, 1])
    tf32[i] = warp.float_to_tf32(x[i, 0])
    # the same rounding from the float's bits, through a shared word of two 16-bit slots, low half first
    smem = cuda.shared.array(64, uint16)
    bits = x[i, 0:1].view(np.uint32)[0]
    smem[2 * i] = uint16(bits & 0xFFFF)
    smem[2 * i + 1] = uint16(bits >> 16)
    cuda.syncthreads()
    tf32_bits[i] = warp.bits_to_tf32(warp.lds_u32(smem, 2 * i))


def test_packing_rounds_to_nearest_even_low_half_first(rng):
    x = (rng.standard_normal((32, 2)) * 10.0 ** rng.integers(-6, 6, (32, 2))).astype(np.float32)
    x[0] = [np.inf, -np.inf]
    x[1] = [np.nan, 70000.0]          # 70000 overflows float16 to inf
    x[2] = [1 + 2 ** -11, 1 + 3 * 2 ** -11]   # float16 ties: to even, 1.0 and 1 + 2**-9
    x[3, 0] = np.uint32(0x7F800001).view(np.float32)   # a NaN whose payload lies below TF32's bits: cut to inf
    f16, bf16, tf32, tf32_bits = (np.zeros(32, np.uint32) for _ in range(4))
    launch(pack_kernel, 32, x, f16, bf16, tf32, tf32_bits)
    lo, hi = (f16 & 0xFFFF).astype(np.uint16).view(np.float16), (f16 >> 16).astype(np.uint16).view(np.float16)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(lo, x[:, 0].astype(np.float16))
        np.testing.assert_array_equal(hi, x[:, 1].astype(np.float16))
    torch = pytest.importorskip("torch")
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    got = np.stack([bf16 & 0xFFFF, bf16 >> 16], axis=1)
    finite = np.isfinite(x) | np.isinf(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan((got[~finite] << 16).astype(np.uint32).view(np.float32)).all()
    # tf32: 10 mantissa bits, nearest with ties away from zero (cvt.rna); inf and NaN cut, not rounded
    mant = x[:, 0].view(np.uint32)
    expect = np.where(np.isfinite(x[:, 0]), (mant.astype(np.uint64) + 0x1000) & 0xFFFFE000, mant & 0xFFFFE000)
    np.testing.assert_array_equal(tf32, expect.astype(np.uint32))
    np.testing.assert_array_equal(tf32_bits, expect.astype(np.uint32))


@cuda.jit
def probe_kernel(tile, probes, words):
    """Lane l reads 8 elements at 8 l with lds_v4 and folds them into a probe of each kind."""
    lane = cuda.threadIdx.x
    smem = cuda.shared.array(256, uint16)
    for e in range(8):
        smem[lane * 8 + e] = tile[lane * 8 + e]
    w = warp.lds_v4(smem, lane * 8)
    f16 = uint32(0)
    bf16 = uint32(0)
    for i in range(4):
        words[lane, i] = w[i]
        f16 = warp.probe_f16x2(f16, w[i])
        bf16 = warp.probe_bf16x2(bf16, w[i])
    probes[lane, 0] = f16
    probes[lane, 1] = bf16


def test_lds_v4_and_the_nonfinite_probes(rng):
    tile = np.asarray(rng.standard_normal(256), np.float16).view(np.uint16).copy()
    tile[8 * 3 + 5] = np.float16(np.inf).view(np.uint16)      # lane 3, word 2, high half: inf as float16
    tile[8 * 7 + 0] = np.float16(np.nan).view(np.uint16)      # lane 7, word 0, low half: NaN
    tile[8 * 9 + 2] = 0xFF80                                   # lane 9, word 1, low half: -inf as bfloat16
    probes, words = np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.uint32)
    launch(probe_kernel, 32, tile, probes, words)
    np.testing.assert_array_equal(words, pack_halves(tile[0::2], tile[1::2]).reshape(32, 4))

    def nan_halves(p, exp_bits):
        return [((int(p) >> s) & 0x7FFF) > exp_bits for s in (0, 16)]

    f16_bad = {i for i in range(32) if any(nan_halves(probes[i, 0], 0x7C00))}
    bf16_bad = {i for i in range(32) if any(nan_halves(probes[i, 1], 0x7F80))}
    # A bfloat16 inf or NaN has float16's exponent bits set too, so lane 9 is flagged both ways; finite float16
    # values may read as non-finite bfloat16 (exponent bits 0x7F80), so the bfloat16 reading need only flag 9.
    assert f16_bad == {3, 7, 9}
    assert 9 in bf16_bad
    assert nan_halves(probes[3, 0], 0x7C00) == [False, True] and nan_halves(probes[7, 0], 0x7C00) == [True, False]


# ---- what the emulation must not hide ----

@cuda.jit
def cross_warp_kernel(tile, out, with_barrier):
    """Warp 0 stores a tile; warp 1 reads it with ldmatrix: a block barrier is needed between them."""
    t = cuda.threadIdx.x
    smem = cuda.shared.array(256, uint16)
    if t < 32:
        for e in range(t, 256, 32):
            smem[e] = tile[e]
    if with_barrier:
        cuda.syncthreads()
    r = warp.ldmatrix_x4(smem, (t % 32) * 8)
    out[t] = r[0]


def test_warp_exchange_does_not_hide_a_missing_block_barrier(rng):
    tile = rng.integers(0, 1 << 16, 256, dtype=np.uint16)
    out = np.zeros(64, np.uint32)
    launch(cross_warp_kernel, 64, tile, out, True)
    with pytest.raises(SimulatorCheckError, match="race"):
        launch(cross_warp_kernel, 64, tile, np.zeros(64, np.uint32), False)


@cuda.jit
def divergent_kernel(x, out):
    lane = cuda.threadIdx.x
    v = x[lane]
    if lane < 16:      # half the warp skips the shuffle: undefined on the hardware
        v = warp.shfl_xor(v, 1)
    out[lane] = v


def test_a_lane_that_skips_a_warp_primitive_fails_the_kernel(monkeypatch):
    monkeypatch.setattr(warp_sim, "WAIT_TIMEOUT", 1.0)
    with pytest.raises(Exception, match="other lanes of its warp"):
        launch(divergent_kernel, 32, np.ones(32, np.float32), np.zeros(32, np.float32), deadline=60.0)
