"""vLLM's configs for a spec without an engine, as the OffloadingConnector of the running
vLLM builds them (vLLM 0.32 and the releases before its offloading config alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def engine_configs(
    model: Path,
    extra: dict[str, Any],
    *,
    engine: dict[str, Any] | None = None,
    num_blocks: int = 64,
    kv_heads: int = 2,
    head_size: int = 64,
    layer_major: bool = True,
    world_size: int = 1,
    rank: int = 0,
) -> tuple[Any, Any]:
    """(``VllmConfig``, ``KVCacheConfig``) of the tiny model at ``model`` with an
    ``OffloadingConnector`` of ``extra``, on ``world_size`` ranks as rank ``rank``.
    ``layer_major`` places each layer's blocks together (vLLM 0.32's cross-layer tensors
    only; older releases keep one tensor per layer)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    from kvtier.testkit import kv_transfer_config
    from kvtier.tiering_spec import vllm_compat

    settings: dict[str, Any] = {"dtype": "float32", "block_size": 32, **(engine or {})}
    args = EngineArgs(
        model=str(model),
        enforce_eager=True,
        kv_transfer_config=kv_transfer_config(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        ),
        **settings,
    )
    vllm_config = args.create_engine_config()
    parallel = vllm_config.parallel_config
    parallel.world_size, parallel.tensor_parallel_size, parallel.rank = world_size, world_size, rank
    spec = FullAttentionSpec(
        block_size=int(settings["block_size"]),
        num_kv_heads=kv_heads,
        head_size=head_size,
        dtype=getattr(torch, str(settings["dtype"])),
    )
    page = spec.page_size_bytes
    if vllm_compat.CONFIG_API:
        tensors = [
            KVCacheTensor(
                size=page * num_blocks * len(LAYERS),
                layers=LAYERS,
                layer_stride=page * num_blocks if layer_major else page,
                block_stride=page if layer_major else page * len(LAYERS),
            )
        ]
    else:
        tensors = [KVCacheTensor(size=page * num_blocks, shared_by=[layer]) for layer in LAYERS]
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=LAYERS, kv_cache_spec=spec)],
    )
    return vllm_config, kv_cache_config


def make_spec(spec_cls: type, model: Path, extra: dict[str, Any], **kwargs: Any) -> Any:
    """``spec_cls`` built from :func:`engine_configs` as vLLM's connector builds it."""
    from kvtier.tiering_spec import vllm_compat

    return vllm_compat.create_spec(spec_cls, *engine_configs(model, extra, **kwargs))


def spec_without_engine(
    spec_cls: type,
    model: Path,
    extra: dict[str, Any],
    *,
    world_size: int = 1,
    rank: int = 0,
    kv_events: bool = False,
    replicated_layout: bool = False,
    engine_id: str = "unit-engine",
) -> Any:
    """``spec_cls`` for the tiny model's KV layout (two layers, 64 KiB per block) without
    vLLM's engine configs where this vLLM allows it: vLLM 0.32 and later build a spec
    from an ``OffloadingConfig`` alone, so this runs where no vLLM platform can (vLLM
    0.33's wheel on a machine without a GPU). Older releases need the engine's configs,
    and report no ``replicated_layout``."""
    from kvtier.tiering_spec import vllm_compat

    if not vllm_compat.CONFIG_API:
        engine: dict[str, Any] = {}
        if kv_events:
            from vllm.config import KVEventsConfig

            engine["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True, publisher="null"
            )
        return make_spec(spec_cls, model, extra, engine=engine, world_size=world_size, rank=rank)
    from kvtier.testkit.offloading import offloading_config

    blocks_per_chunk = int(extra.get("blocks_per_chunk") or 1)
    if extra.get("block_size"):
        blocks_per_chunk = int(extra["block_size"]) // 32
    return spec_cls(
        offloading_config(
            layer_names=LAYERS,
            tokens_per_block=32,
            worker_kv_bytes_per_block=65536,
            extra_config=extra,
            blocks_per_chunk=blocks_per_chunk,
            model=str(model),
            engine_id=engine_id,
            rank=rank,
            world_size=world_size,
            kv_events=kv_events,
            replicated_layout=replicated_layout,
        )
    )
