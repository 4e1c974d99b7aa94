"""The composition root of kvtier's offloading: from the engine's facts and the validated
settings to the host tier's size, its regions, the fingerprint, the pool, the secondary
tiers, the tier manager and the worker.

vLLM's spec (:mod:`kvtier.tiering_spec.vllm_adapter`) turns what vLLM hands it into an
:class:`~kvtier.tiering_spec.offload_facts.OffloadFacts` and calls :func:`build` once;
its manager and worker are thin mappings of what :meth:`Offload.scheduler` and
:meth:`Offload.worker` return. Nothing here imports vLLM, so the whole composition is
tested without it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.blockpool import HostBlockPool, HostRegion
from kvtier.tiering_spec import fingerprint, regions
from kvtier.tiering_spec.config import FsTierConfig, OffloadConfig
from kvtier.tiering_spec.errors import ConfigError
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.offload_facts import OffloadFacts
from kvtier.tiering_spec.private_dirs import make_private_dirs
from kvtier.tiering_spec.regions import AttachedRegions
from kvtier.tiering_spec.sizing import Sizing, size_host_tier, size_in_tokens
from kvtier.tiering_spec.tier_config import check_directory
from kvtier.tiering_spec.tiers.base import SecondaryTier
from kvtier.tiering_spec.tiers.fs.format import FORMAT_DIR
from kvtier.tiering_spec.tiers.registry import TierSite, build_tier
from kvtier.tiering_spec.traffic import TrafficRecorder
from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy
from kvtier.tiering_spec.worker import OffloadTransferWorker
from kvtier.vllm_port.facts import kv_shape, text_config

logger = logging.getLogger("kvtier.tiering_spec")


@dataclass
class SchedulerSide:
    """What the scheduler's manager runs on.

    Attributes:
        core: the tier manager (host pool and secondary tiers).
        regions: the host regions the secondary tiers map (None without tiers).
        new_pool: a fresh empty pool as the settings configure it (``reset_cache``).
        offload: what it was built from (the engine's facts, the settings).
        info_row: the host tier's sizing as vLLM's CPU tier publishes it.
        traffic: the record of the requests served (``record_traffic_dir``), or None.
    """

    core: TierManager
    regions: AttachedRegions | None
    new_pool: Callable[[], HostBlockPool]
    offload: Offload
    info_row: dict[str, Any]
    traffic: TrafficRecorder | None = None


@dataclass
class WorkerSide:
    """A worker's copy engine over its host region; ``store`` is False on the ranks that
    only read a replicated layout's one copy."""

    core: OffloadTransferWorker
    region: HostRegion
    store: bool


class Offload:
    """kvtier's offloading for one engine, sized; its parts are built on demand
    (:meth:`scheduler` on the scheduler, :meth:`worker` on each worker rank)."""

    def __init__(
        self, facts: OffloadFacts, settings: OffloadConfig, *, tiering: bool, name: str
    ) -> None:
        self.facts = facts
        self.settings = settings
        self.tiering = tiering
        self.name = name  # the spec's class name, in logs
        self.sizing: Sizing = size_host_tier(facts, settings, replicated=self._replicated())
        engine = facts.engine
        self.no_loads_reason = fingerprint.cached_prefix_unusable(engine)
        # Whether requests may carry a LoRA adapter (None: the facts were not handed over).
        self.lora_enabled: bool | None = None if engine is None else engine.lora.enabled
        self._scheduler: SchedulerSide | None = None

    # -- the host tier --------------------------------------------------------------

    def _replicated(self) -> bool:
        """Whether one host copy serves every rank: vLLM reports the KV replicated, and
        every rank can map one region (shared memory that can be page-locked where the
        copies need it)."""
        facts = self.facts
        if not (facts.replicated_layout and max(1, facts.world_size) > 1):
            return False
        if self.tiering:
            return True  # its regions are shared memory anyway
        # A mapped file can be page-locked on CUDA only; where it cannot (Ascend),
        # per-rank private pinned copies keep the copies fast, as vLLM's spec does.
        accel = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        if accel is None or accel.type in ("cpu", "cuda"):
            return True
        logger.info(
            "kvtier %s: KV replicated across ranks, but a shared host region cannot be "
            "page-locked on %s; each rank keeps its own pinned copy",
            self.name,
            accel.type,
        )
        return False

    def config_info_row(self) -> dict[str, Any]:
        """The host tier's sizing as vLLM's CPU tier publishes it: chunks, device blocks
        per chunk, bytes (every copy, padding included) and the tokens it holds for
        requests of ``max_model_len`` tokens ("None" where that length is not known)."""
        s = self.sizing
        return {
            "cpu_num_chunks": s.num_chunks,
            "cpu_blocks_per_chunk": int(self.facts.blocks_per_chunk),
            "cpu_kv_cache_size_bytes": s.num_chunks * s.kv_bytes_per_chunk,
            "cpu_kv_cache_size_tokens": size_in_tokens(self.facts, s.num_chunks),
        }

    def new_pool(self) -> HostBlockPool:
        """An empty host pool with the configured eviction policy."""
        s, n = self.settings, self.sizing.num_chunks
        vllm_policy = resolve_vllm_policy(s.eviction_policy, s.cache_policy_module_path)
        return HostBlockPool(
            n,
            eviction_policy=s.eviction_policy,
            cache_policy_module_path=s.cache_policy_module_path,
            policy=None if vllm_policy is None else vllm_policy(n),
            enable_events=self.facts.kv_events,
        )

    # -- the fingerprint ------------------------------------------------------------

    def engine_identity(self, digest_cache: str | None = None) -> tuple[dict[str, Any], bool]:
        """See :func:`kvtier.tiering_spec.fingerprint.engine_identity`."""
        return fingerprint.engine_identity(
            self.facts, self.sizing, self.settings.model_identity, digest_cache
        )

    def layouts(self, identity: dict[str, Any]) -> list[dict[str, Any]]:
        """One fingerprint layout per host copy."""
        return fingerprint.layouts(identity, self.sizing.num_copies)

    # -- the regions ----------------------------------------------------------------

    def host_region(self) -> HostRegion:
        """This worker rank's host region: the replicated layout's one, a shared one the
        secondary tiers map, or a private one."""
        s, facts = self.sizing, self.facts
        if s.replicated_layout:
            return regions.replica_region(facts.engine_id, facts.rank, s.num_chunks, s.chunk_bytes)
        if self.tiering:
            name = regions.region_name(facts.engine_id, facts.rank)
            return HostRegion.create_shared(name, s.num_chunks, s.chunk_bytes)
        return HostRegion.private(s.num_chunks, s.chunk_bytes)

    def attach_regions(self) -> list[HostRegion] | None:
        """Every copy's host region, mapped (None while a worker has not created its own)."""
        s = self.sizing
        return regions.attach_regions(
            self.facts.engine_id, s.num_copies, s.num_chunks, s.chunk_bytes
        )

    # -- the scheduler --------------------------------------------------------------

    def secondary_tiers(self) -> tuple[list[SecondaryTier], AttachedRegions | None]:
        """The secondary tiers, in order, and the host regions they read and write,
        attached on first use (none for the host tier alone)."""
        configured = self.settings.secondary_tiers if self.tiering else ()
        if not configured:
            return [], None
        # The digests of the weight files are cached beside the first fs tier's files.
        fs_roots = [t.root_dir for t in configured if isinstance(t, FsTierConfig)]
        digest_dir = (
            os.path.join(fs_roots[0], FORMAT_DIR)
            if fs_roots
            else os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtier"
            )
        )
        make_private_dirs(digest_dir, "fs tier directory")
        identity, persistent = self.engine_identity(os.path.join(digest_dir, "weight-digests.json"))
        attached = AttachedRegions(self.attach_regions)
        site = TierSite(self.layouts(identity), self.sizing.chunk_bytes, attached.views, persistent)
        tiers: list[SecondaryTier] = []
        seen: dict[str, int] = {}
        try:
            for i, cfg in enumerate(configured):
                n = seen[cfg.type] = seen.get(cfg.type, -1) + 1
                name = cfg.type if n == 0 else f"{cfg.type}{n}"
                events = cfg.enable_kv_events and self.facts.kv_events
                tiers.append(build_tier(cfg, f"secondary_tiers[{i}]", name, events, site))
        except Exception:
            for t in tiers:
                t.shutdown()
            raise
        return tiers, attached

    def scheduler(self) -> SchedulerSide:
        """The scheduler's tier manager over a new pool and the secondary tiers, built
        once. Raises ``ConfigError`` where the host tier cannot be sized."""
        if self._scheduler is not None:
            return self._scheduler
        s = self.sizing
        if s.num_chunks <= 0:
            raise ConfigError(
                "kvtier: the KV bytes per block are unknown on the scheduler side, so the "
                "host tier cannot be sized from cpu_bytes_to_use"
            )
        traffic = self.traffic_recorder()
        try:
            tiers, attached = self.secondary_tiers()
        except BaseException:
            if traffic is not None:
                traffic.close()
            raise
        settings = self.settings
        core = TierManager(
            self.new_pool(),
            tiers,
            store_threshold=settings.store_threshold,
            max_tracker_size=settings.max_tracker_size,
        )
        self._scheduler = SchedulerSide(
            core,
            attached,
            self.new_pool,
            offload=self,
            info_row=self.config_info_row(),
            traffic=traffic,
        )
        if self.no_loads_reason is not None:
            logger.warning(
                "kvtier %s: %s, so kvtier loads nothing into this engine (every lookup "
                "is a miss); it still stores",
                self.name,
                self.no_loads_reason,
            )
        logger.info(
            "kvtier %s active: host tier of %d chunks (%d device blocks each) x %d bytes "
            "%s, %s eviction; %s",
            self.name,
            s.num_chunks,
            self.facts.blocks_per_chunk,
            s.chunk_bytes,
            "in one copy for all ranks" if s.replicated_layout else "per rank",
            settings.eviction_policy,
            s.budget_description,
        )
        return self._scheduler

    def traffic_recorder(self) -> TrafficRecorder | None:
        """The record of the requests this engine serves (``record_traffic_dir``), or
        None; its header says what an id stands for (see :mod:`.traffic`)."""
        folder = self.settings.record_traffic_dir
        if folder is None:
            return None
        check_directory(folder, "record_traffic_dir")  # as an fs tier's root_dir
        facts, s = self.facts, self.sizing
        tokens = self.chunk_hashes() * max(1, facts.tokens_per_hash)
        kv = facts.engine.kv if facts.engine is not None else None
        header = {
            "tokens_per_id": tokens,
            "bytes_per_id": s.kv_bytes_per_chunk,
            "model": facts.model_name,
            "cache_dtype": facts.cache_dtype,
            "world_size": max(1, facts.world_size),
            "device_ids": None if kv is None else kv.num_blocks // int(facts.blocks_per_chunk),
            "eviction_policy": self.settings.eviction_policy,
            "host_ids": s.num_chunks,
            "model_shape": _model_shape(facts),
        }
        try:
            recorder = TrafficRecorder(
                folder, header, max_bytes=self.settings.record_traffic_max_bytes
            )
        except OSError as exc:
            raise ConfigError(f"record_traffic_dir={folder!r} cannot be opened: {exc}") from None
        logger.info(
            "kvtier %s: recording the requests it serves in %s (%d tokens per id)",
            self.name,
            folder,
            tokens,
        )
        return recorder

    def chunk_hashes(self) -> int:
        """Entries of a request's block hashes per offloaded chunk (the last of each
        names the chunk with its whole prefix)."""
        tokens = int(self.facts.blocks_per_chunk) * self.facts.tokens_per_block[0]
        return max(1, tokens // max(1, self.facts.tokens_per_hash))

    # -- a worker -------------------------------------------------------------------

    def worker(self, kv_tensors: list[torch.Tensor]) -> WorkerSide:
        """This rank's copy engine between ``kv_tensors`` (the device KV cache) and its
        host region."""
        s = self.sizing
        region = self.host_region()
        try:
            core = OffloadTransferWorker(
                kv_tensors,
                region,
                num_chunks=s.num_chunks,
                blocks_per_chunk=self.facts.blocks_per_chunk,
                sub_block_bytes=s.sub_block_bytes,
            )
        except Exception:
            region.close()
            raise
        logger.info(
            "kvtier %s worker rank %d: %d host chunks x %d bytes (%s), copies on %s (%s)",
            self.name,
            self.facts.rank,
            s.num_chunks,
            s.chunk_bytes,
            region.pin_method,
            core.engine.device,
            core.engine.backend,
        )
        store = not s.replicated_layout or self.facts.rank == 0
        return WorkerSide(core=core, region=region, store=store)


def _model_shape(facts: OffloadFacts) -> dict[str, Any] | None:
    """The recorded model's shape for a traffic record's header (None where the engine's
    facts were not handed over): its KV layers, heads and head size, and dtype."""
    engine = facts.engine
    if engine is None:
        return None
    try:
        config = text_config(json.loads(engine.model.hf_config_json))
    except (TypeError, ValueError):
        return None
    layers, kv_heads, head_dim = kv_shape(config)
    return {
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "dtype": facts.cache_dtype,
    }


def build(facts: OffloadFacts, settings: OffloadConfig, *, tiering: bool, name: str) -> Offload:
    """kvtier's offloading for the engine ``facts`` describes, configured by ``settings``
    (``tiering``: the multi-tier spec, which keeps its host regions in shared memory for
    the secondary tiers). ``name`` names the spec in logs. Sizes the host tier now
    (raising ``ConfigError`` for a budget that buys nothing); the scheduler's and the
    workers' parts are built when asked for."""
    return Offload(facts, settings, tiering=tiering, name=name)
