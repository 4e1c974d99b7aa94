"""Connector stats: counters add up across ranks, and reach Prometheus-style metrics."""

from __future__ import annotations

from kvtier.testkit import requires_vllm

pytestmark = requires_vllm


def test_counters_add_and_gauges_keep_the_latest() -> None:
    from kvtier.recompute_connector.metrics import RecomputeOffloadStats

    a = RecomputeOffloadStats(
        data={
            "counters": {"bytes_d2h": 10, "fallback:capacity": 1},
            "gauges": {"host_blocks_in_use": 3},
        }
    )
    b = RecomputeOffloadStats(
        data={"counters": {"bytes_d2h": 5}, "gauges": {"host_blocks_in_use": 1}}
    )
    merged = a.aggregate(b)
    assert isinstance(merged, RecomputeOffloadStats)
    assert merged.counters == {"bytes_d2h": 15, "fallback:capacity": 1}
    assert merged.reduce()["host_blocks_in_use"] == 1
    assert not merged.is_empty()
    assert RecomputeOffloadStats().is_empty()


def test_prometheus_observe_maps_every_counter() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from kvtier.recompute_connector.metrics import RecomputeOffloadPromMetrics

    registry = CollectorRegistry()

    def bind(cls):
        def make(**kw):
            kw.pop("multiprocess_mode", None)
            return cls(registry=registry, **kw)

        return make

    class Config:
        kv_transfer_config = None

    prom = RecomputeOffloadPromMetrics(
        Config(),  # type: ignore[arg-type]
        {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
        ["engine"],
        {0: ["0"]},
    )
    prom.observe(
        {
            "counters": {
                "preemptions_offloaded": 2,
                "tokens_restored": 70,
                "fallback:capacity": 1,
                "bytes_h2d": 4096,
                "seconds_d2h": 0.5,
            },
            "gauges": {"host_blocks_in_use": 7},
        }
    )
    value = registry.get_sample_value
    assert value("vllm:kvtier_recompute_preemptions_offloaded_total", {"engine": "0"}) == 2
    assert value("vllm:kvtier_recompute_tokens_restored_total", {"engine": "0"}) == 70
    assert (
        value("vllm:kvtier_recompute_fallbacks_total", {"engine": "0", "reason": "capacity"}) == 1
    )
    assert (
        value("vllm:kvtier_recompute_transfer_bytes_total", {"engine": "0", "direction": "h2d"})
        == 4096
    )
    assert (
        value("vllm:kvtier_recompute_transfer_seconds_total", {"engine": "0", "direction": "d2h"})
        == 0.5
    )
    assert value("vllm:kvtier_recompute_host_blocks_in_use", {"engine": "0"}) == 7
