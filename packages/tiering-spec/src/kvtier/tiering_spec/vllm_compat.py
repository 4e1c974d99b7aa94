"""The tiering spec's side of :mod:`kvtier.vllm_port.port`: what it builds on.

Which vLLM interface generation runs here is the port's answer, asked once at import
(a kvtier plugin chose the port when it registered); this module turns it into the
bases kvtier's classes are defined on and the calls they make, so the spec's own code
is the same on every release:

* **Spec construction.** vLLM 0.26 and later build a spec from an ``OffloadingConfig``.
  Before, from ``(vllm_config, kv_cache_config)``: there :func:`init_spec` runs
  :mod:`kvtier.tiering_spec.vllm_legacy_spec`, which derives the same fields from the
  engine's configs and sets ``block_size_factor`` to ``blocks_per_chunk``.
* **Worker.** vLLM 0.25 and later take an ``OffloadingWorker``; before, handlers keyed
  by medium (:func:`transfer_handlers`).
* **Metrics.** vLLM 0.24 and later ask a spec to declare its metrics and its manager for
  stats. Before, kvtier's connector reports them itself (:func:`legacy_metrics`).
* **Manager answers** (lookups, events, per-request state, cache-hit sources) and vLLM's
  private connector state: the port's, with kvtier's ``Lookup`` mapped here.

The code of an older interface generation lives in a module of its own that only that
generation imports; every class is defined unconditionally at module level, on the same
bases on every release: what differs is called, never inherited.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable, Mapping
from typing import Any

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.base import OffloadingSpec

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec.manager import Lookup
from kvtier.vllm_port import port as _port
from kvtier.vllm_port.facts import EngineFacts

PORT: _port.VllmPort = _port.current()

# What the port says of this vLLM (kept as names: the spec's modules and tests read them).
CONFIG_API = PORT.spec_takes_offloading_config
SPEC_METRICS = PORT.spec_metrics
WORKER_API = PORT.worker_api
FIXED_HASH_SEED = PORT.fixed_hash_seed
# Whether a connector can report a failed load as a failed request
# (``KVConnectorTransferResults.failed_recving``, vLLM 0.32): the only way a model with
# several KV cache groups recomputes a failed load instead of stopping the engine.
REQUEST_LEVEL_LOAD_FAILURES = PORT.request_level_load_failures


def _legacy(module: str) -> Any:
    """A module of kvtier's code for an older interface generation (imported only there)."""
    return importlib.import_module(f"kvtier.tiering_spec.{module}")


def init_spec(spec: Any, *args: Any) -> None:
    """vLLM's ``OffloadingSpec.__init__`` for ``spec`` as this release builds a spec: from
    an ``OffloadingConfig``, or before 0.26 from ``(vllm_config, kv_cache_config)``, with
    the fields of vLLM 0.32's spec derived from them (:mod:`.vllm_legacy_spec`)."""
    if CONFIG_API:
        OffloadingSpec.__init__(spec, *args)
    else:
        _legacy("vllm_legacy_spec").init_legacy_spec(spec, *args)


def transfer_handlers(worker: Any) -> Any:
    """A spec's transfer handlers over ``worker`` (vLLM before 0.25 asks for handlers)."""
    return _legacy("vllm_legacy_spec").legacy_handlers(worker)


def stand_in_for_vllms_worker(cls: type) -> None:
    """Make ``cls`` count as vLLM's ``OffloadingWorker`` (an ABC, vLLM 0.25 and later):
    it implements that interface whole, and inherits nothing of it. Idempotent."""
    base: Any = PORT.worker_base()
    if base is not object and not issubclass(cls, base):
        base.register(cls)


def legacy_metrics() -> Any:
    """kvtier's connector metrics before vLLM 0.24 (:mod:`.vllm_legacy_metrics`)."""
    return _legacy("vllm_legacy_metrics")


# Specs as this vLLM's OffloadingConnector builds them (tools and tests build them so).
create_spec = PORT.create_spec


def engine_facts(spec: Any) -> EngineFacts | None:
    """The facts of the engine behind ``spec``, read from the spec, or None.

    vLLM 0.23 to 0.25 hand a spec the engine's configs themselves. From 0.26 on a spec
    is handed only an ``OffloadingConfig``, which names the model by its path alone:
    kvtier's connector builds its specs with the facts as an argument
    (``PORT.create_spec``), and a spec built outside it (vLLM's own connector, an offline
    replay) has none: its fs tier's fingerprint is then unverified, as the start-up log
    says.
    """
    return PORT.spec_engine_facts(spec)


_LOOKUP = {Lookup.HIT: "hit", Lookup.HIT_PENDING: "pending"}


def lookup_result(found: Lookup) -> Any:
    """vLLM's answer to a lookup that found ``found``."""
    return PORT.lookup_result(_LOOKUP.get(found, "miss"))


def metric_definitions(table: Mapping[str, m.MetricRow]) -> dict[str, Any]:
    """vLLM's metric metadata for kvtier's metric table (where :data:`SPEC_METRICS`)."""
    out: dict[str, Any] = {}
    for name, row in table.items():
        kind, doc, labels, buckets = row.kind, row.documentation, row.labels, row.buckets
        if kind == "counter":
            out[name] = _base.OffloadingCounterMetadata(  # type: ignore[attr-defined]
                documentation=doc, labelnames=labels
            )
        elif kind == "gauge":
            out[name] = _base.OffloadingGaugeMetadata(  # type: ignore[attr-defined]
                documentation=doc, labelnames=labels
            )
        else:
            out[name] = _base.OffloadingHistogramMetadata(  # type: ignore[attr-defined]
                documentation=doc, labelnames=labels, buckets=buckets
            )
    return out


@functools.cache
def _stats_class() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    return OffloadingConnectorStats


def new_stats() -> Any:
    """An empty ``OffloadingConnectorStats`` of vLLM's."""
    return _stats_class()()


def gauge_stats(gauges: Iterable[tuple[str, Any]]) -> Any:
    """vLLM's ``OffloadingConnectorStats`` holding ``gauges`` (name, value; no labels)."""
    stats = new_stats()
    for name, value in gauges:
        stats.set_gauge(name, value)
    return stats


def copy_stats(stats: Any) -> Any:
    """A new stats object of ``stats``'s class with a copy of its ``data``, down to each
    metric's values by labels (vLLM's layout: ``{"types": {name: type}, "data": {name:
    {labels: value}}}``; a gauge's or counter's value is a number, so the copy shares
    nothing that vLLM changes in place)."""
    data = {
        key: {
            name: dict(values) if type(values) is dict else values for name, values in part.items()
        }
        if type(part) is dict
        else part
        for key, part in stats.data.items()
    }
    return type(stats)(data=data)


class QuietGauges:
    """:func:`gauge_stats` for a step where nothing changed (most steps): the stats of
    the same rows (the same tuple) are made once by vLLM's ``set_gauge``, and each call
    hands out a new object of their class with its own copy of that layout (vLLM's
    scheduler and its stats loggers aggregate into the stats they get, so none is
    handed out twice). Asked every engine step: the copy is two dict literals, not
    :func:`copy_stats`' walk over any layout."""

    def __init__(self) -> None:
        self._rows: tuple[tuple[str, Any], ...] | None = None
        self._stats: Any = None
        # (types key, types, values key, values by name) where the stats have vLLM's
        # layout, {types: {name: type}, data: {name: {labels: value}}}; else None.
        self._layout: tuple[str, dict[str, Any], str, dict[str, Any]] | None = None

    def __call__(self, rows: tuple[tuple[str, Any], ...]) -> Any:
        if rows is not self._rows:
            stats = gauge_stats(rows)
            self._rows, self._stats, self._layout = rows, stats, None
            parts = list(stats.data.items())
            if len(parts) == 2 and all(type(part) is dict for _, part in parts):
                (types_key, types), (values_key, values) = parts
                if all(type(v) is dict for v in values.values()):
                    self._layout = (types_key, types, values_key, values)
        layout = self._layout
        if layout is None:
            return copy_stats(self._stats)
        types_key, types, values_key, values = layout
        return type(self._stats)(
            data={
                types_key: types.copy(),
                values_key: {name: by_labels.copy() for name, by_labels in values.items()},
            }
        )
