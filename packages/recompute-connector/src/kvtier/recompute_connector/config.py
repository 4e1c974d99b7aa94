"""Configuration of the recompute offload connector, validated at start-up.

Keys come from ``kv_connector_extra_config`` (the user guide's names). A bad value
raises ``ValueError`` naming the key, so vLLM refuses to start instead of failing
later. Units: bytes for budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.blockpool import (
    PER_RANK_KEY,
    TOTAL_KEY,
    HostBudget,
    require_bool,
    require_positive_int,
)
from kvtier.blockpool import resolve_budget as _resolve_budget
from kvtier.vllm_port.schema import Bool, Int, Key, Schema

logger = logging.getLogger("kvtier.recompute_connector")

DEFAULT_TOTAL_BYTES = 8 * 2**30  # the guide's default: 8 GiB for all ranks together
PREFIX_CACHING_KEY = "enable_offload_prefix_caching"
SCHEDULER_FLAG_KEY = "recompute_scheduler_enable"  # in --additional-config
# Device bytes per copy direction that transfers stage through (allocated at start-up).
STAGING_KEY = "device_staging_bytes"

# kv_connector_extra_config of the connector (the guide's names).
CONNECTOR_SCHEMA = Schema(
    "recompute-connector",
    (
        Key(
            PER_RANK_KEY,
            Int(1),
            "Host bytes for each rank (tensor/pipeline-parallel worker). Wins when set. "
            "Recommended.",
            default_words="unset",
        ),
        Key(
            TOTAL_KEY,
            Int(1),
            "Host bytes for all ranks of this instance together, divided by the world size "
            "(tensor \u00d7 pipeline parallel).",
            default_words=f"8 GiB ({DEFAULT_TOTAL_BYTES})",
        ),
        Key(
            STAGING_KEY,
            Int(1),
            "Device memory per copy direction that NPU/GPU copies stage through, allocated "
            "once at start-up (logged); larger transfers go through it in pieces, so a "
            "preemption never allocates device memory. Must hold one block. Unused on vLLM's "
            "CPU platform.",
            default_words="32 MiB (33554432)",
        ),
        Key(
            PREFIX_CACHING_KEY,
            Bool(),
            "Host block sharing: a full block with a prefix-cache hash is kept on host once, "
            "shared by reference between preempted requests; a request whose full blocks are "
            "on host already (stored for another request) adds references instead of copying "
            "them. Partial and unhashed blocks stay private. Needs vLLM's prefix caching (the "
            "hashes come from it; without it nothing is shared, logged at start-up). The "
            "device prefix cache is used either way: tokens it holds are not restored.",
            False,
        ),
    ),
    columns=("key", "default", "meaning"),
)
KNOWN_KEYS = CONNECTOR_SCHEMA.names()
SUPPORTED_ROLES = ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class RecomputeOffloadConfig:
    """Validated settings.

    Attributes:
        extra: the raw ``kv_connector_extra_config`` (budget keys are resolved per rank
            by :meth:`resolve_budget`, once the bytes of a block are known).
        world_size: ranks sharing ``cpu_bytes_to_use`` (tensor x pipeline parallel).
        kv_role: ``kv_consumer`` or ``kv_both``.
        enable_offload_prefix_caching: keep each full, hashed block on host once per
            prefix-cache hash, shared by reference between preempted requests.
        scheduler_flag: the guide's ``recompute_scheduler_enable`` (accepted; vLLM's own
            scheduler is used either way).
        device_staging_bytes: device bytes per copy direction that an accelerator's
            transfers stage through, allocated once at start-up (None: npu-copy's default).
    """

    extra: Mapping[str, Any]
    world_size: int
    kv_role: str
    enable_offload_prefix_caching: bool = False
    scheduler_flag: bool = False
    device_staging_bytes: int | None = None

    @classmethod
    def from_settings(
        cls,
        extra: Mapping[str, Any] | None,
        *,
        world_size: int,
        kv_role: str | None,
        additional_config: Mapping[str, Any] | None = None,
    ) -> RecomputeOffloadConfig:
        """Validate the connector's settings; raises ``ValueError`` naming the bad key."""
        extra = dict(extra or {})
        if kv_role not in SUPPORTED_ROLES:
            raise ValueError(
                f"kv_role must be one of {', '.join(SUPPORTED_ROLES)} for "
                f"RecomputeCPUOffloadConnector, got {kv_role!r} (a prefill-only "
                "kv_producer node has nothing to resume)"
            )
        world_size = require_positive_int("world_size", world_size)
        values = CONNECTOR_SCHEMA.parse(extra)
        unknown = CONNECTOR_SCHEMA.unknown(extra)
        if unknown:
            logger.warning(
                "kvtier: RecomputeCPUOffloadConnector ignores unknown kv_connector_extra_config "
                "keys %s (known: %s)",
                unknown,
                sorted(KNOWN_KEYS),
            )
        flag: Any = False
        if additional_config and isinstance(additional_config, Mapping):
            flag = additional_config.get(SCHEDULER_FLAG_KEY, False)
        return cls(
            extra=extra,
            world_size=world_size,
            kv_role=kv_role,
            enable_offload_prefix_caching=values[PREFIX_CACHING_KEY],
            scheduler_flag=require_bool(SCHEDULER_FLAG_KEY, flag),
            device_staging_bytes=values[STAGING_KEY],
        )

    def resolve_budget(self, bytes_per_block: int) -> HostBudget:
        """The per-rank host budget in blocks of ``bytes_per_block`` bytes.

        Both the scheduler and every worker call this with the same block size (from
        vLLM's KV cache config), so they agree on the block count.
        """
        return _resolve_budget(
            self.extra,
            world_size=self.world_size,
            bytes_per_block=bytes_per_block,
            default_total=DEFAULT_TOTAL_BYTES,
        )
