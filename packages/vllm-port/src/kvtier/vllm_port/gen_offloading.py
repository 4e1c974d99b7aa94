"""vLLM 0.26 and later: a spec is built from an ``OffloadingConfig``
(:class:`OffloadingConfigPort`; see :mod:`kvtier.vllm_port.port`).

An ``OffloadingConfig`` names the engine's model by its path alone, and vLLM's
``OffloadingConnector`` builds its spec inside its own constructor. So kvtier's
connector runs that constructor's steps itself (:meth:`init_offloading_connector`),
the same steps with the same classes of vLLM's, and builds a kvtier spec with the
engine's facts as an argument. A release whose constructor does anything else (it
refers to a name the port does not know) gets vLLM's constructor as it is, and its
kvtier spec gets no facts, with a warning.
"""

from __future__ import annotations

import inspect
import logging
import sys
from typing import Any, cast

from kvtier.vllm_port.facts import EngineFacts
from kvtier.vllm_port.interface import (
    ENGINE_FACTS_ARG,
    VllmPort,
    lookup_member,
    make_transfer_result,
    module_exists,
    offload_base,
    takes_engine_facts,
)

logger = logging.getLogger("kvtier.vllm_port")

# Every global and attribute name vLLM's OffloadingConnector.__init__ uses, 0.26 to 0.33
# (0.28 added the canonical layout): the steps :meth:`init_offloading_connector` repeats.
CONNECTOR_INIT_NAMES = frozenset(
    {
        "super",
        "__init__",
        "build_offloading_config",
        "canonical_layout",
        "_canonical_layout",
        "OffloadingSpecFactory",
        "create_spec",
        "connector_scheduler",
        "connector_worker",
        "KVConnectorRole",
        "SCHEDULER",
        "WORKER",
        "OffloadingConnectorScheduler",
        "OffloadingConnectorWorker",
    }
)
# What the scheduler and worker sides' constructors may ask for, by parameter name.
_PART_ARGS = frozenset({"spec", "vllm_config", "kv_cache_config"})


def _part_args(part: type) -> list[str] | None:
    """The parameter names of ``part``'s constructor, if the port can supply them all."""
    try:
        names = list(inspect.signature(part).parameters)
    except (TypeError, ValueError):
        return None
    return names if set(names) <= _PART_ARGS else None


class OffloadingConfigPort(VllmPort):
    """vLLM 0.26 and later: specs built from an ``OffloadingConfig``."""

    generation = "offloading-config"
    releases = "0.26 and later"

    @classmethod
    def serves(cls) -> bool:
        return module_exists("vllm.v1.kv_offload.config")

    @property
    def spec_takes_offloading_config(self) -> bool:
        return True

    def _spec(self, spec_cls: type, offloading_config: Any, facts: EngineFacts | None) -> Any:
        if takes_engine_facts(spec_cls):
            return spec_cls(offloading_config, **{ENGINE_FACTS_ARG: facts})
        return spec_cls(offloading_config)

    def _facts(self, vllm_config: Any, kv_cache_config: Any) -> EngineFacts | None:
        from vllm.config import VllmConfig
        from vllm.v1.kv_cache_interface import KVCacheConfig

        if not isinstance(vllm_config, VllmConfig):
            return None
        kv = kv_cache_config if isinstance(kv_cache_config, KVCacheConfig) else None
        return self.engine_facts(vllm_config, kv)

    def create_spec(self, spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
            build_offloading_config,
        )

        config = build_offloading_config(vllm_config, kv_cache_config)
        return self._spec(spec_cls, config, self._facts(vllm_config, kv_cache_config))

    def init_offloading_connector(
        self, connector: Any, base: Any, vllm_config: Any, role: Any, kv_cache_config: Any
    ) -> None:
        vllm_init = base.__init__
        module: Any = sys.modules[base.__module__]
        scheduler_cls: Any = getattr(module, "OffloadingConnectorScheduler", None)
        worker_cls: Any = getattr(module, "OffloadingConnectorWorker", None)
        unknown = set(vllm_init.__code__.co_names) - CONNECTOR_INIT_NAMES
        scheduler_args = None if scheduler_cls is None else _part_args(scheduler_cls)
        worker_args = None if worker_cls is None else _part_args(worker_cls)
        if unknown or scheduler_args is None or worker_args is None:
            logger.warning(
                "kvtier: this vLLM's OffloadingConnector builds its spec in a way kvtier's "
                "port does not know (%s); vLLM's constructor runs as it is, and a kvtier "
                "spec is not told the engine's model: the fs tier's fingerprint is "
                "unverified",
                ", ".join(sorted(unknown)) or "the arguments of its scheduler or worker side",
            )
            vllm_init(connector, vllm_config, role, kv_cache_config)
            return
        # vLLM's constructor, step for step (0.26 to 0.33), with the spec built here.
        super(base, connector).__init__(vllm_config, role, kv_cache_config)  # type: ignore[call-arg]
        config = module.build_offloading_config(vllm_config, kv_cache_config)
        if "_canonical_layout" in vllm_init.__code__.co_names:
            connector._canonical_layout = config.canonical_layout
        factory = module.OffloadingSpecFactory
        spec_cls = factory.get_spec_cls(config.extra_config)
        if takes_engine_facts(spec_cls):
            facts = self._facts(vllm_config, kv_cache_config)
            spec = spec_cls(config, **{ENGINE_FACTS_ARG: facts})
        else:  # another spec: vLLM's factory builds it, as vLLM's connector would
            spec = factory.create_spec(config)
        given = {"spec": spec, "vllm_config": vllm_config, "kv_cache_config": kv_cache_config}
        connector.connector_scheduler = None
        connector.connector_worker = None
        roles = module.KVConnectorRole
        if role == roles.SCHEDULER:
            connector.connector_scheduler = scheduler_cls(*(given[a] for a in scheduler_args))
        elif role == roles.WORKER:
            connector.connector_worker = worker_cls(*(given[a] for a in worker_args))

    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        return None  # an OffloadingConfig does not carry them: see create_spec

    @property
    def spec_metrics(self) -> bool:
        return True

    @property
    def worker_api(self) -> bool:
        return True

    def worker_base(self) -> type:
        return cast(type, offload_base().OffloadingWorker)

    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        return make_transfer_result(offload_base(), job_id, success, nbytes, seconds)

    def lookup_result(self, found: str) -> Any:
        return lookup_member(offload_base().LookupResult, found)
