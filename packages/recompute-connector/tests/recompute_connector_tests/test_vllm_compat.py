"""The differences between supported vLLM releases, found from vLLM's own classes."""

from __future__ import annotations

import pytest

from kvtier.testkit import requires_vllm

pytestmark = requires_vllm


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
