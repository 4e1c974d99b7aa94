"""The differences between supported vLLM releases, found from vLLM's own classes."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testkit import requires_vllm

pytestmark = requires_vllm


class Manager:
    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return ([1, 2],)


def test_the_manager_is_found_from_the_scheduler_constructor_that_binds() -> None:
    from kvtier.recompute_connector.vllm_compat import scheduler_kv_cache_manager

    class Connector:
        def bind_gpu_block_pool(self, pool: Any) -> None:
            self.manager = scheduler_kv_cache_manager()

    class Multi:  # MultiConnector forwards the call to its children
        def __init__(self) -> None:
            self.children = [Connector()]

        def bind_gpu_block_pool(self, pool: Any) -> None:
            for c in self.children:
                c.bind_gpu_block_pool(pool)

    class Scheduler:
        def __init__(self, connector: Any) -> None:
            self.kv_cache_manager = Manager()
            connector.bind_gpu_block_pool(object())

    alone = Connector()
    scheduler = Scheduler(alone)
    assert alone.manager is scheduler.kv_cache_manager
    multi = Multi()
    scheduler = Scheduler(multi)
    assert multi.children[0].manager is scheduler.kv_cache_manager
    stray = Connector()
    stray.bind_gpu_block_pool(None)
    assert stray.manager is None


def test_this_vllm_is_detected() -> None:
    import vllm
    from packaging.version import Version

    from kvtier.recompute_connector.vllm_compat import binds_kv_cache_manager

    release = Version(Version(vllm.__version__).base_version)
    if release >= Version("0.32"):
        assert binds_kv_cache_manager()
    elif release < Version("0.24"):
        assert not binds_kv_cache_manager()
    else:
        pytest.skip(f"vLLM {release}: either answer is possible")


def test_stats_answer_the_data_key_older_multi_connectors_read() -> None:
    from kvtier.recompute_connector.metrics import RecomputeOffloadStats

    stats = RecomputeOffloadStats()
    stats.counters["restores"] = 2
    assert stats["data"] is stats.data
    with pytest.raises(KeyError):
        stats["other"]
