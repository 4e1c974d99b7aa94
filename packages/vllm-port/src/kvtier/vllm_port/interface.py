"""What both kvtier plugins ask of vLLM: :class:`VllmPort`, one implementation per
interface generation (:mod:`kvtier.vllm_port.gen_offloading`,
:mod:`kvtier.vllm_port.gen_legacy`), chosen by :mod:`kvtier.vllm_port.port`, and the
probes of vLLM's classes they share. vLLM is imported only when a method is called.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import os
from typing import Any, ClassVar, TypeVar, cast

from kvtier.vllm_port.facts import EngineFacts, KVLayoutFacts
from kvtier.vllm_port.facts_reader import read_engine_facts, read_kv_layout

logger = logging.getLogger("kvtier.vllm_port")

_T = TypeVar("_T")
STATE_ATTR = "_kvtier_state_"
CONNECTOR_BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"


@functools.cache
def offload_base() -> Any:
    # Kept: the manager's lookups, events and the worker's results ask for it per call.
    return importlib.import_module("vllm.v1.kv_offload.base")


#: The keyword argument of a spec class that takes the engine's facts (kvtier's specs).
ENGINE_FACTS_ARG = "engine_facts"


def takes_engine_facts(spec_cls: type) -> bool:
    """Whether ``spec_cls``'s constructor takes the engine's facts (``engine_facts=``)."""
    try:
        return ENGINE_FACTS_ARG in inspect.signature(spec_cls).parameters
    except (TypeError, ValueError):  # no signature to read: vLLM's way only
        return False


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
        """``spec_cls`` built the way kvtier's ``OffloadingConnector`` builds it: as vLLM's
        connector does, and where the class takes them (:func:`takes_engine_facts`)
        handed this engine's facts as an argument."""

    @abc.abstractmethod
    def init_offloading_connector(
        self, connector: Any, base: Any, vllm_config: Any, role: Any, kv_cache_config: Any
    ) -> None:
        """Run ``base``'s constructor (vLLM's ``OffloadingConnector``) on ``connector``,
        with its spec built by :meth:`create_spec`."""

    @abc.abstractmethod
    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        """The facts of the engine a spec serves, read from the spec itself: from the
        configs it was built from (vLLM 0.23 to 0.25); None where a spec is handed only
        an ``OffloadingConfig`` (0.26 and later: kvtier's connector hands its specs the
        facts as an argument, see :meth:`create_spec`)."""

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
        base = offload_base()
        fields: dict[str, Any] = {"keys": keys, "removed": removed}
        if metadata_only:
            fields["metadata_only"] = True
        medium = getattr(base, "Medium", None)
        if medium is not None:
            fields["medium"] = medium.CPU if tier is None else medium.STORAGE
        else:
            fields["medium"] = "CPU" if tier is None else tier
        if tier is not None:
            names = event_fields()
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
            return "metadata_only" in event_fields()
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

    def kept_request_state(self, req_context: Any, kind: type[_T]) -> tuple[bool, _T | None]:
        """(:meth:`keeps_request_state`, the object of type ``kind`` vLLM keeps for the
        request or None) in one call: (False, None) for a context without vLLM's store."""
        get_state = getattr(req_context, "get_state", None)
        if get_state is None:
            return False, None
        return True, get_state(kind)

    def request_state(self, req_context: Any, kind: type[_T]) -> _T | None:
        """The object of type ``kind`` kept for the request, or None."""
        get_state = getattr(req_context, "get_state", None)
        if get_state is not None:
            # (No typing.cast here: a call per ask, and vLLM asks per request.)
            return get_state(kind)
        return cast("_T | None", getattr(req_context, STATE_ATTR + kind.__name__, None))

    def set_request_state(self, req_context: Any, state: object) -> bool:
        """Keep ``state`` for the request (one object per type); False where the
        context can keep nothing."""
        set_state = getattr(req_context, "set_state", None)
        if set_state is not None:
            set_state(state)
            return True
        try:
            setattr(req_context, STATE_ATTR + type(state).__name__, state)
        except AttributeError:
            return False
        return True

    def load_tiers(self, req_context: Any, localities: list[str]) -> tuple[bool, ...] | None:
        """Whether the request may load from each secondary tier (a storage tier of
        locality ``LOCAL`` or ``REMOTE``, in ``localities``), as its ``kv_load_tiers``
        (vLLM 0.32's ``load_tier_filter``, read from the request's
        ``kv_transfer_params``) says; None: from every tier (no filter, or a release
        without one). The host tier is always read, as vLLM's tiering manager does."""
        allowed = getattr(req_context, "load_tier_filter", None)
        if allowed is None or allowed is getattr(type(allowed), "ALL", None):
            return None
        base = offload_base()
        medium = base.Medium.STORAGE
        return tuple(bool(allowed.allows(medium, base.Locality(loc))) for loc in localities)

    def key_positions(self, req_context: Any, keys: list[Any]) -> list[Any] | None:
        """Each key's place in the request's prompt, where the scheduler tells it."""
        if positions_table(type(req_context)):  # type: ignore[arg-type]
            # (vLLM's method reads this dict: one lookup a key, no call.)
            return list(map(req_context._offload_key_positions.get, keys))
        position = getattr(req_context, "get_offload_key_position", None)
        return None if position is None else [position(key) for key in keys]

    # -- the connector interface -----------------------------------------------------

    @property
    def binds_kv_cache_manager(self) -> bool:
        """Whether vLLM calls ``bind_kv_cache_manager`` on scheduler-side connectors
        (and asks them for stats every step; vLLM 0.32). Older releases hand the
        scheduler side only the block pool, and ask for stats only in steps where a
        worker reported some."""
        return has_member(CONNECTOR_BASE, "KVConnectorBase_V1", "bind_kv_cache_manager")

    @property
    def request_level_load_failures(self) -> bool:
        """Whether vLLM takes a failed load as a failed request (``get_transfer_results``
        with ``failed_recving``, vLLM 0.32): the only failure report it accepts for a
        model with several KV cache groups, whose block ids are unique only within a
        group. Older releases take block-level reports only."""
        return has_member(CONNECTOR_BASE, "KVConnectorBase_V1", "get_transfer_results")

    def transfer_results(self, finished_recving: set[str], failed_recving: set[str]) -> Any:
        """vLLM's ``KVConnectorTransferResults`` (only where
        :attr:`request_level_load_failures`)."""
        return transfer_results_class()(
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

    def request_context(self, scheduler: Any, req_id: str) -> Any | None:
        """The per-request context (``ReqContext``) that ``scheduler`` (vLLM's
        ``OffloadingConnectorScheduler``) made for ``req_id`` and handed its manager, or
        None where it keeps none (it keeps them privately, with the request's state)."""
        states = getattr(scheduler, "_req_status", None)
        state = states.get(req_id) if isinstance(states, dict) else None
        return getattr(state, "req_context", None)

    # -- block hashes ----------------------------------------------------------------

    @property
    def fixed_hash_seed(self) -> bool:
        """Whether vLLM seeds non-xxhash block hashes with a fixed default (vLLM 0.32);
        older releases (0.23) draw a seed per engine unless ``PYTHONHASHSEED`` is set."""
        return has_member("vllm.v1.core.kv_cache_utils", "DEFAULT_NONE_HASH_SEED")

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
        its KV layout where ``kv_cache_config`` is given (read by
        :mod:`kvtier.vllm_port.facts_reader`, with this generation's block-hash seed)."""
        if vllm_config is None:
            return None
        hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        return read_engine_facts(
            vllm_config,
            kv_cache_config,
            seed=self.block_hash_seed(hash_algo),
            fixed_seed_default=self.fixed_hash_seed,
        )

    def kv_layout(self, vllm_config: Any, kv_cache_config: Any) -> KVLayoutFacts:
        """The KV cache of one rank as ``kv_cache_config`` describes it."""
        return read_kv_layout(vllm_config, kv_cache_config)


# ---------------------------------------------------------------- probes


def make_transfer_result(module: Any, job_id: int, ok: bool, nbytes: int, seconds: float) -> Any:
    return module.TransferResult(
        job_id=job_id, success=ok, transfer_size=nbytes, transfer_time=seconds
    )


def lookup_member(result: Any, found: str) -> Any:
    """``found`` as a member of vLLM's ``LookupResult`` enum ``result``."""
    return lookup_table(result).get(found, result.MISS)


@functools.cache
def lookup_table(result: Any) -> dict[str, Any]:
    return {"hit": result.HIT, "pending": result.HIT_PENDING}


def module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package is missing (no vLLM at all)
        return False


@functools.cache
def has_member(module: str, name: str, attribute: str | None = None) -> bool:
    """Whether vLLM's ``module`` has ``name`` (and ``name`` has ``attribute``)."""
    try:
        owner = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return attribute is None or hasattr(owner, attribute)


@functools.cache
def transfer_results_class() -> Any:
    # Asked for every worker step: look the class up once.
    return importlib.import_module(CONNECTOR_BASE).KVConnectorTransferResults


@functools.cache
def positions_table(context_cls: type) -> bool:
    """Whether ``get_offload_key_position`` of vLLM's request context class
    ``context_cls`` answers ``self._offload_key_positions.get(key)`` (vLLM 0.32 and
    0.33), so the dict can be read directly."""
    method = getattr(context_cls, "get_offload_key_position", None)
    code = getattr(method, "__code__", None)
    return code is not None and code.co_names == ("_offload_key_positions", "get")


@functools.cache
def event_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(offload_base().OffloadingEvent))
