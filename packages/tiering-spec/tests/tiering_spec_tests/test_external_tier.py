"""A tier type registered from outside the package: its schema and builder given to the
registry, configured through ``secondary_tiers`` as the fs tier is, and used by the
tier manager (stores written through to it, a host miss promoted back from it), then by
a vLLM engine (the last test, marked ``e2e``)."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec.config import ConfigError, parse_config
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.tier_config import (
    ENABLE_KV_EVENTS,
    TierConfig,
    TierSite,
    TierType,
    locality_key,
    tier_schema,
)
from kvtier.tiering_spec.tiers import registry
from kvtier.tiering_spec.tiers.base import FAULT_KINDS, SecondaryTier, TierResult, TierStats
from kvtier.vllm_port.schema import Int, Key

from .test_manager import settle
from .tier_support import PAYLOAD, Region, layouts

MEMORY_SCHEMA = tier_schema(
    "memory",
    (
        Key("max_blocks", Int(1), "blocks the tier keeps; beyond, writes are refused", 1024),
        ENABLE_KV_EVENTS,
        locality_key("LOCAL"),
    ),
)


class MemoryTierConfig(TierConfig, schema=MEMORY_SCHEMA):
    """One ``{"type": "memory", ...}`` entry: blocks kept in this process's memory."""


class MemoryTier(SecondaryTier):
    """A secondary tier that keeps each block's bytes (one copy per rank) in a dict,
    digest -> bytes; every job finishes when submitted, its result polled later."""

    def __init__(self, cfg: MemoryTierConfig, site: TierSite, name: str) -> None:
        self.name = name
        self.cfg = cfg
        self.stats = TierStats()
        self._index: dict[bytes, list[bytes]] = {}
        self._writing: set[bytes] = set()
        self._results: deque[TierResult] = deque()
        self._inflight = 0
        self._faults = dict.fromkeys(FAULT_KINDS, 0)
        self._events: list[tuple[bool, list[bytes]]] = []
        self._views: Callable[[], Sequence[memoryview] | None] = site.region_views
        self._payload = site.payload_bytes

    def _span(self, block_id: int) -> slice:
        return slice(block_id * self._payload, (block_id + 1) * self._payload)

    @property
    def used_bytes(self) -> int:
        copies = [len(b) for blocks in self._index.values() for b in blocks]
        return sum(copies)

    def contains(self, digest: bytes) -> bool:
        self.stats.queries += 1
        found = digest in self._index
        self.stats.hits += found
        return found

    def submit_write(self, key: bytes, digest: bytes, block_id: int) -> bool:
        views = self._views()
        if views is None or len(self._index) >= self.cfg.max_blocks:
            return False
        self._index[digest] = [bytes(v[self._span(block_id)]) for v in views]
        return self._done("write", key, digest, block_id)

    def submit_read(self, key: bytes, digest: bytes, block_id: int) -> bool:
        views = self._views()
        if views is None or digest not in self._index:
            return False
        for view, data in zip(views, self._index[digest]):
            view[self._span(block_id)] = data
        return self._done("read", key, digest, block_id)

    def _done(self, op: str, key: bytes, digest: bytes, block_id: int) -> bool:
        nbytes = self._payload * len(self._index[digest])
        self._results.append(TierResult(op, key, block_id, True, nbytes=nbytes, digest=digest))
        self._inflight += 1
        return True

    def poll(self) -> list[TierResult]:
        out = list(self._results)
        self._results.clear()
        self._inflight -= len(out)
        for res in out:
            self.stats.record(res)
        return out

    def touch(self, digests: Sequence[bytes]) -> None:
        pass  # no eviction order: the tier refuses writes once full

    @property
    def in_flight(self) -> int:
        return self._inflight

    def shutdown(self) -> bool:
        return True


def build_memory_tier(
    cfg: MemoryTierConfig, where: str, name: str, events: bool, site: TierSite
) -> MemoryTier:
    return MemoryTier(cfg, site, name)


MEMORY_TIER = TierType(MEMORY_SCHEMA, MemoryTierConfig, build_memory_tier)


@pytest.fixture(scope="module", autouse=True)
def memory_tier_registered() -> None:
    """Registered once per process, as a plugin would at import."""
    if "memory" not in registry.tier_types():
        registry.register_tier_type(MEMORY_TIER)


BASE = {"cpu_bytes_to_use": 1 << 30}


def configured(**entry: Any) -> MemoryTierConfig:
    raw = {"type": "memory", **entry}
    cfg = parse_config({**BASE, "secondary_tiers": [raw]}, tiering=True).secondary_tiers[0]
    assert isinstance(cfg, MemoryTierConfig)
    return cfg


def test_the_entry_is_validated_by_the_registered_schema() -> None:
    cfg = configured(max_blocks=8, locality="remote")
    assert (cfg.type, cfg.max_blocks, cfg.locality, cfg.enable_kv_events) == (
        "memory",
        8,
        "REMOTE",
        True,
    )
    assert configured().max_blocks == 1024, "the schema's default"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.max_blocks must be an integer"):
        configured(max_blocks=0)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['colour'\] for a memory tier"):
        configured(colour="red")


def test_an_unknown_type_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match=r"type must be one of fs, mooncake, memory"):
        parse_config({**BASE, "secondary_tiers": [{"type": "s3"}]}, tiering=True)


def test_a_type_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'memory' is registered already"):
        registry.register_tier_type(MEMORY_TIER)


def test_the_config_type_is_made_from_the_schema() -> None:
    cfg = MemoryTierConfig(max_blocks=4)
    assert cfg == MemoryTierConfig(type="memory", max_blocks=4, locality="LOCAL")
    assert cfg.enable_kv_events is True
    with pytest.raises(AttributeError):
        cfg.max_blocks = 5  # frozen, as a dataclass


def store(mgr: TierManager, region: Region, key: bytes, seed: int) -> None:
    plan = mgr.prepare_store([key])
    assert plan is not None
    to_store, blocks, _ = plan
    for block in blocks:
        region.fill(0, block, seed)
    mgr.complete_store(to_store)


def test_the_manager_stores_to_it_and_promotes_from_it() -> None:
    """Built by the registry from its entry, the tier serves a block the one-block host
    tier evicted, byte for byte."""
    region = Region(1)
    site = TierSite(layouts(), PAYLOAD, region.views, persistent=True)
    tier = registry.build_tier(
        configured(max_blocks=8), "secondary_tiers[0]", "memory", False, site
    )
    assert isinstance(tier, MemoryTier)
    mgr = TierManager(HostBlockPool(1), [tier], max_write_backlog=64)
    store(mgr, region, b"a", seed=1)
    settle(mgr)
    expected_a = region.block(0, mgr.pool.block_of(b"a"))
    store(mgr, region, b"b", seed=2)  # evicts a from the host tier
    settle(mgr)
    assert not mgr.pool.contains(b"a") and tier.stats.writes == 2
    assert mgr.lookup(b"a") is Lookup.HIT_PENDING, "a hit in the memory tier starts a promotion"
    settle(mgr)
    assert mgr.lookup(b"a") is Lookup.HIT
    assert region.block(0, mgr.pool.block_of(b"a")) == expected_a
    assert mgr.load_source(b"a") == "memory"
    assert mgr.counters.promotions == 1 and tier.stats.reads == 1
    mgr.pool.check_invariants()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_vllm_engine_runs_with_the_memory_tier_behind_its_host_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine (in this process, where the type is registered) builds the memory tier
    from its ``secondary_tiers`` entry; a host tier too small for the prefixes is served
    from it, and every output is the reference's, token by token."""
    pytest.importorskip("vllm")
    import kvtier.testkit as testkit
    from kvtier.testkit import Workload, compare_outputs, kv_transfer_config, run_with
    from kvtier.testkit.engine import kv_connector_of

    from .e2e_support import ENGINE, ROOMY, offload_config, prefix_prompts

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the weight digests' cache
    monkeypatch.setenv("PYTHONHASHSEED", os.environ.get("PYTHONHASHSEED", "0"))
    model = testkit.make_tiny_llama()
    workload = Workload(prefix_prompts(), 8)
    cfg = offload_config("TieringOffloadingSpec", host_chunks=10)
    cfg["kv_connector_extra_config"]["secondary_tiers"] = [{"type": "memory"}]

    def inspect(llm: Any) -> tuple[Any, Any]:
        core = kv_connector_of(llm).connector_scheduler.manager.core
        return core.secondary_tiers[0], core.counters

    ref, _ = run_with(model, workload, **ROOMY)
    res, (tier, counters) = run_with(
        model, workload, inspect=inspect, kv_transfer_config=kv_transfer_config(cfg), **ENGINE
    )
    cmp = compare_outputs(ref.outputs, res.outputs)
    assert cmp.identical, cmp.report()
    assert isinstance(tier, MemoryTier) and tier.name == "memory"
    assert tier.stats.writes > 0 and tier.stats.reads > 0, tier.stats
    assert counters.promotions > 0
