"""The connector's statistics and Prometheus metrics, the vLLM side of the counters that
:class:`RecomputeOffloadScheduler` and :class:`RecomputeOffloadWorker` keep.

:class:`RecomputeOffloadStats` travels from the workers to the scheduler process and
from there to the logger; :class:`RecomputeOffloadPromMetrics` turns it into
``vllm:kvtier_recompute_*`` series.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from kvtier.recompute_connector.state import RecomputeOffloadScheduler
    from kvtier.recompute_connector.worker import TransferStats

COUNTERS = "counters"
GAUGES = "gauges"


class RecomputeOffloadStats(KVConnectorStats):
    """Connector stats: ``data = {"counters": {name: n}, "gauges": {name: n}}``.

    Counters are deltas since the last report and add up across ranks and steps;
    gauges (host blocks) keep the latest value. Names: ``preemptions_offloaded``,
    ``tokens_stored``, ``restores``, ``tokens_restored``, ``fallback:<reason>``,
    ``bytes_d2h``/``bytes_h2d`` (bytes), ``seconds_d2h``/``seconds_h2d``,
    ``blocks_d2h``/``blocks_h2d``, ``failures_d2h``/``failures_h2d``; gauges
    ``host_blocks_in_use`` and ``host_blocks`` (blocks).
    """

    def __post_init__(self) -> None:
        if COUNTERS not in self.data:
            self.reset()

    def reset(self) -> None:
        empty: dict[str, Any] = {COUNTERS: {}, GAUGES: {}}
        self.data = empty

    @property
    def counters(self) -> dict[str, float]:
        return self.data.setdefault(COUNTERS, {})

    @property
    def gauges(self) -> dict[str, float]:
        return self.data.setdefault(GAUGES, {})

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not isinstance(other, RecomputeOffloadStats):
            return self
        for name, value in other.counters.items():
            self.counters[name] = self.counters.get(name, 0) + value
        self.gauges.update(other.gauges)
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        for name, value in self.counters.items():
            out[name] = round(value, 6) if isinstance(value, float) else value
        out.update(self.gauges)
        return out

    def is_empty(self) -> bool:
        return not any(self.counters.values()) and not self.gauges

    def __getitem__(self, key: str) -> Any:
        # Older MultiConnectors hand a child's Prometheus metrics stats["data"].
        if key == "data":
            return self.data
        raise KeyError(key)


PROM_PREFIX = "vllm:kvtier_recompute_"


class RecomputeOffloadPromMetrics(KVConnectorPromMetrics):
    """The connector's Prometheus metrics (names start with ``vllm:kvtier_recompute_``)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        names = self._labelnames
        self._plain: dict[str, Any] = {
            "preemptions_offloaded": counter(
                name=PROM_PREFIX + "preemptions_offloaded",
                documentation="Preempted requests whose KV was stored in host DRAM.",
                labelnames=names,
            ),
            "restores": counter(
                name=PROM_PREFIX + "restores",
                documentation="Resumed requests whose KV was restored from host DRAM.",
                labelnames=names,
            ),
            "tokens_restored": counter(
                name=PROM_PREFIX + "tokens_restored",
                documentation="Tokens of KV restored from host DRAM instead of recomputed.",
                labelnames=names,
            ),
        }
        self._fallbacks = counter(
            name=PROM_PREFIX + "fallbacks",
            documentation="Preempted requests recomputed instead of restored, by reason.",
            labelnames=[*names, "reason"],
        )
        self._by_direction: dict[str, Any] = {
            "bytes": counter(
                name=PROM_PREFIX + "transfer_bytes",
                documentation="Bytes copied, by direction (d2h: store, h2d: restore).",
                labelnames=[*names, "direction"],
            ),
            "seconds": counter(
                name=PROM_PREFIX + "transfer_seconds",
                documentation="Seconds spent copying, by direction.",
                labelnames=[*names, "direction"],
            ),
            "blocks": counter(
                name=PROM_PREFIX + "transfer_blocks",
                documentation="KV blocks copied, by direction.",
                labelnames=[*names, "direction"],
            ),
        }
        self._gauges: dict[str, Any] = {
            "host_blocks_in_use": gauge(
                name=PROM_PREFIX + "host_blocks_in_use",
                documentation="Host blocks holding preempted requests' KV (per rank).",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
            "host_blocks": gauge(
                name=PROM_PREFIX + "host_blocks",
                documentation="Host blocks of the per-rank budget.",
                labelnames=names,
                multiprocess_mode="mostrecent",
            ),
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = list(self.per_engine_labelvalues[engine_idx])
        for name, value in (transfer_stats_data.get(COUNTERS) or {}).items():
            if not value:
                continue
            if name in self._plain:
                self._plain[name].labels(*labels).inc(value)
            elif name.startswith("fallback:"):
                self._fallbacks.labels(*labels, name.split(":", 1)[1]).inc(value)
            else:
                kind, _, direction = name.partition("_")
                metric = self._by_direction.get(kind)
                if metric is not None and direction in ("d2h", "h2d"):
                    metric.labels(*labels, direction).inc(value)
        for name, value in (transfer_stats_data.get(GAUGES) or {}).items():
            if name in self._gauges:
                self._gauges[name].labels(*labels).set(value)


def scheduler_stats(
    scheduler: RecomputeOffloadScheduler, sent: dict[str, int] | None = None
) -> RecomputeOffloadStats:
    """The scheduler's counters since the last call, and its host-block gauges (blocks).

    With ``sent`` (the gauges this caller sent before, updated here) a gauge is left out
    while its value stays: vLLM asks every engine step, and a Prometheus gauge keeps
    its last value."""
    stats = RecomputeOffloadStats()
    s = scheduler.take_stats()
    counters = stats.counters
    for name in ("preemptions_offloaded", "tokens_stored", "restores", "tokens_restored"):
        if getattr(s, name):
            counters[name] = getattr(s, name)
    for reason, n in s.fallbacks.items():
        counters[f"fallback:{reason}"] = n
    for name, value in (
        ("host_blocks_in_use", scheduler.host_blocks_in_use),
        ("host_blocks", scheduler.pool.num_blocks),
    ):
        if sent is None or sent.get(name) != value:
            stats.gauges[name] = value
            if sent is not None:
                sent[name] = value
    return stats


def worker_stats(transfers: TransferStats | None) -> RecomputeOffloadStats:
    """One worker's copies since the last call: ``<kind>_<direction>`` counters."""
    stats = RecomputeOffloadStats()
    if transfers is None:
        return stats
    for direction in ("d2h", "h2d"):
        for kind, table in (
            ("bytes", transfers.bytes),
            ("seconds", transfers.seconds),
            ("blocks", transfers.blocks),
            ("failures", transfers.failures),
        ):
            if table[direction]:
                stats.counters[f"{kind}_{direction}"] = table[direction]
    return stats
