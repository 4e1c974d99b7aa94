"""The one module that maps vLLM's offloading interfaces onto kvtier's objects.

``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` implement vLLM 0.32's
``OffloadingSpec``: the manager is :class:`~kvtier.tiering_spec.manager.TierManager`
(kvtier-blockpool plus fs tiers), the worker is
:class:`~kvtier.tiering_spec.worker.OffloadTransferWorker` (kvtier-npu-copy).
Everything with logic lives in those modules and is tested without an engine.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.blockpool import HostBlockPool, HostRegion, resolve_budget, round_up
from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec.config import ConfigError, OffloadConfig, parse_config
from kvtier.tiering_spec.fsformat import ALIGNMENT, FORMAT_VERSION
from kvtier.tiering_spec.fstier import FileSystemTier
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.worker import OffloadTransferWorker

logger = logging.getLogger("kvtier.tiering_spec")

_LOOKUP = {Lookup.HIT: LookupResult.HIT, Lookup.HIT_PENDING: LookupResult.HIT_PENDING}


def _region_name(engine_id: str, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:150] or "engine"
    return f"tiering-{safe}-r{rank}"


class _KvtierSpec(OffloadingSpec):
    """What both specs share: config validation, budget, worker."""

    TIERING = False

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        out: dict[str, OffloadingMetricMetadata] = {}
        for name, (kind, doc, labels, buckets) in m.metric_table(
            extra_config, tiering=cls.TIERING
        ).items():
            if kind == "counter":
                out[name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
            elif kind == "gauge":
                out[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=labels)
            else:
                out[name] = OffloadingHistogramMetadata(
                    documentation=doc, labelnames=labels, buckets=buckets
                )
        return out

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings: OffloadConfig = parse_config(self.extra_config, tiering=self.TIERING)
        parallel = config.parallel
        self.world_size = max(1, int(parallel.world_size))
        self.rank = int(parallel.rank)
        bpc = int(self.blocks_per_chunk)
        wkb = int(config.worker_kv_bytes_per_block)
        # A chunk is bpc sub-blocks of equal size, a multiple of 4096 bytes in all, so
        # O_DIRECT reads and writes it in place. KV pages are 4096-multiples in practice.
        self.sub_block_bytes = (
            wkb if (bpc * wkb) % ALIGNMENT == 0 else round_up(max(wkb, 1), ALIGNMENT)
        )
        self.chunk_bytes = bpc * self.sub_block_bytes
        self.num_chunks = 0
        if wkb > 0:
            try:
                budget = resolve_budget(
                    self.settings.budget,
                    world_size=self.world_size,
                    bytes_per_block=self.chunk_bytes,
                    alignment=ALIGNMENT,
                )
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            self.num_chunks = budget.num_blocks
            self.budget_description = budget.describe()
        else:
            self.budget_description = "no KV bytes per block known yet"
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None

    # -- scheduler side -------------------------------------------------------------

    def _layouts(self) -> list[dict[str, Any]]:
        cfg = self.config
        return [
            {
                "kvtier_format": FORMAT_VERSION,
                "model": cfg.model.name,
                "dtype": cfg.model.dtype,
                "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
                "sub_block_bytes": self.sub_block_bytes,
                "blocks_per_chunk": self.blocks_per_chunk,
                "tokens_per_block": list(self.tokens_per_block),
                "tokens_per_hash": self.tokens_per_hash,
                "groups": [[g.group_id, len(g.layer_names)] for g in cfg.groups],
                "kv_cache_layout": cfg.kv_cache_layout,
                "rank": rank,
                "world_size": self.world_size,
                "tp_size": cfg.parallel.tp_size,
                "pp_size": cfg.parallel.pp_size,
                "pcp_size": cfg.parallel.pcp_size,
                "dcp_size": cfg.parallel.dcp_size,
            }
            for rank in range(self.world_size)
        ]

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.num_chunks <= 0:
                raise ConfigError(
                    "kvtier: the KV bytes per block are unknown on the scheduler side, so the "
                    "host tier cannot be sized from cpu_bytes_to_use"
                )
            self._manager = KvtierOffloadingManager(self)
            logger.info(
                "kvtier %s active: host tier of %d chunks (%d device blocks each) x %d bytes "
                "per rank, %s eviction; %s",
                type(self).__name__,
                self.num_chunks,
                self.blocks_per_chunk,
                self.chunk_bytes,
                self.settings.eviction_policy,
                self.budget_description,
            )
        return self._manager

    def new_pool(self) -> HostBlockPool:
        s = self.settings
        return HostBlockPool(
            self.num_chunks,
            eviction_policy=s.eviction_policy,
            cache_policy_module_path=s.cache_policy_module_path,
            store_threshold=s.store_threshold,
            max_tracker_size=s.max_tracker_size,
            enable_events=self.kv_events_config.enable_kv_cache_events,
        )

    # -- worker side ----------------------------------------------------------------

    def _host_region(self) -> HostRegion:
        return HostRegion.private(self.num_chunks, self.chunk_bytes)

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = self._host_region()
            try:
                core = OffloadTransferWorker(
                    [t.tensor for t in kv_caches.tensors],
                    region,
                    num_chunks=self.num_chunks,
                    blocks_per_chunk=self.blocks_per_chunk,
                    sub_block_bytes=self.sub_block_bytes,
                )
            except Exception:
                region.close()
                raise
            self._worker = KvtierOffloadingWorker(core)
            logger.info(
                "kvtier %s worker rank %d: %d host chunks x %d bytes (%s), copies on %s (%s)",
                type(self).__name__,
                self.rank,
                self.num_chunks,
                self.chunk_bytes,
                region.pin_method,
                core.engine.device,
                core.engine.backend,
            )
        return self._worker


class CPUOffloadingSpec(_KvtierSpec):
    """kvtier's host-tier spec: host DRAM behind the device KV cache."""

    TIERING = False


class TieringOffloadingSpec(_KvtierSpec):
    """kvtier's multi-tier spec: the host tier plus secondary tiers (``fs``).

    The host region is shared (``/dev/shm``) so the scheduler's fs tier reads and
    writes the bytes that the workers copy to and from the device.
    """

    TIERING = True

    def _host_region(self) -> HostRegion:
        return HostRegion.create_shared(
            _region_name(self.config.engine_id, self.rank), self.num_chunks, self.chunk_bytes
        )

    def attach_regions(self) -> list[HostRegion] | None:
        """Map every rank's host region (None while a worker has not created its own)."""
        regions: list[HostRegion] = []
        try:
            for rank in range(self.world_size):
                regions.append(
                    HostRegion.attach_shared(
                        _region_name(self.config.engine_id, rank),
                        self.num_chunks,
                        self.chunk_bytes,
                        pin=False,
                    )
                )
        except FileNotFoundError:
            for r in regions:
                r.close()
            return None
        return regions

    def build_fs_tiers(self, on_regions: list[HostRegion]) -> list[FileSystemTier]:
        layouts = self._layouts()
        payload = self.chunk_bytes
        state: dict[str, list[memoryview] | None] = {"views": None}

        def views() -> list[memoryview] | None:
            if state["views"] is None:
                regions = self.attach_regions()
                if regions is None:
                    return None
                on_regions.extend(regions)
                state["views"] = [r.tensor.numpy().data.cast("B") for r in regions]
            return state["views"]

        tiers: list[FileSystemTier] = []
        try:
            for i, cfg in enumerate(self.settings.secondary_tiers):
                tiers.append(
                    FileSystemTier(
                        cfg,
                        layouts,
                        payload,
                        views,
                        name=cfg.type if i == 0 else f"{cfg.type}{i}",
                        enable_events=(
                            cfg.enable_kv_events and self.kv_events_config.enable_kv_cache_events
                        ),
                    )
                )
        except Exception:
            for t in tiers:
                t.shutdown()
            raise
        return tiers


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over :class:`TierManager`."""

    def __init__(self, spec: _KvtierSpec) -> None:
        self.spec = spec
        self._regions: list[HostRegion] = []
        tiers = (
            spec.build_fs_tiers(self._regions) if isinstance(spec, TieringOffloadingSpec) else []
        )
        self.core = TierManager(spec.new_pool(), tiers)
        self._metrics = m.MetricsEmitter(self.core, tiering=spec.TIERING)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP.get(self.core.lookup(key, req_context.req_id), LookupResult.MISS)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        return CacheHitSource.HOST if self.core.load_source(key) == "host" else CacheHitSource.DISK

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return CPULoadStoreSpec(self.core.prepare_load(list(keys)))

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.core.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.core.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        plan = self.core.prepare_store(list(keys))
        if plan is None:
            return None
        to_store, blocks, evicted = plan
        return PrepareStoreOutput(
            keys_to_store=cast(Any, to_store),
            store_spec=CPULoadStoreSpec(blocks),
            evicted_keys=cast(Any, evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.core.complete_store(list(keys), success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.core.pool.take_events():
            yield OffloadingEvent(
                keys=list(event.keys), medium=Medium.CPU, removed=event.kind == "removed"
            )
        for tier in self.core.fs_tiers:
            for removed, keys in tier.take_events():
                yield OffloadingEvent(
                    keys=cast(Any, list(keys)),
                    medium=Medium.STORAGE,
                    removed=removed,
                    locality=Locality(tier.cfg.locality),
                    ownership=tier.name,
                )

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.core.end_step()

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work()

    def reset_cache(self) -> None:
        self.core.reset(self.spec.new_pool())

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        for kind, name, value, labels in self._metrics.collect():
            if kind == "counter":
                if value:
                    stats.increase_counter(name, value, labels)
            elif kind == "gauge":
                stats.set_gauge(name, value, labels)
            else:
                stats.observe_histogram(name, value, labels)
        return None if stats.is_empty() else stats

    def shutdown(self) -> None:
        self.core.shutdown()
        for region in self._regions:
            region.close()
        self._regions.clear()


class KvtierOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` over :class:`OffloadTransferWorker`."""

    def __init__(self, core: OffloadTransferWorker) -> None:
        self.core = core

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        self.core.submit_store(
            job_id,
            src_spec.block_ids.tolist(),
            list(src_spec.group_sizes),
            list(src_spec.block_indices),
            dst_spec.block_ids.tolist(),  # type: ignore[attr-defined]
        )
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        self.core.submit_load(
            job_id,
            src_spec.block_ids.tolist(),  # type: ignore[attr-defined]
            dst_spec.block_ids.tolist(),
            list(dst_spec.group_sizes),
            list(dst_spec.block_indices),
        )
        return True

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(
                job_id=j.job_id, success=j.ok, transfer_size=j.nbytes, transfer_time=j.seconds
            )
            for j in self.core.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


# Names under which kvtier's classes are reachable with spec_module_path
# "kvtier.tiering_spec.vllm_adapter" or "kvtier.tiering_spec" whatever the registry holds.
KvtierCPUOffloadingSpec = CPUOffloadingSpec
KvtierTieringOffloadingSpec = TieringOffloadingSpec
