"""numba_flash.mods: user mods compiled by numba, evaluated over blocks, and block masks, each checked against the
plain Python function called element by element."""

from __future__ import annotations

import numba
import numpy as np
import pytest

from numba_flash import AttentionInputError
from numba_flash.mods import EMPTY, FULL, PARTIAL, block_mask, compile_mod, evaluate_block

DOCS = np.repeat(np.arange(5), [7, 1, 12, 9, 4])  # 33 positions in 5 documents of uneven length
HEAD_SCALE = np.array([0.5, -1.25, 2.0])


def doc_causal(b, h, q_idx, kv_idx):
    return DOCS[q_idx] == DOCS[kv_idx] and kv_idx <= q_idx


def per_head_distance(b, h, q_idx, kv_idx):
    return HEAD_SCALE[h] * abs(q_idx - kv_idx) + 0.1 * b


def squash(score, b, h, q_idx, kv_idx):
    return score * (1.0 + 0.01 * h) - 0.02 * (q_idx % 3)


def _python_grid(fn, shape, scores=None):
    out = np.empty(shape, dtype=object)
    for idx in np.ndindex(*shape):
        out[idx] = fn(*idx) if scores is None else fn(scores[idx], *idx)
    return out


def test_evaluate_block_matches_the_python_function():
    rng = np.random.default_rng(0)
    bias = compile_mod(per_head_distance, "bias_mod")
    got = evaluate_block(bias, "bias_mod", range(1, 3), range(0, 3), range(4, 9), range(2, 13))
    want = _python_grid(per_head_distance, (3, 3, 9, 13))[1:3, 0:3, 4:9, 2:13].astype(np.float64)
    np.testing.assert_array_equal(got, want)
    scores = rng.standard_normal((2, 3, 5, 11))
    mod = compile_mod(squash, "score_mod")
    got = evaluate_block(mod, "score_mod", range(1, 3), range(0, 3), range(4, 9), range(2, 13), scores)
    full = np.zeros((3, 3, 9, 13))
    full[1:3, :, 4:9, 2:13] = scores
    want = _python_grid(squash, full.shape, full)[1:3, :, 4:9, 2:13].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=0)
    mask = evaluate_block(compile_mod(doc_causal, "mask_mod"), "mask_mod", range(0, 1), range(0, 1), range(0, 33),
                          range(0, 33))
    assert mask.dtype == np.bool_
    np.testing.assert_array_equal(mask, _python_grid(doc_causal, (1, 1, 33, 33)).astype(bool))


@pytest.mark.parametrize("block", [(4, 4), (5, 7), (64, 64), (1, 1)])
def test_block_mask_tiles_match_a_brute_force_classification(block):
    bm, bn = block
    got = block_mask(doc_causal, 1, 1, 33, 33, block_m=bm, block_n=bn)
    dense = _python_grid(doc_causal, (1, 1, 33, 33)).astype(bool)[0, 0]
    for qt in range(-(-33 // bm)):
        for kt in range(-(-33 // bn)):
            tile = dense[qt * bm:(qt + 1) * bm, kt * bn:(kt + 1) * bn]
            want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
            assert got.states[0, 0, qt, kt] == want, (qt, kt)
    assert got.shape == (1, 1, 33, 33)
    assert 0 < got.visible_fraction() <= 1
    assert got.tile(3, 2, 32, 0) == got.states[0, 0, 32 // bm, 0]  # B and H of 1 broadcast


def test_block_mask_per_batch_and_head():
    def striped(b, h, q_idx, kv_idx):
        return (kv_idx + b + h) % 4 != 0 if h > 0 else kv_idx < 8

    got = block_mask(striped, 2, 3, 9, 16, block_m=4, block_n=8)
    for b in range(2):
        for h in range(3):
            dense = np.array([[striped(b, h, i, j) for j in range(16)] for i in range(9)])
            for qt in range(3):
                for kt in range(2):
                    tile = dense[qt * 4:(qt + 1) * 4, kt * 8:(kt + 1) * 8]
                    want = EMPTY if not tile.any() else FULL if tile.all() else PARTIAL
                    assert got.states[b, h, qt, kt] == want
    assert "tiles:" in repr(got)


def test_mods_may_be_njit_functions_and_closures():
    @numba.njit
    def shifted(b, h, q_idx, kv_idx):
        return float(q_idx - kv_idx)

    def make_window(width):
        def window(b, h, q_idx, kv_idx):
            return abs(q_idx - kv_idx) <= width
        return window

    assert compile_mod(shifted, "bias_mod") is shifted
    narrow, wide = make_window(1), make_window(5)
    a = evaluate_block(compile_mod(narrow, "mask_mod"), "mask_mod", range(1), range(1), range(10), range(10))
    b = evaluate_block(compile_mod(wide, "mask_mod"), "mask_mod", range(1), range(1), range(10), range(10))
    assert a.sum() == 28 and b.sum() == 80  # 10 + 2*9 and 10 + 2*(9+8+7+6+5)


@pytest.mark.parametrize("fn,name,match", [
    (lambda b, h, q, k: "x" + q, "bias_mod", r"^bias_mod: expected a function \(b, h, q_idx, kv_idx\) -> float "
                                             r"that numba can compile; numba could not compile .*lambda.*Typing"),
    (lambda b, h, q: True, "mask_mod", r"^mask_mod: expected .*numba could not compile"),
    (3.0, "score_mod", r"^score_mod: expected a function \(score, b, h, q_idx, kv_idx\) -> float, got float"),
])
def test_mods_numba_cannot_compile_are_refused_with_its_reason(fn, name, match):
    with pytest.raises(AttentionInputError, match=match):
        compile_mod(fn, name)


@pytest.mark.parametrize("args,match", [((0, 1, 4, 4), "^B: expected an int >= 1"),
                                        ((1, 1, 4, 4.0), "^Sk: expected an int >= 1"),
                                        ((1, True, 4, 4), "^H: expected an int >= 1")])
def test_block_mask_bad_sizes(args, match):
    with pytest.raises(AttentionInputError, match=match):
        block_mask(doc_causal, *args)


def test_an_index_out_of_bounds_is_refused_not_read():
    table = np.arange(5.0)

    def reads_past_the_table(b, h, q_idx, kv_idx):
        return table[q_idx + kv_idx]

    fn = compile_mod(reads_past_the_table, "bias_mod")
    assert evaluate_block(fn, "bias_mod", range(1), range(1), range(2), range(3)).sum() == 0 + 1 + 2 + 1 + 2 + 3
    with pytest.raises(AttentionInputError, match=r"^bias_mod: expected a function that runs on every .* "
                                                  r"reads_past_the_table raised IndexError"):
        evaluate_block(fn, "bias_mod", range(1), range(1), range(10), range(10))

    def mask_past_the_table(b, h, q_idx, kv_idx):
        return table[q_idx] > 0

    with pytest.raises(AttentionInputError, match=r"^mask_mod: .* mask_past_the_table raised IndexError"):
        block_mask(mask_past_the_table, 1, 1, 6, 6)


def test_division_by_zero_follows_numpy_and_gives_inf():
    def inverse_distance(b, h, q_idx, kv_idx):
        return 1.0 / (q_idx - kv_idx)

    got = evaluate_block(compile_mod(inverse_distance, "bias_mod"), "bias_mod", range(1), range(1), range(3),
                         range(3))[0, 0]
    with np.errstate(divide="ignore"):
        want = 1.0 / (np.arange(3)[:, None] - np.arange(3)[None, :])
    np.testing.assert_array_equal(got, want)


def test_block_mask_plot_shows_the_tile_states():
    pytest.importorskip("matplotlib")
    bm = block_mask(doc_causal, 1, 1, 33, 33, block_m=4, block_n=4)
    fig = bm.plot()
    image = fig.axes[0].images[0].get_array()
    np.testing.assert_array_equal(np.asarray(image), bm.states[0, 0])
    assert "doc_causal" in fig.axes[0].get_title()
    assert bm._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"
