"""What differs between the vLLM releases the specs support, in one place.

vLLM rewrote the offloading interfaces that kvtier implements between 0.23 (the
release vllm-ascend 0.23 runs on) and 0.26. Every difference is detected from vLLM's
own modules, not from version numbers (the release that changed it in brackets):

* **Spec construction** (0.26). A spec is built from an ``OffloadingConfig``
  (``vllm.v1.kv_offload.config``); before, from ``(vllm_config, kv_cache_config)``.
  There :data:`SpecBase` is :mod:`kvtier.tiering_spec.vllm_legacy_spec`'s, which
  derives the same fields from the engine's configs and sets ``block_size_factor`` to
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
  transfer records only. There kvtier's connector builds on
  :mod:`kvtier.tiering_spec.vllm_legacy_metrics` (:data:`ConnectorBase`): vLLM's
  connector, plus the kvtier manager's metrics in a stats payload of plain data
  (:mod:`kvtier.tiering_spec.metrics`) and Prometheus metrics of its own. With a spec
  that is not kvtier's it reports what vLLM's connector reports.

The code of an older interface generation lives in a module of its own that only that
generation imports; every class is defined unconditionally at module level.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar, cast

from vllm.v1.kv_offload import base as _base
from vllm.v1.kv_offload.base import OffloadingSpec

from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec.manager import Lookup
from kvtier.vllm_port import connector_api

# The newer interfaces, each present from the release that introduced it.
CONFIG_API = importlib.util.find_spec("vllm.v1.kv_offload.config") is not None
LOOKUP_RESULT = hasattr(_base, "LookupResult")
EVENT_MEDIUM = hasattr(_base, "Medium")
SPEC_METRICS = hasattr(OffloadingSpec, "build_metric_definitions")
WORKER_API = hasattr(_base, "OffloadingWorker")

# The base of kvtier's worker: vLLM 0.32's ABC, or nothing where vLLM has handlers.
WorkerBase: type = getattr(_base, "OffloadingWorker", object)


def transfer_result(job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
    """vLLM's ``TransferResult`` of one finished job."""
    if WORKER_API:
        result: Any = _base.TransferResult  # type: ignore[attr-defined]
    else:
        result = importlib.import_module("vllm.v1.kv_offload.worker.worker").TransferResult
    return result(job_id=job_id, success=success, transfer_size=nbytes, transfer_time=seconds)


# A spec's base: vLLM's ``OffloadingSpec``, or before 0.26 one that derives vLLM 0.32's
# ``OffloadingConfig`` fields from the engine's configs (kvtier.tiering_spec.vllm_legacy_spec).
SpecBase: type = (
    OffloadingSpec
    if CONFIG_API
    else importlib.import_module("kvtier.tiering_spec.vllm_legacy_spec").LegacySpecBase
)


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


# -- the connector -----------------------------------------------------------------------

# The base of kvtier's OffloadingConnector: vLLM's, or before 0.24 vLLM's plus kvtier's
# metrics (kvtier.tiering_spec.vllm_legacy_metrics).
ConnectorBase: type = importlib.import_module(
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
    if SPEC_METRICS
    else "kvtier.tiering_spec.vllm_legacy_metrics"
).OffloadingConnector


def _worker_metadata_base() -> type | None:
    try:  # where completed jobs reach the scheduler in worker metadata (0.23 to 0.33)
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
    except ImportError:  # pragma: no cover - a release without it: vLLM's connector as is
        return None
    result: type = OffloadingWorkerMetadata
    return result


# vLLM's worker metadata class, or None on a release without one.
WorkerMetadataBase: type | None = _worker_metadata_base()


# Whether a connector can report a failed load as a failed request
# (``KVConnectorTransferResults.failed_recving``, vLLM 0.32): the only way a model with
# several KV cache groups recomputes a failed load instead of stopping the engine.
REQUEST_LEVEL_LOAD_FAILURES = connector_api.request_level_load_failures()


def load_job_requests(connector: Any) -> dict[int, str]:
    """The request of each load job in flight on ``connector``'s worker side (vLLM's
    ``OffloadingConnectorWorker`` keeps them privately; read here only)."""
    worker = getattr(connector, "connector_worker", None)
    jobs = getattr(worker, "_load_jobs", None)
    return dict(jobs) if isinstance(jobs, dict) else {}


def store_job_keys(connector: Any, job_id: int) -> list[Any] | None:
    """The keys of store job ``job_id`` on ``connector``'s scheduler side, or None if it
    is not a store job in flight there (vLLM's ``OffloadingConnectorScheduler`` keeps its
    jobs privately; read here only)."""
    jobs = getattr(getattr(connector, "connector_scheduler", None), "_jobs", None)
    status = jobs.get(job_id) if isinstance(jobs, dict) else None
    if status is None or not getattr(status, "is_store", False):
        return None
    return list(status.keys)


# ---------------------------------------------------------------- per-request state
# vLLM 0.32's ReqContext keeps per-request objects by type (get_state / set_state) and
# knows each key's place in the prompt (get_offload_key_position); older ones have
# neither, and kvtier marks the context itself where it can.

_STATE_ATTR = "_kvtier_state_"
_T = TypeVar("_T")


def keeps_request_state(req_context: Any) -> bool:
    """Whether ``req_context`` keeps per-request objects (vLLM 0.32 and later)."""
    return getattr(req_context, "get_state", None) is not None


def request_state(req_context: Any, kind: type[_T]) -> _T | None:
    """The object of type ``kind`` kept for the request, or None."""
    get_state = getattr(req_context, "get_state", None)
    if get_state is not None:
        return cast("_T | None", get_state(kind))
    return cast("_T | None", getattr(req_context, _STATE_ATTR + kind.__name__, None))


def set_request_state(req_context: Any, state: object) -> bool:
    """Keep ``state`` for the request (one object per type); False where the context
    can keep nothing."""
    set_state = getattr(req_context, "set_state", None)
    if set_state is not None:
        set_state(state)
        return True
    try:
        setattr(req_context, _STATE_ATTR + type(state).__name__, state)
    except AttributeError:
        return False
    return True


def key_positions(req_context: Any, keys: list[Any]) -> list[Any] | None:
    """Each key's place in the request's prompt, where the scheduler tells it."""
    position = getattr(req_context, "get_offload_key_position", None)
    return None if position is None else [position(key) for key in keys]
