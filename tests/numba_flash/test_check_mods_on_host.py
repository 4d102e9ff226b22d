"""``numba_flash.check_mods_on_host``: the checked mode for mods, run on the host over every (b, h, q_idx, kv_idx)
of a call before a GPU (which catches no out-of-range read and no raise in a mod) is trusted with them. It reads
only the shapes of q and k, so these tests give it arrays of odd sizes filled with random values."""

from __future__ import annotations

import numpy as np
import pytest

import numba_flash
from numba_flash import AttentionInputError


def _qk(rng, B: int, Sq: int, Sk: int, Hq: int, Hkv: int, D: int, layout: str = "bshd"):
    qs, ks = ((B, Sq, Hq, D), (B, Sk, Hkv, D)) if layout == "bshd" else ((B, Hq, Sq, D), (B, Hkv, Sk, D))
    return rng.standard_normal(qs, dtype=np.float32), rng.standard_normal(ks, dtype=np.float32)


def test_a_table_read_past_its_end_is_named_with_the_element(rng):
    Sq, Sk = 37, 53
    q, k = _qk(rng, 2, Sq, Sk, 3, 1, 8)
    # one document id per query position: the keys run 16 past its end, which only an index check catches
    doc = np.sort(rng.integers(0, 4, size=Sq)).astype(np.int32)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    with pytest.raises(AttentionInputError, match=r"mask_mod: .*same_doc raised IndexError.*kv_idx=37\b") as err:
        numba_flash.check_mods_on_host(q, k, mask_mod=same_doc)
    assert "b=0, h=0, q_idx=0" in str(err.value), err.value   # the first element that reads past the table


def test_a_mod_that_raises_keyerror_is_named(rng):
    q, k = _qk(rng, 1, 19, 23, 2, 2, 4, layout="bhsd")
    limit = int(rng.integers(3, 15))

    def bias_by_distance(b, h, q_idx, kv_idx):
        if kv_idx - q_idx > limit:
            raise KeyError("no bias this far ahead")
        return 0.5 * (q_idx - kv_idx)

    with pytest.raises(AttentionInputError, match=r"bias_mod: .*bias_by_distance raised KeyError"):
        numba_flash.check_mods_on_host(q, k, bias_mod=bias_by_distance, layout="bhsd")


def test_valid_mods_pass_over_many_chunks(rng, monkeypatch):
    from numba_flash import mod_check

    # a small chunk budget, so that the batches, heads, query rows and keys are all cut in pieces
    monkeypatch.setattr(mod_check, "CHUNK_ELEMENTS", 29)
    B, Sq, Sk, Hq = 3, 41, 31, 5
    q, k = _qk(rng, B, Sq, Sk, Hq, 1, 8)
    table = rng.standard_normal((B, Hq, Sq, Sk))

    def bias_from_table(b, h, q_idx, kv_idx):
        return table[b, h, q_idx, kv_idx]

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + (Sk - Sq)

    def tanh_cap(score, b, h, q_idx, kv_idx):
        return 30.0 * np.tanh(score / 30.0)

    def tanh_cap_grad(score, b, h, q_idx, kv_idx):
        return 1.0 - np.tanh(score / 30.0) ** 2

    assert numba_flash.check_mods_on_host(q, k, None, bias_mod=bias_from_table, mask_mod=causal,
                                          score_mod=tanh_cap, score_mod_grad=tanh_cap_grad) is None

    # every element of the call is reached, across the chunks: a mod that fails at one random element is caught
    # there, the last one included
    def failing_at(at: tuple[int, int, int, int]):
        def fails_at_one(b, h, q_idx, kv_idx):
            if b == at[0] and h == at[1] and q_idx == at[2] and kv_idx == at[3]:
                raise RuntimeError("this one")
            return True
        return fails_at_one

    for b, h, i, j in [(B - 1, Hq - 1, Sq - 1, Sk - 1), tuple(int(rng.integers(n)) for n in (B, Hq, Sq, Sk))]:
        with pytest.raises(AttentionInputError, match=rf"fails_at_one raised RuntimeError: this one \(at b={b}, "
                                                      rf"h={h}, q_idx={i}, kv_idx={j},"):
            numba_flash.check_mods_on_host(q, k, mask_mod=failing_at((b, h, i, j)))


def test_bad_arguments_are_named(rng):
    q, k = _qk(rng, 2, 7, 9, 2, 1, 4)

    def keep(b, h, q_idx, kv_idx):
        return True

    with pytest.raises(AttentionInputError, match=r"k: expected 4 dimensions .* got shape \(9, 1, 4\)"):
        numba_flash.check_mods_on_host(q, k[0], mask_mod=keep)
    with pytest.raises(AttentionInputError, match=r"k: expected the batch size of q \(2\), got 1"):
        numba_flash.check_mods_on_host(q, k[:1], mask_mod=keep)
    with pytest.raises(AttentionInputError, match=r"layout: expected 'bshd' or 'bhsd'.*got 'thd'"):
        numba_flash.check_mods_on_host(q, k, mask_mod=keep, layout="thd")
    with pytest.raises(AttentionInputError, match=r"mask_mod: expected a function"):
        numba_flash.check_mods_on_host(q, k, mask_mod=3)
    with pytest.raises(AttentionInputError, match=r"bias_mod, mask_mod, score_mod: expected at least one mod"):
        numba_flash.check_mods_on_host(q, k)
