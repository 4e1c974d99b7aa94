"""What kvtier needs to know about the engine it serves, read from vLLM once.

:class:`EngineFacts` is built by the port (:meth:`kvtier.vllm_port.port.VllmPort.engine_facts`)
from vLLM's ``VllmConfig`` and ``KVCacheConfig`` when kvtier's connector or spec is
constructed, and handed to the code that needs it: the tiering spec's model fingerprint
and load rules, the recompute connector's block placements and groups. Nothing here
imports vLLM; the fields are plain data (vLLM's own dataclasses appear only as
:func:`plain` renderings), so both plugins and their tests can build facts by hand.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


def plain(value: Any) -> Any:
    """``value`` as JSON-serialisable data (dataclasses, enums, dtypes, containers).

    A dataclass becomes ``{"type": its class name, field: value, ...}``; sets are
    sorted; anything else is its ``str`` without a ``torch.`` prefix. The tiering spec's
    model fingerprint is made of these renderings: changing this function changes
    every engine's fingerprint.
    """
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            "type": type(value).__name__,
            **{f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)},
        }
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    return str(value).removeprefix("torch.")


@dataclass(frozen=True)
class DraftFacts:
    """The speculative-decoding configuration: its method and draft model."""

    method: Any  # plain
    model: str | None
    revision: str | None


@dataclass(frozen=True)
class ModelFacts:
    """The model and its weights, as vLLM's model and load configs name them."""

    name: str
    revision: str | None
    dtype: Any  # plain
    quantization: Any  # plain
    hf_config_json: str  # the model's whole config (``to_json_string(use_diff=False)``)
    hf_overrides: Any  # plain, or "fn" for a callable
    load_format: Any  # plain
    download_dir: str | None
    use_mla: bool
    draft: DraftFacts | None = None


@dataclass(frozen=True)
class KVGroupFacts:
    """One KV cache group: its layers and the kind of KV its spec describes."""

    layer_names: tuple[str, ...]
    kind: str  # the spec's class name (FullAttentionSpec, MambaSpec, ...)
    lineage: frozenset[str]  # the class names of the spec's bases, its own included
    block_size: int  # tokens per block
    sliding_window: int | None
    has_heads: bool  # the spec has num_kv_heads and head_size (attention KV)
    # Bytes of one block of each layer (its page, padding included), where known.
    page_bytes: Mapping[str, int | None] = field(default_factory=dict)
    mamba_cache_mode: str | None = None
    speculative_blocks: int = 0
    prefill_checkpoint_blocks: int = 0
    spec: Any = None  # plain rendering of the spec (the fingerprint's)


@dataclass(frozen=True)
class KVPlacement:
    """Where one tensor's layers lie in vLLM's one KV allocation, in bytes."""

    offset: int
    layer_stride: int
    block_stride: int


@dataclass(frozen=True)
class KVTensorFacts:
    """One of vLLM's KV cache tensors."""

    layers: tuple[str, ...]
    size: int
    host_resident: bool
    # Set on releases that place every tensor in one allocation (``layer_stride``);
    # None where each tensor is an allocation of its own.
    placement: KVPlacement | None
    fields: Any = None  # plain rendering of the tensor (the fingerprint's)


@dataclass(frozen=True)
class KVLayoutFacts:
    """The KV cache of one rank: blocks, groups and tensors."""

    num_blocks: int
    groups: tuple[KVGroupFacts, ...]
    tensors: tuple[KVTensorFacts, ...]
    hash_block_size: int  # tokens per entry of a request's block hashes

    def device_tensors(self) -> tuple[KVTensorFacts, ...]:
        return tuple(t for t in self.tensors if not t.host_resident)


@dataclass(frozen=True)
class ParallelFacts:
    world_size: int
    rank: int
    tp_size: int
    pp_size: int


@dataclass(frozen=True)
class BlockHashFacts:
    """How vLLM keys a block: the hash algorithm and how its seed is drawn."""

    algo: str
    # "PYTHONHASHSEED", "fixed" (vLLM's default seed) or "random" (per process).
    seed: str
    fixed_seed_default: bool  # whether this vLLM seeds non-xxhash hashes with a fixed value
    prefix_caching: bool  # whether vLLM's prefix caching is on (blocks carry hashes)


@dataclass(frozen=True)
class LoraFacts:
    enabled: bool
    max_loras: int | None = None


@dataclass(frozen=True)
class EngineFacts:
    """Everything kvtier reads about the engine it serves, once, at construction."""

    vllm_version: str
    platform: str  # vLLM's device type ("cpu", "cuda", "npu", ...)
    platform_is_cpu: bool
    attention_backend: Any  # plain
    model: ModelFacts
    parallel: ParallelFacts
    block_hash: BlockHashFacts
    lora: LoraFacts
    kv: KVLayoutFacts | None  # None where vLLM's KV cache config was not handed over


def config_int(config: Mapping[str, Any], *keys: str) -> int | None:
    """The first positive integer among ``keys`` of a Hugging Face model config (a
    model family may name a field its own way: ``n_layer`` for ``num_hidden_layers``)."""
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def text_config(config: Any) -> dict[str, Any]:
    """A model config's language part (a multimodal model nests it as ``text_config``)."""
    if not isinstance(config, dict):
        return {}
    inner = config.get("text_config", config)
    return inner if isinstance(inner, dict) else {}


def kv_shape(config: Mapping[str, Any]) -> tuple[int | None, int | None, int | None]:
    """``(layers, kv_heads, head_dim)`` as a model's (text) config gives them, None for
    what it does not: KV heads default to the attention heads, the head size to the
    hidden size over the heads."""
    layers = config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = config_int(config, "num_attention_heads", "n_head")
    hidden = config_int(config, "hidden_size", "n_embd")
    kv_heads = config_int(config, "num_key_value_heads") or heads
    head_dim = config_int(config, "head_dim") or (hidden // heads if hidden and heads else None)
    return layers, kv_heads, head_dim
