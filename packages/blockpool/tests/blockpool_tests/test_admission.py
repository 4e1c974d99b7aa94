"""StoreAdmissionFilter: a pool that stores a key only once it was seen often enough."""

from __future__ import annotations

import pytest

from kvtier.blockpool import HostBlockPool, StoreAdmissionFilter


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def test_a_key_is_stored_only_after_threshold_lookups() -> None:
    store = StoreAdmissionFilter(HostBlockPool(8), threshold=2)
    plan = store.prepare_store([k(0)])
    assert plan is not None and plan.keys == [], "stored before any lookup"
    assert store.lookup([k(0)]) == 0
    plan = store.prepare_store([k(0)])
    assert plan is not None and plan.keys == [], "stored after one lookup of two"
    store.lookup([k(0)])
    plan = store.prepare_store([k(0)])
    assert plan is not None and plan.keys == [k(0)]
    assert store.stores_skipped == 2


def test_recorded_offers_count_like_lookups() -> None:
    store = StoreAdmissionFilter(HostBlockPool(8), threshold=2)
    store.record([k(0), k(1)])
    store.record([k(0)])
    plan = store.prepare_store([k(0), k(1)])
    assert plan is not None and plan.keys == [k(0)]
    assert store.stores_skipped == 1


def test_a_refused_key_listed_twice_is_skipped_once() -> None:
    store = StoreAdmissionFilter(HostBlockPool(8), threshold=2)
    plan = store.prepare_store([k(0), k(0)])
    assert plan is not None and plan.keys == []
    assert store.stores_skipped == 1


def test_keys_already_cached_are_neither_skipped_nor_evicted_for_the_call() -> None:
    pool = HostBlockPool(2)
    store = StoreAdmissionFilter(pool, threshold=2)
    for key in (k(0), k(1)):  # cached before the filter saw them
        plan = pool.prepare_store([key])
        assert plan is not None
        pool.complete_store(plan.keys)
    store.record([k(2), k(2)])
    plan = store.prepare_store([k(0), k(2), k(3)])
    assert plan is not None and plan.keys == [k(2)]
    assert plan.evicted == [k(1)], "the request's own cached key k(0) must be spared"
    assert store.stores_skipped == 1, "only k(3) was refused"


def test_the_tracker_is_bounded() -> None:
    store = StoreAdmissionFilter(HostBlockPool(8), threshold=2, max_tracker_size=10)
    for i in range(100):
        store.lookup([k(i)])
    assert len(store) == 10
    store.lookup([k(99)])
    assert store.admits(k(99)) and not store.admits(k(0)), "the oldest counts go first"
    assert list(store.counts)[-1] == k(99) and store.counts[k(99)] == 2
    with pytest.raises(TypeError):
        store.counts[k(1)] = 5  # type: ignore[index]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"threshold": 0}, "store_threshold"),
        ({"threshold": "2"}, "store_threshold"),
        ({"threshold": 2, "max_tracker_size": 0}, "max_tracker_size"),
    ],
)
def test_bad_filter_configuration_names_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        StoreAdmissionFilter(HostBlockPool(8), **kwargs)  # type: ignore[arg-type]
