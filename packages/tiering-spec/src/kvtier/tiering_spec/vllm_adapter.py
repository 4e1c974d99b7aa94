"""kvtier's offloading specs for vLLM.

``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` implement vLLM 0.32's
``OffloadingSpec``: they size the chunks, name and map the host regions, identify the
engine (the model fingerprint) and build the secondary tiers. Their manager is
:class:`~kvtier.tiering_spec.vllm_manager.KvtierOffloadingManager` over
:class:`~kvtier.tiering_spec.manager.TierManager` (kvtier-blockpool plus the tiers),
their worker :class:`~kvtier.tiering_spec.vllm_worker.KvtierOffloadingWorker` over
:class:`~kvtier.tiering_spec.worker.OffloadTransferWorker` (kvtier-npu-copy). Everything
with logic lives in those modules and is tested without an engine.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
import xxhash
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
)

from kvtier.blockpool import HostBlockPool, HostRegion, resolve_budget, round_up
from kvtier.tiering_spec import metrics as m
from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.config import (
    ConfigError,
    FsTierConfig,
    OffloadConfig,
    parse_config,
)
from kvtier.tiering_spec.identity import digest_model, resolve_model_location
from kvtier.tiering_spec.private_dirs import make_private_dirs
from kvtier.tiering_spec.tiers.base import SecondaryTier
from kvtier.tiering_spec.tiers.fs.format import ALIGNMENT, FORMAT_DIR, FORMAT_VERSION
from kvtier.tiering_spec.tiers.registry import TierSite, build_tier
from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager
from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy
from kvtier.tiering_spec.vllm_worker import KvtierOffloadingWorker
from kvtier.tiering_spec.worker import OffloadTransferWorker
from kvtier.vllm_port.facts import EngineFacts

logger = logging.getLogger("kvtier.tiering_spec")

# How long a worker rank waits for rank 0 to create the one host region that every rank
# of a replicated layout maps; ranks start their workers at about the same time.
REPLICA_WAIT_S = 120.0


def _region_name(engine_id: str, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:150] or "engine"
    return f"tiering-{safe}-r{rank}"


def _tensor_placement(fields: Any, num_blocks: int) -> Any:
    """How one ``KVCacheTensor`` (its plain rendering) places its layers' pages, without
    what depends on the number of device blocks (it changes with free device memory from
    one start to the next, and the bytes of a block do not)."""
    if not isinstance(fields, dict):
        return fields
    fields = {k: v for k, v in fields.items() if k != "size"}  # the facts stay as they are
    # Layer-major tensors step a layer by num_blocks blocks: keep that count in layers.
    span = int(fields.get("block_stride") or 0) * num_blocks
    for name in ("layer_stride", "offset"):
        value = fields.get(name)
        if isinstance(value, int) and span:
            fields[name] = [value // span, value % span]
    return fields


def _engine_fields(facts: EngineFacts) -> dict[str, Any]:
    """What vLLM's configs say about the KV a model computes and how it is keyed: the
    model's config, dtype and overrides, vLLM and its attention backend, the block-hash
    scheme (with a warning where its seed is random) and every KV cache group and tensor."""
    model, block_hash, kv = facts.model, facts.block_hash, facts.kv
    assert kv is not None
    if block_hash.seed == "random":
        logger.warning(
            "kvtier fs tier: vLLM seeds its block hashes (prefix_caching_hash_algo=%s) "
            "with a random value per process, so the files this engine writes are "
            "never found after a restart or by another engine. Set PYTHONHASHSEED to "
            "one value for every engine%s",
            block_hash.algo,
            ", or use prefix_caching_hash_algo=sha256" if block_hash.fixed_seed_default else "",
        )
    draft = model.draft
    return {
        "vllm_version": facts.vllm_version,
        "platform": facts.platform,
        "revision": model.revision,
        "quantization": model.quantization,
        "model_dtype": model.dtype,
        "hf_config": xxhash.xxh3_128_hexdigest(model.hf_config_json.encode()),
        "hf_overrides": model.hf_overrides,
        "load_format": model.load_format,
        "attention_backend": facts.attention_backend,
        "speculative": None if draft is None else [draft.method, str(draft.model)],
        "block_hash": [block_hash.algo, block_hash.seed],
        "kv_cache_groups": [[list(g.layer_names), g.spec] for g in kv.groups],
        "kv_cache_tensors": [_tensor_placement(t.fields, kv.num_blocks) for t in kv.tensors],
    }


def _cached_prefix_unusable(facts: EngineFacts | None) -> str | None:
    """Why this engine cannot be given KV it did not compute itself, or None."""
    if facts is None:
        return None
    if facts.model.use_mla and facts.platform_is_cpu and not facts.block_hash.prefix_caching:
        # vLLM's CPU MLA backend computes a prompt on top of cached KV differently from
        # computing it whole (greedy outputs diverge even with vLLM's own prefix cache).
        return (
            "vLLM turned prefix caching off for this MLA model on its CPU platform, whose "
            "MLA backend does not give the same results on top of cached KV"
        )
    return None


def _stand_in_for_vllms_cpu_spec() -> None:
    """Make kvtier's specs count as vLLM's ``CPUOffloadingSpec`` where vLLM asks.

    vLLM 0.32's connector metrics keep its deprecated transfer metrics
    (``vllm:kv_offload_total_bytes``, ``vllm:kv_offload_total_time``,
    ``vllm:kv_offload_size``) only for a spec class that subclasses its
    ``CPUOffloadingSpec`` (as its ``TieringOffloadingSpec`` does), and ask right
    after the spec's ``build_metric_definitions``. kvtier's specs answer that name, so
    they are registered as its virtual subclasses (``ABC.register``): ``issubclass``
    and ``isinstance`` say yes, and nothing of vLLM's class is inherited. Idempotent; a
    release without that class, or where it is no ABC, is left alone.
    """
    vllm_cpu_spec: Any = compat.PORT.vllm_cpu_spec()
    if vllm_cpu_spec is None:
        return
    for spec in (CPUOffloadingSpec, TieringOffloadingSpec):
        if not issubclass(spec, vllm_cpu_spec):
            vllm_cpu_spec.register(spec)


# vLLM 0.33's labels of the host tier's sizing (CPUOffloadingInfo).
CONFIG_INFO_KEYS = (
    "cpu_num_chunks",
    "cpu_blocks_per_chunk",
    "cpu_kv_cache_size_bytes",
    "cpu_kv_cache_size_tokens",
)


def _size_in_tokens(spec: Any, num_chunks: int) -> int | str:
    """Tokens ``num_chunks`` host chunks hold for requests of the model's longest
    length, each KV cache group taking its chunks (a sliding-window group at most its
    window's): vLLM's reckoning. "None" where the length or the groups are unknown."""
    config = spec.config
    max_len = int(getattr(getattr(config, "model", None), "max_model_len", 0) or 0)
    groups = list(getattr(config, "groups", None) or ())
    tokens_per_block = list(getattr(spec, "tokens_per_block", None) or ())
    if max_len <= 0 or not groups or len(tokens_per_block) != len(groups):
        return "None"
    per_request = 0
    for group, per_block in zip(groups, tokens_per_block):
        chunks = -(-max_len // (int(per_block) * int(spec.blocks_per_chunk)))
        window = getattr(group, "sliding_window_size_in_chunks", None)
        if window is not None:
            chunks = min(chunks, int(window))
        per_request += chunks
    return num_chunks * max_len // per_request if per_request else "None"


class _KvtierSpec(compat.SpecBase):  # type: ignore[misc,valid-type]
    """What both specs share: config validation, budget, worker.

    vLLM builds a spec from an ``OffloadingConfig`` (vLLM 0.32) or from its
    ``(vllm_config, kv_cache_config)`` (older releases); :mod:`.vllm_compat` makes both
    look like the first.
    """

    TIERING = False
    extra_config: dict[str, Any]  # vLLM's spec sets it: kv_connector_extra_config

    def build_secondary_tiers(self) -> tuple[list[SecondaryTier], AttachedRegions | None]:
        """The secondary tiers and the regions they use: none for the CPU spec."""
        return [], None

    # Set by kvtier's connector, which reports failed transfers to vLLM's scheduler
    # as blocks to recompute instead of failing vLLM's assertion.
    failures_reported = False

    @classmethod
    def kvtier_metric_table(cls, extra_config: Mapping[str, Any]) -> dict[str, m.MetricRow]:
        return m.metric_table(extra_config, tiering=cls.TIERING)

    @classmethod
    def config_info_keys(cls, extra_config: Mapping[str, Any]) -> tuple[str, ...]:
        """The labels of vLLM's (0.33) ``vllm:kv_offload_config_info`` that the manager's
        ``config_info`` fills: the host tier's sizing, as vLLM's CPU spec names it, and
        with secondary tiers the tier's label."""
        return CONFIG_INFO_KEYS + ((m.TIER_LABEL,) if cls.TIERING else ())

    def config_info_row(self) -> dict[str, Any]:
        """The host tier's sizing as vLLM's CPU tier publishes it: chunks, device blocks
        per chunk, bytes (every copy, padding included) and the tokens it holds for
        requests of ``max_model_len`` tokens ("None" where that length is not known)."""
        return {
            "cpu_num_chunks": self.num_chunks,
            "cpu_blocks_per_chunk": int(self.blocks_per_chunk),
            "cpu_kv_cache_size_bytes": self.num_chunks * self.kv_bytes_per_chunk,
            "cpu_kv_cache_size_tokens": _size_in_tokens(self, self.num_chunks),
        }

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        # vLLM's metrics ask next whether this class is its CPUOffloadingSpec.
        _stand_in_for_vllms_cpu_spec()
        return compat.metric_definitions(cls.kvtier_metric_table(extra_config))

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        config = self.config
        extra: dict[str, Any] = self.extra_config
        self.settings: OffloadConfig = parse_config(extra, tiering=self.TIERING)
        # vLLM 0.33's scheduler reads its budget of synchronous loads from here (0 when
        # unset); kvtier's default applies there too. On 0.32 kvtier's connector does it.
        if "sync_load_budget_bytes" not in extra:
            sync_budget = self.settings.sync_load_budget_bytes
            self.extra_config = {**extra, "sync_load_budget_bytes": sync_budget}
        parallel = config.parallel
        self.world_size = max(1, int(parallel.world_size))
        self.rank = int(parallel.rank)
        # vLLM's worker lets only rank 0 store when this is set: every rank then reads
        # and rank 0 writes the one copy that the host and fs tiers keep.
        self.replicated_layout = (
            bool(getattr(config, "replicated_layout", False) and self.world_size > 1)
            and self._can_share_replica()
        )
        self.num_copies = 1 if self.replicated_layout else self.world_size
        bpc = int(self.blocks_per_chunk)
        wkb = int(config.worker_kv_bytes_per_block)
        # A chunk is bpc sub-blocks of equal size, a multiple of 4096 bytes in all, so
        # O_DIRECT reads and writes it in place. KV pages are 4096-multiples in practice.
        self.sub_block_bytes = (
            wkb if (bpc * wkb) % ALIGNMENT == 0 else round_up(max(wkb, 1), ALIGNMENT)
        )
        self.chunk_bytes = bpc * self.sub_block_bytes
        # A chunk's bytes in every copy the host tier keeps (vLLM's name for it).
        self.kv_bytes_per_chunk = self.chunk_bytes * self.num_copies if wkb > 0 else 0
        # A chunk's bytes in one worker's copy (vLLM's name for it).
        self.cpu_page_size_per_worker = self.chunk_bytes if wkb > 0 else 0
        self.num_chunks = 0
        if wkb > 0:
            try:
                # One copy gets the whole of cpu_bytes_to_use (as vLLM's spec gives
                # it), or cpu_bytes_to_use_per_rank: what each rank maps.
                budget = resolve_budget(
                    self.settings.budget,
                    world_size=self.num_copies,
                    bytes_per_block=self.chunk_bytes,
                    alignment=ALIGNMENT,
                )
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            self.num_chunks = budget.num_blocks
            self.budget_description = budget.describe()
            if self.replicated_layout:
                self.budget_description += (
                    f"; one copy for all {self.world_size} ranks (vLLM reports the KV "
                    "replicated across them), stored by rank 0"
                )
        else:
            self.budget_description = "no KV bytes per block known yet"
        self._manager: KvtierOffloadingManager | None = None
        self._worker: KvtierOffloadingWorker | None = None
        # The connector building this spec hands over the engine's facts: what identifies
        # the model and the KV layout (only the fs tier's fingerprint needs all of it).
        facts = compat.engine_facts(self)
        self.no_loads_reason = _cached_prefix_unusable(facts)
        # Whether requests may carry a LoRA adapter (None: the facts were not handed over).
        self.lora_enabled: bool | None = None if facts is None else facts.lora.enabled
        self._facts = facts if self.settings.secondary_tiers else None

    def _can_share_replica(self) -> bool:
        """Whether every rank can map one host region: it must be shared memory, and
        this spec keeps its per-rank private regions where a shared one cannot be
        page-locked."""
        return True

    # -- scheduler side -------------------------------------------------------------

    def engine_identity(self, digest_cache: str | None = None) -> tuple[dict[str, Any], bool]:
        """What the KV in an fs tier file depends on, besides the rank: the model's
        weights and config, the block-hash scheme, the KV layout, kvtier's format.

        Returns ``(identity, persistent)``; ``persistent`` is False where the weights
        could not be identified, and the identity then holds a nonce of this engine
        alone, so no other engine (and no later start) reads its files.
        """
        cfg = self.config
        ident: dict[str, Any] = {
            "kvtier_format": FORMAT_VERSION,
            "model": cfg.model.name,
            "cache_dtype": cfg.model.dtype,
            "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
            "sub_block_bytes": self.sub_block_bytes,
            "blocks_per_chunk": self.blocks_per_chunk,
            "tokens_per_block": list(self.tokens_per_block),
            "tokens_per_hash": self.tokens_per_hash,
            "groups": [[g.group_id, list(g.layer_names)] for g in cfg.groups],
            "kv_cache_layout": cfg.kv_cache_layout,
            "replicated_layout": bool(getattr(cfg, "replicated_layout", False)),
            "world_size": self.world_size,
            "tp_size": cfg.parallel.tp_size,
            "pp_size": cfg.parallel.pp_size,
            "pcp_size": cfg.parallel.pcp_size,
            "dcp_size": cfg.parallel.dcp_size,
        }
        facts = self._facts
        if facts is None or facts.kv is None:
            unverified = "vLLM's model and KV cache configs were not found"
        else:
            ident.update(_engine_fields(facts))
            ident["weights"], unverified = self._weights(facts, digest_cache)
        if unverified:
            ident["weights"] = ["unverified", secrets.token_hex(16)]
            logger.warning(
                "kvtier fs tier: %s, so nothing proves that files on disk were computed by "
                "this model. This engine writes and reads only files of its own, and "
                "removes them at shutdown. To share files between engines and restarts, set "
                "model_identity in kv_connector_extra_config to a name you change whenever "
                "the weights change",
                unverified,
            )
        return ident, not unverified

    def _weights(self, facts: EngineFacts, digest_cache: str | None) -> tuple[Any, str]:
        """(what identifies the weights, "") or (None, why they cannot be identified)."""
        if self.settings.model_identity is not None:
            return ["model_identity", self.settings.model_identity], ""
        model = facts.model
        load_format = str(model.load_format)
        if load_format == "dummy":
            return None, "load_format=dummy draws new random weights at every start"
        models = [(model.name, model.revision)]
        draft = model.draft
        if draft is not None and draft.model and draft.model != model.name:
            models.append((draft.model, draft.revision))
        weights = []
        for name, revision in models:
            where = resolve_model_location(name, revision=revision, download_dir=model.download_dir)
            if where is None:
                return None, f"the files of {name!r} were not found on this machine"
            try:
                d = digest_model(
                    where,
                    cache_path=digest_cache,
                    prefer_safetensors=load_format not in ("pt", "npcache"),
                )
            except (OSError, ValueError) as exc:
                return None, f"the files of {name!r} could not be hashed ({exc})"
            logger.info(
                "kvtier fs tier: weights of %s identified by %d file(s), digest %s "
                "(%.1f MiB hashed in %.2f s, the rest from the digest cache)",
                d.location,
                len(d.files),
                d.digest[:12],
                d.hashed_bytes / (1 << 20),
                d.seconds,
            )
            weights.append(d.files)
        return weights, ""

    def _layouts(self, identity: dict[str, Any]) -> list[dict[str, Any]]:
        # One per copy: a replicated layout's one copy is rank 0's, which every rank reads.
        return [{**identity, "rank": rank} for rank in range(self.num_copies)]

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            if self.num_chunks <= 0:
                raise ConfigError(
                    "kvtier: the KV bytes per block are unknown on the scheduler side, so the "
                    "host tier cannot be sized from cpu_bytes_to_use"
                )
            self._manager = KvtierOffloadingManager(self)
            if self.no_loads_reason is not None:
                logger.warning(
                    "kvtier %s: %s, so kvtier loads nothing into this engine (every lookup "
                    "is a miss); it still stores",
                    type(self).__name__,
                    self.no_loads_reason,
                )
            logger.info(
                "kvtier %s active: host tier of %d chunks (%d device blocks each) x %d bytes "
                "%s, %s eviction; %s",
                type(self).__name__,
                self.num_chunks,
                self.blocks_per_chunk,
                self.chunk_bytes,
                "in one copy for all ranks" if self.replicated_layout else "per rank",
                self.settings.eviction_policy,
                self.budget_description,
            )
        return self._manager

    def new_pool(self) -> HostBlockPool:
        s = self.settings
        vllm_policy = resolve_vllm_policy(s.eviction_policy, s.cache_policy_module_path)
        return HostBlockPool(
            self.num_chunks,
            eviction_policy=s.eviction_policy,
            cache_policy_module_path=s.cache_policy_module_path,
            policy=None if vllm_policy is None else vllm_policy(self.num_chunks),
            enable_events=self.kv_events_config.enable_kv_cache_events,
        )

    # -- worker side ----------------------------------------------------------------

    def _host_region(self) -> HostRegion:
        if self.replicated_layout:
            return self._replica_region()
        return HostRegion.private(self.num_chunks, self.chunk_bytes)

    def _replica_region(self) -> HostRegion:
        """The one host region of a replicated layout: rank 0 creates it, the other
        ranks map it, waiting for rank 0 as long as ``REPLICA_WAIT_S``."""
        name = _region_name(self.config.engine_id, 0)
        if self.rank == 0:
            return HostRegion.create_shared(name, self.num_chunks, self.chunk_bytes)
        try:
            return HostRegion.attach_shared(
                name, self.num_chunks, self.chunk_bytes, wait_s=REPLICA_WAIT_S
            )
        except FileNotFoundError as exc:
            raise RuntimeError(
                f"kvtier: worker rank {self.rank} waited {REPLICA_WAIT_S:g} s for rank 0 to "
                f"create the host region {exc.filename} that all ranks share (vLLM reports "
                "the KV replicated across ranks); rank 0's worker did not start or failed "
                "first: see its log"
            ) from None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> Any:
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
            self._worker = KvtierOffloadingWorker(
                core, store=not self.replicated_layout or self.rank == 0
            )
            self._worker.failures_reported = self.failures_reported
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

    def _can_share_replica(self) -> bool:
        # A mapped file can be page-locked on CUDA only; where it cannot (Ascend),
        # per-rank private pinned copies keep the copies fast, as vLLM's spec does.
        accel = (
            torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        )
        if accel is None or accel.type in ("cpu", "cuda"):
            return True
        if getattr(self.config, "replicated_layout", False):
            logger.info(
                "kvtier CPUOffloadingSpec: KV replicated across ranks, but a shared host "
                "region cannot be page-locked on %s; each rank keeps its own pinned copy",
                accel.type,
            )
        return False


class TieringOffloadingSpec(_KvtierSpec):
    """kvtier's multi-tier spec: the host tier plus secondary tiers (``fs``).

    The host region is shared (``/dev/shm``) so the scheduler's fs tier reads and
    writes the bytes that the workers copy to and from the device.
    """

    TIERING = True

    def _host_region(self) -> HostRegion:
        if self.replicated_layout:
            return self._replica_region()
        return HostRegion.create_shared(
            _region_name(self.config.engine_id, self.rank), self.num_chunks, self.chunk_bytes
        )

    def attach_regions(self) -> list[HostRegion] | None:
        """Map every copy's host region, one per rank or the one of a replicated layout
        (None while a worker has not created its own)."""
        regions: list[HostRegion] = []
        try:
            for rank in range(self.num_copies):
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

    def build_secondary_tiers(self) -> tuple[list[SecondaryTier], AttachedRegions | None]:
        """The secondary tiers, in order (fs tiers and store tiers), and the host regions
        they read and write, attached on first use."""
        if not self.settings.secondary_tiers:
            return [], None
        # The digests of the weight files are cached beside the first fs tier's files.
        fs_roots = [
            t.root_dir for t in self.settings.secondary_tiers if isinstance(t, FsTierConfig)
        ]
        digest_dir = (
            os.path.join(fs_roots[0], FORMAT_DIR)
            if fs_roots
            else os.path.join(
                os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvtier"
            )
        )
        make_private_dirs(digest_dir, "fs tier directory")
        identity, persistent = self.engine_identity(os.path.join(digest_dir, "weight-digests.json"))
        layouts = self._layouts(identity)
        regions = AttachedRegions(self.attach_regions)
        site = TierSite(layouts, self.chunk_bytes, regions.views, persistent)
        tiers: list[SecondaryTier] = []
        seen: dict[str, int] = {}
        try:
            for i, cfg in enumerate(self.settings.secondary_tiers):
                n = seen[cfg.type] = seen.get(cfg.type, -1) + 1
                name = cfg.type if n == 0 else f"{cfg.type}{n}"
                events = cfg.enable_kv_events and self.kv_events_config.enable_kv_cache_events
                tiers.append(build_tier(cfg, f"secondary_tiers[{i}]", name, events, site))
        except Exception:
            for t in tiers:
                t.shutdown()
            raise
        return tiers, regions


class AttachedRegions:
    """The host regions of every copy, as the secondary tiers read and write them:
    attached on first use (by the scheduler, or a store tier's connect thread), once,
    and closed at shutdown.

    Args:
        attach: maps the regions, or returns None while a worker has not created its own.
    """

    def __init__(self, attach: Callable[[], list[HostRegion] | None]) -> None:
        self._attach = attach
        self._lock = threading.Lock()
        self._regions: list[HostRegion] = []
        self._views: list[memoryview] | None = None

    def views(self) -> list[memoryview] | None:
        """One writable byte view per copy, or None while they cannot be mapped yet."""
        with self._lock:
            if self._views is None:
                regions = self._attach()
                if regions is None:
                    return None
                self._regions = regions
                self._views = [r.tensor.numpy().data.cast("B") for r in regions]
            return self._views

    def close(self) -> None:
        with self._lock:
            for region in self._regions:
                region.close()
            self._regions = []
            self._views = None


# Names under which kvtier's classes are reachable with spec_module_path
# "kvtier.tiering_spec.vllm_adapter" or "kvtier.tiering_spec" whatever the registry holds.
KvtierCPUOffloadingSpec = CPUOffloadingSpec
KvtierTieringOffloadingSpec = TieringOffloadingSpec
