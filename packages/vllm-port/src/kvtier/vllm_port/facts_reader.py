"""The engine's facts read from vLLM's configuration objects (:class:`EngineFacts`).

What kvtier needs of an engine (the model and its weights, the parallel layout, the
block-hash scheme, LoRA, the KV layout of a rank) is read here once, by attribute, from
the ``VllmConfig`` and ``KVCacheConfig`` vLLM hands a connector; fields a release lacks
read as their defaults. :meth:`kvtier.vllm_port.port.VllmPort.engine_facts` calls it
with its interface generation's block-hash seed. vLLM itself is imported only when a
function is called (its version, platform, world group and block-size resolver).
"""

from __future__ import annotations

from typing import Any

from kvtier.vllm_port.facts import (
    BlockHashFacts,
    DraftFacts,
    EngineFacts,
    KVGroupFacts,
    KVLayoutFacts,
    KVPlacement,
    KVTensorFacts,
    LoraFacts,
    ModelFacts,
    ParallelFacts,
    plain,
)


def read_engine_facts(
    vllm_config: Any, kv_cache_config: Any, *, seed: Any, fixed_seed_default: bool
) -> EngineFacts:
    """The facts of the engine behind ``vllm_config``, its KV layout where
    ``kv_cache_config`` is given; ``seed`` is the block-hash seed and
    ``fixed_seed_default`` whether the release fixes it by default (the port's)."""
    import vllm
    from vllm.platforms import current_platform

    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    lora = getattr(vllm_config, "lora_config", None)
    attention = getattr(vllm_config, "attention_config", None)
    return EngineFacts(
        vllm_version=str(vllm.__version__),
        platform=str(current_platform.device_type),
        platform_is_cpu=bool(current_platform.is_cpu()),
        attention_backend=plain(getattr(attention, "backend", None)),
        model=_model_facts(vllm_config),
        parallel=ParallelFacts(
            world_size=int(parallel.world_size),
            rank=_world_rank(parallel),
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(parallel.pipeline_parallel_size),
        ),
        block_hash=BlockHashFacts(
            algo=str(cache.prefix_caching_hash_algo),
            seed=seed,
            fixed_seed_default=fixed_seed_default,
            prefix_caching=bool(getattr(cache, "enable_prefix_caching", False)),
        ),
        lora=LoraFacts(
            enabled=lora is not None,
            max_loras=None if lora is None else getattr(lora, "max_loras", None),
        ),
        kv=None if kv_cache_config is None else read_kv_layout(vllm_config, kv_cache_config),
    )


def read_kv_layout(vllm_config: Any, kv_cache_config: Any) -> KVLayoutFacts:
    """The KV cache of one rank as ``kv_cache_config`` describes it."""
    return KVLayoutFacts(
        num_blocks=int(kv_cache_config.num_blocks),
        groups=tuple(_group_facts(g) for g in kv_cache_config.kv_cache_groups),
        tensors=tuple(_tensor_facts(t) for t in kv_cache_config.kv_cache_tensors),
        hash_block_size=_hash_block_size(vllm_config, kv_cache_config),
    )


def _model_facts(vllm_config: Any) -> ModelFacts:
    mc, lc = vllm_config.model_config, vllm_config.load_config
    draft = vllm_config.speculative_config
    return ModelFacts(
        name=str(mc.model),
        revision=mc.revision,
        dtype=plain(mc.dtype),
        quantization=plain(mc.quantization),
        hf_config_json=mc.hf_config.to_json_string(use_diff=False),
        hf_overrides="fn" if callable(mc.hf_overrides) else plain(mc.hf_overrides),
        load_format=plain(lc.load_format),
        download_dir=lc.download_dir,
        use_mla=bool(getattr(mc, "use_mla", False)),
        draft=None
        if draft is None
        else DraftFacts(
            method=plain(draft.method),
            model=None if draft.model is None else str(draft.model),
            revision=getattr(draft, "revision", None),
        ),
    )


def _world_rank(parallel: Any) -> int:
    """This process's rank in vLLM's world group (the worker's), or the configured one
    where no group exists yet (the scheduler's process)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank)
    except Exception:
        return int(getattr(parallel, "rank", 0) or 0)


def _group_facts(group: Any) -> KVGroupFacts:
    spec = group.kv_cache_spec
    layers = tuple(str(n) for n in group.layer_names)
    per_layer = getattr(spec, "kv_cache_specs", {}) or {}
    pages: dict[str, int | None] = {}
    for layer in layers:
        page = getattr(per_layer.get(layer, spec), "page_size_bytes", None)
        pages[layer] = int(page) if page else None
    window = getattr(spec, "sliding_window", None)
    return KVGroupFacts(
        layer_names=layers,
        kind=type(spec).__name__,
        lineage=frozenset(c.__name__ for c in type(spec).__mro__),
        block_size=int(spec.block_size),
        sliding_window=int(window) if window else None,
        has_heads=hasattr(spec, "num_kv_heads") and hasattr(spec, "head_size"),
        page_bytes=pages,
        mamba_cache_mode=getattr(spec, "mamba_cache_mode", None),
        speculative_blocks=int(getattr(spec, "num_speculative_blocks", 0) or 0),
        prefill_checkpoint_blocks=int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0),
        spec=plain(spec),
    )


def _tensor_facts(tensor: Any) -> KVTensorFacts:
    # Releases before placements name a tensor's layers ``shared_by``.
    layers = getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or ()
    placement = None
    if hasattr(tensor, "layer_stride"):
        placement = KVPlacement(
            offset=int(tensor.offset),
            layer_stride=int(tensor.layer_stride),
            block_stride=int(tensor.block_stride),
        )
    return KVTensorFacts(
        layers=tuple(str(n) for n in layers),
        size=int(tensor.size),
        host_resident=bool(getattr(tensor, "host_resident", False)),
        placement=placement,
        fields=plain(tensor),
    )


def _hash_block_size(vllm_config: Any, kv_cache_config: Any) -> int:
    """Tokens per entry of a request's ``block_hashes`` (vLLM hashes at this size)."""
    try:
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

        return int(resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)[1])
    except Exception:
        return int(vllm_config.cache_config.block_size)
