"""The user's mods compiled into the CPU kernels (numba_flash.cpu.modhooks): over many tiles against the float64
reference, tiles a BlockMask calls empty really skipped and full ones really unmasked, a mod that fails inside the
kernel reported by name, and BlockMasks of any tile size mapped onto the kernels' tiles.

Every test here runs the set tests/numba_flash/test_mods_backends.py runs on the cpu backend too
(tests/mods_cases.py): a document mask with four rows that see no key, a per-head distance bias, and a soft clip of
the score that hides one key. (tests/numba_flash/cpu/test_mods_hooks.py: how mods are compiled and cached.)"""

from __future__ import annotations

import numpy as np
import pytest
from mods_cases import CPU_SHIFT, cpu_doc_mask, cpu_head_bias, soft_clip, soft_clip_grad

from numba_flash import AttentionInputError, attention_ref, attention_ref_backward, backend_registry, block_mask
from numba_flash.cpu import BLOCK_M, BLOCK_N
from numba_flash.cpu.modhooks import kernel_tile_states
from numba_flash.mods import EMPTY, FULL, PARTIAL, BlockMask

# 4 x 4 of the kernels' 64 x 64 tiles; the documents' table (mods_cases.CPU_DOCS) has exactly SK keys
SQ, SK, D = 203, 219, 24
MODS = dict(bias_mod=cpu_head_bias, mask_mod=cpu_doc_mask, score_mod=soft_clip)
assert SK - SQ == CPU_SHIFT


def _inputs(seed, batch=1, hq=3, hkv=1):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, SQ, hq, D)).astype(np.float32)
    k = rng.standard_normal((batch, SK, hkv, D)).astype(np.float32)
    v = rng.standard_normal((batch, SK, hkv, D)).astype(np.float32)
    return q, k, v, rng.standard_normal(q.shape).astype(np.float32)


def _close(got, want, tol):
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)


@pytest.mark.parametrize("given", ["none", "aligned", "unaligned"])
def test_many_tiles_match_reference_with_and_without_a_block_mask(given):
    """Forward and both backward passes (B * Hkv = 1: dQ in its own pass) over 4 x 4 tiles, with a window, against
    the reference; with no BlockMask the kernel finds the empty tiles itself."""
    q, k, v, dout = _inputs(1)
    kw = dict(MODS, window_size=(150, 40))
    if given != "none":
        size = (BLOCK_M, BLOCK_N) if given == "aligned" else (24, 40)
        kw["block_mask"] = block_mask(cpu_doc_mask, 1, 1, SQ, SK, *size)
        assert (kw["block_mask"].states == EMPTY).any() and (kw["block_mask"].states == FULL).any()
    op = backend_registry.get("flash", backend="cpu")
    out, lse = op.forward(q, k, v, return_lse=True, **kw)
    grads = op.backward(dout, q, k, v, out, lse, score_mod_grad=soft_clip_grad, **kw)
    ref = {n: x for n, x in kw.items() if n != "block_mask"}
    want_out, want_lse = attention_ref(q, k, v, **ref)
    np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=0)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=2e-5, rtol=1e-5)
    for got, want in zip(grads, attention_ref_backward(dout, q, k, v, score_mod_grad=soft_clip_grad, **ref)):
        _close(got, want, 2e-5)


def test_tiles_the_block_mask_calls_empty_are_skipped_and_full_ones_unmasked():
    """A BlockMask that misstates two tiles changes the answer exactly as skipping or not masking them would: the
    kernels trust it and do no per-element work there (score_mod still runs on what they keep)."""
    q, k, v, _ = _inputs(2)
    kw = dict(MODS)
    honest = block_mask(cpu_doc_mask, 1, 1, SQ, SK, BLOCK_M, BLOCK_N)
    states = honest.states.copy()
    full_tile = tuple(np.argwhere(states[0, 0] == FULL)[0])
    partial_tile = tuple(np.argwhere(states[0, 0] == PARTIAL)[0])
    states[0, 0][full_tile] = EMPTY      # skipped: its keys vanish from its rows
    states[0, 0][partial_tile] = FULL    # unmasked: its hidden keys appear
    lying = BlockMask(cpu_doc_mask, states, SQ, SK, BLOCK_M, BLOCK_N)
    op = backend_registry.get("flash", backend="cpu")
    out = op.forward(q, k, v, block_mask=lying, **kw)
    grid = np.array([[cpu_doc_mask(0, 0, i, j) for j in range(SK)] for i in range(SQ)])
    for (qt, kt), value in ((full_tile, False), (partial_tile, True)):
        grid[qt * BLOCK_M:(qt + 1) * BLOCK_M, kt * BLOCK_N:(kt + 1) * BLOCK_N] = value
    table = np.where(grid, 0.0, -np.inf).astype(np.float32)
    np.testing.assert_allclose(out, attention_ref(q, k, v, attn_bias=table, bias_mod=cpu_head_bias, score_mod=soft_clip)[0], atol=2e-5, rtol=0)
    assert np.abs(out - attention_ref(q, k, v, **kw)[0]).max() > 1e-2


def test_a_mod_that_fails_inside_the_kernel_is_named():
    """cpu_doc_mask reads a table of SK keys: called with more keys, it raises IndexError inside the kernel."""
    q, _, _, _ = _inputs(3)
    rng = np.random.default_rng(3)
    k, v = (rng.standard_normal((1, SK + 29, 1, D)).astype(np.float32) for _ in range(2))
    kw = dict(MODS)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    with pytest.raises(AttentionInputError, match=r"^bias_mod, mask_mod, score_mod: expected functions that run on "
                                                  r"every .* bias_mod=head_bias mask_mod=doc_mask score_mod=soft_clip "
                                                  r"raised IndexError"):
        backend_registry.get("flash", backend="cpu").forward(q, k, v, **kw)
    assert all(np.array_equal(a, b) for a, b in ((q, q0), (k, k0), (v, v0)))
    k, v = k[:, :SK].copy(), v[:, :SK].copy()
    out = backend_registry.get("flash", backend="cpu").forward(q, k, v, **kw)  # still works
    np.testing.assert_allclose(out, attention_ref(q, k, v, **kw)[0], atol=2e-5, rtol=0)


@pytest.mark.parametrize("size", [(16, 16), (64, 64), (24, 40), (100, 7), (512, 512)])
def test_block_masks_of_any_tile_size_map_onto_the_kernel_tiles(size):
    """Each kernel tile's state from a BlockMask of other tiles equals the one computed at the kernel's own."""
    direct = block_mask(cpu_doc_mask, 1, 1, SQ, SK, BLOCK_M, BLOCK_N).states
    mapped = kernel_tile_states(block_mask(cpu_doc_mask, 1, 1, SQ, SK, *size), SQ, SK)
    assert mapped.shape == direct.shape
    # a coarser mask knows less: where it says EMPTY or FULL it must be right, elsewhere PARTIAL is safe
    known = mapped != PARTIAL
    assert np.array_equal(mapped[known], direct[known])
    if BLOCK_M % size[0] == 0 and BLOCK_N % size[1] == 0:
        assert np.array_equal(mapped, direct)    # finer and aligned: exact


def test_tile_states_found_without_a_block_mask_are_kept_for_later_passes_and_calls():
    """Without a BlockMask the first pass over a tile evaluates the mask_mod there and records what it found: the
    record equals the BlockMask at the kernels' tiles wherever a pass looked (the window keeps some tiles unseen)."""
    from numba_flash.cpu.modhooks import UNKNOWN, states_for_call
    from numba_flash.mods import check_mods

    q, k, v, _ = _inputs(4, batch=2, hq=2)
    kw = dict(MODS, window_size=(40, 0))
    op = backend_registry.get("flash", backend="cpu")
    mods = check_mods(cpu_head_bias, cpu_doc_mask, soft_clip, None, None, (2, 2, SQ, SK), "bshd", False)
    fresh = states_for_call(mods, 2, 2, SQ, SK)
    assert (fresh == UNKNOWN).all() and fresh.shape == (2, 2, -(-SQ // BLOCK_M), -(-SK // BLOCK_N))
    first, lse = op.forward(q, k, v, return_lse=True, **kw)
    found = states_for_call(mods, 2, 2, SQ, SK)
    seen = found != UNKNOWN
    assert seen.any() and not seen.all()
    direct = np.broadcast_to(block_mask(cpu_doc_mask, 1, 1, SQ, SK, BLOCK_M, BLOCK_N).states, found.shape)
    assert np.array_equal(found[seen], direct[seen])
    again = op.forward(q, k, v, **kw)
    np.testing.assert_array_equal(again, first)     # a known tile takes the same path as a first look
    np.testing.assert_allclose(first, attention_ref(q, k, v, **kw)[0], atol=2e-5, rtol=0)
