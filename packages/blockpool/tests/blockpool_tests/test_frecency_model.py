"""The frecency policy against a model of it, step by step.

The model keeps each key's uses, clock, last use and order in plain dicts, scores every
cached key afresh when asked for victims (no heap, no lazy queueing), and tunes ``tau``
and halves uses exactly as ``FrecencyPolicy`` documents. After every step the policy and
the model must agree on the eviction order, the clock, ``tau``, the uses and the ghosts.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Sequence
from heapq import heappush

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvtier.blockpool import FrecencyPolicy
from kvtier.blockpool.policy_base import NO_KEY

KEY = st.integers(0, 19)


class SmallFrecency(FrecencyPolicy):
    """Few ghosts, so that the model checks their forgetting too."""

    __slots__ = ()
    GHOST_KEYS = 5


class ModelFrecency:
    def __init__(self, capacity: int, max_ghosts: int) -> None:
        self.c = capacity
        self.max_ghosts = max_ghosts
        self.tau = float(capacity)
        self.clock = 0.0
        self.stored = 0
        self.next_tune = capacity
        self.order = 0
        self.uses: dict[Hashable, float] = {}
        self.clock_at: dict[Hashable, float] = {}
        self.stored_at: dict[Hashable, int] = {}  # absent: never used
        self.restored: set[Hashable] = set()
        self.last: dict[Hashable, int] = {}  # order of the last use (or insert)
        self.cached: set[Hashable] = set()
        self.ghosts: list[Hashable] = []  # first evicted first
        self.distances: list[int] = [0] * 64
        self.reuses = self.lead = 0

    def score(self, key: Hashable) -> tuple[float, int]:
        return (self.uses[key] + self.clock_at[key], self.last[key])

    def insert(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            self.order += 1
            if key not in self.uses:
                self.uses[key], self.clock_at[key], self.last[key] = 0, self.clock, self.order
            elif key in self.ghosts:
                self.ghosts.remove(key)
                if key in self.stored_at:
                    self.restored.add(key)
            self.cached.add(key)
        self.stored += len(keys)
        self.clock += len(keys) / self.tau
        if self.stored >= self.next_tune:
            self.tune()

    def touch(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            if key in self.uses:
                self.order += 1
                self.uses[key] += 1
                self.clock_at[key] = self.clock
                self.last[key] = self.order

    def touch_prefix(self, keys: Sequence[Hashable]) -> None:
        for key in reversed(keys):
            if key not in self.uses:
                continue
            if key in self.stored_at:
                distance = self.stored - self.stored_at[key]
                self.distances[distance.bit_length()] += 1
                self.reuses += 1
                self.lead += (key not in self.restored) - (distance <= self.c)
                self.restored.discard(key)
            self.order += 1
            self.uses[key] += 1
            self.clock_at[key] = self.clock
            self.stored_at[key] = self.stored
            self.last[key] = self.order
        if self.reuses >= self.c:
            self.tune()

    def remove(self, key: Hashable) -> None:
        self.cached.remove(key)
        for table in (self.uses, self.clock_at, self.stored_at, self.last):
            table.pop(key, None)
        self.restored.discard(key)

    def evict(self, n: int, ok: Callable[[Hashable], bool]) -> list[Hashable] | None:
        if n <= 0:
            return []
        candidates = sorted((k for k in self.cached if ok(k)), key=self.score)
        if len(candidates) < n:
            return None
        victims = candidates[:n]
        for key in victims:
            self.cached.remove(key)
            self.ghosts.append(key)
        while len(self.ghosts) > self.max_ghosts:
            self.remove_ghost(self.ghosts.pop(0))
        return victims

    def remove_ghost(self, key: Hashable) -> None:
        for table in (self.uses, self.clock_at, self.stored_at, self.last):
            table.pop(key, None)
        self.restored.discard(key)

    def tune(self) -> None:
        self.next_tune = self.stored + self.c
        if self.lead < 0:
            for key in self.uses:
                self.uses[key] /= 2
        self.reuses = self.lead = 0
        half = sum(self.distances) / 2
        median = below = 0.0
        for bits, count in enumerate(self.distances):
            if count and below + count >= half:
                low = 1 << bits >> 1
                median = low + max(1, low) * (half - below) / count
                break
            below += count
        self.tau = max(float(self.c), median)
        self.distances = [count // 2 for count in self.distances]

    def eviction_order(self) -> list[Hashable]:
        return sorted(self.cached, key=self.score)


class OftenRescaled(SmallFrecency):
    """Scales its entries back every second halving (see ``RESCALE_HALVINGS``)."""

    __slots__ = ()
    RESCALE_HALVINGS = 2


class FrecencyAgainstModel(RuleBasedStateMachine):
    policy_type: type[FrecencyPolicy] = SmallFrecency
    park = False  # evict with park=True, unparking the keys no longer refused

    @initialize(capacity=st.integers(1, 8))
    def setup(self, capacity: int) -> None:
        self.policy = self.policy_type(capacity)
        self.model = ModelFrecency(capacity, self.policy.max_ghosts)
        self.refused: set[int] = set()

    @rule(keys=st.lists(KEY, min_size=1, max_size=6, unique=True))
    def insert(self, keys: list[int]) -> None:
        new = [k for k in keys if k not in self.model.cached]
        if new:
            self.policy.insert(new)
            self.model.insert(new)

    @rule(keys=st.lists(KEY, min_size=1, max_size=8, unique=True))  # unknown keys too
    def finish(self, keys: list[int]) -> None:
        self.policy.touch_prefix(keys, set(keys[:1]))
        self.model.touch_prefix(keys)

    @rule(keys=st.lists(KEY, min_size=1, max_size=8, unique=True))
    def touch(self, keys: list[int]) -> None:
        self.policy.touch(keys)
        self.model.touch(keys)

    @precondition(lambda self: self.model.cached)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.model.cached)))
        self.policy.remove(key)
        self.model.remove(key)

    @rule(keys=st.sets(KEY, max_size=4))
    def pin(self, keys: set[int]) -> None:
        if self.park:
            self.policy.unpark(sorted(self.refused - keys))
        self.refused = keys

    @rule(n=st.integers(0, 6))
    def evict(self, n: int) -> None:
        refused = self.refused

        def ok(key: Hashable) -> bool:
            return key not in refused

        assert self.policy.evict(n, ok, park=self.park) == self.model.evict(n, ok)

    @invariant()
    def same_state(self) -> None:
        policy, model = self.policy, self.model
        assert policy.keys_in_eviction_order() == model.eviction_order()
        assert policy.clock == model.clock
        assert policy.tau == model.tau
        assert list(policy._ghosts) == model.ghosts
        assert {k: policy.score(k) for k in model.uses} == {
            k: model.uses[k] + model.clock_at[k] for k in model.uses
        }


class OftenRescaledAgainstModel(FrecencyAgainstModel):
    """Scaled uses scaled back every second halving: halvings before and after a
    rescale, and keys queued on either side of one."""

    policy_type = OftenRescaled


class BuiltAhead(SmallFrecency):
    """Builds the queues of each halving ahead, whatever its capacity (see
    ``INCREMENTAL_KEYS``)."""

    __slots__ = ()
    INCREMENTAL_KEYS = 1


class BuiltAheadRescaled(BuiltAhead):
    __slots__ = ()
    RESCALE_HALVINGS = 2


class BuiltAheadAgainstModel(FrecencyAgainstModel):
    """Halvings swap in queues built a few rows a stored block or reuse: the same
    victims as queueing every key anew in the halving's call."""

    policy_type = BuiltAhead


class BuiltAheadParkingAgainstModel(BuiltAheadAgainstModel):
    policy_type = BuiltAheadRescaled
    park = True


class ParkingAgainstModel(FrecencyAgainstModel):
    """Evictions park the keys they find unevictable until they are unparked: the same
    victims as going over them each time."""

    park = True


@pytest.mark.parametrize(
    "machine",
    [
        FrecencyAgainstModel,
        OftenRescaledAgainstModel,
        ParkingAgainstModel,
        BuiltAheadAgainstModel,
        BuiltAheadParkingAgainstModel,
    ],
    ids=["plain", "scaled-back-often", "parking", "built-ahead", "built-ahead-parking"],
)
def test_frecency_policy_matches_model(machine: type[FrecencyAgainstModel]) -> None:
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=200, stateful_step_count=60, deadline=None),
    )


class OneRowAtATime(FrecencyPolicy):
    """``insert`` adding each new key's entry alone (``_new``), as it did before new
    keys' entries were added together."""

    __slots__ = ()

    def insert(self, keys: Sequence[Hashable]) -> None:
        seen, ghosts, heap, fresh = self._seen, self._ghosts, self._heap, self._fresh
        uses, clocks, orders, items = self._uses, self._clocks, self._orders, self._items
        stored_at, scale = self._stored_at, self._scale
        clock, order = self.clock, self._order
        at_clock = scale * clock
        for key in reversed(keys):
            row = seen.get(key)
            order += 1
            if row is None:
                item = (at_clock, order, key)
                seen[key] = self._new(clock, order, item)
                fresh.append(item)
                continue
            if ghosts.pop(key, NO_KEY) is not NO_KEY and stored_at[row] >= 0:
                self._restored[row] = True
            item = items[row] = (uses[row] + scale * clocks[row], orders[row], key)
            heappush(heap, item)
            if self._spare_items is not None:
                self._spare(row, key)
        self._order = order
        self.stored += len(keys)
        self.clock += len(keys) / self.tau
        if self._walk < self._walk_end:
            self._walk_rows(len(keys) * self._walk_step)
        if self._graves:
            self._free_graves(len(keys))
        if self.stored >= self._next_tune:
            self._tune()


_STATE = ("_uses", "_clocks", "_stored_at", "_restored", "_orders", "_items", "_free",
          "_seen", "_heap", "_fresh", "_spare_items", "_spare_heap", "_spare_fresh",
          "_ghosts", "parked", "clock", "tau", "_order", "stored")  # fmt: skip


@pytest.mark.parametrize("incremental", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_new_keys_added_together_leave_the_state_of_one_at_a_time(
    seed: int, incremental: bool
) -> None:
    """Every field of every entry, the queues and the spare queues are those of adding
    each new key's entry alone, through inserts of new, known and ghost keys (a key
    given twice in one call too), evictions that free rows, removals and reuses."""
    rng = random.Random(seed)
    capacity = 16

    def make(cls: type[FrecencyPolicy]) -> FrecencyPolicy:
        if incremental:  # the spare queues, built ahead from INCREMENTAL_KEYS on
            cls = type(cls.__name__, (cls,), {"__slots__": (), "INCREMENTAL_KEYS": 1})
        policy = cls(capacity)
        policy.max_ghosts = 12  # ghosts are forgotten, so rows are used again
        return policy

    fast, slow = make(FrecencyPolicy), make(OneRowAtATime)
    cached: set[int] = set()
    for _ in range(400):
        op = rng.random()
        if op < 0.45:
            drawn = [rng.randrange(80) for _ in range(rng.randint(1, 7))]
            keys = list(dict.fromkeys(k for k in drawn if k not in cached))
            if not keys:
                continue
            if rng.random() < 0.15:
                keys.append(keys[0])  # a key given twice in one call
            for policy in (fast, slow):
                policy.insert(keys)
            cached.update(keys)
        elif op < 0.7 and cached:
            n = rng.randint(1, 4)
            victims = slow.evict(n, lambda k: True)
            assert fast.evict(n, lambda k: True) == victims
            cached.difference_update(victims or ())
        elif op < 0.8 and cached:
            key = rng.choice(sorted(cached))
            for policy in (fast, slow):
                policy.remove(key)
            cached.discard(key)
        else:
            keys = rng.sample(range(80), rng.randint(1, 6))
            for policy in (fast, slow):
                policy.touch_prefix(keys, set(keys[:2]))
        for name in _STATE:
            a, b = getattr(fast, name), getattr(slow, name)
            if isinstance(a, (list, dict)) or hasattr(a, "popleft"):
                a, b = list(a), list(b)  # (a deque, or the order of a dict's keys)
            assert a == b, name
