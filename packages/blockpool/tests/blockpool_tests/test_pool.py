"""HostBlockPool behaviours, one per test."""

from __future__ import annotations

import random

import pytest

from kvtier.blockpool import ALLOCATION_BUCKETS, CacheEvent, Hold, HostBlockPool
from kvtier.blockpool.policies import make_policy


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def stored(pool: HostBlockPool, keys: list[bytes]) -> list[int]:
    plan = pool.prepare_store(keys)
    assert plan is not None
    pool.complete_store(plan.keys)
    return plan.block_ids


def test_lookup_counts_leading_cached_keys_only() -> None:
    pool = HostBlockPool(8)
    stored(pool, [k(0), k(1), k(3)])
    assert pool.lookup([k(0), k(1), k(2), k(3)]) == 2
    assert pool.lookup([k(2), k(0)]) == 0
    assert pool.lookup([]) == 0


def test_key_being_stored_is_not_a_hit_until_complete() -> None:
    pool = HostBlockPool(4)
    plan = pool.prepare_store([k(0)])
    assert plan is not None and pool.lookup([k(0)]) == 0 and pool.is_storing(k(0))
    pool.complete_store([k(0)])
    assert pool.lookup([k(0)]) == 1


def test_prepare_store_skips_keys_already_present() -> None:
    pool = HostBlockPool(8)
    stored(pool, [k(0), k(1)])
    plan = pool.prepare_store([k(0), k(1), k(2)])
    assert plan is not None and plan.keys == [k(2)] and len(plan.block_ids) == 1


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_key_listed_twice_is_stored_once(policy: str) -> None:
    pool = HostBlockPool(4, eviction_policy=policy)
    plan = pool.prepare_store([k(0), k(1), k(0)])
    assert plan is not None and plan.keys == [k(0), k(1)] and len(plan.block_ids) == 2
    pool.complete_store(plan.keys)
    pool.check_invariants()
    assert pool.num_free == 2
    # Both go again on eviction, each once.
    assert sorted(pool.evict_all()) == [k(0), k(1)] and pool.num_free == 4


def test_prepare_store_hands_out_contiguous_blocks() -> None:
    pool = HostBlockPool(64)
    plan = pool.prepare_store([k(i) for i in range(16)])
    assert plan is not None
    assert plan.block_ids == list(range(plan.block_ids[0], plan.block_ids[0] + 16))


def test_failed_store_frees_its_blocks() -> None:
    pool = HostBlockPool(4)
    plan = pool.prepare_store([k(0), k(1)])
    assert plan is not None
    pool.complete_store(plan.keys, success=False)
    assert pool.num_free == 4 and pool.lookup([k(0)]) == 0 and pool.block_of(k(0)) is None
    pool.check_invariants()


def test_eviction_makes_room_and_reports_evicted_keys() -> None:
    pool = HostBlockPool(4, eviction_policy="lru")
    stored(pool, [k(0), k(1), k(2), k(3)])
    plan = pool.prepare_store([k(4), k(5)])
    assert plan is not None and plan.evicted == [k(0), k(1)]
    assert pool.lookup([k(0)]) == 0 and pool.lookup([k(2)]) == 1


def test_prepare_store_returns_none_and_changes_nothing_when_no_room() -> None:
    pool = HostBlockPool(2)
    stored(pool, [k(0), k(1)])
    pool.prepare_load([k(0), k(1)])  # both pinned
    before = pool.stats()
    assert pool.prepare_store([k(2)]) is None
    assert pool.stats() == before
    assert pool.lookup([k(0), k(1)]) == 2


def test_keys_of_the_request_itself_are_not_evicted_for_it() -> None:
    pool = HostBlockPool(2)
    stored(pool, [k(0), k(1)])
    # k(0) is part of this request: making room must not evict it.
    plan = pool.prepare_store([k(0), k(2)])
    assert plan is not None and plan.evicted == [k(1)] and pool.lookup([k(0)]) == 1


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_keys_the_request_loaded_are_kept_while_it_stores_its_tail(policy: str) -> None:
    pool = HostBlockPool(3, eviction_policy=policy)
    stored(pool, [k(0)])  # the request's head, loaded (its load done: unpinned)
    stored(pool, [k(1)])
    stored(pool, [k(2)])
    pool.touch([k(2), k(1)])  # the head is the least recent
    plan = pool.prepare_store([k(3)], keep=[k(0)])
    assert plan is not None and plan.evicted != [k(0)] and pool.lookup([k(0)]) == 1
    # With everything cached kept, no room can be made: the store is refused.
    assert pool.prepare_store([k(4), k(5)], keep=[k(0), k(1), k(2)]) is None


def test_pinned_block_is_never_evicted() -> None:
    pool = HostBlockPool(3, eviction_policy="lru")
    stored(pool, [k(0), k(1), k(2)])
    pool.prepare_load([k(0)])
    plan = pool.prepare_store([k(3)])
    assert plan is not None and plan.evicted == [k(1)]
    pool.complete_load([k(0)])
    plan = pool.prepare_store([k(4)])
    assert plan is not None and plan.evicted == [k(0)]


def test_block_being_stored_is_never_evicted() -> None:
    pool = HostBlockPool(2)
    first = pool.prepare_store([k(0), k(1)])
    assert first is not None
    assert pool.prepare_store([k(2)]) is None


def test_prepare_load_returns_blocks_in_key_order() -> None:
    pool = HostBlockPool(8)
    blocks = stored(pool, [k(0), k(1), k(2)])
    assert pool.prepare_load([k(2), k(0)]) == [blocks[2], blocks[0]]


def test_prepare_load_of_missing_key_raises_and_pins_nothing() -> None:
    pool = HostBlockPool(8)
    stored(pool, [k(0)])
    with pytest.raises(KeyError):
        pool.prepare_load([k(0), k(9)])
    assert pool.stats().read_pinned == 0


@pytest.mark.parametrize("keys", [[k(9)], [k(1)], [k(0), k(1)]], ids=["missing", "storing", "two"])
def test_prepare_load_refuses_keys_not_readable_and_pins_nothing(keys: list[bytes]) -> None:
    pool = HostBlockPool(8)
    stored(pool, [k(0)])
    assert pool.prepare_store([k(1)]) is not None  # k(1) is being stored
    reason = "not cached" if keys == [k(9)] else "being stored"
    with pytest.raises(KeyError, match=reason):
        pool.prepare_load(keys)
    assert pool.stats().read_pinned == 0


def test_complete_store_of_a_batch_skips_keys_it_does_not_know() -> None:
    pool = HostBlockPool(8)
    plan = pool.prepare_store([k(0), k(1), k(2)])
    assert plan is not None
    pool.complete_store([k(0), k(7), k(1), k(2)])  # k(7) was never prepared
    assert pool.lookup([k(0), k(1), k(2)]) == 3 and pool.lookup([k(7)]) == 0
    pool.check_invariants()


def test_complete_load_without_prepare_is_an_error_that_changes_nothing() -> None:
    pool = HostBlockPool(8)
    stored(pool, [k(0), k(1)])
    with pytest.raises(RuntimeError):
        pool.complete_load([k(0)])
    pool.prepare_load([k(0)])
    with pytest.raises(RuntimeError):
        pool.complete_load([k(0), k(1)])
    assert pool.stats().read_pinned == 1, "a failed complete_load released a pin"
    pool.check_invariants()


def test_nested_loads_keep_the_pin_until_the_last_completes() -> None:
    pool = HostBlockPool(1)
    stored(pool, [k(0)])
    pool.prepare_load([k(0)])
    pool.prepare_load([k(0)])
    pool.complete_load([k(0)])
    assert pool.prepare_store([k(1)]) is None
    pool.complete_load([k(0)])
    assert pool.prepare_store([k(1)]) is not None


def test_touch_puts_the_first_key_last_in_eviction_order() -> None:
    pool = HostBlockPool(4, eviction_policy="lru")
    stored(pool, [k(0), k(1), k(2), k(3)])
    pool.touch([k(1), k(0)])  # k(1) is the prefix head: most recent
    plan = pool.prepare_store([k(4), k(5), k(6)])
    assert plan is not None and plan.evicted == [k(2), k(3), k(0)]


def test_owned_blocks_come_from_the_same_capacity() -> None:
    pool = HostBlockPool(6, eviction_policy="lru")
    stored(pool, [k(0), k(1), k(2), k(3)])
    blocks = pool.allocate_owned("req-a", 4)
    assert blocks is not None and len(blocks) == 4
    assert pool.lookup([k(0), k(1)]) == 0, "two cached keys should have been evicted"
    assert pool.stats().owned == 4
    assert pool.allocate_owned("req-b", 3) is None
    assert pool.free_owned("req-a") == 4
    assert pool.num_free == 4
    pool.check_invariants()


def test_owned_allocation_without_eviction_fails_when_free_is_short() -> None:
    pool = HostBlockPool(4)
    stored(pool, [k(0), k(1), k(2)])
    assert pool.allocate_owned("r", 2, evict=False) is None
    assert pool.lookup([k(0), k(1), k(2)]) == 3


def test_owned_blocks_are_never_given_to_the_cache() -> None:
    pool = HostBlockPool(4)
    owned = pool.allocate_owned("r", 3)
    assert owned is not None
    plan = pool.prepare_store([k(0), k(1)])
    assert plan is None
    plan = pool.prepare_store([k(0)])
    assert plan is not None and not set(plan.block_ids) & set(owned)


def test_pinned_owned_blocks_cannot_be_freed() -> None:
    pool = HostBlockPool(4)
    owned = pool.allocate_owned("r", 2)
    assert owned is not None
    pool.pin(owned, write=True)
    assert pool.stats().write_pinned == 2
    with pytest.raises(RuntimeError):
        pool.free_owned("r")
    pool.unpin(owned, write=True)
    assert pool.free_owned("r") == 2


def test_owned_blocks_accumulate_per_owner() -> None:
    pool = HostBlockPool(8)
    a = pool.allocate_owned("r", 2)
    b = pool.allocate_owned("r", 3)
    assert a is not None and b is not None
    assert pool.owned_blocks("r") == a + b


def test_events_report_stored_and_removed_keys() -> None:
    pool = HostBlockPool(2, eviction_policy="lru", enable_events=True)
    stored(pool, [k(0), k(1)])
    stored(pool, [k(2)])
    assert pool.take_events() == [
        CacheEvent("stored", (k(0), k(1))),
        CacheEvent("removed", (k(0),)),
        CacheEvent("stored", (k(2),)),
    ]
    assert pool.take_events() == []


def test_no_events_are_kept_unless_enabled() -> None:
    pool = HostBlockPool(2)
    stored(pool, [k(0), k(1)])
    stored(pool, [k(2)])
    assert pool.take_events() == []


def test_stats_fractions_follow_pins() -> None:
    pool = HostBlockPool(10)
    stored(pool, [k(0), k(1)])
    pool.prepare_store([k(2), k(3), k(4)])
    pool.prepare_load([k(0)])
    stats = pool.stats()
    assert stats.usage == pytest.approx(0.5)
    assert stats.write_usage == pytest.approx(0.3)
    assert stats.read_usage == pytest.approx(0.1)


def test_allocation_histogram_buckets_by_powers_of_four() -> None:
    assert ALLOCATION_BUCKETS == (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
    pool = HostBlockPool(400)
    for n in (1, 2, 4, 5, 16, 17, 300):
        stored(pool, [k(1000 * n + i) for i in range(n)])
    hist = pool.stats().allocation_histogram
    assert hist[:6] == [1, 2, 2, 1, 0, 1] and sum(hist) == 7


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"eviction_policy": "fifo"}, "eviction_policy"),
        ({"cache_policy_module_path": "no.such.module:Policy"}, "cache_policy_module_path"),
    ],
)
def test_bad_pool_configuration_names_the_key(kwargs: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        HostBlockPool(8, **kwargs)  # type: ignore[arg-type]


def test_zero_blocks_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        HostBlockPool(0)


def test_evict_all_keeps_pinned_keys() -> None:
    pool = HostBlockPool(4)
    stored(pool, [k(0), k(1), k(2)])
    pool.prepare_load([k(1)])
    assert sorted(pool.evict_all()) == [k(0), k(2)]
    assert pool.lookup([k(1)]) == 1
    pool.check_invariants()


def test_evict_frees_blocks_in_policy_order_sparing_pins_and_kept_keys() -> None:
    pool = HostBlockPool(4, eviction_policy="lru", enable_events=True)
    stored(pool, [k(0), k(1), k(2), k(3)])
    pool.take_events()
    pool.prepare_load([k(0)])
    pool.hold([k(0)], Hold.TIER_WRITE)
    assert pool.pins(k(0)) == 2 and pool.pins(k(1)) == 0
    assert pool.evict(3, keep=[k(1)]) is None, "only k(2) and k(3) may go"
    assert pool.num_cached == 4 and pool.take_events() == []
    assert pool.evict(2, keep=[k(1)]) == [k(2), k(3)]
    assert pool.num_free == 2 and pool.lookup([k(2)]) == 0
    assert [e.keys for e in pool.take_events()] == [(k(2), k(3))]
    assert pool.evict(0) == []
    pool.check_invariants()


@pytest.mark.parametrize("name", ["lru", "arc", "frecency"])
def test_a_store_that_cannot_evict_enough_never_walks_the_policy(name: str) -> None:
    walks = []

    class Counted(type(make_policy(name, 4))):  # type: ignore[misc]
        __slots__ = ()

        def evict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            walks.append(args)
            return super().evict(*args, **kwargs)

    pool = HostBlockPool(4, policy=Counted(4))
    stored(pool, [k(0), k(1), k(2), k(3)])
    pool.prepare_load([k(0), k(1), k(2)])
    assert pool.prepare_store([k(4), k(5)]) is None, "one evictable key for two"
    assert pool.prepare_store([k(3), k(4)]) is None, "k(3) is the request's own"
    assert walks == []
    plan = pool.prepare_store([k(4)])
    assert plan is not None and plan.evicted == [k(3)] and len(walks) == 1
    pool.check_invariants()


def test_holds_pin_and_are_counted_per_kind() -> None:
    pool = HostBlockPool(3, eviction_policy="lru")
    blocks = stored(pool, [k(0), k(1), k(2)])
    assert pool.hold([k(0)], Hold.TIER_WRITE) == [blocks[0]]
    assert pool.hold([k(0), k(1)], Hold.DEVICE_LOAD) == blocks[:2]
    assert pool.held(Hold.TIER_WRITE) == 1 and pool.held(Hold.DEVICE_LOAD) == 2
    assert pool.held(Hold.PROMOTION) == pool.held(Hold.LOOKUP_PASS) == 0
    assert pool.stats().holds == {
        "device_load": 2,
        "tier_write": 1,
        "promotion": 0,
        "lookup_pass": 0,
    }
    plan = pool.prepare_store([k(3)])  # only k(2) is unheld
    assert plan is not None and plan.evicted == [k(2)]
    pool.complete_store(plan.keys)
    pool.release([k(0), k(1)], Hold.DEVICE_LOAD)
    assert pool.prepare_store([k(4)]) is not None, "k(1) is free to go"
    assert pool.holds(k(0), Hold.TIER_WRITE) == 1, "the write still holds k(0)"
    with pytest.raises(RuntimeError, match="device_load hold"):
        pool.release([k(0)], Hold.DEVICE_LOAD)  # held, but not for a device load
    pool.release([k(0)], Hold.TIER_WRITE)
    assert pool.stats().read_pinned == 0
    pool.check_invariants()


def test_a_failed_hold_or_release_changes_nothing() -> None:
    pool = HostBlockPool(4)
    stored(pool, [k(0)])
    with pytest.raises(KeyError):
        pool.hold([k(0), k(9)], Hold.PROMOTION)
    assert pool.held(Hold.PROMOTION) == 0 and pool.stats().read_pinned == 0
    pool.hold([k(0)], Hold.PROMOTION)
    with pytest.raises(RuntimeError):
        pool.release([k(0), k(0)], Hold.PROMOTION)  # held once, released twice
    assert pool.holds(k(0), Hold.PROMOTION) == 1 and pool.stats().read_pinned == 1
    stored(pool, [k(1), k(2)])
    pool.hold([k(1)], Hold.PROMOTION)
    with pytest.raises(RuntimeError):
        pool.release([k(0), k(1), k(2)], Hold.PROMOTION)  # k(2) is not held
    assert [pool.holds(x, Hold.PROMOTION) for x in (k(0), k(1), k(2))] == [1, 1, 0]
    assert [pool.pins(x) for x in (k(0), k(1), k(2))] == [1, 1, 0]
    pool.release([k(1), k(0)], Hold.PROMOTION)  # each named once: all at once
    assert pool.held(Hold.PROMOTION) == 0 and pool.stats().read_pinned == 0
    pool.check_invariants()


@pytest.mark.parametrize("policy", ["frecency", "lru", "arc"])
def test_keys_an_eviction_passed_over_are_evictable_once_released_together(policy: str) -> None:
    """Every policy parks the pinned keys an eviction passes over until a key may
    have become evictable: a hold's release on several keys at once says so, and the
    next eviction chooses what a pool that scans every key chooses."""
    parked, scanned = (
        HostBlockPool(4, eviction_policy=policy),
        HostBlockPool(4, eviction_policy=policy),
    )
    scanned._parking = None
    chosen = []
    for pool in (parked, scanned):
        stored(pool, [k(0), k(1), k(2), k(3)])
        first_two, third = (
            pool.policy.keys_in_eviction_order()[:2],
            pool.policy.keys_in_eviction_order()[2],
        )
        pool.hold(first_two, Hold.DEVICE_LOAD)
        first = pool.prepare_store([k(4)])  # passes over the first two
        assert first is not None and first.evicted == [third]
        pool.release(first_two, Hold.DEVICE_LOAD)
        plan = pool.prepare_store([k(5)])
        assert plan is not None
        chosen.append(plan.evicted)
        pool.complete_store([k(4), k(5)])
        pool.check_invariants()
    assert chosen[0] == chosen[1] and set(chosen[0]) <= set(first_two), "a released key goes"


@pytest.mark.parametrize("policy", ["frecency", "lru", "arc"])
def test_evictions_do_not_go_over_the_pinned_keys_again(policy: str) -> None:
    """A slow tier's writes may pin most of a pool: an eviction parks the pinned keys
    it passes over, and later evictions (a store completing between them) do not go
    over them again until their pins end (each went over all of them: 0.15-0.2 s a
    store at 100,000 blocks with three quarters pinned). They choose what a pool that
    goes over every key chooses."""
    parked = HostBlockPool(400, eviction_policy=policy)
    scanned = HostBlockPool(400, eviction_policy=policy)
    scanned._parking = None
    checks = 0
    is_evictable = parked._is_evictable

    def counted(key: object) -> bool:
        nonlocal checks
        checks += 1
        return is_evictable(key)

    parked._is_evictable = counted  # type: ignore[method-assign]
    pinned = [k(i) for i in range(300)]
    for pool in (parked, scanned):
        for i in range(0, 400, 16):  # requests of 16 blocks
            stored(pool, [k(j) for j in range(i, min(i + 16, 400))])
        pool.hold(pinned, Hold.TIER_WRITE)  # the oldest three quarters
    steps = 40
    for i in range(1000, 1000 + steps):
        plans = [pool.prepare_store([k(i)]) for pool in (parked, scanned)]
        assert plans[0] is not None and plans[1] is not None
        assert plans[0].evicted == plans[1].evicted and not set(plans[0].evicted) & set(pinned)
        for pool in (parked, scanned):
            pool.complete_store([k(i)])  # a store lands between evictions
    # Each pinned key gone over once at most, each unpinned one evicted or passed once.
    assert checks <= len(pinned) + 2 * steps, checks
    for pool in (parked, scanned):
        pool.release(pinned, Hold.TIER_WRITE)
    plans = [pool.prepare_store([k(2000)]) for pool in (parked, scanned)]
    assert plans[0] is not None and plans[1] is not None
    assert plans[0].evicted == plans[1].evicted and set(plans[0].evicted) <= set(pinned)
    for pool in (parked, scanned):
        pool.check_invariants()


def test_release_of_storing_and_cached_keys_together() -> None:
    """A late read's hold on a key still storing and on cached keys ends in one call:
    the storing key stays storing, the cached ones are evictable again."""
    pool = HostBlockPool(4)
    stored(pool, [k(0), k(1)])
    plan = pool.prepare_store([k(2)])
    assert plan is not None
    pool.hold([k(0), k(2), k(1)], Hold.LATE_READ)
    assert pool.stats().read_pinned == 2
    pool.release([k(0), k(2), k(1)], Hold.LATE_READ)
    assert pool.held(Hold.LATE_READ) == 0 and pool.stats().read_pinned == 0
    assert pool.is_storing(k(2))
    pool.complete_store([k(2)])
    pool.check_invariants()


@pytest.mark.parametrize("policy", ["frecency", "lru", "arc"])
@pytest.mark.parametrize("seed", range(6))
def test_parked_evictions_choose_what_a_full_scan_chooses(seed: int, policy: str) -> None:
    """Each policy parks the keys an eviction finds storing or pinned; a pool that scans
    them every time (parking off) must evict the same keys, call for call, through
    long runs with most keys storing or pinned (a small host tier writing through)."""
    rng = random.Random(seed)
    parked = HostBlockPool(48, eviction_policy=policy)
    scanned = HostBlockPool(48, eviction_policy=policy)
    scanned._parking = None
    storing: list[list[bytes]] = []
    loading: list[list[bytes]] = []
    for step in range(4000):
        op = rng.random()
        if op < 0.4:
            keys = [b"k%d" % rng.randrange(300) for _ in range(rng.randint(1, 6))]
            a, b = parked.prepare_store(keys), scanned.prepare_store(keys)
            assert (a is None) == (b is None), step
            if a is not None and b is not None:
                assert a.keys == b.keys and a.evicted == b.evicted, step
                if a.keys:
                    storing.append(list(a.keys))
        elif op < 0.55 and storing:
            batch = storing.pop(rng.randrange(len(storing)))
            ok = rng.random() < 0.95
            parked.complete_store(batch, ok)
            scanned.complete_store(batch, ok)
        elif op < 0.75:
            # Loads of the keys eviction would take next: pinned where it looks first.
            order = parked.policy.keys_in_eviction_order()[: rng.randint(1, 6)]
            keys = [key for key in order if parked.contains(key)]
            if keys:
                assert parked.prepare_load(keys) == scanned.prepare_load(keys)
                loading.append(keys)
        elif op < 0.9 and loading:
            batch = loading.pop(rng.randrange(len(loading)))
            parked.complete_load(batch)
            scanned.complete_load(batch)
        elif op < 0.95:
            keys = [b"k%d" % rng.randrange(300) for _ in range(rng.randint(1, 8))]
            reused = keys[: rng.randint(0, len(keys))]
            parked.finish_request(keys, reused)
            scanned.finish_request(keys, reused)
        else:  # (vLLM before 0.32 touches a request's keys at every store)
            keys = [b"k%d" % rng.randrange(300) for _ in range(rng.randint(1, 8))]
            parked.touch(keys)
            scanned.touch(keys)
        parked.check_invariants()
    assert parked.policy.keys_in_eviction_order() == scanned.policy.keys_in_eviction_order()
