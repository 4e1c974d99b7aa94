"""What older vLLM releases read from the connector's stats (how the release is detected:
the port of kvtier-vllm-port, ``kvtier.vllm_port.port``, and its tests)."""

from __future__ import annotations

import pytest

from kvtier.testkit import requires_vllm

pytestmark = requires_vllm


def test_stats_answer_the_data_key_older_multi_connectors_read() -> None:
    from kvtier.recompute_connector.metrics import RecomputeOffloadStats

    stats = RecomputeOffloadStats()
    stats.counters["restores"] = 2
    assert stats["data"] is stats.data
    with pytest.raises(KeyError):
        stats["other"]
