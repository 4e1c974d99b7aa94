"""A job's reads go to the fs tier's read threads in one task per thread
(``_submit_reads``): the same reads start, with the same counts of reads in flight and
the same order of uses in the eviction policy, as one ``submit_read`` a read; every
block reads back byte for byte."""

from __future__ import annotations

import pytest

from kvtier.tiering_spec.tiers.base import TierJob
from kvtier.tiering_spec.tiers.fs.format import key_digest

from .tier_support import Region, wait_results

KEYS = [b"read-%02d" % i for i in range(12)]


def _tier_with_files(make_tier, region: Region, policy: str, root):
    tier = make_tier(region, root=root, eviction_policy=policy, threads=3)
    for i, key in enumerate(KEYS):  # (one at a time: the index takes them in order)
        region.fill(0, i, i + 1)
        assert tier.submit_write(key, key_digest(key), i)
        wait_results(tier)
    return tier


@pytest.mark.parametrize("policy", ["frecency", "lru", "arc"])
def test_a_jobs_reads_start_and_are_used_as_one_read_at_a_time(
    make_tier, tmp_path, policy: str
) -> None:
    # Some keys twice, one never written, in an order other than the files'.
    asked = [KEYS[7], KEYS[2], b"never-written", KEYS[9], KEYS[2], KEYS[0], KEYS[11]]
    items = [(key, key_digest(key), 16 + i) for i, key in enumerate(asked)]
    tiers, outcomes = [], []
    for together in (True, False):
        region = Region(32)
        tier = _tier_with_files(make_tier, region, policy, tmp_path / f"fs-{together}")
        written = {key: region.block(0, i) for i, key in enumerate(KEYS)}
        if together:
            started = tier.submit(TierJob(1, "read", "req", items))
        else:
            started = [tier.submit_read(*item) for item in items]
        reading = dict(tier._reading)
        results = wait_results(tier, sum(started))
        assert all(res.ok for res in results), results
        for key, _digest, block in (item for item, ok in zip(items, started) if ok):
            assert region.block(0, block) == written[key], "read back byte for byte"
        # The policy's order of uses: what it evicts first, all of it.
        order = [d for d, _entry in tier._index.evict(len(KEYS), lambda d: False) or []]
        outcomes.append((started, reading, order))
        tiers.append(tier)
    assert outcomes[0] == outcomes[1]
    started, reading, order = outcomes[0]
    assert started == [True, True, False, True, True, True, True]
    assert reading[key_digest(KEYS[2])] == 2
    read = {key_digest(key) for key in asked if key in KEYS}
    assert set(order[-len(read) :]) == read, "the keys read are evicted last"
