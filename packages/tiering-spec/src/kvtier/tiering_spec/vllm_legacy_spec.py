"""kvtier's spec base on vLLM releases before 0.26 (vLLM 0.23 to 0.25).

Called by :mod:`kvtier.tiering_spec.vllm_compat` only on those releases: a spec
there is built from ``(vllm_config, kv_cache_config)``, and vLLM drives a spec's
transfers through handlers keyed by (source, destination) medium. This module derives
the fields of vLLM 0.32's ``OffloadingConfig`` that kvtier reads from the engine's
configs (:func:`init_legacy_spec`), and serves both directions with one
:class:`TransferHandler` over kvtier's worker (:func:`legacy_handlers`), so kvtier's
spec is one class on every release.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.base import GPULoadStoreSpec, OffloadingSpec
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

from kvtier.tiering_spec.errors import ConfigError
from kvtier.vllm_port.port import current as current_port


@dataclass(frozen=True)
class _Group:
    group_id: int
    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class _Model:
    name: str
    dtype: str


@dataclass(frozen=True)
class _Cache:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclass(frozen=True)
class _Parallel:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int


@dataclass(frozen=True)
class LegacyOffloadingConfig:
    """The fields of vLLM 0.32's ``OffloadingConfig`` that kvtier's specs read."""

    groups: tuple[_Group, ...]
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: Mapping[str, Any]
    engine_id: str
    model: _Model
    cache: _Cache
    parallel: _Parallel
    kv_cache_layout: str | None = None
    replicated_layout: bool = False


@dataclass(frozen=True)
class _EventsConfig:
    enable_kv_cache_events: bool


def _blocks_per_chunk(extra: Mapping[str, Any], tokens_per_block: set[int]) -> int:
    """``blocks_per_chunk`` or ``block_size`` of ``kv_connector_extra_config``, checked
    as vLLM 0.32 checks them."""
    per_chunk, tokens = extra.get("blocks_per_chunk"), extra.get("block_size")
    if per_chunk is not None and tokens is not None:
        raise ConfigError(
            "kv_connector_extra_config: set one of 'blocks_per_chunk' or 'block_size', not both"
        )
    if per_chunk is not None:
        if isinstance(per_chunk, bool) or not isinstance(per_chunk, int) or per_chunk <= 0:
            raise ConfigError(
                f"kv_connector_extra_config.blocks_per_chunk must be a positive integer, "
                f"got {per_chunk!r}"
            )
        return per_chunk
    if tokens is None:
        return 1
    if len(tokens_per_block) != 1:
        raise ConfigError(
            "kv_connector_extra_config.block_size needs every KV cache group to have the "
            f"same block size (they have {sorted(tokens_per_block)}); set blocks_per_chunk"
        )
    (per_block,) = tokens_per_block
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens % per_block:
        raise ConfigError(
            f"kv_connector_extra_config.block_size must be a multiple of the device block "
            f"size ({per_block} tokens), got {tokens!r}; or set blocks_per_chunk"
        )
    return tokens // per_block


def legacy_offloading_config(vllm_config: Any, kv_cache_config: Any) -> LegacyOffloadingConfig:
    """What vLLM 0.32's ``build_offloading_config`` derives, from an older vLLM's configs."""
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    transfer = vllm_config.kv_transfer_config
    extra: Mapping[str, Any] = transfer.kv_connector_extra_config or {}
    parallel = vllm_config.parallel_config
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    pcp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
    groups = tuple(
        _Group(i, int(g.kv_cache_spec.block_size) * dcp * pcp, tuple(g.layer_names))
        for i, g in enumerate(kv_cache_config.kv_cache_groups)
    )
    _, tokens_per_hash = resolve_kv_cache_block_sizes(kv_cache_config, vllm_config)
    num_blocks = int(kv_cache_config.num_blocks)
    # One KVCacheTensor per layer (or per layer set sharing one) in these releases.
    kv_bytes = sum(int(t.size) for t in kv_cache_config.kv_cache_tensors)
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = vllm_config.model_config.dtype if cache_dtype == "auto" else cache_dtype
    events = getattr(vllm_config, "kv_events_config", None)
    layout = current_port().kv_cache_layout()
    return LegacyOffloadingConfig(
        groups=groups,
        worker_kv_bytes_per_block=kv_bytes // num_blocks if num_blocks > 0 else 0,
        enable_kv_cache_events=bool(events is not None and events.enable_kv_cache_events),
        extra_config=extra,
        engine_id=str(transfer.engine_id),
        model=_Model(vllm_config.model_config.model, str(dtype).removeprefix("torch.")),
        cache=_Cache(
            int(tokens_per_hash), _blocks_per_chunk(extra, {g.tokens_per_block for g in groups})
        ),
        parallel=_Parallel(
            rank=int(parallel.rank),
            world_size=int(parallel.world_size),
            tp_size=int(parallel.tensor_parallel_size),
            pp_size=int(parallel.pipeline_parallel_size),
            pcp_size=pcp,
            dcp_size=dcp,
        ),
        kv_cache_layout=layout,
    )


class TransferHandler:
    """An older vLLM's ``OffloadingHandler`` for both directions, over a kvtier worker
    (an object with vLLM 0.32's ``submit_store``/``submit_load``/``get_finished``/
    ``wait``/``shutdown``). vLLM calls a handler by these four methods only."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._directions: dict[int, tuple[str, str]] = {}

    def transfer_async(self, job_id: int, spec: tuple[Any, Any]) -> bool:
        src, dst = spec
        if isinstance(src, GPULoadStoreSpec):
            ok = self.worker.submit_store(job_id, src, dst)
        else:
            ok = self.worker.submit_load(job_id, src, dst)
        self._directions[job_id] = (src.medium(), dst.medium())
        return bool(ok)

    def get_finished(self) -> list[Any]:
        # The worker's results are this vLLM's TransferResult (see transfer_result),
        # which names the direction as well.
        results = self.worker.get_finished()
        for r in results:
            r.transfer_type = self._directions.pop(r.job_id, None)
        return results

    def wait(self, job_ids: set[int]) -> None:
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        self.worker.shutdown()


def init_legacy_spec(spec: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """vLLM's ``OffloadingSpec.__init__`` as an older release runs it, then the fields of
    vLLM 0.32's spec derived from the engine's configs: the spec then looks like vLLM
    0.32's to kvtier."""
    config = legacy_offloading_config(vllm_config, kv_cache_config)
    OffloadingSpec.__init__(spec, vllm_config, kv_cache_config)
    spec.config = config
    spec.kv_events_config = _EventsConfig(config.enable_kv_cache_events)
    spec.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
    spec.tokens_per_hash = config.cache.tokens_per_hash
    spec.blocks_per_chunk = config.cache.blocks_per_chunk
    spec.block_size_factor = spec.blocks_per_chunk


def legacy_handlers(worker: Any) -> Iterator[tuple[type, type, Any]]:
    """An older vLLM's transfer handlers of a spec: one :class:`TransferHandler` over the
    spec's worker, for both directions."""
    handler = TransferHandler(worker)
    yield GPULoadStoreSpec, CPULoadStoreSpec, handler
    yield CPULoadStoreSpec, GPULoadStoreSpec, handler
