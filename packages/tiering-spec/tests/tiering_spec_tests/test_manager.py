"""The tier manager: host hits, write-through, promotions, faults as misses, metrics."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import pytest

from kvtier.blockpool import Hold, HostBlockPool
from kvtier.tiering_spec import metrics, metrics_emitter
from kvtier.tiering_spec.manager import FRESH_STEPS, DigestMemo, Lookup, TierManager
from kvtier.tiering_spec.tiers.base import FAULT_KINDS, TierFault, TierResult, TierStats
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.format import key_digest

from .tier_support import PAYLOAD, Region


def settle(mgr: TierManager, timeout: float = 20.0) -> None:
    """Submit what waits for the end of the step, then wait for every tier job."""
    mgr.flush()
    deadline = time.monotonic() + timeout
    while mgr.has_pending_work() and time.monotonic() < deadline:
        time.sleep(0.002)
        mgr.poll()
    assert not mgr.has_pending_work(), "fs jobs did not finish"


def store(mgr: TierManager, region: Region | None, keys: list[bytes]) -> list[int]:
    plan = mgr.prepare_store(keys)
    assert plan is not None
    to_store, blocks, _ = plan
    if region is not None:
        for k, b in zip(to_store, blocks):
            region.fill(0, b, int.from_bytes(key_digest(k)[:4], "little"))
    mgr.complete_store(to_store)
    return blocks


def test_host_tier_lookup_states() -> None:
    mgr = TierManager(HostBlockPool(4))
    assert mgr.lookup(b"a") is Lookup.MISS
    plan = mgr.prepare_store([b"a"])
    assert plan is not None and plan[0] == [b"a"]
    assert mgr.lookup(b"a") is Lookup.HIT_PENDING, "a store in flight is pending"
    mgr.complete_store([b"a"])
    assert mgr.lookup(b"a") is Lookup.HIT
    blocks = mgr.prepare_load([b"a"])
    assert blocks == plan[1]
    mgr.complete_load([b"a"])
    assert mgr.counters.host_hits == 1


def _host_state(seed: int) -> tuple[TierManager, list[bytes]]:
    """A host-only manager whose keys are cached, being stored, being stored with a
    late read's hold, or absent, at random (the same for the same ``seed``)."""
    rng = random.Random(seed)
    mgr = TierManager(HostBlockPool(32))
    keys = [b"k%d" % i for i in range(12)]
    for key in keys:
        state = rng.choice(["cached", "storing", "late", "absent"])
        if state == "absent":
            continue
        assert mgr.prepare_store([key]) is not None
        if state == "cached":
            mgr.complete_store([key])
        elif state == "late":
            mgr.pool.hold([key], Hold.LATE_READ)
    rng.shuffle(keys)
    return mgr, keys


def test_a_key_being_stored_is_pending_unless_a_late_read_holds_it() -> None:
    """A key the host tier is storing reads HIT_PENDING; held for a read that timed
    out (never loaded), it reads MISS, key by key and in a prefix."""
    mgr = TierManager(HostBlockPool(8))
    assert mgr.prepare_store([b"a", b"b"]) is not None
    assert mgr.lookup(b"a", "r") is Lookup.HIT_PENDING
    assert mgr.lookup_prefix([b"a", b"b"], "q") == (2, [False, False])
    mgr.pool.hold([b"b"], Hold.LATE_READ)
    assert mgr.lookup(b"b", "s") is Lookup.MISS
    assert mgr.lookup_prefix([b"a", b"b"], "t") == (1, [False])


@pytest.mark.parametrize("seed", range(40))
def test_a_host_only_prefix_lookup_answers_as_its_keys_looked_up_one_by_one(seed: int) -> None:
    """``lookup_prefix`` with the host tier alone answers the key a run of cached keys
    stops at without ``lookup``'s call: the same answers, counters and pass as asking
    ``lookup`` key by key up to the first MISS."""
    fast, keys = _host_state(seed)
    slow, _ = _host_state(seed)
    found, ready = fast.lookup_prefix(keys, "r")
    answers = []
    for key in keys:
        answer = slow.lookup(key, "r")
        if answer is Lookup.MISS:
            break
        answers.append(answer is Lookup.HIT)
    assert found == len(answers)
    assert ready == (None if all(answers) else answers)
    assert (fast.counters.host_queries, fast.counters.host_hits) == (
        slow.counters.host_queries,
        slow.counters.host_hits,
    )
    assert fast._pass_keys == slow._pass_keys


def test_a_failed_store_is_a_miss() -> None:
    mgr = TierManager(HostBlockPool(2))
    mgr.prepare_store([b"a"])
    mgr.complete_store([b"a"], success=False)
    assert mgr.lookup(b"a") is Lookup.MISS


def test_store_threshold_counts_offers() -> None:
    mgr = TierManager(HostBlockPool(4), store_threshold=2)
    first = mgr.prepare_store([b"a"])
    assert first is not None and first[0] == [], "first offer only counts"
    second = mgr.prepare_store([b"a"])
    assert second is not None and second[0] == [b"a"]
    assert mgr.admission is not None and mgr.admission.stores_skipped == 1


def test_store_threshold_counts_survive_a_cache_reset() -> None:
    mgr = TierManager(HostBlockPool(4), store_threshold=2)
    mgr.prepare_store([b"a"])
    new_pool = HostBlockPool(4)
    mgr.reset(new_pool)
    plan = mgr.prepare_store([b"a"])
    assert plan is not None and plan[0] == [b"a"], "the first offer was forgotten"
    assert new_pool.is_storing(b"a"), "the store went to the old pool"
    assert mgr.admission is not None and mgr.admission.stores_skipped == 1


def test_store_threshold_below_two_stores_every_offer() -> None:
    mgr = TierManager(HostBlockPool(4), store_threshold=1)
    plan = mgr.prepare_store([b"a"])
    assert plan is not None and plan[0] == [b"a"] and mgr.admission is None


def test_stored_blocks_are_written_through_and_promoted_back(make_tier) -> None:
    region = Region(2)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(2), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"b"])
    settle(mgr)
    assert tier.has(key_digest(b"a")) and tier.has(key_digest(b"b"))
    assert mgr.write_pinned_blocks == 0
    expected_a = region.block(0, mgr.pool.block_of(b"a"))
    store(mgr, region, [b"c", b"d"])  # evicts a and b from the host tier
    settle(mgr)
    assert not mgr.pool.contains(b"a")
    assert mgr.lookup(b"a") is Lookup.HIT_PENDING, "an fs hit starts a promotion"
    settle(mgr)
    assert mgr.lookup(b"a") is Lookup.HIT
    assert region.block(0, mgr.pool.block_of(b"a")) == expected_a
    assert mgr.load_source(b"a") == "fs"
    assert mgr.counters.promotions == 1
    # One source for several keys: where each key's is the same, else none.
    assert mgr.sole_load_source([b"a"]) == "fs"
    assert mgr.load_source(b"c") == "host" and mgr.sole_load_source([b"c", b"d"]) == "host"
    assert mgr.sole_load_source([b"a", b"c"]) is None
    assert mgr.sole_load_source([b"c", b"a"]) is None


def test_a_host_tier_alone_is_the_sole_load_source() -> None:
    mgr = TierManager(HostBlockPool(2))
    plan = mgr.prepare_store([b"a", b"b"])
    assert plan is not None
    mgr.complete_store([b"a", b"b"])
    assert [mgr.load_source(k) for k in (b"a", b"b")] == ["host", "host"]
    assert mgr.sole_load_source([b"a", b"b"]) == "host"


def a_in_the_fs_tier_only(make_tier) -> tuple[TierManager, object]:
    """A one-block host tier holding b, in front of an fs tier holding a and b."""
    region = Region(1)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(1), [tier], max_write_backlog=64)
    store(mgr, region, [b"a"])
    settle(mgr)
    store(mgr, region, [b"b"])
    settle(mgr)
    return mgr, tier


def promote_a_corrupt_file(make_tier) -> tuple[TierManager, object]:
    """A manager whose fs tier held a, damaged on disk, and just tried to promote it."""
    mgr, tier = a_in_the_fs_tier_only(make_tier)
    [path] = tier.paths(key_digest(b"a"))
    with open(path, "r+b") as f:
        f.seek(5000)
        f.write(b"\x00garbage")
    assert mgr.lookup(b"a") is Lookup.HIT_PENDING
    settle(mgr)
    return mgr, tier


def test_a_corrupt_file_is_a_miss_and_never_becomes_a_hit(make_tier) -> None:
    mgr, tier = promote_a_corrupt_file(make_tier)
    assert mgr.lookup(b"a") is Lookup.MISS
    assert tier.faults()["corrupt"] == 1 and mgr.counters.promotion_failures == 1
    mgr.pool.check_invariants()


def test_a_promotion_never_evicts_the_keys_its_own_lookup_pass_found(make_tier) -> None:
    region = Region(3)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(3, eviction_policy="lru"), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"b", b"c"])
    settle(mgr)
    store(mgr, region, [b"x"])  # a is evicted (least recently used)
    settle(mgr)
    mgr.touch([b"b", b"c"])
    mgr.end_step()
    # request r looks up b, c (host hits), then a (fs): the promotion must evict x
    assert mgr.lookup(b"b", "r") is Lookup.HIT
    assert mgr.lookup(b"c", "r") is Lookup.HIT
    assert mgr.lookup(b"a", "r") is Lookup.HIT_PENDING
    assert mgr.pool.contains(b"b") and mgr.pool.contains(b"c")
    assert not mgr.pool.contains(b"x")


def test_hits_after_a_pass_first_promotion_are_kept_for_its_next_ones(make_tier) -> None:
    """The pass holds its cached keys from its first promotion to its end: a host hit
    found after that promotion is not evicted by the pass's next promotion either."""
    region = Region(4)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(4, eviction_policy="lru"), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"d", b"c", b"w"])
    settle(mgr)
    store(mgr, region, [b"y", b"z"])  # a and d leave the host tier (least recently used)
    settle(mgr)
    mgr.touch([b"z", b"y", b"w", b"c"])  # oldest first: c, w, y, z
    mgr.end_step()
    assert mgr.lookup(b"y", "r") is Lookup.HIT
    assert mgr.lookup(b"w", "r") is Lookup.HIT
    assert mgr.lookup(b"a", "r") is Lookup.HIT_PENDING  # evicts c; y and w held
    assert not mgr.pool.contains(b"c")
    assert mgr.lookup(b"z", "r") is Lookup.HIT
    assert mgr.lookup(b"d", "r") is Lookup.MISS  # y, w, z held, a storing: no room
    assert mgr.counters.promotion_allocation_failures == 1
    assert all(mgr.pool.contains(k) for k in (b"y", b"w", b"z"))
    assert mgr.pool.held(Hold.LOOKUP_PASS) == 3
    mgr.end_step()
    assert mgr.pool.held(Hold.LOOKUP_PASS) == 0
    mgr.pool.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc", "frecency"])
def test_a_promoted_key_outranks_keys_nobody_asked_for_since(make_tier, policy: str) -> None:
    """A promotion is a use: once its pin ends, the next promotion evicts a key that
    was not used since, not the key promoted a moment ago (with frecency it entered
    unused, promotions evicted each other and requests waited on them for ever)."""
    region = Region(3)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(3, eviction_policy=policy), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"b", b"c"])
    settle(mgr)
    store(mgr, region, [b"x", b"y", b"z"])  # a, b and c are now in the fs tier only
    mgr.finish_request([b"x", b"y", b"z"], reused=())
    settle(mgr)
    for key in (b"a", b"b"):
        assert mgr.lookup(key) is Lookup.HIT_PENDING
        settle(mgr)
        for _ in range(FRESH_STEPS):  # nobody loads it: its pin ends
            mgr.end_step()
    assert mgr.pool.contains(b"a") and mgr.pool.contains(b"b"), policy
    assert sum(mgr.pool.contains(k) for k in (b"x", b"y", b"z")) == 1
    mgr.pool.check_invariants()


def test_a_full_fs_tier_drops_the_copy_of_a_block_the_host_tier_serves(make_tier) -> None:
    """Requests reuse h from the host tier; a, b and c are stored once each. The fs tier
    (room for 3) is told of what it served and what was stored, not of host hits, so h
    is no more used there than the others: being the oldest, its copy goes for c."""
    region = Region(4)
    tier = make_tier(region, capacity=3 * (fs_format.HEADER_SIZE + PAYLOAD))
    mgr = TierManager(HostBlockPool(4), [tier], max_write_backlog=64)
    store(mgr, region, [b"h"])
    settle(mgr)  # written through: the fs tier's policy knows h
    mgr.finish_request([b"h"], reused=())
    for _ in range(3):
        assert mgr.lookup(b"h") is Lookup.HIT
        mgr.finish_request([b"h"], reused={b"h"})
    for key in (b"a", b"b", b"c"):
        store(mgr, region, [key])
        settle(mgr)
        mgr.finish_request([key], reused=())
    assert mgr.pool.contains(b"h"), "the host tier still serves h"
    assert not tier.has(key_digest(b"h"))
    assert all(tier.has(key_digest(k)) for k in (b"a", b"b", b"c"))


def test_promotion_without_host_room_is_a_miss(make_tier) -> None:
    mgr, _ = a_in_the_fs_tier_only(make_tier)
    mgr.prepare_load([b"b"])  # the only host block is pinned by a load
    assert mgr.lookup(b"a") is Lookup.MISS
    assert mgr.counters.promotion_allocation_failures == 1


def test_write_backlog_limit_drops_write_throughs(make_tier) -> None:
    region = Region(4)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(4), [tier], max_write_backlog=1)
    store(mgr, region, [b"a", b"b"])
    assert mgr.counters.writes_dropped == 1
    settle(mgr)
    mgr.pool.check_invariants()


def test_reset_keeps_files_and_empties_the_host_tier(make_tier) -> None:
    region = Region(2)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(2), [tier], max_write_backlog=64)
    store(mgr, region, [b"a"])
    mgr.reset(HostBlockPool(2))
    assert not mgr.pool.contains(b"a")
    assert tier.has(key_digest(b"a"))


def test_every_emitted_metric_is_declared(make_tier) -> None:
    region = Region(2)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(2), [tier], max_write_backlog=64)
    store(mgr, region, [b"a"])
    settle(mgr)
    for tiering in (False, True):
        declared = metrics.metric_table({}, tiering=tiering)
        emitter = metrics_emitter.MetricsEmitter(mgr, tiering=tiering)
        for kind, name, _value, labels in emitter.collect():
            assert name in declared, f"{name} is emitted but not declared"
            assert declared[name][0] == kind, name
            assert len(declared[name][2]) == len(labels), name


def test_tier_metrics_keep_their_fs_names_as_aliases(make_tier) -> None:
    """vllm:kvtier_tier_* cover every secondary tier; the vllm:kvtier_fs_* names they
    had before are emitted beside them with the same values, for one more release
    (counters that did not move are emitted under neither name)."""
    mgr, tier = promote_a_corrupt_file(make_tier)
    emitted = {
        (n, lab): v for _, n, v, lab in metrics_emitter.MetricsEmitter(mgr, tiering=True).collect()
    }
    declared = metrics.metric_table({}, tiering=True)
    for name, old in metrics.DEPRECATED_ALIASES.items():
        assert name in declared and old in declared
        new_pairs = {(lab, v) for (n, lab), v in emitted.items() if n == name}
        old_pairs = {(lab, v) for (n, lab), v in emitted.items() if n == old}
        assert new_pairs == old_pairs, (name, old)
    assert emitted[(metrics.TIER_FAULTS, (tier.name, "corrupt"))] == 1
    assert emitted[(metrics.FS_FAULTS, (tier.name, "corrupt"))] == 1
    assert emitted[(metrics.TIER_USED_BYTES, (tier.name,))] == tier.used_bytes


def test_a_store_that_finds_no_room_is_still_an_allocation_sample() -> None:
    """vLLM's manager samples the allocation it tries before it looks for room, so its
    histogram does not thin out exactly when the host tier is under pressure."""
    mgr = TierManager(HostBlockPool(2), [], max_write_backlog=64)
    plan = mgr.prepare_store([b"a", b"b"])  # stored, never completed: not evictable
    assert plan is not None
    assert mgr.take_allocation_sizes() == [2]
    assert mgr.prepare_store([b"a", b"c", b"d", b"d"]) is None  # a is there; c, d are new
    assert mgr.take_allocation_sizes() == [2]
    mgr.complete_store([b"a", b"b"])


def test_counters_are_emitted_as_increments() -> None:
    mgr = TierManager(HostBlockPool(2))
    em = metrics_emitter.MetricsEmitter(mgr, tiering=False)
    mgr.lookup(b"a")
    first = {n: v for k, n, v, _ in em.collect() if k == "counter"}
    second = {n: v for k, n, v, _ in em.collect() if k == "counter"}
    assert first[metrics.HOST_QUERIES] == 1 and metrics.HOST_QUERIES not in second


def test_a_step_where_nothing_changed_emits_only_the_usage_gauges() -> None:
    mgr = TierManager(HostBlockPool(4))
    em = metrics_emitter.MetricsEmitter(mgr, tiering=False)
    first = list(em.collect())
    assert {n for k, n, _, _ in first if k == "gauge"} >= {metrics.CPU_CACHE_USAGE_PERC}
    quiet = list(em.collect())
    assert [n for _, n, _, _ in quiet] == list(metrics_emitter.ALWAYS_GAUGES), (
        "a step where nothing changed emits only vLLM's always-reported usage gauges"
    )
    mgr.prepare_store([b"a"])
    emitted = {n: v for _, n, v, _ in em.collect()}
    assert emitted[metrics.CPU_CACHE_WRITE_USAGE_PERC] == 0.25


def random_step(
    mgr: TierManager, op: int, some: list[bytes], p: float, other_size: int = 6
) -> None:
    """One random step of the emitter tests: a store (completed or failed, or left in
    flight), lookups, a load, or a reset to 6 or ``other_size`` host blocks."""
    if op == 0:
        plan = mgr.prepare_store(some)
        if plan is not None and p < 0.7:
            mgr.complete_store(plan[0], success=p < 0.55)
    elif op == 1:
        for k in some:
            mgr.lookup(k)
    elif op == 2:
        cached = [k for k in some if mgr.pool.contains(k)]
        if cached:
            mgr.prepare_load(cached)
            if p < 0.8:
                mgr.complete_load(cached)
    elif op == 3 and p < 0.1:
        mgr.reset(HostBlockPool(6 if p < 0.05 else other_size))


def test_skipping_unchanged_steps_emits_what_computing_every_step_does() -> None:
    """The emitter's shortcut (a signature of what it reads) against collecting every
    step, over the same random stores, loads, lookups, failures and resets."""
    keys = [bytes([i]) for i in range(10)]
    rng = random.Random(7)
    ops = [
        (rng.randrange(5), rng.sample(keys, rng.randint(1, 3)), rng.random()) for _ in range(400)
    ]

    def steps(
        every_row: bool, quiet_first: bool = False
    ) -> list[list[tuple[str, str, object, tuple[str, ...]]]]:
        mgr = TierManager(HostBlockPool(6), store_threshold=2)
        em = metrics_emitter.MetricsEmitter(mgr, tiering=False)
        out = []
        for op, some, p in ops:
            random_step(mgr, op, some, p)
            if every_row:
                em._signed = None  # the reference computes every row, every step
            if quiet_first:  # as the vLLM manager's get_stats asks
                gauges = em.quiet_gauges()
                if gauges is None:
                    out.append(list(em.collect_changed()))
                else:
                    rows = [("gauge", n, v, ()) for n, v in gauges]
                    out.append([*rows, ("counter", metrics.STORES_SKIPPED, 0, ())])
            else:
                out.append(list(em.collect()))
        return out

    quick, full, via_quiet = steps(False), steps(True), steps(False, quiet_first=True)
    assert via_quiet == quick
    quiet = [
        rows
        for rows in full
        if all(
            n in metrics_emitter.ALWAYS_GAUGES or n == metrics.STORES_SKIPPED for _, n, _, _ in rows
        )
    ]
    assert len(quiet) > 20, "some steps must change nothing"
    for step, (a, b) in enumerate(zip(quick, full)):
        assert a == b, f"step {step} ({ops[step][0]}): {a} != {b}"


class RecordingSink:
    """What vLLM's ``OffloadingConnectorStats`` would hold, as plain data."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str, tuple[str, ...]], Any] = {}

    def set_gauge(self, name: str, value: object, labels: tuple[str, ...] = ()) -> None:
        self.held[("gauge", name, labels)] = value

    def increase_counter(self, name: str, value: float, labels: tuple[str, ...] = ()) -> None:
        key = ("counter", name, labels)
        self.held[key] = self.held.get(key, 0) + value

    def observe_histogram(self, name: str, value: object, labels: tuple[str, ...] = ()) -> None:
        self.held.setdefault(("histogram", name, labels), []).append(value)


class CountingTier:
    """A secondary tier that holds nothing and refuses every job; the test moves its
    counters by hand."""

    name = "counting"
    in_flight = 0

    def __init__(self) -> None:
        self.stats = TierStats()
        self.used_bytes = 0
        self.fault_counts = dict.fromkeys(FAULT_KINDS, 0)

    def contains(self, digest: bytes) -> bool:
        return False

    def has(self, digest: bytes) -> bool:
        return False

    def submit(self, job) -> list[bool]:
        return [False] * len(job.items)

    def results(self) -> list:
        return []

    def drain(self, timeout: float | None = None) -> bool:
        return True

    def faults(self) -> dict[str, int]:
        return dict(self.fault_counts)

    @property
    def fault_count(self) -> int:
        return sum(self.fault_counts.values())


@pytest.mark.parametrize("tiering", [False, True])
def test_stats_written_directly_hold_what_the_rows_say(tiering: bool) -> None:
    """``write_changed`` (the vLLM manager's get_stats, most steps writing the host
    tier's rows without the tiers') against every row computed every step, over random
    stores, loads, lookups, failures, allocation failures and resets."""
    keys = [bytes([i]) for i in range(10)]
    rng = random.Random(11)
    ops = [
        (rng.randrange(5), rng.sample(keys, rng.randint(1, 3)), rng.random()) for _ in range(400)
    ]

    def steps(direct: bool) -> list[dict[tuple[str, str, tuple[str, ...]], object]]:
        # The same lookup delays in both runs: a clock that ticks a microsecond a read.
        ticks = itertools.count()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "perf_counter", lambda: next(ticks) * 1e-6)
            return run(direct)

    def run(direct: bool) -> list[dict[tuple[str, str, tuple[str, ...]], object]]:
        tier = CountingTier()
        mgr = TierManager(HostBlockPool(6), [tier] if tiering else [], store_threshold=2)
        em = metrics_emitter.MetricsEmitter(mgr, tiering=tiering)
        out = []
        for op, some, p in ops:
            random_step(mgr, op, some, p, other_size=8)
            if op == 4 and p < 0.3:
                mgr.counters.promotion_allocation_failures += 1
                if tiering:
                    flow = mgr.flows[0]
                    flow.dropped(int(p < 0.1) * 2)
                    flow.write_completed(p, 1 << 20)
                    flow.looked_up(p / 1000, p / 2 if p < 0.2 else None, p)
                tier.stats.hits += p < 0.15
                tier.used_bytes += 4096 * (p < 0.2)
                tier.fault_counts["corrupt"] += p > 0.25
            if tiering and op == 4 and p >= 0.3:  # one of the tier's counters moves alone
                name = ("queries", "read_bytes", "read_seconds", "write_bytes", "write_seconds",
                        "evictions")[int(p * 100) % 6]  # fmt: skip
                setattr(tier.stats, name, getattr(tier.stats, name) + 1)
            sink = RecordingSink()
            if direct:
                gauges = em.quiet_gauges()
                if gauges is None:
                    em.write_changed(sink)
                else:
                    for name, value in gauges:
                        sink.set_gauge(name, value)
            else:  # the reference: every row computed, every step
                em._signed = None
                metrics_emitter.write_rows(em.collect(), sink)
            out.append(sink.held)
        return out

    direct, rows = steps(True), steps(False)
    counters = {n for held in rows for kind, n, _ in held if kind == "counter"}
    assert metrics.HOST_QUERIES in counters and metrics.STORES_SKIPPED in counters
    if tiering:
        assert {
            metrics.PROMOTION_ALLOCATION_FAILURES,
            metrics.STORES_DROPPED,
            metrics.BLOCKS_DROPPED,
            metrics.TIER_FAULTS,
        } <= counters
        samples = {n for held in rows for kind, n, _ in held if kind == "histogram"}
        assert {metrics.LOOKUP_SYNC_DELAY, metrics.LOOKUP_ASYNC_DELAY} <= samples
        gauges = {n for held in rows for kind, n, _ in held if kind == "gauge"}
        assert metrics.STORE_LATENCY_EMA in gauges
        for held in rows:  # the host tier's chunk counters are its own counters again
            for chunk, own in (
                (metrics.CHUNK_QUERIES, metrics.HOST_QUERIES),
                (metrics.CHUNK_HITS, metrics.HOST_HITS),
            ):
                assert held.get(("counter", chunk, ("CPU",))) == held.get(("counter", own, ()))
    for step, (a, b) in enumerate(zip(direct, rows)):
        assert a == b, f"step {step} ({ops[step][0]}): {a} != {b}"


def _totals(steps: list[dict[tuple[str, str, tuple[str, ...]], Any]]) -> dict[Any, Any]:
    """Counters summed and histogram samples gathered over ``steps`` (sorted)."""
    out: dict[Any, Any] = {}
    for held in steps:
        for (kind, name, labels), value in held.items():
            if kind == "counter":
                out[(name, labels)] = out.get((name, labels), 0) + value
            elif kind == "histogram":
                out.setdefault((name, labels), []).extend(value)
    return {k: sorted(v) if isinstance(v, list) else v for k, v in out.items() if v}


@pytest.mark.parametrize("tiering", [False, True])
def test_lookups_alone_wait_for_later_stats_and_nothing_is_lost(tiering: bool) -> None:
    """``quiet_gauges(defer=True)`` (the vLLM manager's get_stats) leaves a change in
    lookups alone for a later step: every step's gauges are those of every row
    computed every step, and the counters and samples of the whole run are the same."""
    keys = [bytes([i]) for i in range(10)]
    rng = random.Random(5)
    # Mostly lookups (a waiting request asked about every step), some stores and loads.
    ops = [
        (-1 if rng.random() < 0.7 else rng.randrange(5), rng.sample(keys, rng.randint(1, 3)),
         rng.random())
        for _ in range(400)
    ]  # fmt: skip

    def run(defer: bool) -> tuple[list[dict[Any, Any]], int]:
        ticks = itertools.count()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(time, "perf_counter", lambda: next(ticks) * 1e-6)
            tier = CountingTier()
            mgr = TierManager(HostBlockPool(6), [tier] if tiering else [])
            em = metrics_emitter.MetricsEmitter(mgr, tiering=tiering)
            out, deferred = [], 0
            for i, (op, some, p) in enumerate(ops):
                if op < 0:
                    for key in some:
                        mgr.lookup(key, f"waiting-{i % 3}")
                    tier.stats.queries += 1  # (a tier's lookups count too)
                    tier.stats.hits += p < 0.5
                else:
                    random_step(mgr, op, some, p, other_size=8)
                    if p < 0.3:  # a tier's write finished: a gauge and counters move
                        tier.used_bytes += 4096
                        tier.stats.write_bytes += 4096
                mgr.end_step()
                if i == len(ops) - 1:
                    em.emit_next()  # (the last request finished)
                sink = RecordingSink()
                gauges = em.quiet_gauges(defer=defer)
                if gauges is None:
                    em.write_changed(sink)
                else:
                    deferred += em._signature() != em._signed or em._samples_waiting()
                    for name, value in gauges:
                        sink.set_gauge(name, value)
                out.append(sink.held)
            return out, deferred

    later, deferred = run(True)
    now, none = run(False)
    assert deferred > 50 and none == 0
    assert _totals(later) == _totals(now)
    for step, (a, b) in enumerate(zip(later, now)):
        gauges_a = {k: v for k, v in a.items() if k[0] == "gauge"}
        gauges_b = {k: v for k, v in b.items() if k[0] == "gauge"}
        assert gauges_a == gauges_b, f"step {step}"
    # No change waits more than MAX_DEFERRED_STEPS steps.
    quiet = 0
    for held in later:
        quiet = 0 if any(k[0] != "gauge" for k in held) else quiet + 1
        assert quiet <= metrics_emitter.MAX_DEFERRED_STEPS + 8


def test_a_store_or_a_finished_request_writes_what_lookups_left() -> None:
    mgr = TierManager(HostBlockPool(4), [])
    em = metrics_emitter.MetricsEmitter(mgr, tiering=False)
    assert em.quiet_gauges(defer=True) is None  # (the first call writes everything)
    em.write_changed(RecordingSink())
    mgr.lookup(b"a", "r")
    assert em.quiet_gauges(defer=True) is not None, "a lookup alone waits"
    em.emit_next()
    assert em.quiet_gauges(defer=True) is None
    sink = RecordingSink()
    em.write_changed(sink)
    assert sink.held[("counter", metrics.HOST_QUERIES, ())] == 1
    mgr.lookup(b"a", "r")
    assert em.quiet_gauges(defer=True) is not None
    mgr.prepare_store([b"a"])  # a store starts: the write gauge moves
    assert em.quiet_gauges(defer=True) is None
    sink = RecordingSink()
    em.write_changed(sink)
    assert sink.held[("counter", metrics.HOST_QUERIES, ())] == 1


def test_stores_skipped_is_emitted_only_with_a_filter_and_survives_a_reset() -> None:
    assert metrics.STORES_SKIPPED not in {
        n
        for _, n, _, _ in metrics_emitter.MetricsEmitter(
            TierManager(HostBlockPool(2)), tiering=False
        ).collect()
    }, "stores_skipped emitted without store_threshold"
    mgr = TierManager(HostBlockPool(2), store_threshold=2)
    em = metrics_emitter.MetricsEmitter(mgr, tiering=False)
    mgr.prepare_store([b"a", b"b"])
    first = {n: v for k, n, v, _ in em.collect() if k == "counter"}
    mgr.reset(HostBlockPool(2))
    mgr.prepare_store([b"c"])
    second = {n: v for k, n, v, _ in em.collect() if k == "counter"}
    assert first[metrics.STORES_SKIPPED] == 2 and second[metrics.STORES_SKIPPED] == 1


def test_usage_gauges_follow_the_excerpts_meanings() -> None:
    mgr = TierManager(HostBlockPool(4))
    mgr.prepare_store([b"a", b"b"])  # 2 of 4 blocks pinned by stores in flight
    mgr.complete_store([b"b"])
    mgr.prepare_load([b"b"])  # 1 of 4 pinned by a load
    g = {
        n: v
        for k, n, v, _ in metrics_emitter.MetricsEmitter(mgr, tiering=False).collect()
        if k == "gauge"
    }
    assert g[metrics.CPU_CACHE_WRITE_USAGE_PERC] == 0.25
    assert g[metrics.CPU_CACHE_READ_USAGE_PERC] == 0.25
    assert g[metrics.CPU_CACHE_USAGE_PERC] == 0.5


def test_payload_constant_is_aligned() -> None:
    assert PAYLOAD % 4096 == 0


def test_a_key_a_tier_cannot_answer_yet_is_pending_not_a_miss(make_tier) -> None:
    region = Region(4)
    tier = make_tier(region)
    answers: list[bool | None] = [None]
    real = tier.contains

    def asking(digest: bytes) -> bool | None:
        # A store tier answers an unknown key after a background check.
        return answers.pop(0) if answers else real(digest)

    tier.contains = asking  # type: ignore[method-assign]
    mgr = TierManager(HostBlockPool(4), [tier])
    assert mgr.lookup(b"k") is Lookup.HIT_PENDING, "an unanswered key was a miss"
    assert mgr.lookup(b"k") is Lookup.MISS


def spy_on_jobs(tier) -> list[tuple[str, str, int]]:
    """(op, request, items) of each job submitted to ``tier`` from now on."""
    seen: list[tuple[str, str, int]] = []
    submit = tier.submit

    def spy(job):
        seen.append((job.op, job.request, len(job.items)))
        return submit(job)

    tier.submit = spy
    return seen


def test_a_device_store_goes_to_each_tier_as_one_job_at_the_end_of_the_step(make_tier) -> None:
    region = Region(4)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(4), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"b", b"c"])
    # Held for the write at once (no eviction can take them), submitted later.
    assert mgr.write_pinned_blocks == 3
    assert tier.in_flight == 0 and mgr.counters.jobs_submitted == 0
    assert mgr.has_pending_work(), "queued writes keep the engine stepping"
    submitted = spy_on_jobs(tier)
    mgr.end_step()
    assert submitted == [("write", "store-1", 3)]
    assert mgr.counters.jobs_submitted == 1 and mgr.counters.writes_submitted == 3
    results = []
    results_of = tier.results

    def keep():
        out = results_of()
        results.extend(out)
        return out

    tier.results = keep
    settle(mgr)
    assert sorted(r.key for r in results if r.op == "write") == [b"a", b"b", b"c"]
    assert {r.job for r in results if r.op == "write"} == {1}, "results carry their job's id"
    assert mgr.jobs_in_flight == 0 and mgr.write_pinned_blocks == 0


def test_one_requests_promotions_are_one_read_job_when_its_pass_ends(make_tier) -> None:
    region = Region(6)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(6), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"b", b"c"])
    settle(mgr)
    store(mgr, region, [b"u", b"v", b"w", b"x", b"y", b"z"])  # a, b, c: in the fs tier only
    settle(mgr)
    ops = spy_on_jobs(tier)
    assert [mgr.lookup(k, "r1") for k in (b"a", b"b")] == [Lookup.HIT_PENDING] * 2
    assert ops == [] and mgr.promoting_blocks == 2, "reserved now, read when the pass ends"
    assert mgr.lookup(b"c", "r2") is Lookup.HIT_PENDING  # r1's pass ended: its job goes
    assert ops == [("read", "r1", 2)]
    mgr.end_step()
    assert ops == [("read", "r1", 2), ("read", "r2", 1)]
    settle(mgr)
    assert [mgr.lookup(k, "r3") for k in (b"a", b"b", b"c")] == [Lookup.HIT] * 3
    assert mgr.counters.promotions == 3
    assert mgr.counters.jobs_submitted == 4, "two device stores' writes and two reads"


def fs_only(make_tier, host_blocks: int, keys: list[bytes]) -> TierManager:
    """A manager whose host tier holds ``host_blocks`` blocks, ``keys`` in its fs tier
    only (written through, then evicted by as many other keys)."""
    region = Region(host_blocks)
    mgr = TierManager(HostBlockPool(host_blocks), [make_tier(region)], max_write_backlog=64)
    for start in range(0, len(keys), host_blocks):
        store(mgr, region, keys[start : start + host_blocks])
        settle(mgr)
    store(mgr, region, [b"filler%d" % i for i in range(host_blocks)])
    settle(mgr)
    assert not any(mgr.pool.contains(k) for k in keys)
    return mgr


def test_a_request_alone_in_the_promotion_room_takes_more_instead_of_waiting(
    make_tier,
) -> None:
    """A prefix needing more than ``max_promoting`` promotions: the request is the only
    holder of the room, so it goes on promoting as the host tier allows and loads its
    whole hit a step later. Waiting for room instead, it waited on its own pins until
    they ended (FRESH_STEPS), step after step."""
    prefix = [b"a", b"b", b"c", b"d"]
    mgr = fs_only(make_tier, 4, prefix)
    assert mgr.max_promoting == 2
    assert mgr.lookup_prefix(prefix, "r") == (4, [False] * 4)
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(prefix, "r") == (4, None)
    assert mgr.counters.promotions_deferred == 0
    mgr.prepare_load(prefix)
    mgr.complete_load(prefix)
    assert mgr.pool.held(Hold.PROMOTION) == 0, "loaded: the promotions' pins ended"
    mgr.pool.check_invariants()


def test_requests_holding_parts_of_the_promotion_room_take_turns(make_tier) -> None:
    """p and q each hold half of the room and need more. p took room first: it goes
    on and loads its whole prefix; q waits for it, then loads its own. Neither waits
    on the other's pins, which would last until they end (FRESH_STEPS) and again."""
    p = [b"p0", b"p1", b"p2", b"p3"]
    q = [b"q0", b"q1", b"q2", b"q3"]
    mgr = fs_only(make_tier, 8, p + q)
    assert mgr.max_promoting == 4
    assert mgr.lookup_prefix(p[:2], "p") == (2, [False, False])
    assert mgr.lookup_prefix(q[:2], "q") == (2, [False, False])
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(p, "p") == (4, [True, True, False, False]), "p goes on"
    assert mgr.lookup_prefix(q, "q") == (4, [True, True, False, False]), "q waits"
    deferred = mgr.counters.promotions_deferred
    assert deferred == 2, "q's two keys wait for room, p's do not"
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(p, "p") == (4, None)
    mgr.prepare_load(p)
    mgr.complete_load(p)  # p is running: its pins end, and q holds the room alone
    assert mgr.lookup_prefix(q, "q") == (4, [True, True, False, False])
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(q, "q") == (4, None)
    assert mgr.counters.promotions_deferred == deferred, "q waited one step"
    mgr.prepare_load(q)
    mgr.complete_load(q)
    assert mgr.pool.held(Hold.PROMOTION) == 0
    mgr.pool.check_invariants()


def test_the_room_of_a_request_that_never_loads_goes_to_the_next_one(make_tier) -> None:
    """p took room first and went away without loading (aborted, say): its pins end
    after FRESH_STEPS, and q, which waited behind it, goes on."""
    p = [b"p0", b"p1", b"p2"]
    q = [b"q0", b"q1", b"q2"]
    mgr = fs_only(make_tier, 8, p + q)
    assert mgr.lookup_prefix(p, "p") == (3, [False] * 3)
    assert mgr.lookup_prefix(q, "q") == (3, [False] * 3), "q takes the last room"
    assert mgr.counters.promotions_deferred == 2
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(q, "q") == (3, [True, False, False]), "q waits behind p"
    assert mgr.counters.promotions_deferred == 4
    for _ in range(FRESH_STEPS):
        mgr.end_step()
    assert mgr.pool.held(Hold.PROMOTION) == 0, "every pin ended: nobody loaded"
    assert mgr.lookup_prefix(q, "q") == (3, [True, False, False])
    assert mgr.counters.promotions_deferred == 4, "p's room is q's now"
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_prefix(q, "q") == (3, None)
    mgr.pool.check_invariants()


def test_a_request_waits_for_room_other_requests_promotions_take(make_tier) -> None:
    mgr = fs_only(make_tier, 4, [b"a", b"b", b"c"])
    assert mgr.lookup_prefix([b"a", b"b"], "s") == (2, [False, False])
    assert mgr.lookup_prefix([b"c"], "t") == (1, [False]), "s's promotions end in ms"
    assert mgr.counters.promotions_deferred == 1
    settle(mgr)
    mgr.end_step()
    mgr.prepare_load([b"a", b"b"])
    mgr.complete_load([b"a", b"b"])
    assert mgr.lookup_prefix([b"c"], "t") == (1, [False]), "now promoted"
    assert mgr.counters.promotions_deferred == 1


def test_a_read_the_tier_refuses_is_a_miss_not_a_wait(make_tier) -> None:
    mgr, tier = a_in_the_fs_tier_only(make_tier)
    views = tier._region_views
    tier._views, tier._region_views = None, lambda: None  # its region unmapped
    assert mgr.lookup(b"a", "r") is Lookup.HIT_PENDING
    mgr.end_step()
    assert mgr.promoting_blocks == 0 and not mgr.pool.is_storing(b"a"), "block given back"
    for _ in range(FRESH_STEPS - 1):
        assert mgr.lookup(b"a", "r") is Lookup.MISS, "a refused read must not wait forever"
        mgr.end_step()
    tier._region_views = views  # the tier reads again
    mgr.end_step()
    assert mgr.lookup(b"a", "r") is Lookup.HIT_PENDING, "tried again after FRESH_STEPS"


def _prefix_by_lookups(mgr: TierManager, keys: list[bytes], req: str) -> tuple[int, list[bool]]:
    flags = []
    for key in keys:
        answer = mgr.lookup(key, req)
        if answer is Lookup.MISS:
            break
        flags.append(answer is Lookup.HIT)
    return len(flags), flags


def _state(mgr: TierManager, keys: list[bytes]) -> tuple[object, ...]:
    pool = mgr.pool
    return (
        [(pool.contains(k), pool.is_storing(k)) for k in keys],
        [pool.held(h) for h in Hold],
        vars(mgr.counters).copy(),
        sorted(mgr._promoting),
    )


def test_a_prefix_looked_up_in_one_call_is_what_key_by_key_lookups_find() -> None:
    """lookup_prefix (vLLM's prefix lookup in one call) answers, holds and counts what
    lookup() key by key up to the first miss does, on twin host tiers."""
    rng = random.Random(5)
    universe = [bytes([i]) for i in range(24)]
    twins = [TierManager(HostBlockPool(8)), TierManager(HostBlockPool(8))]
    stored: list[bytes] = []
    fast = 0
    for step in range(600):
        if rng.random() < 0.4:
            keys = rng.sample(universe, rng.randint(1, 4))
            complete = rng.random() < 0.9
            for mgr in twins:
                if mgr.prepare_store(keys) is not None:
                    pending = [k for k in keys if mgr.pool.is_storing(k)]
                    if complete:
                        mgr.complete_store(pending)
            stored = keys + stored[:4]
        else:
            # Mostly what was stored lately (cached prefixes), then anything.
            keys = stored[: rng.randint(0, len(stored))]
            keys += [k for k in rng.sample(universe, rng.randint(0, 4)) if k not in keys]
            a, b = twins
            found, ready = a.lookup_prefix(keys, f"r{step}")
            want_found, flags = _prefix_by_lookups(b, keys, f"r{step}")
            assert found == want_found
            assert ready == (None if all(flags) else flags)
            fast += ready is None and found > 1
        for mgr in twins:
            mgr.end_step()
        assert _state(twins[0], universe) == _state(twins[1], universe), step
    assert fast > 50, "the workload must find cached prefixes"
    for mgr in twins:
        mgr.pool.check_invariants()


def _fs_twin(make_tier, tmp_path, name: str, host_blocks: int, keys: list[bytes]) -> Any:
    """A manager of ``host_blocks`` host blocks with ``keys`` in its own fs tier only,
    and its region."""
    region = Region(2 * host_blocks)
    tier = make_tier(region, root=tmp_path / name)
    mgr = TierManager(HostBlockPool(host_blocks), [tier], max_write_backlog=64)
    for start in range(0, len(keys), host_blocks):
        store(mgr, region, keys[start : start + host_blocks])
        settle(mgr)
    store(mgr, region, [b"filler%d" % i for i in range(host_blocks)])
    settle(mgr)
    mgr.end_step()
    return mgr, region


def _count_calls(obj: Any, name: str) -> list[int]:
    calls = [0]
    method = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return method(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


@pytest.mark.parametrize("on_host", [None, 4])
def test_a_prefix_promoted_from_the_fs_tier_reserves_its_run_at_once(
    make_tier, tmp_path, on_host: int | None
) -> None:
    """lookup_prefix's first promotion reserves host blocks for the next keys the same
    tier will promote, in one call, up to the first key the host tier holds: answers,
    holds, counters and promotions are those of key-by-key lookups, and the promoted
    blocks read back the bytes written."""
    keys = [b"p%d" % i for i in range(8)]  # (the promotions' room: 8 blocks)
    twins = [_fs_twin(make_tier, tmp_path, name, 16, keys) for name in ("a", "b")]
    (a, region), (b, _) = twins
    if on_host is not None:  # a key of the prefix back on the host tier: the run stops
        for mgr, _r in twins:
            assert mgr.lookup(keys[on_host], "warm") is Lookup.HIT_PENDING
            settle(mgr)
            mgr.end_step()
            mgr.end_step()
    reservations = _count_calls(a.pool, "prepare_store")
    one_by_one = _count_calls(b.pool, "prepare_store")
    found, ready = a.lookup_prefix(keys, "r")
    want = _prefix_by_lookups(b, keys, "r")
    assert (found, ready) == (want[0], want[1]) and found == len(keys)
    assert _state(a, keys) == _state(b, keys)
    ta, tb = a.secondary_tiers[0], b.secondary_tiers[0]
    assert (ta.stats.queries, ta.stats.hits) == (tb.stats.queries, tb.stats.hits)
    assert a.flows[0].lookups == b.flows[0].lookups  # (and the warm-up's)
    promoted = len(keys) - (on_host is not None)
    assert one_by_one[0] == promoted
    # The first key, then its run; where the host tier holds p4, p5 and the run after it.
    assert reservations[0] == (2 if on_host is None else 4), "the first key, then its run"
    assert not a._reserved
    for mgr, _r in twins:
        mgr.end_step()
        settle(mgr)
        assert mgr.lookup_prefix(keys, "r") == (len(keys), None)
        mgr.pool.check_invariants()
    for key in keys:
        expected = int.from_bytes(key_digest(key)[:4], "little").to_bytes(4, "little")
        assert region.block(0, a.pool.block_of(key))[:4] == expected, key


def test_reserved_runs_behind_two_fs_tiers_find_what_key_by_key_lookups_find(
    make_tier, tmp_path
) -> None:
    """Two fs tiers, keys placed on the host tier, in either fs tier, both or none, and
    requests allowed to load from both or one: every prefix lookup (reserving the runs
    one tier promotes) answers, counts and promotes what lookups key by key do."""
    rng = random.Random(11)
    universe = [b"u%02d" % i for i in range(12)]
    runs = 0  # reservations of two keys or more
    for round_ in range(30):
        twins = []
        placement = {k: rng.choice(["host", "a", "b", "ab", "ab", "ab", "none"]) for k in universe}
        allowed: bool | list[bool] = rng.choice([True, True, [True, False], [False, True]])
        for name in ("x", "y"):
            root = tmp_path / f"{round_}{name}"
            tiers = [make_tier(Region(32), root=root / t) for t in ("a", "b")]
            mgr = TierManager(HostBlockPool(32), tiers, max_write_backlog=64)
            store(mgr, None, list(universe))
            settle(mgr)
            for key in universe:
                for i, t in enumerate("ab"):
                    if t not in placement[key]:
                        tiers[i]._forget(key_digest(key), key, unlink=False)
            gone = [k for k in universe if placement[k] != "host"]
            mgr.pool.evict(len(gone), keep=[k for k in universe if k not in gone])
            mgr.end_step()
            twins.append(mgr)
        x, y = twins
        keys = rng.sample(universe, rng.randint(4, len(universe)))
        prepare_store = x.pool.prepare_store

        def counted(keys: Any, *args: Any, _f: Any = prepare_store) -> Any:
            nonlocal runs
            runs += len(keys) > 1
            return _f(keys, *args)

        x.pool.prepare_store = counted  # type: ignore[method-assign]
        found, ready = x.lookup_prefix(keys, "r", secondary=allowed)
        flags: list[bool] = []
        for key in keys:
            answer = y.lookup(key, "r", secondary=allowed)
            if answer is Lookup.MISS:
                break
            flags.append(answer is Lookup.HIT)
        assert (found, ready) == (len(flags), None if all(flags) else flags), round_
        assert _state(x, universe) == _state(y, universe), round_
        for tx, ty, fx, fy in zip(x.secondary_tiers, y.secondary_tiers, x.flows, y.flows):
            assert (tx.stats.queries, tx.stats.hits) == (ty.stats.queries, ty.stats.hits)
            assert fx.lookups == fy.lookups

        def queued(mgr: TierManager) -> dict[object, list[bytes]]:
            return {job: [item[0] for item in items] for job, items in mgr._queued.items()}

        assert queued(x) == queued(y), round_
        assert not x._reserved
        for mgr in twins:
            mgr.end_step()
            settle(mgr)
            mgr.pool.check_invariants()
    assert runs >= 6, "the rounds must reserve runs"


def test_reserved_blocks_a_prefix_lookup_does_not_use_are_given_back(make_tier, tmp_path) -> None:
    """A key of the reserved run that its own lookup misses after all ends the prefix,
    and the blocks reserved for it and the keys after it are freed."""
    keys = [b"q%d" % i for i in range(6)]
    mgr, _region = _fs_twin(make_tier, tmp_path, "a", 16, keys)
    tier = mgr.secondary_tiers[0]
    gone = key_digest(keys[3])
    contains = tier.contains
    tier.contains = lambda digest: digest != gone and contains(digest)  # type: ignore[method-assign]
    free = mgr.pool.num_free + mgr.pool.num_evictable
    assert mgr.lookup_prefix(keys, "r") == (3, [False] * 3)
    assert [mgr.pool.is_storing(k) for k in keys] == [True] * 3 + [False] * 3
    assert not mgr._reserved and sorted(mgr._promoting) == sorted(keys[:3])
    assert mgr.pool.num_free + mgr.pool.num_evictable == free - 3
    mgr.end_step()
    settle(mgr)
    mgr.pool.check_invariants()


def test_results_of_one_poll_are_applied_as_one_at_a_time(make_tier, tmp_path) -> None:
    """Promotions that land in one poll are applied together: the host tier ends as
    if each result were applied alone, in order (readable, touched, held, the failed
    one freed, the write's hold ended), and its policy evicts them in the same order."""
    keys = [b"k%d" % i for i in range(5)]
    twins = []
    for name in ("a", "b"):
        mgr = TierManager(HostBlockPool(12), [make_tier(Region(12), root=tmp_path / name)])
        store(mgr, None, [b"old0", b"old1", b"w"])
        mgr.pool.hold([b"w"], Hold.TIER_WRITE)
        for key in keys:
            assert mgr._promote(0, key, key_digest(key), "r")
        twins.append(mgr)
    (a, b) = twins
    blocks = {key: block for key, _digest, block in a._queued[(0, "read", "r")]}
    results = [TierResult("read", k, blocks[k], ok=True) for k in keys]
    results[2] = TierResult("read", keys[2], blocks[keys[2]], ok=False, fault=TierFault.CORRUPT)
    results.insert(3, TierResult("write", b"w", a.pool.block_of(b"w") or 0, ok=True, nbytes=8))
    for mgr, batches in ((a, [results]), (b, [[res] for res in results])):
        for batch in batches:
            written: dict[bytes, int] = {}
            mgr._apply(batch, written, mgr.flows[0])
            mgr.pool.release([k for k, n in written.items() for _ in range(n)], Hold.TIER_WRITE)
    assert _state(a, [*keys, b"w"]) == _state(b, [*keys, b"w"])
    assert list(a._fresh) == list(b._fresh) == [k for k in keys if k != keys[2]]
    for mgr in twins:
        mgr.pool.check_invariants()
        mgr.pool.release(list(mgr._fresh), Hold.PROMOTION)
    assert a.pool.evict(a.pool.num_evictable) == b.pool.evict(b.pool.num_evictable)


def test_a_prefix_looked_up_in_one_call_holds_its_hits_from_its_first_promotion(
    make_tier,
) -> None:
    """The scenario of the test above it, as one lookup_prefix call: hits before and
    after the pass's first promotion are held, and the pass's second promotion finds
    no room (a miss that ends the prefix)."""
    region = Region(4)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(4, eviction_policy="lru"), [tier], max_write_backlog=64)
    store(mgr, region, [b"a", b"d", b"c", b"w"])
    settle(mgr)
    store(mgr, region, [b"y", b"z"])
    settle(mgr)
    mgr.touch([b"z", b"y", b"w", b"c"])
    mgr.end_step()
    assert mgr.lookup_prefix([b"y", b"w", b"a", b"z", b"d", b"c"], "r") == (
        4,
        [True, True, False, True],
    )
    assert not mgr.pool.contains(b"c")
    assert mgr.counters.promotion_allocation_failures == 1
    assert mgr.counters.host_queries == 5 and mgr.counters.host_hits == 3
    assert mgr.pool.held(Hold.LOOKUP_PASS) == 3
    mgr.end_step()
    assert mgr.pool.held(Hold.LOOKUP_PASS) == 0
    mgr.pool.check_invariants()


def tier_rows(mgr: TierManager) -> RecordingSink:
    sink = RecordingSink()
    metrics_emitter.write_rows(metrics_emitter.MetricsEmitter(mgr, tiering=True).collect(), sink)
    return sink


def test_a_store_larger_than_the_host_tier_stores_its_head(make_tier) -> None:
    """A store of more new blocks than the host tier has could never be given room:
    with a secondary tier its leading blocks that fit now are stored (and written
    through), the rest is not; a store that fits once writes land is refused (vLLM
    asks again), and without a secondary tier any store that finds no room is refused,
    as vLLM's manager does."""
    region = Region(4)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(4), [tier], max_write_backlog=64)
    keys = [b"k%d" % i for i in range(6)]
    plan = mgr.prepare_store(keys)
    assert plan is not None
    assert plan[0] == keys[:4], "the head of the store, in order"
    mgr.complete_store(plan[0])
    settle(mgr)
    assert all(tier.has(key_digest(k)) for k in keys[:4])
    assert not any(mgr.pool.contains(k) or mgr.pool.is_storing(k) for k in keys[4:])
    # Two blocks pinned by loads: a store of three fits in the tier but not now.
    mgr.prepare_load(keys[:2])
    assert mgr.prepare_store([b"x", b"y", b"z"]) is None
    # Five never fit: the two the pins leave free are taken, head first.
    plan = mgr.prepare_store([b"p%d" % i for i in range(5)])
    assert plan is not None and plan[0] == [b"p0", b"p1"]
    mgr.pool.check_invariants()
    host_only = TierManager(HostBlockPool(4))
    assert host_only.prepare_store(keys) is None, "host tier alone: vLLM's answer"


def test_back_pressure_counts_stores_and_blocks_dropped_per_tier(make_tier) -> None:
    """vLLM's meanings: a store is one device store's write-through to a tier, dropped
    when a block of it was not written; the blocks are counted beside it."""
    region = Region(8)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(8), [tier], max_write_backlog=1)
    store(mgr, region, [b"a", b"b", b"c"])  # one store: 1 block written, 2 dropped
    store(mgr, region, [b"d"])  # the backlog is full until the write ends: dropped
    settle(mgr)
    store(mgr, region, [b"e"])  # room again: written
    settle(mgr)
    held = tier_rows(mgr).held
    lab = (tier.name,)
    assert held[("counter", metrics.STORES_DROPPED, lab)] == 2
    assert held[("counter", metrics.BLOCKS_DROPPED, lab)] == 3
    assert mgr.counters.writes_dropped == 3


def test_store_latency_ema_follows_completed_writes(make_tier) -> None:
    region = Region(16)
    tier = make_tier(region)
    mgr = TierManager(HostBlockPool(16), [tier], max_write_backlog=64)
    em = metrics_emitter.MetricsEmitter(mgr, tiering=True)
    lab = (tier.name,)
    for i in range(9):
        store(mgr, region, [bytes([i])])
    settle(mgr)
    sink = RecordingSink()
    metrics_emitter.write_rows(em.collect(), sink)
    assert sink.held[("gauge", metrics.STORE_LATENCY_EMA, lab)] == 0.0, "warm-up: 0"
    store(mgr, region, [b"\x09"])
    settle(mgr)
    sink = RecordingSink()
    metrics_emitter.write_rows(em.collect(), sink)
    ema = sink.held[("gauge", metrics.STORE_LATENCY_EMA, lab)]
    # The mean of the ten writes' seconds per MiB.
    flow_ema = mgr.flows[0].store_latency_ema
    assert ema == flow_ema and ema > 0.0
    mib = tier.stats.write_bytes / (1 << 20)
    assert ema == pytest.approx(tier.stats.write_seconds / mib, rel=1e-6)


def test_lookup_sync_delay_is_observed_per_resolved_tier_lookup(make_tier) -> None:
    mgr = fs_only(make_tier, 2, [b"a"])
    tier = mgr.secondary_tiers[0]
    assert mgr.lookup(b"a", "r1") is Lookup.HIT_PENDING  # fs hit: a promotion
    assert mgr.lookup(b"z", "r1") is Lookup.MISS  # fs miss
    held = tier_rows(mgr).held
    delays = held[("histogram", metrics.LOOKUP_SYNC_DELAY, (tier.name,))]
    assert len(delays) == 2 and all(0.0 <= d < 1.0 for d in delays)
    assert ("histogram", metrics.LOOKUP_ASYNC_DELAY, (tier.name,)) not in held
    assert not any(k[1] == metrics.LOOKUP_SYNC_DELAY and k[2] == ("CPU",) for k in held)


class AskingTier(CountingTier):
    """Answers "not known yet" to a digest's first ``asks`` lookups, then that it holds
    nothing (a store tier asking its store in the background)."""

    name = "asking"

    def __init__(self, asks: int) -> None:
        super().__init__()
        self.asks = asks
        self.asked: dict[bytes, int] = {}

    def contains(self, digest: bytes) -> bool | None:
        n = self.asked[digest] = self.asked.get(digest, 0) + 1
        return None if n <= self.asks else False


def test_lookup_async_delay_runs_from_the_first_retry_to_the_answer() -> None:
    tier = AskingTier(asks=2)
    mgr = TierManager(HostBlockPool(2), [tier])  # type: ignore[list-item]
    em = metrics_emitter.MetricsEmitter(mgr, tiering=True)
    start = time.perf_counter()
    assert mgr.lookup(b"a", "r1") is Lookup.HIT_PENDING
    time.sleep(0.02)
    assert mgr.lookup(b"a", "r1") is Lookup.HIT_PENDING
    sink = RecordingSink()
    metrics_emitter.write_rows(em.collect(), sink)
    assert ("histogram", metrics.LOOKUP_SYNC_DELAY, ("asking",)) not in sink.held, (
        "no answer yet: nothing observed"
    )
    time.sleep(0.02)
    assert mgr.lookup(b"a", "r1") is Lookup.MISS
    waited = time.perf_counter() - start
    sink = RecordingSink()
    metrics_emitter.write_rows(em.collect(), sink)
    (delay,) = sink.held[("histogram", metrics.LOOKUP_ASYNC_DELAY, ("asking",))]
    assert 0.04 <= delay <= waited
    assert len(sink.held[("histogram", metrics.LOOKUP_SYNC_DELAY, ("asking",))]) == 1
    # Taken once: the next collect holds none.
    sink = RecordingSink()
    metrics_emitter.write_rows(em.collect(), sink)
    assert not any(k[0] == "histogram" for k in sink.held)


def test_lookups_asked_again_answer_and_count_as_the_version_says(make_tier) -> None:
    """``lookup_version`` is equal exactly while lookups answer the same, and
    ``recount_lookups`` with the counts one lookup moved counts what asking again
    counts (kvtier-vllm-port's lookup memo answers a waiting request so)."""
    mgr = fs_only(make_tier, 4, [b"f0", b"f1"])
    prefix = [b"filler0", b"filler1", b"nowhere"]  # two host hits, then a miss

    def ask() -> tuple[tuple[int, list[bool] | None], tuple[int, ...]]:
        before = mgr.lookup_counts()
        answer = mgr.lookup_prefix(prefix, "waiting")
        return answer, tuple(a - b for a, b in zip(mgr.lookup_counts(), before))

    version = mgr.lookup_version()
    assert version is not None
    first, moves = ask()
    assert first == (2, None) and moves == (3, 2, 1, 0, 1), "3 host asks, 1 fs ask"
    assert mgr.lookup_version() == version, "a lookup that promotes nothing changes nothing"
    mgr.end_step()
    again, moved_again = ask()
    assert (again, moved_again) == (first, moves)
    delays = len(mgr.flows[0].sync_delays)
    before = mgr.lookup_counts()
    mgr.recount_lookups(moves)
    assert tuple(a - b for a, b in zip(mgr.lookup_counts(), before)) == moves
    assert len(mgr.flows[0].sync_delays) == delays + 1, "timed as asked"

    # What may change an answer changes the version.
    assert mgr.lookup_prefix([b"f0"], "other") == (1, [False])  # promoted: host blocks move
    assert mgr.lookup_version() != version
    version = mgr.lookup_version()
    mgr.end_step()
    settle(mgr)
    assert mgr.lookup_version() != version, "the promotion landed"
    version = mgr.lookup_version()
    tier = mgr.secondary_tiers[0]
    tier._index.add(key_digest(b"theirs"), None)  # a file another engine wrote, found
    assert mgr.lookup_version() != version
    version = mgr.lookup_version()
    tier._index.remove(key_digest(b"theirs"))
    assert mgr.lookup_version() != version
    mgr._refused[b"x"] = mgr._step  # a key refused for a while: asked every time
    assert mgr.lookup_version() is None


def test_a_prefix_lookup_answers_as_key_by_key_lookups() -> None:
    """As ``test_a_prefix_looked_up_in_one_call_is_what_key_by_key_lookups_find``,
    where a request's pass goes on over several calls (no step ends between them),
    through failed stores and loads: the same answers, holds, counters and pass (runs
    of cached keys are taken at once)."""
    rng = random.Random(5)
    ours, theirs = TierManager(HostBlockPool(24)), TierManager(HostBlockPool(24))
    keys = [bytes([i]) * 4 for i in range(40)]
    storing: list[list[bytes]] = []
    prefixes = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            start = rng.randrange(len(keys))
            wanted = keys[start : start + rng.randint(1, 6)]
            plans = [m.prepare_store(wanted) for m in (ours, theirs)]
            assert plans[0] == plans[1]
            if plans[0] is not None and plans[0][0]:
                storing.append(plans[0][0])
        elif op < 0.45 and storing:
            done = storing.pop(rng.randrange(len(storing)))
            success = rng.random() < 0.85
            for m in (ours, theirs):
                m.complete_store(done, success)
        elif op < 0.55:
            for m in (ours, theirs):
                m.end_step()
        else:
            start = rng.randrange(8) * 5
            prefix = keys[start : start + rng.randint(0, 10)]
            req = f"r{rng.randrange(4)}"
            found, ready = ours.lookup_prefix(prefix, req)
            want_found, flags = _prefix_by_lookups(theirs, prefix, req)
            assert found == want_found
            assert ready == (None if all(flags) else flags)
            prefixes += found > 1 and ready is None
            if found and rng.random() < 0.3 and ready is None:
                for m in (ours, theirs):
                    if m.prepare_load(prefix[:found]):
                        m.complete_load(prefix[:found])
        assert _state(ours, keys) == _state(theirs, keys)
        assert ours._pass_req == theirs._pass_req and ours._pass_keys == theirs._pass_keys
        assert ours.pool.num_free == theirs.pool.num_free
    assert prefixes > 20, "runs of cached keys must have been looked up"


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_digest_memo_names_keys_within_its_size_dropping_little_at_a_time(size: int) -> None:
    """Every key gets its digest, the memo holds at most ``size`` names, and no call
    drops more than two of them (a full memo freed at once held the scheduler's thread
    for 35 ms at a million names)."""
    rng = random.Random(size)
    memo = DigestMemo(size)
    keys = [bytes([i % 256, i // 256]) for i in range(5 * size + 9)]
    held = 0
    for _ in range(40 * size + 200):
        key = rng.choice(keys[: rng.choice((3, len(keys)))])  # some come back soon
        assert memo.get(key) == key_digest(key)
        assert len(memo) <= max(2, size)
        assert len(memo) >= held - 2, "names dropped all at once"
        held = len(memo)


@pytest.mark.parametrize("size", [1, 2, 7, 64])
def test_digest_memo_names_a_run_of_keys_as_one_at_a_time(size: int) -> None:
    """``get_all`` gives each key's digest and leaves the memo as ``get`` of each in
    turn does (the same names held, in the same generations), over runs that turn
    the generations over and keys that come back."""
    rng = random.Random(size)
    together, each = DigestMemo(size), DigestMemo(size)
    keys = [bytes([i % 256, i // 256]) for i in range(5 * size + 9)]
    for _ in range(20 * size + 100):
        run = [rng.choice(keys[: rng.choice((3, len(keys)))]) for _ in range(rng.randint(0, 9))]
        assert together.get_all(run) == [key_digest(key) for key in run]
        for key in run:
            each.get(key)
        assert (together._new, together._old) == (each._new, each._old)
        assert list(together._new) == list(each._new)
