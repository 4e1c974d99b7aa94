"""Long random operation sequences against the pool, invariants checked after every step.

A reference model tracks what each key and block should be; the pool must agree
with it and keep: no block owned twice, free + storing + cached + owned ==
capacity, pinned blocks never evicted, evicted keys no longer found, and eviction
in the policy's documented order (LRU: least recently used evictable key first;
ARC: the oldest evictable keys of T1 and T2, as the policy's lists stood; frecency: the
lowest-scored evictable keys, in the order the policy reported before the call).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvtier.blockpool import ARCPolicy, Hold, HostBlockPool, LRUPolicy, StoreAdmissionFilter

KEYS = st.lists(st.integers(0, 40).map(lambda i: b"k%d" % i), min_size=1, max_size=6, unique=True)


class PoolMachine(RuleBasedStateMachine):
    policy_name = "lru"

    @initialize(capacity=st.integers(1, 24), threshold=st.sampled_from([0, 0, 2]))
    def setup(self, capacity: int, threshold: int) -> None:
        self.pool = HostBlockPool(capacity, eviction_policy=self.policy_name, enable_events=True)
        # Lookups and stores go through an admission filter when there is one.
        self.store: HostBlockPool | StoreAdmissionFilter = (
            StoreAdmissionFilter(self.pool, threshold) if threshold else self.pool
        )
        self.storing: list[list[bytes]] = []  # outstanding store batches
        self.loading: list[list[bytes]] = []  # outstanding load batches
        self.kinds: list[Hold | None] = []  # each load batch's hold (None: prepare_load)
        self.owners: dict[str, int] = {}
        self.cached: set[bytes] = set()
        self.recency: list[bytes] = []  # LRU model, oldest first

    # -- helpers ---------------------------------------------------------------
    def _pinned_keys(self) -> set[bytes]:
        return {key for batch in self.loading for key in batch}

    def _evictable_in_model_order(self) -> list[bytes]:
        pinned = self._pinned_keys()
        return [key for key in self.recency if key in self.cached and key not in pinned]

    def _arc_expected(self) -> tuple[list[bytes], list[bytes]]:
        policy = self.pool.policy
        assert isinstance(policy, ARCPolicy)
        pinned = self._pinned_keys()
        ok = [key for key in policy.t1 if key in self.cached and key not in pinned]
        ok2 = [key for key in policy.t2 if key in self.cached and key not in pinned]
        return ok, ok2

    def _check_victims(self, victims: list[bytes], protected: set[bytes], before: object) -> None:
        pinned = self._pinned_keys()
        assert not set(victims) & pinned, "a pinned key was evicted"
        assert not set(victims) & protected, "a key of the request itself was evicted"
        if self.policy_name in ("lru", "frecency"):
            order = [key for key in before if key not in protected]  # type: ignore[attr-defined]
            assert victims == order[: len(victims)], f"{self.policy_name} order broken"
        else:
            t1, t2 = before  # type: ignore[misc]
            t1 = [key for key in t1 if key not in protected]
            t2 = [key for key in t2 if key not in protected]
            from1 = [key for key in victims if key in t1]
            from2 = [key for key in victims if key in t2]
            assert from1 == t1[: len(from1)], "ARC evicted a T1 key out of order"
            assert from2 == t2[: len(from2)], "ARC evicted a T2 key out of order"
        for key in victims:
            self.cached.discard(key)
            self.recency.remove(key)
            assert self.pool.lookup([key]) == 0, "evicted key is still found"

    def _snapshot(self) -> object:
        if self.policy_name == "lru":
            return self._evictable_in_model_order()
        if self.policy_name == "frecency":  # its own order (its model test checks it)
            pinned = self._pinned_keys()
            order = self.pool.policy.keys_in_eviction_order()  # type: ignore[attr-defined]
            return [key for key in order if key in self.cached and key not in pinned]
        return self._arc_expected()

    # -- rules -------------------------------------------------------------------
    @rule(keys=KEYS)
    def lookup(self, keys: list[bytes]) -> None:
        expected = 0
        for key in keys:
            if key not in self.cached:
                break
            expected += 1
        assert self.store.lookup(keys) == expected

    @rule(keys=KEYS)
    def prepare_store(self, keys: list[bytes]) -> None:
        before = self._snapshot()
        plan = self.store.prepare_store(keys)
        if plan is None:
            return
        self._check_victims(plan.evicted, set(keys), before)
        assert len(plan.block_ids) == len(set(plan.block_ids)) == len(plan.keys)
        for key in plan.keys:
            assert key not in self.cached
            self.recency.append(key)
        if plan.keys:
            self.storing.append(plan.keys)

    @precondition(lambda self: self.storing)
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        batch = self.storing.pop(data.draw(st.integers(0, len(self.storing) - 1)))
        self.pool.complete_store(batch, success=success)
        for key in batch:
            if success:
                self.cached.add(key)
            else:
                self.recency.remove(key)

    @rule(keys=KEYS, kind=st.sampled_from([None, *Hold]))
    def prepare_load(self, keys: list[bytes], kind: Hold | None) -> None:
        present = [key for key in keys if key in self.cached]
        if not present:
            return
        pool = self.pool
        blocks = pool.prepare_load(present) if kind is None else pool.hold(present, kind)
        assert blocks == [self.pool.block_of(key) for key in present]
        self.loading.append(present)
        self.kinds.append(kind)

    @precondition(lambda self: self.loading)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.loading) - 1))
        batch, kind = self.loading.pop(i), self.kinds.pop(i)
        if kind is None:
            self.pool.complete_load(batch)
            return
        other = next(k for k in Hold if k != kind)
        if self.pool.holds(batch[0], other) == 0:
            with pytest.raises(RuntimeError):  # another kind's hold is not this one's
                self.pool.release(batch, other)
        self.pool.release(batch, kind)

    @invariant()
    def holds_are_counted_per_kind(self) -> None:
        if not hasattr(self, "pool"):
            return
        for kind in Hold:
            expected = sum(len(b) for b, k in zip(self.loading, self.kinds) if k is kind)
            assert self.pool.held(kind) == expected
            assert self.pool.stats().holds[kind.value] == expected

    @rule(keys=KEYS)
    def touch(self, keys: list[bytes]) -> None:
        self.pool.touch(keys)
        for key in reversed(keys):
            if key in self.recency:
                self.recency.remove(key)
                self.recency.append(key)

    @rule(owner=st.sampled_from(["a", "b", "c"]), n=st.integers(1, 6))
    def allocate_owned(self, owner: str, n: int) -> None:
        before = self._snapshot()
        blocks = self.pool.allocate_owned(owner, n)
        if blocks is None:
            return
        evicted = [key for key in self.cached if self.pool.block_of(key) is None]
        # the pool evicts in policy order; reuse the victim checks
        if self.policy_name in ("lru", "frecency"):
            evicted.sort(key=before.index)  # type: ignore[attr-defined]
        else:
            t1, t2 = before  # type: ignore[misc]
            evicted.sort(key=lambda key: (0, t1.index(key)) if key in t1 else (1, t2.index(key)))
        self._check_victims(evicted, set(), before)
        self.owners[owner] = self.owners.get(owner, 0) + n

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def free_owned(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        assert self.pool.free_owned(owner) == self.owners.pop(owner)

    # -- invariants --------------------------------------------------------------
    @invariant()
    def bookkeeping_is_consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        stats = self.pool.stats()
        assert stats.free + stats.storing + stats.cached + stats.owned == stats.capacity
        assert stats.cached == len(self.cached)
        assert stats.storing == sum(len(batch) for batch in self.storing)
        assert stats.owned == sum(self.owners.values())
        for batch in self.loading:
            for key in batch:
                assert self.pool.contains(key), "a key pinned by a load vanished"


class LRUPoolMachine(PoolMachine):
    policy_name = "lru"


class ARCPoolMachine(PoolMachine):
    policy_name = "arc"


class FrecencyPoolMachine(PoolMachine):
    policy_name = "frecency"


SETTINGS = settings(max_examples=60, stateful_step_count=80, deadline=None)
TestLRUPool = LRUPoolMachine.TestCase
TestLRUPool.settings = SETTINGS
TestARCPool = ARCPoolMachine.TestCase
TestARCPool.settings = SETTINGS
TestFrecencyPool = FrecencyPoolMachine.TestCase
TestFrecencyPool.settings = SETTINGS


def test_lru_policy_class_matches_model_order() -> None:
    lru = LRUPolicy(4)
    lru.insert(list("abcd"))
    lru.touch(["b"])
    assert lru.keys_in_eviction_order() == ["a", "c", "d", "b"]
