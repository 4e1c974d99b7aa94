"""vLLM 0.23 to 0.25: a spec is built from the engine's configs
(:class:`LegacyPort`; see :mod:`kvtier.vllm_port.port`)."""

from __future__ import annotations

import importlib
from typing import Any, cast

from kvtier.vllm_port.facts import EngineFacts
from kvtier.vllm_port.interface import (
    VllmPort,
    has_member,
    lookup_member,
    make_transfer_result,
    module_exists,
    offload_base,
)


class LegacyPort(VllmPort):
    """vLLM 0.23 to 0.25: specs built from the engine's configs."""

    generation = "engine-configs"
    releases = "0.23 to 0.25"

    @classmethod
    def serves(cls) -> bool:
        return module_exists("vllm.v1.kv_offload.base")

    @property
    def spec_takes_offloading_config(self) -> bool:
        return False

    def create_spec(self, spec_cls: type, vllm_config: Any, kv_cache_config: Any) -> Any:
        return spec_cls(vllm_config, kv_cache_config)

    def spec_engine_facts(self, spec: Any) -> EngineFacts | None:
        return self.engine_facts(
            getattr(spec, "vllm_config", None), getattr(spec, "kv_cache_config", None)
        )

    def init_offloading_connector(
        self, connector: Any, base: Any, vllm_config: Any, role: Any, kv_cache_config: Any
    ) -> None:
        # vLLM's constructor hands the spec the configs themselves: nothing to add.
        base.__init__(connector, vllm_config, role, kv_cache_config)

    @property
    def spec_metrics(self) -> bool:  # 0.24 and 0.25
        return has_member("vllm.v1.kv_offload.base", "OffloadingSpec", "build_metric_definitions")

    @property
    def worker_api(self) -> bool:  # 0.25
        return has_member("vllm.v1.kv_offload.base", "OffloadingWorker")

    def worker_base(self) -> type:
        return cast(type, getattr(offload_base(), "OffloadingWorker", object))

    def transfer_result(self, job_id: int, success: bool, nbytes: int, seconds: float) -> Any:
        module = (
            offload_base()
            if self.worker_api
            else importlib.import_module("vllm.v1.kv_offload.worker.worker")
        )
        return make_transfer_result(module, job_id, success, nbytes, seconds)

    def lookup_result(self, found: str) -> Any:
        result = getattr(offload_base(), "LookupResult", None)
        if result is not None:  # 0.25
            return lookup_member(result, found)
        return {"hit": True, "pending": None}.get(found, False)
