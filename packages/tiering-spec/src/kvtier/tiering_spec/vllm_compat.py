"""What differs between the vLLM releases the specs support, in one place.

vLLM rewrote the offloading interfaces that kvtier implements between 0.23 (the
release vllm-ascend 0.23 runs on) and 0.26. Every difference is detected from vLLM's
own modules, not from version numbers (the release that changed it in brackets):

* **Spec construction** (0.26). A spec is built from an ``OffloadingConfig``
  (``vllm.v1.kv_offload.config``); before, from ``(vllm_config, kv_cache_config)``.
  There :class:`SpecBase` derives the same fields from the engine's configs
  (:func:`legacy_offloading_config`) and sets ``block_size_factor`` to
  ``blocks_per_chunk``: the old scheduler chunks by that factor, and the old spec base
  reads only ``block_size``.
* **Worker** (0.25). A spec returns an ``OffloadingWorker`` (``submit_store``,
  ``submit_load``); before, handlers keyed by (source, destination) medium, each with
  ``transfer_async``. There one :class:`TransferHandler` serves both directions over
  kvtier's worker and labels each result with its direction. (0.33 adds
  ``submit_load(..., expedited)``.)
* **Manager.** ``lookup`` answers a ``LookupResult`` (0.25; ``True``/``None``/``False``
  before) and ``on_schedule_end`` takes a context (0.25). ``OffloadingEvent`` takes a
  ``Medium`` (0.27; a string before), a ``locality`` (0.26) and an ``ownership`` (0.29).
* **Block hashes.** vLLM 0.32 seeds sha256 block hashes with a fixed default; older
  releases (0.23) draw a seed per engine unless ``PYTHONHASHSEED`` is set.
* **Metrics** (0.24). vLLM asks a spec to declare its metrics and its manager for
  stats. Before, it did neither, and its ``OffloadingConnector`` reports worker-side
  transfer records only. There the plugin points the connector name
  ``OffloadingConnector`` at :class:`OffloadingConnector`: vLLM's connector, plus the
  kvtier manager's metrics in a stats payload of plain data
  (:mod:`kvtier.tiering_spec.metrics`) and Prometheus metrics of its own. With a spec
  that is not kvtier's it reports what vLLM's connector reports.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec.config import ConfigError
from kvtier.tiering_spec.manager import Lookup

# The newer interfaces, each present from the release that introduced it.
CONFIG_API = importlib.util.find_spec("vllm.v1.kv_offload.config") is not None
LOOKUP_RESULT = hasattr(_base, "LookupResult")
EVENT_MEDIUM = hasattr(_base, "Medium")
SPEC_METRICS = hasattr(OffloadingSpec, "build_metric_definitions")
WORKER_API = hasattr(_base, "OffloadingWorker")

# -- spec construction ------------------------------------------------------------------


@dataclass(frozen=True)
class _Group:
    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class _Model:
    name: str
    dtype: str


@dataclass(frozen=True)
class _Cache:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclass(frozen=True)
class _Parallel:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int


@dataclass(frozen=True)
class LegacyOffloadingConfig:
    """The fields of vLLM 0.32's ``OffloadingConfig`` that kvtier's specs read."""

    groups: tuple[_Group, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: _Model
    cache: _Cache
    parallel: _Parallel
    kv_cache_layout: str | None = None
    replicated_layout: bool = False


@dataclass(frozen=True)
class _EventsConfig:
    enable_kv_cache_events: bool


def _blocks_per_chunk(extra: Mapping[str, Any], tokens_per_block: set[int]) -> int:
    """``blocks_per_chunk`` or ``block_size`` of ``kv_connector_extra_config``, checked
    as vLLM 0.32 checks them."""
    per_chunk, tokens = extra.get("blocks_per_chunk"), extra.get("block_size")
    if per_chunk is not None and tokens is not None:
        raise ConfigError(
            "kv_connector_extra_config: set one of 'blocks_per_chunk' or 'block_size', not both"
        )
    if per_chunk is not None:
        if isinstance(per_chunk, bool) or not isinstance(per_chunk, int) or per_chunk <= 0:
            raise ConfigError(
                f"kv_connector_extra_config.blocks_per_chunk must be a positive integer, "
                f"got {per_chunk!r}"
            )
        return per_chunk
    if tokens is None:
        return 1
    if len(tokens_per_block) != 1:
        raise ConfigError(
            "kv_connector_extra_config.block_size needs every KV cache group to have the "
            f"same block size (they have {sorted(tokens_per_block)}); set blocks_per_chunk"
        )
    (per_block,) = tokens_per_block
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens % per_block:
        raise ConfigError(
            f"kv_connector_extra_config.block_size must be a multiple of the device block "
            f"size ({per_block} tokens), got {tokens!r}; or set blocks_per_chunk"
        )
    return tokens // per_block


def legacy_offloading_config(vllm_config: Any, kv_cache_config: Any) -> LegacyOffloadingConfig:
    """What vLLM 0.32's ``build_offloading_config`` derives, from an older vLLM's configs."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    transfer = vllm_config.kv_transfer_config
    extra: Mapping[str, Any] = transfer.kv_connector_extra_config or {}
    parallel = vllm_config.parallel_config
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    groups = tuple(
        _Group(i, int(g.kv_cache_spec.block_size) * dcp * pcp, tuple(g.layer_names))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    num_blocks = int(kv_cache_config.num_blocks)
    # One KVCacheTensor per layer (or per layer set sharing one) in these releases.
    kv_bytes = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
    events = getattr(vllm_config, "kv_events_config", None)
    try:
        from vllm.v1.attention.backends.utils import get_kv_cache_layout

        layout: str | None = str(get_kv_cache_layout())
    except Exception:
        layout = None
    return LegacyOffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=kv_bytes // num_blocks if num_blocks > 0 else 0,
        enable_kv_cache_events=bool(events is not None and events.enable_kv_cache_events),
        extra_config=extra,
        engine_id=str(transfer.engine_id),
        model=_Model(vllm_config.model_config.model, str(dtype).removeprefix("torch.")),
        cache=_Cache(
            int(tokens_per_hash), _blocks_per_chunk(extra, {g.tokens_per_block for g in groups})
        ),
        parallel=_Parallel(
            rank=int(parallel.rank),
            world_size=int(parallel.world_size),
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(parallel.pipeline_parallel_size),
            pcp_size=pcp,
            dcp_size=dcp,
        ),
        kv_cache_layout=layout,
    )


# The base of kvtier's worker: vLLM 0.32's ABC, or nothing where vLLM has handlers.
WorkerBase: type = getattr(_base, "OffloadingWorker", object)


def transfer_result(job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
    """vLLM's ``TransferResult`` of one finished job."""
    if WORKER_API:
        result: Any = _base.TransferResult  # type: ignore[attr-defined]
    else:
        result = importlib.import_module("vllm.v1.kv_offload.worker.worker").TransferResult
    return result(job_id=job_id, success=success, transfer_size=nbytes, transfer_time=seconds)


class TransferHandler:
    """An older vLLM's ``OffloadingHandler`` for both directions, over a kvtier worker
    (an object with vLLM 0.32's ``submit_store``/``submit_load``/``get_finished``/
    ``wait``/``shutdown``). vLLM calls a handler by these four methods only."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._directions: dict[int, tuple[str, str]] = {}

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        src, dst = spec
        if isinstance(src, GPULoadStoreSpec):
            ok = self.worker.submit_store(job_id, src, dst)
        else:
            ok = self.worker.submit_load(job_id, src, dst)
        self._directions[job_id] = (src.medium(), dst.medium())
        return bool(ok)

    def get_finished(self) -> list[Any]:
        # The worker's results are this vLLM's TransferResult (see transfer_result),
        # which names the direction as well.
        results = self.worker.get_finished()
        for r in results:
            r.transfer_type = self._directions.pop(r.job_id, None)
        return results

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        self.worker.shutdown()


if CONFIG_API:
    SpecBase: type = OffloadingSpec
else:

    class _LegacySpecBase(OffloadingSpec):
        """An older vLLM's ``OffloadingSpec`` that looks like vLLM 0.32's to kvtier."""

        def __init__(self, vllm_config: Any, kv_cache_config: Any) -> None:
            config = legacy_offloading_config(vllm_config, kv_cache_config)
            super().__init__(vllm_config, kv_cache_config)
            self.config = config
            self.kv_events_config = _EventsConfig(config.enable_kv_cache_events)
            self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
            self.tokens_per_hash = config.cache.tokens_per_hash
            self.blocks_per_chunk = config.cache.blocks_per_chunk
            self.block_size_factor = self.blocks_per_chunk

        def get_worker(self, kv_caches: Any) -> Any:
            raise NotImplementedError

        def get_handlers(self, kv_caches: Any) -> Iterator[tuple[type, type, Any]]:
            handler = TransferHandler(self.get_worker(kv_caches))
            yield GPULoadStoreSpec, CPULoadStoreSpec, handler
            yield CPULoadStoreSpec, GPULoadStoreSpec, handler

    SpecBase = _LegacySpecBase


# The engine configs of the connector that is building a spec right now: vLLM 0.32 hands
# a spec only an ``OffloadingConfig``, so kvtier's connector (and ``create_spec``) hand
# them over explicitly, for the duration of the spec's construction.
_BUILDING: contextvars.ContextVar[tuple[Any, Any] | None] = contextvars.ContextVar(
    "kvtier_building_spec", default=None
)


@contextlib.contextmanager
def building_spec(vllm_config: Any, kv_cache_config: Any) -> Iterator[None]:
    """Specs built inside this block see ``vllm_config`` and ``kv_cache_config`` in
    :func:`engine_configs` (where vLLM 0.32 and later do not hand them over)."""
    token = _BUILDING.set((vllm_config, kv_cache_config))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def engine_configs(spec: Any) -> tuple[Any, Any]:
    """The ``VllmConfig`` and ``KVCacheConfig`` behind ``spec``, or (None, None).

    Older releases hand them to the spec. vLLM 0.32 hands a spec only an
    ``OffloadingConfig``, which names the model by its path alone; kvtier's connector
    hands both over while it builds the spec (:func:`building_spec`). A spec built
    outside it (vLLM's own connector, an offline replay) gets (None, None): its fs
    tier's fingerprint is then unverified, as the start-up log says.
    """
    if not CONFIG_API:
        return getattr(spec, "vllm_config", None), getattr(spec, "kv_cache_config", None)
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

    vllm_config, kv_cache_config = _BUILDING.get() or (None, None)
    return (
        vllm_config if isinstance(vllm_config, VllmConfig) else None,
        kv_cache_config if isinstance(kv_cache_config, KVCacheConfig) else None,
    )


def create_spec(spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
    """``spec_cls`` built the way this vLLM's ``OffloadingConnector`` builds it."""
    if not CONFIG_API:
        return spec_cls(vllm_config, kv_cache_config)
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )

    with building_spec(vllm_config, kv_cache_config):
        return spec_cls(build_offloading_config(vllm_config, kv_cache_config))


# -- block hashes -------------------------------------------------------------------------


def _has_fixed_hash_seed() -> bool:
    from vllm.v1.core import kv_cache_utils

    return hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED")


# Whether vLLM seeds non-xxhash block hashes with a fixed default (vLLM 0.32); older
# releases (0.23) draw a seed per engine unless PYTHONHASHSEED is set.
FIXED_HASH_SEED = _has_fixed_hash_seed()


def block_hash_seed(hash_algo: str) -> str:
    """How vLLM seeds its block hashes: ``"PYTHONHASHSEED"``, ``"fixed"`` (vLLM's default
    seed) or ``"random"`` (per process: no key repeats after a restart)."""
    if os.environ.get("PYTHONHASHSEED") is not None:
        return "PYTHONHASHSEED"
    if not FIXED_HASH_SEED or hash_algo.startswith("xxhash"):
        return "random"
    return "fixed"


# -- manager ------------------------------------------------------------------------------


def lookup_result(found: Lookup) -> Any:
    if LOOKUP_RESULT:
        result = _base.LookupResult  # type: ignore[attr-defined]
        return {Lookup.HIT: result.HIT, Lookup.HIT_PENDING: result.HIT_PENDING}.get(
            found, result.MISS
        )
    return {Lookup.HIT: True, Lookup.HIT_PENDING: None}.get(found, False)


_EVENT_FIELDS = {f.name for f in dataclasses.fields(_base.OffloadingEvent)}


def offloading_event(
    keys: list[Any],
    removed: bool,
    *,
    tier: str | None = None,
    locality: str | None = None,
) -> Any:
    """An ``OffloadingEvent`` of the host tier (``tier`` None) or of a secondary tier.

    The medium is a ``Medium`` from vLLM 0.27 on and a string before; ``locality`` and
    ``ownership`` are passed where the event has them (0.26 and 0.29 on).
    """
    fields: dict[str, Any] = {"keys": keys, "removed": removed}
    if EVENT_MEDIUM:
        medium = _base.Medium  # type: ignore[attr-defined]
        fields["medium"] = medium.CPU if tier is None else medium.STORAGE
    else:
        fields["medium"] = "CPU" if tier is None else tier
    if tier is not None:
        if "locality" in _EVENT_FIELDS and locality is not None:
            fields["locality"] = _base.Locality(locality)  # type: ignore[attr-defined]
        if "ownership" in _EVENT_FIELDS:
            fields["ownership"] = tier
    return _base.OffloadingEvent(**fields)


def cache_hit_source(source: str) -> Any:
    """vLLM 0.32's ``CacheHitSource`` for ``"host"`` or a secondary tier."""
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    return CacheHitSource.HOST if source == "host" else CacheHitSource.DISK


def metric_definitions(table: Mapping[str, m.MetricRow]) -> dict[str, Any]:
    """vLLM 0.32's metric metadata for kvtier's metric table."""
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


def manager_stats(rows: Iterator[tuple[str, str, Any, tuple[str, ...]]]) -> Any:
    """vLLM 0.32's ``OffloadingConnectorStats`` of a manager's metric rows, or None."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )

    stats = OffloadingConnectorStats()
    for kind, name, value, labels in rows:
        if kind == "counter":
            if value:
                stats.increase_counter(name, value, labels)
        elif kind == "gauge":
            stats.set_gauge(name, value, labels)
        else:
            stats.observe_histogram(name, value, labels)
    return None if stats.is_empty() else stats


# -- metrics on releases without spec metrics ---------------------------------------------


def _kvtier_metric_table(vllm_config: Any) -> dict[str, m.MetricRow]:
    """The metric table of the spec ``vllm_config`` names, if it is kvtier's; else {}."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = dict(getattr(transfer, "kv_connector_extra_config", None) or {})
    name = extra.get("spec_name", "CPUOffloadingSpec")
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        entry = OffloadingSpecFactory._registry.get(name)
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


if not SPEC_METRICS:
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadPromMetrics,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector as _VllmOffloadingConnector,
    )

    @dataclass
    class KvtierOffloadingStats(KVConnectorStats):
        """vLLM's transfer records plus kvtier's metrics, as plain data."""

        data: dict[str, Any] = field(default_factory=m.new_payload)

        def __post_init__(self) -> None:
            if not self.data:
                self.reset()

        def reset(self) -> None:
            self.data = m.new_payload()

        def aggregate(self, other: Any) -> Any:
            if not other.is_empty():
                m.merge_payload(self.data, other.data)
            return self

        def reduce(self) -> dict[str, int | float]:
            return m.reduce_payload(self.data)

        def is_empty(self) -> bool:
            return m.payload_is_empty(self.data)

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
                        series = family.labels(*engine_labels, *m.label_values(key))
                        self._series[(engine_idx, name, key)] = series
                    if kind == "counter":
                        series.inc(value)
                    elif kind == "gauge":
                        series.set(value)
                    else:
                        for observation in value:
                            series.observe(observation)

    class OffloadingConnector(_VllmOffloadingConnector):  # type: ignore[misc,no-redef]
        """vLLM's ``OffloadingConnector`` that also reports its manager's metrics."""

        def get_kv_connector_stats(self) -> Any:
            stats = KvtierOffloadingStats()
            if self.connector_worker is not None:
                records = super().get_kv_connector_stats()
                for kind, ops in (records.data if records is not None else {}).items():
                    for op in ops:
                        size = op["op_size"] if isinstance(op, dict) else op.op_size
                        seconds = op["op_time"] if isinstance(op, dict) else op.op_time
                        m.add_transfer(stats.data, kind, size, seconds)
                # Every step, even empty: these releases ask the scheduler side for its
                # stats only in steps where a worker reported some.
                return stats
            collect = getattr(self.connector_scheduler.manager, "collect_metrics", None)
            for kind, name, value, labels in collect() if collect is not None else ():
                if kind != "counter" or value:
                    m.add_metric(stats.data, kind, name, value, labels)
            return None if stats.is_empty() else stats

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
            return KvtierOffloadingStats(data=data) if data is not None else KvtierOffloadingStats()

        @classmethod
        def build_prom_metrics(
            cls,
            vllm_config: Any,
            metric_types: Any,
            labelnames: list[str],
            per_engine_labelvalues: dict[int, list[object]],
        ) -> Any:
            return KvtierOffloadPromMetrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
