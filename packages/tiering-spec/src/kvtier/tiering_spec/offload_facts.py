"""What kvtier's offloading needs to know of the engine it serves, in plain values.

vLLM hands a spec an ``OffloadingConfig`` (vLLM 0.26 and later) or its own configs
(before); the spec's vLLM side turns either into an :class:`OffloadFacts` at one place,
and everything kvtier builds from it (:func:`kvtier.tiering_spec.build.build`) reads
only these. No vLLM import, so the composition is tested without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.vllm_port.facts import EngineFacts


@dataclass(frozen=True)
class GroupFacts:
    """One KV cache group as the offloading sees it.

    Attributes:
        group_id: vLLM's index of the group.
        layer_names: the layers whose KV it holds.
        tokens_per_block: tokens per device block of the group.
        sliding_window_chunks: host chunks a request of a sliding-window group keeps
            at most (None: the whole request, or not known).
    """

    group_id: int
    layer_names: tuple[str, ...]
    tokens_per_block: int
    sliding_window_chunks: int | None = None


@dataclass(frozen=True)
class OffloadFacts:
    """The engine, its KV layout and its parallelism, as the host tier is sized and the
    fs tier's fingerprint is written.

    Attributes:
        engine_id: vLLM's engine id (names the host regions).
        model_name / cache_dtype: the model's name and the KV cache's dtype.
        max_model_len: the model's longest request in tokens (0: not known).
        groups: the KV cache groups.
        blocks_per_chunk: device blocks per host chunk.
        tokens_per_hash: tokens per entry of a request's block hashes.
        worker_kv_bytes_per_block: KV bytes of one device block on one worker
            (0: not known here, as on a scheduler of an older vLLM).
        kv_cache_layout: vLLM's KV cache layout name, where it has one.
        rank / world_size / tp_size / pp_size / pcp_size / dcp_size: parallelism.
        replicated_layout: vLLM reports every rank's KV to be the same (one copy can
            serve all ranks).
        kv_events: whether vLLM publishes KV cache events.
        engine: what identifies the model's weights and the KV it computes (the fs tier's
            fingerprint); None where nobody handed it over.
    """

    engine_id: str
    model_name: str
    cache_dtype: str
    groups: tuple[GroupFacts, ...]
    blocks_per_chunk: int
    tokens_per_hash: int
    worker_kv_bytes_per_block: int
    rank: int = 0
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    max_model_len: int = 0
    kv_cache_layout: str | None = None
    replicated_layout: bool = False
    kv_events: bool = False
    engine: EngineFacts | None = None

    @property
    def tokens_per_block(self) -> tuple[int, ...]:
        """Tokens per device block of each group, in order."""
        return tuple(g.tokens_per_block for g in self.groups)
