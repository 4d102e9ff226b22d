"""A BlockMask (``numba_flash.block_mask``) in the CUDA kernels, under the Numba CUDA simulator: its tiles re-cut to
the kernels' own (``numba_flash.cuda.device.block_tiles.kernel_tile_states``, against a per-element brute force for odd
sizes and unaligned blocks), the SIMT kernels (float32, toy tiles) and the tensor-core kernels (float16, one-warp
tiles) matching the reference with an honest BlockMask, and a BlockMask that misstates tiles changing the answer
exactly as skipping (a FULL tile called EMPTY) or not masking (a PARTIAL tile called FULL) would: the kernels
trust the table and do no per-element mask_mod work there. The CPU kernels' equivalents are in
tests/numba_flash/cpu/test_mods_kernels.py.

Run: NUMBA_ENABLE_CUDASIM=1 NUMBA_FLASH_SIMCHECK=1 .venv/bin/python -m pytest -q -m cudasim <this file>
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim_cases import TILES, forward_backward, random_inputs, rel_l2

from numba_flash import attention_ref, attention_ref_backward, block_mask
from numba_flash.cuda.device.block_tiles import kernel_tile_states
from numba_flash.mods import EMPTY, FULL, PARTIAL, BlockMask

# RuntimeWarnings: the simulator's numpy arithmetic on the -inf the masks make.
pytestmark = [pytest.mark.cudasim, pytest.mark.filterwarnings("ignore::RuntimeWarning")]


def _brute_force_states(states, sq, sk, bm, bn, km, kn):
    """Kernel tile states from each element's BlockMask state: EMPTY if every element's is EMPTY, FULL if every
    one's is FULL, else PARTIAL."""
    per_element = states.repeat(bm, axis=2).repeat(bn, axis=3)[:, :, :sq, :sk]
    out = np.empty(states.shape[:2] + (-(-sq // km), -(-sk // kn)), np.int8)
    for qt, kt in np.ndindex(out.shape[2:]):
        box = per_element[:, :, qt * km:(qt + 1) * km, kt * kn:(kt + 1) * kn]
        out[:, :, qt, kt] = np.where((box == EMPTY).all(axis=(2, 3)), EMPTY,
                                     np.where((box == FULL).all(axis=(2, 3)), FULL, PARTIAL))
    return out


@pytest.mark.parametrize("sq, sk, bm, bn, km, kn", [
    (13, 19, 8, 8, 8, 8),        # the same tiles
    (37, 53, 5, 12, 16, 16),     # unaligned both ways
    (29, 31, 64, 64, 8, 16),     # one BlockMask tile covers everything
    (41, 23, 3, 7, 8, 4),        # kernel tiles larger along one axis, smaller along the other
])
def test_kernel_tile_states_match_a_per_element_brute_force(rng, sq, sk, bm, bn, km, kn):
    shape = (2, 3, -(-sq // bm), -(-sk // bn))
    # Mostly EMPTY or FULL, so that kernel tiles of one state over several BlockMask tiles occur.
    states = rng.choice(np.array([EMPTY, PARTIAL, FULL], np.int8), size=shape, p=[0.45, 0.1, 0.45])
    given = BlockMask(lambda b, h, i, j: True, states, sq, sk, bm, bn)
    np.testing.assert_array_equal(kernel_tile_states(given, km, kn), _brute_force_states(states, sq, sk, bm, bn,
                                                                                         km, kn))


def test_kernel_tile_states_are_exact_for_a_real_mask():
    """With a mask_mod's BlockMask, a kernel tile called EMPTY hides every pair and one called FULL shows every
    pair, whatever the two tilings."""
    sq, sk = 37, 53
    mask = _doc_mask(np.repeat(np.arange(3), [18, 3, 32]), sq, sk)
    grid = np.array([[mask(0, 0, i, j) for j in range(sk)] for i in range(sq)])
    for bm, bn, km, kn in ((5, 12, 16, 16), (16, 16, 8, 8), (7, 3, 8, 16)):
        tiles = kernel_tile_states(block_mask(mask, 1, 1, sq, sk, bm, bn), km, kn)[0, 0]
        for qt, kt in np.ndindex(tiles.shape):
            box = grid[qt * km:(qt + 1) * km, kt * kn:(kt + 1) * kn]
            assert tiles[qt, kt] != EMPTY or not box.any()
            assert tiles[qt, kt] != FULL or box.all()


def _doc_mask(docs, sq, sk, holes_in_head=-1):
    """A query (at position i + sk - sq) sees the keys of its document; head ``holes_in_head`` (none for -1) also
    misses every key j with j % 7 == 3, so that the mask depends on the head."""
    shift = sk - sq

    def doc_mask(b, h, q_idx, kv_idx):
        seen = docs[q_idx + shift] == docs[kv_idx]
        if h == holes_in_head:
            seen = seen and kv_idx % 7 != 3
        return seen

    return doc_mask


def _lying(mask, sq, sk, block):
    """A BlockMask of ``mask`` at ``block`` tiles with one FULL tile called EMPTY and one PARTIAL tile called FULL,
    and the mask it describes: ``mask``'s grid with the first tile hidden and the second shown."""
    honest = block_mask(mask, 1, 1, sq, sk, *block)
    states = honest.states.copy()
    full_tile = tuple(np.argwhere(states[0, 0] == FULL)[0])
    partial_tile = tuple(np.argwhere(states[0, 0] == PARTIAL)[0])
    states[0, 0][full_tile] = EMPTY
    states[0, 0][partial_tile] = FULL
    grid = np.array([[mask(0, 0, i, j) for j in range(sk)] for i in range(sq)])
    for (qt, kt), value in ((full_tile, False), (partial_tile, True)):
        grid[qt * block[0]:(qt + 1) * block[0], kt * block[1]:(kt + 1) * block[1]] = value
    return BlockMask(mask, states, sq, sk, *block), np.where(grid, 0.0, -np.inf).astype(np.float32)


# SIMT: 8 x 8 kernel tiles (cuda_sim_cases.TILES).
B, SQ, SK, HQ, HKV, D = 2, 29, 37, 2, 1, 8
DOCS = np.repeat(np.arange(3), [14, 3, 20])   # query i sits at key position i + 8


@pytest.mark.parametrize("given", ["aligned+per-head", "unaligned+broadcast"])
def test_simt_kernels_with_an_honest_block_mask_match_reference(rng, given):
    per_head = given.endswith("per-head")
    mask = _doc_mask(DOCS, SQ, SK, holes_in_head=1 if per_head else -1)
    size = (TILES["block_m"], TILES["block_n"]) if given.startswith("aligned") else (5, 11)
    bmask = block_mask(mask, 1, HQ if per_head else 1, SQ, SK, *size)
    seen = kernel_tile_states(bmask, TILES["block_m"], TILES["block_n"])
    assert (seen == EMPTY).any() and (seen == FULL).any() and (seen == PARTIAL).any()   # every path runs
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    got = forward_backward(q, k, v, dout, mask_mod=mask, block_mask=bmask)
    want_out, want_lse = attention_ref(q, k, v, mask_mod=mask)
    np.testing.assert_allclose(got[0], want_out, atol=2e-5, rtol=0)
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(got[1]), finite)
    np.testing.assert_allclose(got[1][finite], want_lse[finite], atol=2e-5, rtol=1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), got[2:], attention_ref_backward(dout, q, k, v, mask_mod=mask)):
        assert rel_l2(g, ref) <= 2e-5, name


def test_simt_kernels_trust_a_block_mask_that_misstates_tiles(rng):
    mask = _doc_mask(DOCS, SQ, SK)
    lying, table = _lying(mask, SQ, SK, (TILES["block_m"], TILES["block_n"]))
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    got = forward_backward(q, k, v, dout, mask_mod=mask, block_mask=lying)
    want_out, want_lse = attention_ref(q, k, v, attn_bias=table)
    np.testing.assert_allclose(got[0], want_out, atol=2e-5, rtol=0)
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(got[1][finite], want_lse[finite], atol=2e-5, rtol=1e-5)
    for name, g, ref in zip(("dq", "dk", "dv"), got[2:], attention_ref_backward(dout, q, k, v, attn_bias=table)):
        assert rel_l2(g, ref) <= 2e-5, name
    assert np.abs(got[0] - attention_ref(q, k, v, mask_mod=mask)[0]).max() > 1e-2   # the lie shows


def _same_nans_and_close(got, want, atol=None):
    """(out, lse, dq, dk, dv) NaN exactly where the reference's are, and with ``atol`` within it elsewhere."""
    for name, g, ref in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        g = g.double().numpy() if hasattr(g, "double") else np.asarray(g)
        assert np.array_equal(np.isnan(g), np.isnan(ref)), name
        if atol is not None:
            fin = ~np.isnan(ref)
            np.testing.assert_allclose(g[fin], ref[fin], atol=atol, rtol=0, err_msg=name)


def test_simt_non_finite_keys_in_skipped_or_hidden_tiles_never_poison(rng):
    """V NaN at key 3 (document 0): it poisons the rows that see it, not rows 6 and 7 of the same query tile (mask_mod
    hides it there: the forward's rare path) nor the query tiles whose table entry skips its key tile; K inf at
    batch 1's key 30 poisons document 2's rows, and only theirs."""
    mask = _doc_mask(DOCS, SQ, SK)
    bmask = block_mask(mask, 1, 1, SQ, SK, TILES["block_m"], TILES["block_n"])
    q, k, v, dout = random_inputs(rng, B, SQ, SK, HQ, HKV, D)
    v[:, 3] = np.nan
    k[1, 30] = np.inf
    got = forward_backward(q, k, v, dout, mask_mod=mask, block_mask=bmask)
    want = attention_ref(q, k, v, mask_mod=mask) + attention_ref_backward(dout, q, k, v, mask_mod=mask)
    assert np.isnan(want[0][:, :6]).all() and not np.isnan(want[0][0, 6:]).any()   # the cases are live
    _same_nans_and_close(got, want, 5e-5)


torch = pytest.importorskip("torch")

from tc_sim_cases import BOUND, ONE_WARP, inputs, naive_same_dtype  # noqa: E402
from tc_sim_cases import rel_l2 as tc_rel_l2  # noqa: E402

# Tensor cores: 16 x 16 kernel tiles of one warp (tc_sim_cases.ONE_WARP).
TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D = 1, 37, 53, 2, 1, 16
TC_DOCS = np.repeat(np.arange(3), [18, 3, 32])   # query i sits at key position i + 16


def _tc_run(q, k, v, dout, **kw):
    from backends import backend_registry
    from numba_flash.cuda import tile_config_override

    with tile_config_override(**ONE_WARP):
        op = backend_registry.get("flash", backend="cuda")
        out, lse = op.forward(q, k, v, return_lse=True, **kw)
        return (out, lse) + tuple(op.backward(dout, q, k, v, out, lse, **kw))


def _tc_judge(got, q, k, v, dout, **ref_kw):
    """out, dq, dk, dv within the dtype's bound and twice the error of attention plainly in float16, against the
    float64 reference under ``ref_kw``; lse to 1e-4."""
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    want_out, want_lse = attention_ref(q64, k64, v64, **ref_kw)
    want = attention_ref_backward(do64, q64, k64, v64, **ref_kw)
    naive_out, naive_grads = naive_same_dtype(q, k, v, dout=dout, **ref_kw)
    out, lse, *grads = got
    for what, g, ref, plain in zip(("out", "dq", "dk", "dv"), [out] + grads, [want_out] + list(want),
                                   [naive_out] + naive_grads):
        err, naive_err = tc_rel_l2(g.double().numpy(), ref), tc_rel_l2(plain, ref)
        assert err <= BOUND["float16"] and err <= 2 * naive_err, (what, err, naive_err)
    finite = np.isfinite(want_lse)
    assert np.array_equal(np.isfinite(lse.numpy()), finite)
    np.testing.assert_allclose(lse.numpy()[finite], want_lse[finite], rtol=0, atol=1e-4)
    return want_out


@pytest.mark.parametrize("given", ["aligned", "unaligned"])
def test_tensor_core_kernels_with_an_honest_block_mask_match_reference(rng, given):
    mask = _doc_mask(TC_DOCS, TC_SQ, TC_SK)
    size = (16, 16) if given == "aligned" else (5, 7)
    bmask = block_mask(mask, 1, 1, TC_SQ, TC_SK, *size)
    seen = kernel_tile_states(bmask, 16, 16)
    assert (seen == EMPTY).any() and (seen == FULL).any() and (seen == PARTIAL).any()
    (q, k, v), _ = inputs(rng, "float16", TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    got = _tc_run(q, k, v, dout, mask_mod=mask, block_mask=bmask)
    _tc_judge(got, q, k, v, dout, mask_mod=mask)


def test_tensor_core_kernels_trust_a_block_mask_that_misstates_tiles(rng):
    mask = _doc_mask(TC_DOCS, TC_SQ, TC_SK)
    lying, table = _lying(mask, TC_SQ, TC_SK, (16, 16))
    (q, k, v), _ = inputs(rng, "float16", TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    got = _tc_run(q, k, v, dout, mask_mod=mask, block_mask=lying)
    want_out = _tc_judge(got, q, k, v, dout, attn_bias=table)
    honest_out = attention_ref(*(x.double().numpy() for x in (q, k, v)), mask_mod=mask)[0]
    assert np.abs(want_out - honest_out).max() > 1e-1   # the lie shows


def test_tensor_core_non_finite_keys_in_skipped_or_hidden_tiles_never_poison(rng):
    """As the SIMT test: V NaN at key 5 (document 0, seen by rows 0 and 1 only), K inf at key 40 (document 2)."""
    mask = _doc_mask(TC_DOCS, TC_SQ, TC_SK)
    bmask = block_mask(mask, 1, 1, TC_SQ, TC_SK, 16, 16)
    (q, k, v), _ = inputs(rng, "float16", TC_B, TC_SQ, TC_SK, TC_HQ, TC_HKV, TC_D)
    dout = torch.from_numpy(rng.standard_normal(q.shape).astype(np.float32)).half()
    v[:, 5] = float("nan")
    k[0, 40] = float("inf")
    got = _tc_run(q, k, v, dout, mask_mod=mask, block_mask=bmask)
    q64, k64, v64, do64 = (x.double().numpy() for x in (q, k, v, dout))
    want = attention_ref(q64, k64, v64, mask_mod=mask) + attention_ref_backward(do64, q64, k64, v64, mask_mod=mask)
    assert np.isnan(want[0][0, :2]).all() and not np.isnan(want[0][0, 2:5]).any()   # the cases are live
    _same_nans_and_close(got, want)
