"""Thin classes with the constructors vLLM's tests call, building kvtier's objects."""

from __future__ import annotations

from typing import Any

from kvtier.tiering_spec.config import parse_config
from kvtier.tiering_spec.vllm_adapter import _KvtierSpec
from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager


class _EventsConfig:
    def __init__(self, enabled: bool) -> None:
        self.enable_kv_cache_events = enabled


class _ManagerSpec:
    """What :class:`KvtierOffloadingManager` reads from its spec, for a host tier of
    ``num_chunks`` chunks and the manager arguments vLLM's tests give."""

    TIERING = False
    no_loads_reason = None
    lora_enabled = False
    new_pool = _KvtierSpec.new_pool

    def __init__(self, num_chunks: int, extra: dict[str, Any], enable_events: bool) -> None:
        # cpu_bytes_to_use is required by the config; the chunk count is given here.
        self.settings = parse_config({"cpu_bytes_to_use": 1, **extra}, tiering=False)
        self.num_chunks = num_chunks
        self.kv_events_config = _EventsConfig(enable_events)

    def build_secondary_tiers(self) -> tuple[list[Any], None]:
        return [], None

    def config_info_row(self) -> dict[str, Any]:
        # No spec sized this host tier: nothing to publish, as vLLM's manager built
        # without its spec's info.
        return {}


class CPUOffloadingManager(KvtierOffloadingManager):
    """kvtier's manager, built from the arguments of vLLM's ``CPUOffloadingManager``."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
    ) -> None:
        extra: dict[str, Any] = {
            "eviction_policy": cache_policy,
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
        }
        if cache_policy_module_path is not None:
            extra["cache_policy_module_path"] = cache_policy_module_path
        super().__init__(_ManagerSpec(num_chunks, extra, enable_events))  # type: ignore[arg-type]
