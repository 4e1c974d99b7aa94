"""kvtier's connector metrics on vLLM releases before 0.24.

Called by :mod:`kvtier.tiering_spec.connector` only on those releases (vLLM 0.23):
there vLLM neither asks a spec to declare its metrics nor its manager for stats, and
its connector reports worker-side transfer records only. Here kvtier's connector also
reports the kvtier manager's metrics, in a stats payload of plain data
(:mod:`kvtier.tiering_spec.metrics_payload`) with Prometheus metrics of its own
(:class:`KvtierOffloadPromMetrics`). With a spec that is not kvtier's it reports what
vLLM's connector reports.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadPromMetrics,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec import metrics_payload as mp
from kvtier.vllm_port.plugins import registry_of


def _kvtier_metric_table(vllm_config: Any) -> dict[str, m.MetricRow]:
    """The metric table of the spec ``vllm_config`` names, if it is kvtier's; else {}."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    name = extra.get("spec_name", "CPUOffloadingSpec")
    try:  # another plugin's spec, or a module that fails to import: no kvtier metrics
        entry = registry_of(OffloadingSpecFactory).get(name)
        if entry is not None:
            spec_cls = entry()
        elif extra.get("spec_module_path"):
            spec_cls = getattr(importlib.import_module(extra["spec_module_path"]), name)
        else:
            return {}
    except Exception:
        return {}
    table = getattr(spec_cls, "kvtier_metric_table", None)
    return table(extra) if callable(table) else {}


@dataclass
class KvtierOffloadingStats(KVConnectorStats):
    """vLLM's transfer records plus kvtier's metrics, as plain data."""

    data: dict[str, Any] = field(default_factory=mp.new_payload)

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data = mp.new_payload()

    def aggregate(self, other: Any) -> Any:
        if not other.is_empty():
            mp.merge_payload(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return mp.reduce_payload(self.data)

    def is_empty(self) -> bool:
        return mp.payload_is_empty(self.data)

    def __getitem__(self, key: str) -> Any:
        # vLLM 0.23's MultiConnector hands its children stats["data"].
        if key != "data":
            raise KeyError(key)
        return self.data


class KvtierOffloadPromMetrics(OffloadPromMetrics):  # type: ignore[misc]
    """vLLM's transfer metrics, plus the metrics kvtier's spec declares."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[str, Any] = {}
        for name, row in _kvtier_metric_table(vllm_config).items():
            kind, doc, labels, buckets = row.kind, row.documentation, row.labels, row.buckets
            args: dict[str, Any] = {
                "name": name,
                "documentation": doc,
                "labelnames": [*labelnames, *labels],
            }
            if kind == "counter":
                self._families[name] = self._counter_cls(**args)
            elif kind == "gauge":
                self._families[name] = self._gauge_cls(**args)
            else:
                self._families[name] = self._histogram_cls(**args, buckets=list(buckets or ()))
        self._series: dict[tuple[int, str, str], Any] = {}

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        payload = transfer_stats_data
        transfers = {
            kind: [{"op_size": op[0], "op_time": op[1]} for op in ops]
            for kind, ops in payload.get("transfers", {}).items()
        }
        super().observe(transfers, engine_idx)
        for name, (kind, values) in payload.get("metrics", {}).items():
            family = self._families.get(name)
            if family is None:
                continue
            for key, value in values.items():
                series = self._series.get((engine_idx, name, key))
                if series is None:
                    engine_labels = self.per_engine_labelvalues[engine_idx]
                    series = family.labels(*engine_labels, *mp.label_values(key))
                    self._series[(engine_idx, name, key)] = series
                if kind == "counter":
                    series.inc(value)
                elif kind == "gauge":
                    series.set(value)
                else:
                    for observation in value:
                        series.observe(observation)


def connector_stats(connector: Any, worker_records: Callable[[], Any]) -> Any:
    """The stats of kvtier's connector on these releases: on a worker, vLLM's transfer
    records (``worker_records``: vLLM's own ``get_kv_connector_stats``) as plain data; on
    the scheduler, its manager's metrics."""
    stats = KvtierOffloadingStats()
    if connector.connector_worker is not None:
        records = worker_records()
        for kind, ops in (records.data if records is not None else {}).items():
            for op in ops:
                size = op["op_size"] if isinstance(op, dict) else op.op_size
                seconds = op["op_time"] if isinstance(op, dict) else op.op_time
                mp.add_transfer(stats.data, kind, size, seconds)
        # Every step, even empty: these releases ask the scheduler side for its
        # stats only in steps where a worker reported some.
        return stats
    collect = getattr(connector.connector_scheduler.manager, "collect_metrics", None)
    for kind, name, value, labels in collect() if collect is not None else ():
        if kind != "counter" or value:
            mp.add_metric(stats.data, kind, name, value, labels)
    return None if stats.is_empty() else stats


def build_stats(data: dict[str, Any] | None = None) -> Any:
    """The connector's stats of ``data`` (as they travel between processes)."""
    return KvtierOffloadingStats(data=data) if data is not None else KvtierOffloadingStats()
