"""Workload and engine settings shared by the end-to-end tests and the benchmark."""

from __future__ import annotations

from typing import Any

from kvtier.testkit import PREFIX_ENGINE, PREFIX_REFERENCE_ENGINE, PREFIX_WORKLOAD

# The testkit's prefix-reuse settings: a device cache of 12 blocks of 32 tokens, too
# small to keep 8 prefixes of 4 blocks; ROOMY has room for everything.
ENGINE: dict[str, Any] = PREFIX_ENGINE
ROOMY: dict[str, Any] = PREFIX_REFERENCE_ENGINE
CHUNK_BYTES = 65536  # one 32-token block of the tiny model: 2 layers x K,V x 2 heads x 64 x 4 B


def prefix_prompts() -> tuple[tuple[int, ...], ...]:
    """The testkit's prefix workload: 8 prefixes of 128 tokens asked twice, own suffixes."""
    return PREFIX_WORKLOAD.prompts


def offload_config(spec_name: str, *, host_chunks: int, root_dir: str | None = None, **tier: Any):
    extra: dict[str, Any] = {"cpu_bytes_to_use": host_chunks * CHUNK_BYTES, "spec_name": spec_name}
    if root_dir is not None:
        extra["secondary_tiers"] = [
            {"type": "fs", "root_dir": root_dir, "n_read_threads": 2, "n_write_threads": 2, **tier}
        ]
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
