"""``plan_cache.PlanCache``: bounded, least recently used dropped first, a None key never kept, off means off."""

from __future__ import annotations

from numba_flash.plan_cache import PlanCache


def test_the_least_recently_used_plan_is_dropped_first():
    store = PlanCache(3)
    for key in "abc":
        store.keep((key,), key.upper())
    assert store.cached(("a",)) == "A"     # a is now the most recent: b goes first
    store.keep(("d",), "D")
    assert store.kept_count() == 3
    assert store.cached(("b",)) is None
    assert [store.cached((key,)) for key in "acd"] == ["A", "C", "D"]


def test_a_none_key_is_never_kept_and_a_store_turned_off_keeps_and_finds_nothing():
    store = PlanCache(2)
    store.keep(None, "x")
    assert store.kept_count() == 0 and store.cached(None) is None
    store.keep(("a",), "A")
    assert store.set_enabled(False) is True
    store.keep(("b",), "B")
    assert store.cached(("a",)) is None and store.kept_count() == 1
    assert store.set_enabled(True) is False
    assert store.cached(("a",)) == "A" and store.cached(("b",)) is None
    store.clear()
    assert store.kept_count() == 0
