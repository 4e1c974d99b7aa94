"""``HostBlockPool.prepare_store_many``: a step's stores in one call, the same as
``prepare_store`` of each in turn, or nothing changed."""

from __future__ import annotations

import random

import pytest

from kvtier.blockpool import HostBlockPool
from kvtier.blockpool.policies import POLICIES


def k(i: int) -> bytes:
    return i.to_bytes(8, "big")


def _state(pool: HostBlockPool) -> tuple[object, ...]:
    return (pool.stats(), pool.key_changes, pool.num_free, pool.num_evictable)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(6))
def test_many_stores_plan_what_one_by_one_plans(policy: str, seed: int) -> None:
    """Random steps of requests (new keys, keys cached or being stored, keys of an
    earlier request of the step, a key listed twice) on two pools: one asked with
    prepare_store_many, the other request by request. Where the batch would need an
    eviction it answers None and changes nothing, and is asked one by one instead.
    Plans, counts and every later eviction are the same."""
    rng = random.Random(seed)
    batched, single = (HostBlockPool(64, eviction_policy=policy) for _ in range(2))
    storing: list[bytes] = []
    answered = refused = 0
    for _step in range(300):
        requests = []
        for _ in range(rng.randrange(1, 6)):
            keys = [k(rng.randrange(160)) for _ in range(rng.randrange(0, 7))]
            if keys and rng.random() < 0.1:
                keys.append(keys[0])
            requests.append(keys)
        before = _state(batched)
        plans = batched.prepare_store_many(requests)
        if plans is None:
            refused += 1
            assert _state(batched) == before
            plans = [batched.prepare_store(keys) for keys in requests]
        else:
            answered += 1
            assert all(not plan.evicted for plan in plans)
        expected = [single.prepare_store(keys) for keys in requests]
        assert plans == expected
        assert _state(batched) == _state(single)
        for plan in plans:
            if plan is not None:
                storing += plan.keys
        rng.shuffle(storing)
        done, storing = storing[: len(storing) // 2], storing[len(storing) // 2 :]
        touched = [k(rng.randrange(160)) for _ in range(3)] if rng.random() < 0.3 else []
        for pool in (batched, single):
            pool.complete_store(done)
            pool.touch(touched)
        batched.check_invariants()
    assert answered > 10 and refused > 10  # both paths taken
    batched.complete_store(storing)
    single.complete_store(storing)
    assert batched.evict_all() == single.evict_all()


def test_nothing_to_store_changes_nothing() -> None:
    pool = HostBlockPool(8)
    plan = pool.prepare_store([k(0), k(1)])
    assert plan is not None
    pool.complete_store(plan.keys)
    before = _state(pool)
    plans = pool.prepare_store_many([[k(0)], [], [k(1), k(0)]])
    assert plans is not None and [p.keys for p in plans] == [[], [], []]
    assert _state(pool) == before


def test_a_key_of_two_requests_is_stored_by_the_first() -> None:
    pool = HostBlockPool(8)
    plans = pool.prepare_store_many([[k(0), k(1)], [k(1), k(2)]])
    assert plans is not None
    assert [p.keys for p in plans] == [[k(0), k(1)], [k(2)]]
    assert pool.is_storing(k(1)) and pool.num_free == 5
