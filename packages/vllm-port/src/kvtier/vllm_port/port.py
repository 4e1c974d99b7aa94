"""The one place where kvtier meets vLLM's interfaces: :class:`VllmPort`.

vLLM rewrote the interfaces kvtier implements between its 0.23 release (the one
vllm-ascend 0.23 runs on) and 0.26. kvtier supports two interface generations, one
implementation each, chosen once when a kvtier plugin registers (:func:`select`):

* :class:`OffloadingConfigPort`, vLLM 0.26 and later: a spec is built from an
  ``OffloadingConfig`` (``vllm.v1.kv_offload.config``), which names the engine's model
  by its path alone, so kvtier's connector hands the spec the engine's facts while it
  builds it (:meth:`VllmPort.building_spec`). Its worker is an ``OffloadingWorker`` and
  its manager answers lookups with a ``LookupResult``.
* :class:`LegacyPort`, vLLM 0.23 to 0.25: a spec is built from ``(vllm_config,
  kv_cache_config)`` and reads the facts from them; vLLM drives a spec's transfers
  through handlers (before 0.25), a lookup answers ``True`` / ``None`` / ``False``
  (before 0.25) and an event's medium is a string.

What changed inside a generation (an event's ``Medium`` and fields, vLLM 0.32's
``bind_kv_cache_manager`` and request-level load failures, its fixed block-hash seed,
its per-request state, its KV tensor placements) is probed here too, from vLLM's own
classes and never from its version number, and kept for the process. No other module
of kvtier asks which vLLM it runs on; both plugins ask the port.

The port also reads the engine once: :meth:`VllmPort.engine_facts` turns vLLM's configs
into :class:`~kvtier.vllm_port.facts.EngineFacts`. And it is the only reader of vLLM's
private state (:meth:`VllmPort.load_job_requests`, :meth:`VllmPort.store_job_keys`).

vLLM is imported only when a method is called, so this module imports without it.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
import functools
import importlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from typing import Any, ClassVar, TypeVar, cast

from kvtier.vllm_port.facts import (
    BlockHashFacts,
    DraftFacts,
    EngineFacts,
    KVGroupFacts,
    KVLayoutFacts,
    KVPlacement,
    KVTensorFacts,
    LoraFacts,
    ModelFacts,
    ParallelFacts,
    plain,
)

logger = logging.getLogger("kvtier.vllm_port")

_T = TypeVar("_T")
_STATE_ATTR = "_kvtier_state_"
_CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"

# The facts of the engine whose connector is building a spec right now (vLLM 0.26 and
# later hand a spec only an ``OffloadingConfig``).
_BUILDING: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar(
    "kvtier_building_spec", default=None
)


@functools.cache
def _offload_base() -> Any:
    # Kept: the manager's lookups, events and the worker's results ask for it per call.
    return importlib.import_module("vllm.v1.kv_offload.base")


class VllmPort(abc.ABC):
    """What kvtier's plugins ask of vLLM, answered for one interface generation."""

    #: A short name of the generation and the vLLM releases it covers.
    generation: ClassVar[str]
    releases: ClassVar[str]

    @classmethod
    @abc.abstractmethod
    def serves(cls) -> bool:
        """Whether the installed vLLM has this generation's interfaces."""

    # -- the offloading spec ---------------------------------------------------------

    @property
    @abc.abstractmethod
    def spec_takes_offloading_config(self) -> bool:
        """Whether vLLM builds a spec from an ``OffloadingConfig`` (else from the
        engine's ``(vllm_config, kv_cache_config)``)."""

    @abc.abstractmethod
    def create_spec(self, spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
        """``spec_cls`` built the way this vLLM's ``OffloadingConnector`` builds it."""

    @abc.abstractmethod
    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        """The facts of the engine ``spec`` serves, or None where nobody handed them
        over (a spec built outside kvtier's connector on vLLM 0.26 and later)."""

    @abc.abstractmethod
    def building_spec(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        """A context manager: specs built inside it see this engine's facts."""

    @property
    @abc.abstractmethod
    def spec_metrics(self) -> bool:
        """Whether vLLM asks a spec to declare its metrics and its manager for stats
        (0.24 and later)."""

    # -- the worker ------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def worker_api(self) -> bool:
        """Whether a spec returns an ``OffloadingWorker`` (0.25 and later; before, handlers
        keyed by (source, destination) medium)."""

    @abc.abstractmethod
    def worker_base(self) -> type:
        """The base of kvtier's worker: vLLM's ``OffloadingWorker``, or ``object``."""

    @abc.abstractmethod
    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        """vLLM's ``TransferResult`` of one finished job."""

    # -- the manager -----------------------------------------------------------------

    @abc.abstractmethod
    def lookup_result(self, found: str) -> Any:
        """vLLM's answer to a lookup: ``found`` is ``"hit"``, ``"pending"`` or ``"miss"``."""

    def offloading_event(
        self,
        keys: list[Any],
        removed: bool,
        *,
        tier: str | None = None,
        locality: str | None = None,
        metadata_only: bool = False,
    ) -> Any:
        """An ``OffloadingEvent`` of the host tier (``tier`` None) or of a secondary tier.

        The medium is a ``Medium`` from vLLM 0.27 on and a string before; ``locality`` and
        ``ownership`` are passed where the event has them (0.26 and 0.29 on), and
        ``metadata_only`` (a removal of keys never stored: vLLM's tracker forgets what it
        noted for them) where it has that (0.33 on; see :meth:`metadata_only_events`).
        """
        base = _offload_base()
        fields: dict[str, Any] = {"keys": keys, "removed": removed}
        if metadata_only:
            fields["metadata_only"] = True
        medium = getattr(base, "Medium", None)
        if medium is not None:
            fields["medium"] = medium.CPU if tier is None else medium.STORAGE
        else:
            fields["medium"] = "CPU" if tier is None else tier
        if tier is not None:
            names = _event_fields()
            if "locality" in names and locality is not None:
                fields["locality"] = base.Locality(locality)
            if "ownership" in names:
                fields["ownership"] = tier
        return base.OffloadingEvent(**fields)

    @property
    def metadata_only_events(self) -> bool:
        """Whether vLLM's ``OffloadingEvent`` has ``metadata_only`` (0.33 on): its
        manager reports a failed store with one, so its KV-event tracker drops the
        metadata it noted for the keys."""
        try:
            return "metadata_only" in _event_fields()
        except (ImportError, TypeError):  # no event dataclass to ask: none have it
            return False

    def cache_hit_source(self, source: str) -> Any:
        """vLLM 0.32's ``CacheHitSource`` for ``"host"`` or a secondary tier."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        return CacheHitSource.HOST if source == "host" else CacheHitSource.DISK

    def vllm_cpu_spec(self) -> type | None:
        """vLLM's own ``CPUOffloadingSpec`` class, where it is an ABC kvtier's specs can
        register with (vLLM 0.32 keeps its deprecated transfer metrics only for its
        subclasses); None on a release without one."""
        try:
            module = importlib.import_module("vllm.v1.kv_offload.cpu.spec")
        except ImportError:  # another layout of vLLM's modules: nothing there asks
            return None
        spec = getattr(module, "CPUOffloadingSpec", None)
        registers = isinstance(spec, type) and callable(getattr(spec, "register", None))
        return spec if registers else None

    def kv_cache_layout(self) -> str | None:
        """vLLM's KV cache layout name (``NHD``, ``HND``), where this release says it."""
        try:
            utils = importlib.import_module("vllm.v1.attention.backends.utils")
            return str(utils.get_kv_cache_layout())
        except Exception:  # a release or platform without it
            return None

    def cache_policy_api(self) -> tuple[type, Any] | None:
        """vLLM's ``CachePolicy`` base and ``CachePolicyFactory`` (vLLM 0.32's pluggable
        host eviction policies); None on releases without them."""
        try:
            base = importlib.import_module("vllm.v1.kv_offload.cpu.policies.base")
            factory = importlib.import_module("vllm.v1.kv_offload.cpu.policies.factory")
            return cast(type, base.CachePolicy), factory.CachePolicyFactory
        except (ImportError, AttributeError):
            return None

    # -- per-request state ------------------------------------------------------------
    # vLLM 0.32's ReqContext keeps per-request objects by type (get_state / set_state)
    # and knows each key's place in the prompt (get_offload_key_position); older ones
    # have neither, and kvtier marks the context itself where it can.

    def keeps_request_state(self, req_context: Any) -> bool:
        return getattr(req_context, "get_state", None) is not None

    def request_state(self, req_context: Any, kind: type[_T]) -> _T | None:
        """The object of type ``kind`` kept for the request, or None."""
        get_state = getattr(req_context, "get_state", None)
        if get_state is not None:
            return cast("_T | None", get_state(kind))
        return cast("_T | None", getattr(req_context, _STATE_ATTR + kind.__name__, None))

    def set_request_state(self, req_context: Any, state: object) -> bool:
        """Keep ``state`` for the request (one object per type); False where the
        context can keep nothing."""
        set_state = getattr(req_context, "set_state", None)
        if set_state is not None:
            set_state(state)
            return True
        try:
            setattr(req_context, _STATE_ATTR + type(state).__name__, state)
        except AttributeError:
            return False
        return True

    def key_positions(self, req_context: Any, keys: list[Any]) -> list[Any] | None:
        """Each key's place in the request's prompt, where the scheduler tells it."""
        position = getattr(req_context, "get_offload_key_position", None)
        return None if position is None else [position(key) for key in keys]

    # -- the connector interface -----------------------------------------------------

    @property
    def binds_kv_cache_manager(self) -> bool:
        """Whether vLLM calls ``bind_kv_cache_manager`` on scheduler-side connectors
        (and asks them for stats every step; vLLM 0.32). Older releases hand the
        scheduler side only the block pool, and ask for stats only in steps where a
        worker reported some."""
        return _has(_CONNECTOR_BASE, "KVConnectorBase_V1", "bind_kv_cache_manager")

    @property
    def request_level_load_failures(self) -> bool:
        """Whether vLLM takes a failed load as a failed request (``get_transfer_results``
        with ``failed_recving``, vLLM 0.32): the only failure report it accepts for a
        model with several KV cache groups, whose block ids are unique only within a
        group. Older releases take block-level reports only."""
        return _has(_CONNECTOR_BASE, "KVConnectorBase_V1", "get_transfer_results")

    def transfer_results(self, finished_recving: set[str], failed_recving: set[str]) -> Any:
        """vLLM's ``KVConnectorTransferResults`` (only where
        :attr:`request_level_load_failures`)."""
        return _transfer_results_class()(
            finished_recving=set(finished_recving), failed_recving=set(failed_recving)
        )

    def worker_metadata_base(self) -> type | None:
        """vLLM's ``OffloadingWorkerMetadata`` (completed jobs reach the scheduler in
        worker metadata, 0.23 to 0.33), or None on a release without it."""
        try:
            module = importlib.import_module(
                "vllm.distributed.kv_transfer.kv_connector.v1.offloading.common"
            )
        except ImportError:  # pragma: no cover - a release without it
            return None
        return cast("type | None", getattr(module, "OffloadingWorkerMetadata", None))

    # -- vLLM's private state, read here only ------------------------------------------

    def load_job_requests(self, connector: Any) -> dict[int, str]:
        """The request of each load job in flight on ``connector``'s worker side (vLLM's
        ``OffloadingConnectorWorker`` keeps them privately)."""
        worker = getattr(connector, "connector_worker", None)
        jobs = getattr(worker, "_load_jobs", None)
        return dict(jobs) if isinstance(jobs, dict) else {}

    def store_job_keys(self, connector: Any, job_id: int) -> list[Any] | None:
        """The keys of store job ``job_id`` on ``connector``'s scheduler side, or None if
        it is not a store job in flight there (vLLM's ``OffloadingConnectorScheduler``
        keeps its jobs privately)."""
        jobs = getattr(getattr(connector, "connector_scheduler", None), "_jobs", None)
        status = jobs.get(job_id) if isinstance(jobs, dict) else None
        if status is None or not getattr(status, "is_store", False):
            return None
        return list(status.keys)

    # -- block hashes ----------------------------------------------------------------

    @property
    def fixed_hash_seed(self) -> bool:
        """Whether vLLM seeds non-xxhash block hashes with a fixed default (vLLM 0.32);
        older releases (0.23) draw a seed per engine unless ``PYTHONHASHSEED`` is set."""
        return _has("vllm.v1.core.kv_cache_utils", "DEFAULT_NONE_HASH_SEED")

    def block_hash_seed(self, hash_algo: str) -> str:
        """How vLLM seeds its block hashes: ``"PYTHONHASHSEED"``, ``"fixed"`` (vLLM's
        default seed) or ``"random"`` (per process: no key repeats after a restart)."""
        if os.environ.get("PYTHONHASHSEED") is not None:
            return "PYTHONHASHSEED"
        if not self.fixed_hash_seed or hash_algo.startswith("xxhash"):
            return "random"
        return "fixed"

    # -- the engine --------------------------------------------------------------------

    def engine_facts(self, vllm_config: Any, kv_cache_config: Any) -> EngineFacts | None:
        """What kvtier needs of the engine behind ``vllm_config`` (None without one);
        its KV layout where ``kv_cache_config`` is given."""
        if vllm_config is None:
            return None
        import vllm
        from vllm.platforms import current_platform

        cache = vllm_config.cache_config
        hash_algo = str(cache.prefix_caching_hash_algo)
        parallel = vllm_config.parallel_config
        lora = getattr(vllm_config, "lora_config", None)
        attention = getattr(vllm_config, "attention_config", None)
        return EngineFacts(
            vllm_version=str(vllm.__version__),
            platform=str(current_platform.device_type),
            platform_is_cpu=bool(current_platform.is_cpu()),
            attention_backend=plain(getattr(attention, "backend", None)),
            model=_model_facts(vllm_config),
            parallel=ParallelFacts(
                world_size=int(parallel.world_size),
                rank=_world_rank(parallel),
                tp_size=int(parallel.tensor_parallel_size),
                pp_size=int(parallel.pipeline_parallel_size),
            ),
            block_hash=BlockHashFacts(
                algo=hash_algo,
                seed=self.block_hash_seed(hash_algo),
                fixed_seed_default=self.fixed_hash_seed,
                prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
            ),
            lora=LoraFacts(
                enabled=lora is not None,
                max_loras=None if lora is None else getattr(lora, "max_loras", None),
            ),
            kv=None if kv_cache_config is None else self.kv_layout(vllm_config, kv_cache_config),
        )

    def kv_layout(self, vllm_config: Any, kv_cache_config: Any) -> KVLayoutFacts:
        """The KV cache of one rank as ``kv_cache_config`` describes it."""
        return KVLayoutFacts(
            num_blocks=int(kv_cache_config.num_blocks),
            groups=tuple(_group_facts(g) for g in kv_cache_config.kv_cache_groups),
            tensors=tuple(_tensor_facts(t) for t in kv_cache_config.kv_cache_tensors),
            hash_block_size=_hash_block_size(vllm_config, kv_cache_config),
        )


class OffloadingConfigPort(VllmPort):
    """vLLM 0.26 and later: specs built from an ``OffloadingConfig``."""

    generation = "offloading-config"
    releases = "0.26 and later"

    @classmethod
    def serves(cls) -> bool:
        return _module_exists("vllm.v1.kv_offload.config")

    @property
    def spec_takes_offloading_config(self) -> bool:
        return True

    def create_spec(self, spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )

        with self.building_spec(vllm_config, kv_cache_config):
            return spec_cls(build_offloading_config(vllm_config, kv_cache_config))

    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        return _BUILDING.get()

    @contextlib.contextmanager
    def building_spec(self, vllm_config: Any, kv_cache_config: Any) -> Iterator[None]:
        from vllm.config import VllmConfig
        from vllm.v1.kv_cache_interface import KVCacheConfig

        facts = None
        if isinstance(vllm_config, VllmConfig):
            kv = kv_cache_config if isinstance(kv_cache_config, KVCacheConfig) else None
            facts = self.engine_facts(vllm_config, kv)
        token = _BUILDING.set(facts)
        try:
            yield
        finally:
            _BUILDING.reset(token)

    @property
    def spec_metrics(self) -> bool:
        return True

    @property
    def worker_api(self) -> bool:
        return True

    def worker_base(self) -> type:
        return cast(type, _offload_base().OffloadingWorker)

    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        return _transfer_result(_offload_base(), job_id, success, nbytes, seconds)

    def lookup_result(self, found: str) -> Any:
        return _lookup(_offload_base().LookupResult, found)


class LegacyPort(VllmPort):
    """vLLM 0.23 to 0.25: specs built from the engine's configs."""

    generation = "engine-configs"
    releases = "0.23 to 0.25"

    @classmethod
    def serves(cls) -> bool:
        return _module_exists("vllm.v1.kv_offload.base")

    @property
    def spec_takes_offloading_config(self) -> bool:
        return False

    def create_spec(self, spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
        return spec_cls(vllm_config, kv_cache_config)

    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        return self.engine_facts(
            getattr(spec, "vllm_config", None), getattr(spec, "kv_cache_config", None)
        )

    def building_spec(self, vllm_config: Any, kv_cache_config: Any) -> Any:
        return contextlib.nullcontext()  # the spec is handed the configs themselves

    @property
    def spec_metrics(self) -> bool:  # 0.24 and 0.25
        return _has("vllm.v1.kv_offload.base", "OffloadingSpec", "build_metric_definitions")

    @property
    def worker_api(self) -> bool:  # 0.25
        return _has("vllm.v1.kv_offload.base", "OffloadingWorker")

    def worker_base(self) -> type:
        return cast(type, getattr(_offload_base(), "OffloadingWorker", object))

    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        module = (
            _offload_base()
            if self.worker_api
            else importlib.import_module("vllm.v1.kv_offload.worker.worker")
        )
        return _transfer_result(module, job_id, success, nbytes, seconds)

    def lookup_result(self, found: str) -> Any:
        result = getattr(_offload_base(), "LookupResult", None)
        if result is not None:  # 0.25
            return _lookup(result, found)
        return {"hit": True, "pending": None}.get(found, False)


# Newest first: the first generation whose interfaces the installed vLLM has serves it.
GENERATIONS: tuple[type[VllmPort], ...] = (OffloadingConfigPort, LegacyPort)

_selected: list[VllmPort] = []


def select() -> VllmPort:
    """Choose the port for the installed vLLM (once per process; a kvtier plugin does
    it when it registers) and return it."""
    if not _selected:
        for generation in GENERATIONS:
            if generation.serves():
                _selected.append(generation())
                logger.debug(
                    "kvtier: vLLM's interfaces of %s (%s)",
                    generation.releases,
                    generation.generation,
                )
                break
        else:
            raise RuntimeError(
                "kvtier: no vLLM with an offloading interface kvtier supports is installed "
                "(vllm.v1.kv_offload is missing; kvtier supports vLLM 0.23 and later)"
            )
    return _selected[0]


def current() -> VllmPort:
    """The port chosen for this process (chosen now if no plugin registered)."""
    return _selected[0] if _selected else select()


# ---------------------------------------------------------------- helpers


def _transfer_result(module: Any, job_id: int, ok: bool, nbytes: int, seconds: float) -> Any:
    return module.TransferResult(
        job_id=job_id, success=ok, transfer_size=nbytes, transfer_time=seconds
    )


def _lookup(result: Any, found: str) -> Any:
    """``found`` as a member of vLLM's ``LookupResult`` enum ``result``."""
    return _lookup_table(result).get(found, result.MISS)


@functools.cache
def _lookup_table(result: Any) -> dict[str, Any]:
    return {"hit": result.HIT, "pending": result.HIT_PENDING}


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing (no vLLM at all)
        return False


@functools.cache
def _has(module: str, name: str, attribute: str | None = None) -> bool:
    """Whether vLLM's ``module`` has ``name`` (and ``name`` has ``attribute``)."""
    try:
        owner = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return attribute is None or hasattr(owner, attribute)


@functools.cache
def _transfer_results_class() -> Any:
    # Asked for every worker step: look the class up once.
    return importlib.import_module(_CONNECTOR_BASE).KVConnectorTransferResults


@functools.cache
def _event_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(_offload_base().OffloadingEvent))


def _model_facts(vllm_config: Any) -> ModelFacts:
    mc, lc = vllm_config.model_config, vllm_config.load_config
    draft = vllm_config.speculative_config
    return ModelFacts(
        name=str(mc.model),
        revision=mc.revision,
        dtype=plain(mc.dtype),
        quantization=plain(mc.quantization),
        hf_config_json=mc.hf_config.to_json_string(use_diff=False),
        hf_overrides="fn" if callable(mc.hf_overrides) else plain(mc.hf_overrides),
        load_format=plain(lc.load_format),
        download_dir=lc.download_dir,
        use_mla=bool(getattr(mc, "use_mla", False)),
        draft=None
        if draft is None
        else DraftFacts(
            method=plain(draft.method),
            model=None if draft.model is None else str(draft.model),
            revision=getattr(draft, "revision", None),
        ),
    )


def _world_rank(parallel: Any) -> int:
    """This process's rank in vLLM's world group (the worker's), or the configured one
    where no group exists yet (the scheduler's process)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:
        return int(getattr(parallel, "rank", 0) or 0)


def _group_facts(group: Any) -> KVGroupFacts:
    spec = group.kv_cache_spec
    layers = tuple(str(n) for n in group.layer_names)
    per_layer = getattr(spec, "kv_cache_specs", {}) or {}
    pages: dict[str, int | None] = {}
    for layer in layers:
        page = getattr(per_layer.get(layer, spec), "page_size_bytes", None)
        pages[layer] = int(page) if page else None
    window = getattr(spec, "sliding_window", None)
    return KVGroupFacts(
        layer_names=layers,
        kind=type(spec).__name__,
        lineage=frozenset(c.__name__ for c in type(spec).__mro__),
        block_size=int(spec.block_size),
        sliding_window=int(window) if window else None,
        has_heads=hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"),
        page_bytes=pages,
        mamba_cache_mode=getattr(spec, "mamba_cache_mode", None),
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        prefill_checkpoint_blocks=int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0),
        spec=plain(spec),
    )


def _tensor_facts(tensor: Any) -> KVTensorFacts:
    # Releases before placements name a tensor's layers ``shared_by``.
    layers = getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ()
    placement = None
    if hasattr(tensor, "layer_stride"):
        placement = KVPlacement(
            offset=int(tensor.offset),
            layer_stride=int(tensor.layer_stride),
            block_stride=int(tensor.block_stride),
        )
    return KVTensorFacts(
        layers=tuple(str(n) for n in layers),
        size=int(tensor.size),
        host_resident=bool(getattr(tensor, "host_resident", False)),
        placement=placement,
        fields=plain(tensor),
    )


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per entry of a request's ``block_hashes`` (vLLM hashes at this size)."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except Exception:
        return int(vllm_config.cache_config.block_size)
