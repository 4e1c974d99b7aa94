"""The engine's identity in the fs tier's fingerprint: what the KV in a file depends on
(the model's weights and config, the block-hash scheme, the KV layout, kvtier's format),
so no file is ever loaded into an engine that would compute other KV. No vLLM import."""

from __future__ import annotations

import logging
import secrets
from typing import Any

import xxhash

from kvtier.tiering_spec.identity import digest_model, resolve_model_location
from kvtier.tiering_spec.offload_facts import OffloadFacts
from kvtier.tiering_spec.sizing import Sizing
from kvtier.tiering_spec.tiers.fs.format import FORMAT_VERSION
from kvtier.vllm_port.facts import EngineFacts

logger = logging.getLogger("kvtier.tiering_spec")


def _tensor_placement(fields: Any, num_blocks: int) -> Any:
    """How one ``KVCacheTensor`` (its plain rendering) places its layers' pages, without
    what depends on the number of device blocks (it changes with free device memory from
    one start to the next, and the bytes of a block do not)."""
    if not isinstance(fields, dict):
        return fields
    fields = {k: v for k, v in fields.items() if k != "size"}  # the facts stay as they are
    # Layer-major tensors step a layer by num_blocks blocks: keep that count in layers.
    span = int(fields.get("block_stride") or 0) * num_blocks
    for name in ("layer_stride", "offset"):
        value = fields.get(name)
        if isinstance(value, int) and span:
            fields[name] = [value // span, value % span]
    return fields


def _engine_fields(facts: EngineFacts) -> dict[str, Any]:
    """What vLLM's configs say about the KV a model computes and how it is keyed: the
    model's config, dtype and overrides, vLLM and its attention backend, the block-hash
    scheme (with a warning where its seed is random) and every KV cache group and tensor."""
    model, block_hash, kv = facts.model, facts.block_hash, facts.kv
    assert kv is not None
    if block_hash.seed == "random":
        logger.warning(
            "kvtier fs tier: vLLM seeds its block hashes (prefix_caching_hash_algo=%s) "
            "with a random value per process, so the files this engine writes are "
            "never found after a restart or by another engine. Set PYTHONHASHSEED to "
            "one value for every engine%s",
            block_hash.algo,
            ", or use prefix_caching_hash_algo=sha256" if block_hash.fixed_seed_default else "",
        )
    draft = model.draft
    return {
        "vllm_version": facts.vllm_version,
        "platform": facts.platform,
        "revision": model.revision,
        "quantization": model.quantization,
        "model_dtype": model.dtype,
        "hf_config": xxhash.xxh3_128_hexdigest(model.hf_config_json.encode()),
        "hf_overrides": model.hf_overrides,
        "load_format": model.load_format,
        "attention_backend": facts.attention_backend,
        "speculative": None if draft is None else [draft.method, str(draft.model)],
        "block_hash": [block_hash.algo, block_hash.seed],
        "kv_cache_groups": [[list(g.layer_names), g.spec] for g in kv.groups],
        "kv_cache_tensors": [_tensor_placement(t.fields, kv.num_blocks) for t in kv.tensors],
    }


def cached_prefix_unusable(facts: EngineFacts | None) -> str | None:
    """Why this engine cannot be given KV it did not compute itself, or None."""
    if facts is None:
        return None
    if facts.model.use_mla and facts.platform_is_cpu and not facts.block_hash.prefix_caching:
        # vLLM's CPU MLA backend computes a prompt on top of cached KV differently from
        # computing it whole (greedy outputs diverge even with vLLM's own prefix cache).
        return (
            "vLLM turned prefix caching off for this MLA model on its CPU platform, whose "
            "MLA backend does not give the same results on top of cached KV"
        )
    return None


def engine_identity(
    facts: OffloadFacts,
    sizing: Sizing,
    model_identity: str | None,
    digest_cache: str | None = None,
) -> tuple[dict[str, Any], bool]:
    """What the KV in an fs tier file depends on, besides the rank: the model's weights
    and config, the block-hash scheme, the KV layout, kvtier's format.

    Returns ``(identity, persistent)``; ``persistent`` is False where the weights could
    not be identified, and the identity then holds a nonce of this engine alone, so no
    other engine (and no later start) reads its files. ``model_identity`` is the user's
    name for the weights (it stands in for their digest).
    """
    ident: dict[str, Any] = {
        "kvtier_format": FORMAT_VERSION,
        "model": facts.model_name,
        "cache_dtype": facts.cache_dtype,
        "worker_kv_bytes_per_block": facts.worker_kv_bytes_per_block,
        "sub_block_bytes": sizing.sub_block_bytes,
        "blocks_per_chunk": facts.blocks_per_chunk,
        "tokens_per_block": list(facts.tokens_per_block),
        "tokens_per_hash": facts.tokens_per_hash,
        "groups": [[g.group_id, list(g.layer_names)] for g in facts.groups],
        "kv_cache_layout": facts.kv_cache_layout,
        "replicated_layout": facts.replicated_layout,
        "world_size": max(1, facts.world_size),
        "tp_size": facts.tp_size,
        "pp_size": facts.pp_size,
        "pcp_size": facts.pcp_size,
        "dcp_size": facts.dcp_size,
    }
    engine = facts.engine
    if engine is None or engine.kv is None:
        unverified = "vLLM's model and KV cache configs were not found"
    else:
        ident.update(_engine_fields(engine))
        ident["weights"], unverified = _weights(engine, model_identity, digest_cache)
    if unverified:
        ident["weights"] = ["unverified", secrets.token_hex(16)]
        logger.warning(
            "kvtier fs tier: %s, so nothing proves that files on disk were computed by "
            "this model. This engine writes and reads only files of its own, and "
            "removes them at shutdown. To share files between engines and restarts, set "
            "model_identity in kv_connector_extra_config to a name you change whenever "
            "the weights change",
            unverified,
        )
    return ident, not unverified


def _weights(
    facts: EngineFacts, model_identity: str | None, digest_cache: str | None
) -> tuple[Any, str]:
    """(what identifies the weights, "") or (None, why they cannot be identified)."""
    if model_identity is not None:
        return ["model_identity", model_identity], ""
    model = facts.model
    load_format = str(model.load_format)
    if load_format == "dummy":
        return None, "load_format=dummy draws new random weights at every start"
    models = [(model.name, model.revision)]
    draft = model.draft
    if draft is not None and draft.model and draft.model != model.name:
        models.append((draft.model, draft.revision))
    weights = []
    for name, revision in models:
        where = resolve_model_location(name, revision=revision, download_dir=model.download_dir)
        if where is None:
            return None, f"the files of {name!r} were not found on this machine"
        try:
            d = digest_model(
                where,
                cache_path=digest_cache,
                prefer_safetensors=load_format not in ("pt", "npcache"),
            )
        except (OSError, ValueError) as exc:
            return None, f"the files of {name!r} could not be hashed ({exc})"
        logger.info(
            "kvtier fs tier: weights of %s identified by %d file(s), digest %s "
            "(%.1f MiB hashed in %.2f s, the rest from the digest cache)",
            d.location,
            len(d.files),
            d.digest[:12],
            d.hashed_bytes / (1 << 20),
            d.seconds,
        )
        weights.append(d.files)
    return weights, ""


def layouts(identity: dict[str, Any], num_copies: int) -> list[dict[str, Any]]:
    """One layout per copy: a replicated layout's one copy is rank 0's, which every rank
    reads."""
    return [{**identity, "rank": rank} for rank in range(num_copies)]
