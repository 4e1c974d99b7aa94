"""vLLM's cache policies behind kvtier's host tier: by the name vLLM's
CachePolicyFactory knows, and by vLLM's module-path convention."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.v1.kv_offload.cpu.policies.factory")

from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy

from kvtier.blockpool import HostBlockPool
from kvtier.tiering_spec.config import ConfigError, parse_config
from kvtier.tiering_spec.vllm_policy import VllmPolicyAdapter, resolve_vllm_policy

LRU_MODULE = "vllm.v1.kv_offload.cpu.policies.lru"
BASE = {"cpu_bytes_to_use": 1 << 30}


@pytest.fixture(scope="module")
def registered_name() -> str:
    name = "kvtier-test-registered-lru"
    if name not in CachePolicyFactory._registry:
        CachePolicyFactory.register_cache_policy(name, LRU_MODULE, "LRUCachePolicy")
    return name


def pool_of(name: str, module_path: str | None, capacity: int = 3) -> HostBlockPool:
    factory = resolve_vllm_policy(name, module_path)
    assert factory is not None
    return HostBlockPool(capacity, policy=factory(capacity))


def store(pool: HostBlockPool, keys: list[bytes]) -> list[bytes]:
    plan = pool.prepare_store(keys)
    assert plan is not None
    pool.complete_store(plan.keys)
    return plan.evicted


def test_kvtier_names_and_classes_need_no_adapter() -> None:
    for name in ("lru", "arc", "frecency"):
        assert resolve_vllm_policy(name, None) is None


def test_vllm_convention_module_path_names_the_module_and_the_name_the_class() -> None:
    """vLLM's convention: eviction_policy="LRUCachePolicy" and the module alone in
    cache_policy_module_path (kvtier read it as 'module.Class' and failed on
    "'lru' is not a class")."""
    pool = pool_of("LRUCachePolicy", LRU_MODULE)
    assert isinstance(pool.policy, VllmPolicyAdapter)
    assert isinstance(pool.policy.policy, LRUCachePolicy)
    store(pool, [b"a", b"b", b"c"])
    pool.touch([b"a"])
    assert store(pool, [b"d"]) == [b"b"], "b was least recently used"


def test_a_name_registered_with_vllms_factory_is_honoured(registered_name: str) -> None:
    pool = pool_of(registered_name, None)
    store(pool, [b"a", b"b", b"c"])
    assert store(pool, [b"d"]) == [b"a"]
    parse_config({**BASE, "eviction_policy": registered_name}, tiering=False)


def test_a_pinned_key_is_never_evicted_by_a_vllm_policy() -> None:
    pool = pool_of("LRUCachePolicy", LRU_MODULE)
    store(pool, [b"a", b"b", b"c"])
    pool.prepare_load([b"a"])  # a is being read: pinned
    assert store(pool, [b"d"]) == [b"b"]
    assert pool.prepare_store([b"e", b"f", b"g"]) is None, "only c and d may go"
    pool.complete_load([b"a"])
    assert sorted(store(pool, [b"e", b"f"])) == [b"a", b"c"]
    pool.check_invariants()


def test_a_finished_request_orders_a_vllm_policy_tail_first() -> None:
    pool = pool_of("LRUCachePolicy", LRU_MODULE, capacity=4)
    store(pool, [b"1", b"2", b"3", b"4"])
    pool.finish_request([b"1", b"2", b"3", b"4"], reused=())
    assert store(pool, [b"5"]) == [b"4"], "the prefix's tail goes first"


def test_a_module_without_the_named_class_says_which_keys_to_set() -> None:
    with pytest.raises(ConfigError, match=r"eviction_policy='NoSuchPolicy'"):
        resolve_vllm_policy("NoSuchPolicy", LRU_MODULE)


def test_an_unknown_name_lists_what_is_allowed() -> None:
    with pytest.raises(
        ConfigError, match=r"eviction_policy must be one of lru, arc, frecency, a policy registered"
    ):
        parse_config({**BASE, "eviction_policy": "mru"}, tiering=False)
