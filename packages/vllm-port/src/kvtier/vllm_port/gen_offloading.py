"""vLLM 0.26 and later: a spec is built from an ``OffloadingConfig``
(:class:`OffloadingConfigPort`; see :mod:`kvtier.vllm_port.port`)."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, cast

from kvtier.vllm_port.facts import EngineFacts
from kvtier.vllm_port.interface import (
    VllmPort,
    lookup_member,
    make_transfer_result,
    module_exists,
    offload_base,
)

# The facts of the engine whose connector is building a spec right now (vLLM 0.26 and
# later hand a spec only an ``OffloadingConfig``).
_BUILDING: contextvars.ContextVar[EngineFacts | None] = contextvars.ContextVar(
    "kvtier_building_spec", default=None
)


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
        return cast(type, offload_base().OffloadingWorker)

    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        return make_transfer_result(offload_base(), job_id, success, nbytes, seconds)

    def lookup_result(self, found: str) -> Any:
        return lookup_member(offload_base().LookupResult, found)
