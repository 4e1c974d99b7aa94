"""vLLM's ``OffloadingConfig`` (vLLM 0.32 and later) for one offloading spec, built
without an engine: what vLLM's ``OffloadingConnector`` hands a spec, for benchmarks and
tests that drive a spec or one of vLLM's tier managers directly."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any


def _build(cls: type, **fields: Any) -> Any:
    # Later releases add fields; give each dataclass only the fields it has.
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in names})


def offloading_config(
    *,
    layer_names: Sequence[str],
    tokens_per_block: int,
    worker_kv_bytes_per_block: int,
    extra_config: dict[str, Any] | None = None,
    blocks_per_chunk: int = 1,
    model: str = "unit",
    dtype: str = "float32",
    engine_id: str = "unit-engine",
    rank: int = 0,
    world_size: int = 1,
    kv_events: bool = False,
    replicated_layout: bool = False,
) -> Any:
    """An ``OffloadingConfig`` of one KV cache group.

    Args:
        layer_names: the group's attention layers.
        tokens_per_block: tokens per device block (also the hash block size).
        worker_kv_bytes_per_block: bytes one rank holds per device block, all layers.
        extra_config: the connector's ``kv_connector_extra_config``.
        blocks_per_chunk: device blocks per offloaded chunk.
        rank, world_size: this rank and the tensor-parallel size (no PP, DP or CP).
        kv_events: whether the engine publishes KV cache events.
        replicated_layout: whether every rank holds the same KV (MLA).

    Raises ImportError on a vLLM without ``vllm.v1.kv_offload.config`` (before 0.32).
    """
    from vllm.v1.kv_offload import config as c

    return _build(
        c.OffloadingConfig,
        groups=(
            _build(
                c.OffloadingGroupConfig,
                tokens_per_block=tokens_per_block,
                layer_names=tuple(layer_names),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=kv_events,
        extra_config=dict(extra_config or {}),
        engine_id=engine_id,
        model=_build(c.OffloadingModelConfig, name=model, dtype=dtype),
        cache=_build(
            c.OffloadingCacheConfig,
            tokens_per_hash=tokens_per_block,
            blocks_per_chunk=blocks_per_chunk,
        ),
        parallel=_build(
            c.OffloadingParallelConfig,
            rank=rank,
            world_size=world_size,
            tp_size=world_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=replicated_layout,
    )
