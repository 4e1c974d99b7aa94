"""The one module that maps vLLM's offloading interfaces onto kvtier's objects.

``CPUOffloadingSpec`` and ``TieringOffloadingSpec`` implement vLLM 0.32's
``OffloadingSpec``: the manager is :class:`~kvtier.tiering_spec.manager.TierManager`
(kvtier-blockpool plus fs tiers), the worker is
:class:`~kvtier.tiering_spec.worker.OffloadTransferWorker` (kvtier-npu-copy).
Everything with logic lives in those modules and is tested without an engine.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import secrets
import threading
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import Any, cast

import torch
import xxhash
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

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
from kvtier.tiering_spec.manager import Lookup, TierManager
from kvtier.tiering_spec.tiers.base import SecondaryTier
from kvtier.tiering_spec.tiers.fs_dirs import make_private_dirs
from kvtier.tiering_spec.tiers.fs_format import ALIGNMENT, FORMAT_DIR, FORMAT_VERSION
from kvtier.tiering_spec.tiers.registry import TierSite, build_tier
from kvtier.tiering_spec.vllm_policy import resolve_vllm_policy
from kvtier.tiering_spec.worker import OffloadTransferWorker

logger = logging.getLogger("kvtier.tiering_spec")

# How long a worker rank waits for rank 0 to create the one host region that every rank
# of a replicated layout maps; ranks start their workers at about the same time.
REPLICA_WAIT_S = 120.0


def _region_name(engine_id: str, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:150] or "engine"
    return f"tiering-{safe}-r{rank}"


def _plain(value: Any) -> Any:
    """``value`` as JSON-serialisable data (dataclasses, enums, dtypes, containers)."""
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return str(value).removeprefix("torch.")


def _tensor_placement(tensor: Any, num_blocks: int) -> Any:
    """How one ``KVCacheTensor`` places its layers' pages, without what depends on the
    number of device blocks (it changes with free device memory from one start to the
    next, and the bytes of a block do not)."""
    fields = _plain(tensor)
    if not isinstance(fields, dict):
        return fields
    fields.pop("size", None)
    # Layer-major tensors step a layer by num_blocks blocks: keep that count in layers.
    span = int(fields.get("block_stride") or 0) * num_blocks
    for name in ("layer_stride", "offset"):
        value = fields.get(name)
        if isinstance(value, int) and span:
            fields[name] = [value // span, value % span]
    return fields


def _engine_fields(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """What vLLM's configs say about the KV a model computes and how it is keyed: the
    model's config, dtype and overrides, vLLM and its attention backend, the block-hash
    scheme (with a warning where its seed is random) and every KV cache group and tensor."""
    import vllm
    from vllm.platforms import current_platform

    mc = vllm_config.model_config
    hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    seed = compat.block_hash_seed(hash_algo)
    if seed == "random":
        logger.warning(
            "kvtier fs tier: vLLM seeds its block hashes (prefix_caching_hash_algo=%s) "
            "with a random value per process, so the files this engine writes are "
            "never found after a restart or by another engine. Set PYTHONHASHSEED to "
            "one value for every engine%s",
            hash_algo,
            ", or use prefix_caching_hash_algo=sha256" if compat.FIXED_HASH_SEED else "",
        )
    hf_config = mc.hf_config.to_json_string(use_diff=False)
    draft = vllm_config.speculative_config
    attention = getattr(vllm_config, "attention_config", None)
    return {
        "vllm_version": vllm.__version__,
        "platform": str(current_platform.device_type),
        "revision": mc.revision,
        "quantization": _plain(mc.quantization),
        "model_dtype": _plain(mc.dtype),
        "hf_config": xxhash.xxh3_128_hexdigest(hf_config.encode()),
        "hf_overrides": "fn" if callable(mc.hf_overrides) else _plain(mc.hf_overrides),
        "load_format": _plain(vllm_config.load_config.load_format),
        "attention_backend": _plain(getattr(attention, "backend", None)),
        "speculative": None if draft is None else [_plain(draft.method), str(draft.model)],
        "block_hash": [hash_algo, seed],
        "kv_cache_groups": [
            [list(g.layer_names), _plain(g.kv_cache_spec)] for g in kv_cache_config.kv_cache_groups
        ],
        "kv_cache_tensors": [
            _tensor_placement(t, kv_cache_config.num_blocks)
            for t in kv_cache_config.kv_cache_tensors
        ],
    }


def _cached_prefix_unusable(vllm_config: Any) -> str | None:
    """Why this engine cannot be given KV it did not compute itself, or None."""
    if vllm_config is None:
        return None
    from vllm.platforms import current_platform

    if (
        getattr(vllm_config.model_config, "use_mla", False)
        and current_platform.is_cpu()
        and not vllm_config.cache_config.enable_prefix_caching
    ):
        # vLLM's CPU MLA backend computes a prompt on top of cached KV differently from
        # computing it whole (greedy outputs diverge even with vLLM's own prefix cache).
        return (
            "vLLM turned prefix caching off for this MLA model on its CPU platform, whose "
            "MLA backend does not give the same results on top of cached KV"
        )
    return None


class _KvtierSpec(compat.SpecBase):  # type: ignore[misc,valid-type]
    """What both specs share: config validation, budget, worker.

    vLLM builds a spec from an ``OffloadingConfig`` (vLLM 0.32) or from its
    ``(vllm_config, kv_cache_config)`` (older releases); :mod:`.vllm_compat` makes both
    look like the first.
    """

    TIERING = False
    # Set by kvtier's connector, which reports failed transfers to vLLM's scheduler
    # as blocks to recompute instead of failing vLLM's assertion.
    failures_reported = False

    @classmethod
    def kvtier_metric_table(cls, extra_config: Mapping[str, Any]) -> dict[str, m.MetricRow]:
        return m.metric_table(extra_config, tiering=cls.TIERING)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return compat.metric_definitions(cls.kvtier_metric_table(extra_config))

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        config = self.config
        self.settings: OffloadConfig = parse_config(self.extra_config, tiering=self.TIERING)
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
        # The connector building this spec holds what identifies the model and the KV
        # layout; only the fs tier's fingerprint needs it.
        configs: tuple[Any, Any] = compat.engine_configs(self)
        self.no_loads_reason = _cached_prefix_unusable(configs[0])
        # Whether requests may carry a LoRA adapter (None: vLLM's config was not found).
        self.lora_enabled: bool | None = (
            None if configs[0] is None else getattr(configs[0], "lora_config", None) is not None
        )
        if not self.settings.secondary_tiers:
            configs = (None, None)
        self._vllm_config, self._kv_cache_config = configs

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
        vllm_config, kv_cache_config = self._vllm_config, self._kv_cache_config
        if vllm_config is None or kv_cache_config is None:
            unverified = "vLLM's model and KV cache configs were not found"
        else:
            ident.update(_engine_fields(vllm_config, kv_cache_config))
            ident["weights"], unverified = self._weights(vllm_config, digest_cache)
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

    def _weights(self, vllm_config: Any, digest_cache: str | None) -> tuple[Any, str]:
        """(what identifies the weights, "") or (None, why they cannot be identified)."""
        if self.settings.model_identity is not None:
            return ["model_identity", self.settings.model_identity], ""
        mc, lc = vllm_config.model_config, vllm_config.load_config
        load_format = str(_plain(lc.load_format))
        if load_format == "dummy":
            return None, "load_format=dummy draws new random weights at every start"
        models = [(mc.model, mc.revision)]
        draft = vllm_config.speculative_config
        if draft is not None and draft.model and draft.model != mc.model:
            models.append((draft.model, getattr(draft, "revision", None)))
        weights = []
        for name, revision in models:
            where = resolve_model_location(name, revision=revision, download_dir=lc.download_dir)
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

    def build_secondary_tiers(self, on_regions: list[HostRegion]) -> list[SecondaryTier]:
        """The secondary tiers, in order: fs tiers and store tiers."""
        if not self.settings.secondary_tiers:
            return []
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
        payload = self.chunk_bytes
        state: dict[str, list[memoryview] | None] = {"views": None}
        # A store tier's connect thread asks too: the regions are attached once.
        attaching = threading.Lock()

        def views() -> list[memoryview] | None:
            with attaching:
                if state["views"] is None:
                    regions = self.attach_regions()
                    if regions is None:
                        return None
                    on_regions.extend(regions)
                    state["views"] = [r.tensor.numpy().data.cast("B") for r in regions]
                return state["views"]

        site = TierSite(layouts, payload, views, persistent)
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
        return tiers


class _RequestReuse:
    """The keys one request stored or reused (loaded, or offered for storing again
    while cached), in the order first seen, and which of them it reused: vLLM 0.32 and
    later never call ``touch`` and leave recency to the manager when the request
    finishes; older releases touch keys themselves, after each store."""

    __slots__ = ("finished", "keys", "reused", "stored")

    def __init__(self) -> None:
        self.keys: dict[OffloadKey, None] = {}
        self.reused: set[OffloadKey] = set()
        self.stored: set[OffloadKey] = set()
        self.finished = False

    def note(self, keys: Iterable[OffloadKey], *, reused: bool) -> None:
        """Record ``keys`` as reused by the request, or as stored by it. Reading back
        a key the request stored (a cascade between tiers) is not a reuse."""
        seen, stored = self.keys, self.stored
        for key in keys:
            seen.setdefault(key, None)
            if not reused:
                stored.add(key)
            elif key not in stored:
                self.reused.add(key)


class _RequestTiers:
    """Which tiers one request may use: the host tier always, the secondary (persistent)
    tiers unless the request runs with a LoRA adapter or kvtier cannot tell."""

    __slots__ = ("secondary",)

    def __init__(self, secondary: bool) -> None:
        self.secondary = secondary


# Where vLLM's ReqContext has no per-request state (before 0.32), the mark is an attribute.
_TIERS_ATTR = "_kvtier_tiers"


def _mark_request(req_context: ReqContext, tiers: _RequestTiers) -> None:
    set_state = getattr(req_context, "set_state", None)
    if set_state is not None:
        set_state(tiers)
        return
    try:
        setattr(req_context, _TIERS_ATTR, tiers)
    except AttributeError:  # unmarked: treated as a request kvtier cannot tell
        pass


def _request_mark(req_context: ReqContext) -> _RequestTiers | None:
    get_state = getattr(req_context, "get_state", None)
    if get_state is not None:
        return cast("_RequestTiers | None", get_state(_RequestTiers))
    return cast("_RequestTiers | None", getattr(req_context, _TIERS_ATTR, None))


class KvtierOffloadingManager(OffloadingManager):
    """vLLM's ``OffloadingManager`` over :class:`TierManager`.

    A request with a LoRA adapter uses the host tier only: vLLM's block hashes name the
    adapter (0.23: its name; 0.32: its name and path), never its weights, so a file or
    object in a persistent tier could outlive the adapter it was computed with. kvtier's
    connector tells the manager which requests carry one (:meth:`note_new_request`);
    a request it did not announce uses the secondary tiers only where vLLM's config
    shows LoRA off.
    """

    def __init__(self, spec: _KvtierSpec) -> None:
        self.spec = spec
        self._regions: list[HostRegion] = []
        # (request id, whether it has a LoRA adapter) of the request being added now.
        self._arriving: tuple[str, bool] | None = None
        self._logged: set[str] = set()
        tiers = (
            spec.build_secondary_tiers(self._regions)
            if isinstance(spec, TieringOffloadingSpec)
            else []
        )
        s = spec.settings
        self.core = TierManager(
            spec.new_pool(),
            tiers,
            store_threshold=s.store_threshold,
            max_tracker_size=s.max_tracker_size,
        )
        self._metrics = m.MetricsEmitter(self.core, tiering=spec.TIERING)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> Any:
        if self.spec.no_loads_reason is not None:
            return compat.lookup_result(Lookup.MISS)
        return compat.lookup_result(
            self.core.lookup(key, req_context.req_id, secondary=self._secondary(req_context))
        )

    def note_new_request(self, req_id: str, has_lora: bool) -> None:
        """Called by kvtier's connector just before vLLM adds the request ``req_id``
        (``on_new_request``): whether it runs with a LoRA adapter."""
        self._arriving = (req_id, has_lora)

    def _secondary(self, req_context: ReqContext) -> bool:
        """Whether the request may read and write the secondary (persistent) tiers."""
        if not self.core.secondary_tiers:
            return True
        mark = _request_mark(req_context)
        if mark is not None:
            return mark.secondary
        if self.spec.lora_enabled is False:
            return True  # vLLM refuses LoRA requests when LoRA is off
        self._log_once(
            "unknown",
            "kvtier: a request reached the manager without kvtier's connector in front, and "
            "LoRA may be on (vLLM's config %s), so kvtier cannot tell whether its blocks "
            "were computed with an adapter: such requests use the host tier only, never "
            "the fs or mooncake tiers",
            "enables it" if self.spec.lora_enabled else "was not found",
        )
        return False

    def _log_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._logged:
            self._logged.add(what)
            logger.warning(msg, *args)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return compat.cache_hit_source(self.core.load_source(key))

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        blocks = self.core.prepare_load(list(keys))
        state = self._request_reuse(req_context)
        if state is not None:
            state.note(keys, reused=True)
        return CPULoadStoreSpec(blocks)

    @staticmethod
    def _request_reuse(req_context: ReqContext) -> _RequestReuse | None:
        """The request's record for :meth:`on_request_finished`; None before vLLM 0.32
        (no request state: the connector calls touch itself) or once it finished."""
        get_state = getattr(req_context, "get_state", None)
        if get_state is None:
            return None
        state = get_state(_RequestReuse)
        if state is None:
            state = _RequestReuse()
            req_context.set_state(state)
        return None if state.finished else state

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Order every key the request stored or reused so that its prefix's tail goes
        first and its head last (as vLLM 0.32 does); only reused keys count as a use."""
        get_state = getattr(req_context, "get_state", None)
        state = get_state(_RequestReuse) if get_state is not None else None
        if state is None or state.finished:
            return
        state.finished = True
        keys = list(state.keys)
        position = getattr(req_context, "get_offload_key_position", None)
        if position is not None:
            ends = [position(key) for key in keys]
            if None not in ends:  # the scheduler knows each key's place in the prompt
                keys = [k for _, k in sorted(zip(ends, keys), key=lambda e: e[0])]
        if keys:
            self.core.finish_request(keys, state.reused)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.core.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.core.complete_load(list(keys))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        keys = list(keys)
        state = self._request_reuse(req_context)
        if state is not None:
            pool = self.core.pool  # cached keys offered again are a use
            state.note((k for k in keys if pool.contains(k)), reused=True)
        plan = self.core.prepare_store(keys)
        if plan is None:
            return None
        to_store, blocks, evicted = plan
        if state is not None:
            state.note(to_store, reused=False)
        return PrepareStoreOutput(
            keys_to_store=cast(Any, to_store),
            store_spec=CPULoadStoreSpec(blocks),
            evicted_keys=cast(Any, evicted),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.core.complete_store(list(keys), success, secondary=self._secondary(req_context))

    def fail_store(self, keys: Collection[OffloadKey]) -> None:
        """A store a worker could not copy: its keys are dropped now, never loaded
        (vLLM's own completion of the job then finds nothing stored)."""
        self.core.complete_store(list(keys), False)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        arriving, self._arriving = self._arriving, None
        if arriving is not None and arriving[0] == req_context.req_id:
            has_lora = arriving[1]
            _mark_request(req_context, _RequestTiers(secondary=not has_lora))
            if has_lora and self.core.secondary_tiers:
                self._log_once(
                    "lora",
                    "kvtier: requests with a LoRA adapter use the host tier only, never the "
                    "fs or mooncake tiers: vLLM's block hashes name an adapter, not its "
                    "weights, so KV kept across restarts could outlive a retrained adapter",
                )
        return RequestOffloadingContext()

    def take_events(self) -> Iterable[OffloadingEvent]:
        for event in self.core.pool.take_events():
            yield compat.offloading_event(list(event.keys), event.kind == "removed")
        for tier in self.core.secondary_tiers:
            for removed, keys in tier.take_events():
                yield compat.offloading_event(
                    list(keys), removed, tier=tier.name, locality=tier.locality
                )

    def on_schedule_end(self, context: Any = None) -> None:
        self.core.end_step()

    def has_pending_work(self) -> bool:
        return self.core.has_pending_work()

    def reset_cache(self) -> None:
        self.core.reset(self.spec.new_pool())

    def collect_metrics(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        """(kind, name, value, label values) of kvtier's metrics since the last call."""
        return self._metrics.collect()

    def get_stats(self) -> Any:
        return compat.manager_stats(self.collect_metrics())

    def shutdown(self) -> None:
        if not self.core.shutdown():
            # An I/O thread stuck in a read may still write into these mappings.
            logger.warning("kvtier: host regions left mapped until the process ends")
            return
        for region in self._regions:
            region.close()
        self._regions.clear()


class KvtierOffloadingWorker(compat.WorkerBase):  # type: ignore[misc,valid-type]
    """vLLM's ``OffloadingWorker`` over :class:`OffloadTransferWorker`.

    vLLM asserts that every transfer succeeds. Under kvtier's connector
    (:mod:`kvtier.tiering_spec.connector`, which sets ``failures_reported``), a job
    that fails (a plan the copy engine refuses, a failed copy) is reported to vLLM as
    done and to the connector as failed: a failed load's device blocks are recomputed,
    a failed store's host blocks are never read. Without it, a failure reaches vLLM.
    """

    def __init__(self, core: OffloadTransferWorker, *, store: bool = True) -> None:
        self.core = core
        # False on ranks other than 0 of a replicated layout: vLLM 0.32 and 0.33 send
        # them no stores; a release that did would have them rewrite rank 0's copy.
        self.store = store
        self.failures_reported = False
        self._skipped: list[int] = []
        self._refused: list[int] = []
        self._load_blocks: dict[int, list[int]] = {}  # load job -> device block ids
        self._failed_loads: dict[int, list[int]] = {}  # failed load job -> device block ids
        self._failed_stores: list[int] = []
        self._logged: set[str] = set()

    def _refuse(self, job_id: int, what: str, exc: Exception) -> None:
        if not self.failures_reported:
            raise exc
        if what not in self._logged:
            self._logged.add(what)
            logger.error(
                "kvtier: a %s plan was refused by the copy engine (%s: %s); that transfer "
                "failed and is recomputed. Further refusals are only counted.",
                what,
                type(exc).__name__,
                exc,
            )
        self._refused.append(job_id)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        if not self.store:
            # Acknowledged as done: the scheduler waits for every rank's report of a job.
            self._skipped.append(job_id)
            return True
        try:
            self.core.submit_store(
                job_id,
                src_spec.block_ids.tolist(),
                list(src_spec.group_sizes),
                list(src_spec.block_indices),
                dst_spec.block_ids.tolist(),  # type: ignore[attr-defined]
            )
        except Exception as exc:
            self._refuse(job_id, "store", exc)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,  # vLLM 0.33: a load vLLM waits for at once; all start at once
    ) -> bool:
        device_ids = dst_spec.block_ids.tolist()
        self._load_blocks[job_id] = device_ids
        try:
            self.core.submit_load(
                job_id,
                src_spec.block_ids.tolist(),  # type: ignore[attr-defined]
                device_ids,
                list(dst_spec.group_sizes),
                list(dst_spec.block_indices),
            )
        except Exception as exc:
            self._refuse(job_id, "load", exc)
        return True

    def get_finished(self) -> list[Any]:
        skipped, self._skipped = self._skipped, []
        refused, self._refused = self._refused, []
        done = [(j, True, 0, 0.0) for j in skipped] + [(j, False, 0, 0.0) for j in refused]
        done += [(j.job_id, j.ok, j.nbytes, j.seconds) for j in self.core.get_finished()]
        results = []
        for job_id, ok, nbytes, seconds in done:
            device_ids = self._load_blocks.pop(job_id, None)
            if not ok and self.failures_reported:
                ok = True  # for vLLM, which asserts; the connector learns the truth
                if device_ids is not None:
                    self._failed_loads[job_id] = device_ids
                else:
                    self._failed_stores.append(job_id)
            results.append(compat.transfer_result(job_id, ok, nbytes, seconds))
        return results

    def take_failed_loads(self) -> dict[int, list[int]]:
        """Load jobs that failed since the last call, with their device block ids: the
        connector reports the blocks, or the jobs' requests, for vLLM to recompute."""
        failed, self._failed_loads = self._failed_loads, {}
        return failed

    def take_failed_stores(self) -> list[int]:
        """Store jobs that failed since the last call (their host blocks hold no KV)."""
        failed, self._failed_stores = self._failed_stores, []
        return failed

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()


# Names under which kvtier's classes are reachable with spec_module_path
# "kvtier.tiering_spec.vllm_adapter" or "kvtier.tiering_spec" whatever the registry holds.
KvtierCPUOffloadingSpec = CPUOffloadingSpec
KvtierTieringOffloadingSpec = TieringOffloadingSpec
