"""Eviction order of LRU and ARC, and plugging a policy in from a module path."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import pytest

from kvtier.blockpool import ARCPolicy, FrecencyPolicy, HostBlockPool, LRUPolicy, make_policy
from kvtier.blockpool.policy_frecency import FrecencyEntry


def always(_: Hashable) -> bool:
    return True


def _entry(policy: FrecencyPolicy, key: str) -> FrecencyEntry:
    entry = policy.entry(key)
    assert entry is not None, f"{key!r} has no entry"
    return entry


def test_lru_evicts_least_recently_used_first() -> None:
    lru = LRUPolicy(8)
    lru.insert(list("abcd"))
    lru.touch(["a"])
    assert lru.evict(2, always) == ["b", "c"]
    assert lru.keys_in_eviction_order() == ["d", "a"]


def test_lru_skips_keys_the_predicate_refuses() -> None:
    lru = LRUPolicy(8)
    lru.insert(list("abc"))
    assert lru.evict(1, lambda key: key != "a") == ["b"]
    assert lru.evict(3, always) is None, "must fail atomically"
    assert lru.keys_in_eviction_order() == ["a", "c"]


def test_arc_prefers_evicting_keys_seen_once() -> None:
    arc = ARCPolicy(4)
    arc.insert(list("abcd"))
    arc.touch(["a"])
    arc.touch(["b"])  # a, b -> T2 (frequent); c, d stay in T1
    assert arc.evict(2, always) == ["c", "d"]
    assert list(arc.b1) == ["c", "d"], "evicted T1 keys become B1 ghosts"


def test_arc_ghost_hit_in_b1_grows_t1_target_and_enters_t2() -> None:
    arc = ARCPolicy(4)
    arc.insert(list("abcd"))
    arc.evict(1, always)  # a -> B1
    assert arc.p == 0
    arc.insert(["a"])
    assert arc.p == 1 and "a" in arc.t2 and "a" not in arc.b1


def test_arc_ghost_hit_in_b2_shrinks_t1_target() -> None:
    arc = ARCPolicy(4)
    arc.insert(list("abcd"))
    arc.touch(["a"])  # a in T2
    arc.evict(1, always)  # b from T1 (|T1|=3 > p=0)
    arc.insert(["b"])  # B1 hit: p -> 1, b -> T2
    arc.evict(3, always)  # c, d from T1 (|T1| > p), then from T2
    assert "a" in arc.b2
    before = arc.p
    arc.insert(["a"])
    assert arc.p < before and "a" in arc.t2


def test_arc_evicts_from_t2_when_t1_is_within_target() -> None:
    arc = ARCPolicy(4)
    arc.p = 2.0
    arc.insert(list("abcd"))
    arc.touch(["a"])
    arc.touch(["b"])  # T1 = [c, d], T2 = [a, b]
    assert arc.evict(1, always) == ["a"], "|T1| == p, so T2's LRU goes"


def test_arc_ghost_lists_are_bounded() -> None:
    arc = ARCPolicy(4)
    for i in range(100):
        arc.insert([i])
        if len(arc.t1) + len(arc.t2) > 4:
            arc.evict(1, always)
    assert len(arc.t1) + len(arc.b1) <= 4
    assert len(arc.t1) + len(arc.t2) + len(arc.b1) + len(arc.b2) <= 8


def test_arc_eviction_behind_a_key_that_may_not_go_stays_linear() -> None:
    """A pinned key at the old end must not make every eviction walk the keys
    evicted behind it (that is quadratic over a run)."""
    n = 2000
    arc = ARCPolicy(n)
    arc.insert(list(range(n)))
    pinned = 0
    asked = 0

    def not_pinned(key: Hashable) -> bool:
        nonlocal asked
        asked += 1
        return key != pinned

    for i in range(n, 3 * n):
        assert arc.evict(1, not_pinned) == [i - n + 1]
        arc.insert([i])
    assert arc.keys_in_eviction_order()[0] == pinned
    # The pinned key and the victim per eviction; a walk over the gone keys is ~n*n/2.
    assert asked == 2 * 2 * n, f"the predicate was asked {asked} times for {2 * n} evictions"


def test_arc_in_pool_keeps_reused_prefix_over_a_scan() -> None:
    pool = HostBlockPool(4, eviction_policy="arc")
    hot = [b"h0", b"h1"]
    plan = pool.prepare_store(hot)
    assert plan is not None
    pool.complete_store(plan.keys)
    pool.touch(hot)
    for i in range(20):  # a scan of one-off keys
        plan = pool.prepare_store([b"s%d" % i])
        assert plan is not None
        pool.complete_store(plan.keys)
    assert pool.lookup(hot) == 2, "ARC let a scan flush the reused keys"


@pytest.mark.parametrize(("name", "kept"), [("lru", 0), ("frecency", 2)])
def test_frecency_keeps_a_shared_prefix_a_while_then_forgets_it(name: str, kept: int) -> None:
    pool = HostBlockPool(4, eviction_policy=name)
    hot = [b"h0", b"h1"]

    def serve(keys: list[bytes]) -> None:
        hits = pool.lookup(keys)
        plan = pool.prepare_store(keys)
        assert plan is not None
        pool.complete_store(plan.keys)
        pool.finish_request(keys, reused=set(keys[:hits]))

    serve(hot)
    serve(hot)  # two requests share the prefix
    for i in range(2):  # one-off requests: 4 more blocks into 4
        serve([b"s%d" % i, b"t%d" % i])
    assert pool.lookup(hot) == kept
    for i in range(2, 6):  # its extra use is worth tau (here 4) stored blocks: it goes
        serve([b"s%d" % i, b"t%d" % i])
    assert pool.lookup(hot) == 0


def test_frecency_remembers_the_uses_of_evicted_keys() -> None:
    policy = FrecencyPolicy(2)
    policy.insert(["a"])
    for _ in range(3):
        policy.touch_prefix(["a"], {"a"})
    assert policy.evict(1, always) == ["a"]
    policy.insert(["a"])  # it comes back: its three uses with it
    policy.insert(["b"])
    policy.touch_prefix(["b"], ())
    assert policy.keys_in_eviction_order() == ["b", "a"]


def test_frecency_halves_uses_when_lru_would_have_hit_more() -> None:
    policy = FrecencyPolicy(2)
    policy.insert(["old"])
    policy.touch_prefix(["old"], ())
    for _ in range(3):  # three more requests use it; they hit, as under LRU
        policy.touch_prefix(["old"], {"old"})
    assert _entry(policy, "old").uses == 4
    policy.insert(["x"])
    policy.touch_prefix(["x"], ())
    # "x" comes back within 2 stored blocks, twice, after frecency evicted it: two
    # reuses LRU would have hit and frecency missed, at the next tuning.
    for _ in range(2):
        assert policy.evict(1, lambda key: key == "x") == ["x"]
        policy.insert(["x"])
        policy.touch_prefix(["x"], ())
    assert _entry(policy, "old").uses == 2


def _older_half_used(policy: FrecencyPolicy) -> list[str]:
    """64 keys stored in turn (clocks rising), the older half used once, then the
    lowest (k32) evicted; the keys."""
    keys = [f"k{i:02}" for i in range(64)]
    for i, key in enumerate(keys):
        policy.insert([key])
        if i < 32:
            policy.touch([key])
    assert policy.evict(1, lambda key: True) == ["k32"]
    return keys


def test_frecency_halving_leaves_every_queued_score_exact() -> None:
    """After a halving every cached key is queued with its score as halved, so the next
    eviction pushes nothing back (one key popped and pushed at a time, a pool of
    100,000 keys took 0.2 s there), and it takes the lowest scores as halved."""
    policy = FrecencyPolicy(64)
    keys = _older_half_used(policy)
    before = policy.keys_in_eviction_order()
    policy._lead = -1  # LRU would have hit more reuses: the next tuning halves
    policy._tune()
    assert policy._halvings == 1
    for key in keys[:32]:
        assert policy.entry(key).uses == 0.5
        assert policy.score(key) == 0.5 + policy.entry(key).clock
    scale = 2.0**policy._halvings
    queued = sorted(policy._heap) + list(policy._fresh)
    assert sorted(item[2] for item in queued) == sorted(keys[:32] + keys[33:])
    for score, order, key in queued:
        entry = policy.entry(key)
        assert (score, order) == (scale * (entry.uses + entry.clock), entry.order), key
    after = policy.keys_in_eviction_order()
    assert after[:8] != before[:8], "the halving must reorder the keys"
    queued_before = len(policy._heap) + len(policy._fresh)
    assert policy.evict(8, lambda key: True) == after[:8]
    assert len(policy._heap) + len(policy._fresh) == queued_before - 8, "keys pushed back"


class _AheadFrecency(FrecencyPolicy):
    """Builds each halving's queues ahead at any capacity (``INCREMENTAL_KEYS``)."""

    __slots__ = ()
    INCREMENTAL_KEYS = 1


def _evictable_but(refused: set[int]) -> Callable[[Hashable], bool]:
    return lambda key: key not in refused


def test_frecency_halving_swaps_in_queues_built_ahead() -> None:
    """From ``INCREMENTAL_KEYS`` on, a halving goes over no key: it swaps in the queues
    of the next scale, built a few rows per stored block between tunings; the keys
    used since are queued anew as evictions reach them."""
    policy = _AheadFrecency(64)
    _older_half_used(policy)
    spare = policy._spare_heap, policy._spare_fresh
    policy._lead = -1  # the next tuning halves
    policy._tune()
    assert policy._halvings == 1
    assert (policy._heap, policy._fresh) == spare and policy._heap is spare[0]
    assert policy._walk == 0 and policy._walk_end == 64, "the next walk starts"
    assert sum(map(len, policy._graves)) == 63, "the old queues wait to be freed"
    after = policy.keys_in_eviction_order()
    assert policy.evict(8, lambda key: True) == after[:8]
    policy.insert(["k64"])
    assert not policy._graves, "freed a slice at a time by the calls that store"


class _SmallGraves(_AheadFrecency):
    __slots__ = ()
    GRAVE_SLICE = 4


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_frecency_frees_the_queues_swapped_out_by_the_next_tuning(batch: int) -> None:
    """The queues a halving swaps out are freed as calls store, however many blocks a
    call stores (an fs tier indexes a poll's files in one call): what waits to be freed
    stays within a halving's worth."""
    policy, next_key = _SmallGraves(64), 0
    for _ in range(40):
        stored = 0
        while stored < 64:
            keys = list(range(next_key, next_key + batch))
            next_key += batch
            over = len(policy._seen) - len(policy._ghosts) + batch - 64
            if over > 0:
                assert policy.evict(over, lambda key: True) is not None
            policy._lead = -1  # LRU would have hit more: each tuning halves
            policy.insert_each(keys)
            stored += batch
        assert sum(map(len, policy._graves)) <= 2 * 64, policy._halvings
    assert policy._halvings >= 40


def test_frecency_built_ahead_evicts_as_queueing_anew() -> None:
    """Queues built ahead give the victims of queueing every key anew at each halving,
    also where tunings come closer than ``capacity`` stored blocks apart (the walk then
    ends in the halving's call), over stores, reuses, touches, parking and removals."""
    import random

    rng = random.Random(11)
    ahead, anew = _AheadFrecency(16), FrecencyPolicy(16)
    assert anew._spare_items is None and ahead._spare_items is not None
    cached: set[int] = set()
    refused: set[int] = set()
    halvings = 0
    for step in range(6000):
        roll = rng.random()
        policies = (ahead, anew)
        if roll < 0.35:
            keys = [k for k in rng.sample(range(200), rng.randint(1, 8)) if k not in cached]
            for policy in policies:
                policy.insert(keys)
            cached.update(keys)
        elif roll < 0.6 and cached:
            keys = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 6)))
            reused = {k for k in keys if rng.random() < 0.6}
            for policy in policies:
                policy.touch_prefix(keys, reused)
        elif roll < 0.65 and cached:
            keys = rng.sample(sorted(cached), min(len(cached), 3))
            for policy in policies:
                policy.touch(keys)
        elif roll < 0.68 and cached:
            key = rng.choice(sorted(cached))
            for policy in policies:
                policy.remove(key)
            cached.discard(key)
        elif roll < 0.72:
            for policy in policies:  # a halving sooner than the walk's pace
                policy._lead = -1
                policy._tune()
            halvings += 1
        elif roll < 0.8 and cached:
            unrefused = sorted(refused)
            refused = set(rng.sample(sorted(cached), min(len(cached), 3)))
            ahead.unpark([k for k in unrefused if k not in refused])
        elif len(cached) > 4:
            n = rng.randint(1, len(cached) - 4)
            ok = _evictable_but(refused)
            gone = [ahead.evict(n, ok, park=True), anew.evict(n, ok)]
            assert gone[0] == gone[1], step
            cached.difference_update(gone[0] or ())
        assert ahead.keys_in_eviction_order() == anew.keys_in_eviction_order(), step
    assert ahead._halvings == anew._halvings > halvings, "tunings halved on their own too"


@pytest.mark.parametrize("comes_back", ["insert", "touch", "touch_prefix"])
def test_frecency_halves_a_ghosts_uses_when_it_comes_back(comes_back: str) -> None:
    """A halving goes over the cached keys only; a ghost's uses are halved when it is
    next stored or used, to what halving them at once would have given."""
    policy = FrecencyPolicy(2)
    policy.insert(["g"])
    policy.touch_prefix(["g"], ())
    for _ in range(3):
        policy.touch_prefix(["g"], {"g"})
    assert policy.evict(1, lambda key: key == "g") == ["g"]  # a ghost with four uses
    policy.insert(["old"])
    policy.touch_prefix(["old"], ())
    for _ in range(3):
        policy.touch_prefix(["old"], {"old"})
    policy.insert(["x"])
    policy.touch_prefix(["x"], ())
    for _ in range(2):  # as above: one halving
        assert policy.evict(1, lambda key: key == "x") == ["x"]
        policy.insert(["x"])
        policy.touch_prefix(["x"], ())
    assert _entry(policy, "old").uses == 2
    if comes_back == "insert":
        policy.insert(["g"])
        assert _entry(policy, "g").uses == 2
    else:
        getattr(policy, comes_back)(["g"], *([()] if comes_back == "touch_prefix" else []))
        assert _entry(policy, "g").uses == 3, "4 halved, plus this use"
    assert policy.score("g") == 2 + (comes_back != "insert") + _entry(policy, "g").clock


class EvictNewestFirst:
    """A custom policy for the plug-in test: most recently inserted goes first."""

    def __init__(self, capacity: int) -> None:
        self.keys: list[Hashable] = []

    def insert(self, keys: Sequence[Hashable]) -> None:
        self.keys.extend(keys)

    def touch(self, keys: Sequence[Hashable]) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        self.keys.remove(key)

    def evict(self, n: int, evictable: Callable[[Hashable], bool]) -> list[Hashable] | None:
        victims = [key for key in reversed(self.keys) if evictable(key)][:n]
        if len(victims) < n:
            return None
        for key in victims:
            self.keys.remove(key)
        return victims


def _frecency_state(policy: FrecencyPolicy) -> dict[str, object]:
    seen = {key: tuple(policy.entry(key) or ()) for key in policy._seen}
    fields = ("clock", "stored", "tau", "_order", "_halvings", "_next_tune", "_heap")
    return {
        "seen": seen,
        "ghosts": list(policy._ghosts),
        "fresh": list(policy._fresh),
        "distances": list(policy._distances),
        **{name: getattr(policy, name) for name in fields},
    }


def test_frecency_insert_each_is_one_insert_per_key_in_turn() -> None:
    """``insert_each`` (the fs tier indexes a poll's writes in one call) leaves the
    policy as an ``insert`` of each key in turn does: the same clock, scores, order,
    ghosts and tunings, over evictions, reuses and halvings."""
    import random

    rng = random.Random(7)
    each, one_by_one = FrecencyPolicy(8), FrecencyPolicy(8)
    cached: set[int] = set()
    for step in range(3000):
        roll = rng.random()
        if roll < 0.4:
            keys = [k for k in rng.sample(range(64), rng.randint(1, 6)) if k not in cached]
            each.insert_each(keys)
            for key in keys:
                one_by_one.insert([key])
            cached.update(keys)
        elif roll < 0.7 and cached:
            keys = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 4)))
            reused = {k for k in keys if rng.random() < 0.5}
            for policy in (each, one_by_one):
                policy.touch_prefix(keys, reused)
        elif len(cached) > 4:
            n = rng.randint(1, len(cached) - 4)
            gone = [each.evict(n, lambda k: True), one_by_one.evict(n, lambda k: True)]
            assert gone[0] == gone[1], step
            cached.difference_update(gone[0] or ())
        assert _frecency_state(each) == _frecency_state(one_by_one), step
    assert each._halvings > 0 and each.tau > each.capacity, "tunings must have run"


def test_frecency_insert_each_of_new_keys_together_is_one_insert_per_key() -> None:
    """Where ``insert_each`` adds new keys' entries together (no free row, no walk,
    no tuning before the last key), on a policy large enough to keep spare queues:
    the same state as an ``insert`` of each key in turn, over evictions, reuses,
    ghosts stored again, walks and halvings; both ways are taken."""
    import random

    rng = random.Random(11)
    capacity = FrecencyPolicy.INCREMENTAL_KEYS
    together: list[int] = []

    class Counted(FrecencyPolicy):
        def _add_new_each(self, keys: Sequence[Hashable]) -> None:
            together.append(len(keys))
            super()._add_new_each(keys)

    each, one_by_one = Counted(capacity), FrecencyPolicy(capacity)
    cached: set[int] = set()
    gone: list[int] = []
    next_key = 0
    for step in range(2500):
        roll = rng.random()
        if roll < 0.5:
            keys = list(range(next_key, next_key + rng.randint(1, 24)))
            next_key = keys[-1] + 1
            if gone and rng.random() < 0.2:
                keys.insert(rng.randrange(len(keys)), gone.pop(rng.randrange(len(gone))))
            over = len(cached) + len(keys) - capacity
            if over > 0:
                evicted = [p.evict(over, lambda k: True) for p in (each, one_by_one)]
                assert evicted[0] == evicted[1], step
                cached.difference_update(evicted[0] or ())
                gone += evicted[0] or ()
            for policy in (each, one_by_one):
                policy._lead = -1  # LRU would have hit more: each tuning halves
            each.insert_each(keys)
            for key in keys:
                one_by_one.insert([key])
            cached.update(keys)
        elif cached:
            keys = rng.sample(sorted(cached), min(len(cached), rng.randint(1, 8)))
            reused = {k for k in keys if rng.random() < 0.5}
            for policy in (each, one_by_one):
                policy.touch_prefix(keys, reused)
        if step % 50 == 0:
            assert _frecency_state(each) == _frecency_state(one_by_one), step
            assert each._spare_items == one_by_one._spare_items, step
            assert list(each._spare_fresh) == list(one_by_one._spare_fresh), step
    assert _frecency_state(each) == _frecency_state(one_by_one)
    # New keys up to exactly the next tuning: the last one's insert tunes.
    for policy in (each, one_by_one):
        over = len(cached) + each._next_tune - each.stored - capacity
        if over > 0:
            policy.evict(over, lambda k: True)
    while each._walk < each._walk_end:  # (a walk going on takes them one at a time)
        for policy in (each, one_by_one):
            policy.touch_prefix([next(iter(cached))], set())
            policy._walk_rows(capacity)
    keys = list(range(next_key, next_key + each._next_tune - each.stored))
    tunings = each._halvings
    each.insert_each(keys)
    for key in keys:
        one_by_one.insert([key])
    assert each._halvings == tunings + 1
    assert _frecency_state(each) == _frecency_state(one_by_one)
    assert each._spare_items is not None and each._halvings > 1, "halvings, walks"
    assert len(together) > 100, "new keys must be added together"


@pytest.mark.parametrize(
    "path",
    [f"{__name__}:EvictNewestFirst", f"{__name__}.EvictNewestFirst"],
)
def test_policy_plugs_in_from_a_module_path(path: str) -> None:
    pool = HostBlockPool(2, cache_policy_module_path=path)
    for key in (b"a", b"b"):
        plan = pool.prepare_store([key])
        assert plan is not None
        pool.complete_store(plan.keys)
    plan = pool.prepare_store([b"c"])
    assert plan is not None and plan.evicted == [b"b"]


def test_module_path_to_a_non_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match="cache_policy_module_path"):
        make_policy("lru", 4, "collections:OrderedDict")


@pytest.mark.parametrize("name", ["LRU", "Arc"])
def test_policy_names_are_case_insensitive(name: str) -> None:
    assert make_policy(name, 4).name == name.lower()  # type: ignore[attr-defined]


def test_arc_touch_that_raises_part_way_loses_no_key() -> None:
    arc = ARCPolicy(4)
    arc.insert(["a", "b"])
    with pytest.raises(TypeError):
        arc.touch(["b", []])  # the second key cannot be hashed
    assert sorted([*arc.t1, *arc.t2]) == ["a", "b"]
    assert arc.evict(2, always) == ["a", "b"], "every key can still be evicted"


def test_arc_eviction_walks_only_the_list_it_takes_from() -> None:
    arc = ARCPolicy(10_000)
    arc.insert(list(range(8000)))
    arc.touch(list(range(4000)))  # T2 = 0..3999, T1 = 4000..7999; p = 0: T1 goes first
    calls = []

    def counting(key: Hashable) -> bool:
        calls.append(key)
        return True

    assert arc.evict(1000, counting) == list(range(4000, 5000))
    assert len(calls) == 1000, "T2 was walked although the rule never reached it"
    arc.p = 3000.0  # = |T1|: T2 goes first
    calls.clear()
    assert arc.evict(1000, counting) == list(range(3999, 2999, -1))  # first touched is newest
    assert len(calls) == 1000, "T1 was walked although the rule never reached it"


def test_arc_policy_copies_and_pickles_with_its_state() -> None:
    import copy
    import pickle

    arc = ARCPolicy(4)
    arc.insert(list("abcd"))
    arc.touch(["a"])
    arc.evict(1, always)  # b -> B1
    for twin in (copy.copy(arc), copy.deepcopy(arc), pickle.loads(pickle.dumps(arc))):
        assert (list(twin.t1), list(twin.t2), list(twin.b1), twin.p) == (
            ["c", "d"],
            ["a"],
            ["b"],
            0.0,
        ), "a copy lost the policy's state"
    twin = copy.deepcopy(arc)
    twin.touch(["c"])
    assert list(arc.t1) == ["c", "d"], "touching a deep copy changed the original"


@pytest.mark.parametrize("name", ["lru", "arc", "frecency"])
def test_a_finished_request_gives_up_its_prefix_from_the_tail(name: str) -> None:
    pool = HostBlockPool(4, eviction_policy=name)
    plan = pool.prepare_store([1, 2, 3, 4])
    assert plan is not None
    pool.complete_store(plan.keys)
    pool.finish_request([1, 2, 3, 4], reused=())
    plan = pool.prepare_store([5])
    assert plan is not None and plan.evicted == [4], "the tail goes first"


def test_arc_finish_counts_only_reused_keys_as_a_second_use() -> None:
    arc = ARCPolicy(8)
    arc.insert(list("abcd"))
    arc.touch_prefix(list("abcd"), reused={"a", "b"})  # c, d were stored by the request
    assert list(arc.t1) == ["d", "c"], "stored keys stay in T1, tail oldest"
    assert list(arc.t2) == ["b", "a"], "reused keys enter T2, head newest"


class RecordTouches(EvictNewestFirst):
    """A custom policy with no ``touch_prefix``, recording its touches."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.touched: list[list[Hashable]] = []

    def touch(self, keys: Sequence[Hashable]) -> None:
        self.touched.append(list(keys))


def test_a_policy_without_touch_prefix_is_touched_when_a_request_finishes() -> None:
    pool = HostBlockPool(3, cache_policy_module_path=f"{__name__}:RecordTouches")
    pool.finish_request([b"a", b"b", b"c"], reused={b"a"})
    assert pool.policy.touched == [[b"a", b"b", b"c"]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", ["lru", "arc", "frecency"])
def test_a_policy_keeps_no_object_per_key_for_the_garbage_collector(name: str) -> None:
    """A full collection stops the engine's thread for as long as it takes to visit
    every tracked object: a policy holding many keys (and ghosts) must not add one
    per key."""
    import gc

    from kvtier.blockpool.bench import make_keys

    n = 2000
    keys = make_keys(4 * n)
    gc.collect()
    before = len(gc.get_objects())
    policy = make_policy(name, n)
    for i in range(0, len(keys), 16):
        batch = keys[i : i + 16]
        if i >= n:  # full: make room first, leaving ghosts
            assert policy.evict(len(batch), always) is not None
        policy.insert(batch)
        policy.touch(batch[:4])
    gc.collect()  # (a plain tuple of numbers and bytes is untracked when collected)
    gc.collect()
    added = len(gc.get_objects()) - before
    assert added < n // 20, f"{added} tracked objects for {n} keys and their ghosts"
