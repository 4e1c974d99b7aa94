"""A step's write jobs taken by an fs tier together, and the writes that land in one
poll applied together: what taking them one at a time does."""

from __future__ import annotations

import random
from typing import Any

from kvtier.blockpool import Hold, HostBlockPool
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.tiers.base import TierFault
from kvtier.tiering_spec.tiers.fs import format as fs_format
from kvtier.tiering_spec.tiers.fs.format import key_digest

from .test_manager import settle
from .tier_support import PAYLOAD, Region

HOST_BLOCKS = 24
TIER_ENTRIES = 10  # fewer than a step writes: evictions and taken-over files


def _spy(tier: Any) -> list[tuple[int, str, list[bytes], list[bool]]]:
    """(job id, request, keys, started flags) of each write job ``tier`` takes, and
    (job id, op, [key], [ok]) of each result it hands back."""
    seen: list[tuple[int, str, list[bytes], list[bool]]] = []
    submit, submit_all = tier.submit, tier.submit_all

    def one(job: Any) -> list[bool]:
        started = submit(job)
        seen.append((job.id, job.request, [k for k, _d, _b in job.items], list(started)))
        return started

    def together(jobs: Any) -> Any:
        started = submit_all(jobs)
        if started is not None:
            for job, flags in zip(jobs, started):
                seen.append((job.id, job.request, [k for k, _d, _b in job.items], list(flags)))
        return started

    def results() -> Any:
        out = results_of()
        seen.extend((res.job, res.op, [res.key], [res.ok]) for res in out)
        return out

    results_of = tier.results
    tier.submit, tier.submit_all, tier.results = one, together, results
    return seen


def _tier_state(mgr: TierManager, universe: list[bytes]) -> tuple[object, ...]:
    tier = mgr.secondary_tiers[0]
    stats = tier.stats
    return (
        [tier.has(key_digest(k)) for k in universe],
        [mgr.pool.contains(k) for k in universe],
        [mgr.pool.held(h) for h in Hold],
        (stats.writes, stats.evictions, stats.files_reused, stats.writes_dropped),
        tier.used_bytes,
        vars(mgr.counters).copy(),
        (mgr.flows[0].stores_dropped, mgr.flows[0].blocks_dropped),
    )


def test_a_steps_write_jobs_start_together_as_one_by_one(make_tier, tmp_path) -> None:
    """Twin managers over random steps of several device stores each (keys twice in a
    step, keys written before, more than the tier holds, writes the backlog drops):
    one tier takes each step's write jobs together, the other one by one. Each job
    starts the same items, and the tiers write, evict, take over and count alike; the
    bytes read back are the blocks written. One write thread each: the tiers index
    writes in the order they land, which two threads would leave to chance."""
    rng = random.Random(23)
    universe = [b"u%d" % i for i in range(40)]
    entry = fs_format.HEADER_SIZE + PAYLOAD
    twins, spies, regions = [], [], []
    for name in ("together", "one-by-one"):
        region = Region(HOST_BLOCKS)
        tier = make_tier(region, root=tmp_path / name, capacity=TIER_ENTRIES * entry, threads=1)
        mgr = TierManager(HostBlockPool(HOST_BLOCKS), [tier], max_write_backlog=12)
        spies.append(_spy(tier))
        if name == "one-by-one":
            tier.submit_all = lambda jobs: None
        twins.append(mgr)
        regions.append(region)
    together_steps = 0
    jobs_held: list[int] = []
    for step in range(40):
        stores = [rng.sample(universe, rng.randint(1, 5)) for _ in range(rng.randint(1, 4))]
        for mgr, region in zip(twins, regions):
            for keys in stores:
                plan = mgr.prepare_store(keys)
                if plan is None:
                    continue
                for key, block in zip(plan[0], plan[1]):
                    region.fill(0, block, int.from_bytes(key_digest(key)[:4], "little"))
                mgr.complete_store(plan[0])
            mgr.end_step()
            jobs_held.append(mgr.jobs_in_flight)
            settle(mgr)  # (in step: what the tiers index does not hang on write timing)
        assert spies[0] == spies[1], step
        assert jobs_held[-2] == jobs_held[-1], step
        together_steps += len(stores) > 1
        assert _tier_state(twins[0], universe) == _tier_state(twins[1], universe), step
    for mgr in twins:
        settle(mgr)
        mgr.pool.check_invariants()
    assert _tier_state(twins[0], universe) == _tier_state(twins[1], universe)
    assert together_steps >= 10 and twins[0].secondary_tiers[0].stats.evictions > 0
    # What the tier taking jobs together wrote reads back as the blocks stored.
    tier = twins[0].secondary_tiers[0]
    indexed = [k for k in universe if key_digest(k) in tier._index]
    assert indexed
    region = regions[0]
    for key in indexed:
        assert tier.submit_read(key, key_digest(key), 0)
        tier.drain(20)
        [res] = [r for r in tier.poll() if r.op == "read"]
        assert res.ok, res
        seed = int.from_bytes(key_digest(key)[:4], "little")
        assert region.block(0, 0) == (seed.to_bytes(4, "little") * (PAYLOAD // 4))[:PAYLOAD]


def _index_order(tier: Any) -> list[bytes]:
    """The tier's entries in the order its policy evicts them (empties the index)."""
    index = tier._index
    evicted = index.make_room(index.used, index.used + index.reserved, lambda digest: False)
    assert evicted is not None and len(evicted) == len(index) + len(evicted)
    return [digest for digest, _entry in evicted]


def test_writes_that_land_together_are_applied_as_one_at_a_time(make_tier, tmp_path) -> None:
    """Twin fs tiers write the same jobs (one write thread each; some writes take over
    evicted files); one takes every result in one poll, the other one result a poll,
    with a failed write and a write naming no digest among them: the same results in
    the same order, index and eviction order, counters, events and reservations."""
    entry = fs_format.HEADER_SIZE + PAYLOAD
    twins = []
    for name in ("together", "one-at-a-time"):
        region = Region(16)
        tier = make_tier(region, root=tmp_path / name, capacity=12 * entry, threads=1)
        for start in range(0, 24, 4):
            items = [(b"w%d" % i, key_digest(b"w%d" % i), i % 16) for i in range(start, start + 4)]
            assert tier._submit_writes(items) is not None
            if start < 12:  # (the tier fills up; the writes after it take over files)
                assert tier.drain(20)
                tier.poll()
        assert tier.drain(20)
        twins.append(tier)
    pending = [list(tier._results) for tier in twins]
    assert [(r.op, r.key) for r in pending[0]] == [(r.op, r.key) for r in pending[1]]
    assert len(pending[0]) == 12
    for results in pending:
        for i, res in enumerate(results):
            res.seconds = i / 1000  # (measured: made equal for the twins)
        first_write = next(i for i, r in enumerate(results) if r.op == "write")
        failed = results[first_write + 2]
        failed.ok, failed.fault, failed.nbytes = False, TierFault.WRITE_FAILED, 0
        results[first_write + 5].digest = None
    together, alone = twins
    for tier in twins:
        tier.stats.write_seconds = 0.0  # (the writes polled before were measured)
    out_together = together.poll()
    alone._results.clear()
    out_alone = []
    for res in pending[1]:
        alone._results.append(res)
        out_alone += alone.poll()
    assert [(r.op, r.key, r.ok) for r in out_together] == [(r.op, r.key, r.ok) for r in out_alone]

    def state(tier: Any) -> tuple[object, ...]:
        return (
            vars(tier.stats).copy(),
            tier.faults(),
            tier._inflight,
            sorted(tier._writing),
            tier._index.reserved,
            tier._index.used,
            dict(tier._unlinking),
            tier.take_events(),
        )

    assert state(together) == state(alone)
    assert together.stats.writes == 23 and together.stats.files_reused >= 8
    order = _index_order(together)
    assert len(order) == 11 and order == _index_order(alone)
