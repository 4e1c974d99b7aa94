"""Workload and engine settings shared by the end-to-end tests and the benchmark."""

from __future__ import annotations

import random
from typing import Any

# Device cache of 12 blocks of 32 tokens: too small to keep 8 prefixes of 4 blocks.
ENGINE: dict[str, Any] = {
    "block_size": 32,
    "enforce_eager": True,
    "dtype": "float32",
    "disable_log_stats": False,
    "max_model_len": 256,
    "max_num_seqs": 2,
    "num_gpu_blocks_override": 12,
    # On vLLM's CPU platform this is the share of host memory for the KV cache.
    "gpu_memory_utilization": 0.15,
}
ROOMY = {**ENGINE, "num_gpu_blocks_override": 200}
CHUNK_BYTES = 65536  # one 32-token block of the tiny model: 2 layers x K,V x 2 heads x 64 x 4 B


def prefix_prompts(
    groups: int = 8, prefix: int = 128, suffix: int = 32, rounds: int = 2, seed: int = 1
):
    """``rounds`` passes over ``groups`` long prefixes, each prompt with its own suffix."""
    rng = random.Random(seed)
    allowed = list(range(3, 512))
    heads = [[rng.choice(allowed) for _ in range(prefix)] for _ in range(groups)]
    return tuple(
        tuple(heads[g] + [rng.choice(allowed) for _ in range(suffix)])
        for _ in range(rounds)
        for g in range(groups)
    )


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
