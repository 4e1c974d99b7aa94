"""kvtier's own admission path for vLLM 0.32's offloading scheduler, on plain models.

Every request vLLM admits goes through two scheduler-side calls of its offloading
connector: ``get_num_new_matched_tokens`` (the request's offload keys brought up to
date, its prefix looked up, the lookup's delay observed) and, where it hits,
``update_state_after_alloc`` (the device blocks a load fills, the load job, its key
ranges). vLLM writes both for every model it serves (several KV cache groups,
sliding windows, Mamba state, EAGLE drafts, partial tails), in layers: a lookup is
five Python calls deep before the manager is asked, and each offload key is made and
placed by two calls of its own. On a step that admits a burst of requests that is most
of the connector's work, on the scheduler's thread.

:func:`install` puts kvtier's own versions of the two, and of the lookup they share
(``_lookup``), on one scheduler instance where none of that generality can apply: one
KV cache group, plain full attention (:func:`kvtier.vllm_port.store_jobs.plain_model`),
no partial recurrent tails. For such a model they do what vLLM's code does, request for
request: the same keys made and placed, the same keys asked of the manager, the same
answers, load jobs (ids, blocks, group sizes and offsets), request and job state,
counters, histograms and log lines. They are written against vLLM 0.32.0's code and
installed only where the scheduler's code is that code (:data:`KNOWN_SOURCES`: a digest
of the source of every function whose rules they follow); with any other source, vLLM's
own methods run.

kvtier's other scheduler changes stay in front of them as before: the lookup memo
(:mod:`kvtier.vllm_port.lookup_memo`) wraps ``_lookup``, synchronous loads
(:mod:`kvtier.vllm_port.sync_loads`) and the store-planning filter wrap the other two.
The lookup asks the scheduler's ``_maximal_prefix_lookup`` (kvtier's one-call lookup
where :mod:`kvtier.vllm_port.lookups` installed it), which records the KV events vLLM's
loop records.

One thing differs in time, not in content: the lookup's delay sample (vLLM's
``LOOKUP_SYNC_DELAY`` histogram) of an ask the lookup memo answered (a waiting request
asked about again, a third of the steps of a busy engine) is held while the
scheduler's own connector stats (``_connector_stats``) carry nothing else, and observed
into them once they carry something, at the latest ``HOLD_STEPS`` stats later or when a
request finishes (:meth:`Admissions.release_held`, which the connector calls before vLLM
takes those stats, and when a request finishes: a caller of :func:`install` with the
lookup memo must do the same, or the held samples are never reported). Observed at
once, it made vLLM hand out and merge a stats object on each such step, for one sample.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any

from kvtier.vllm_port import store_jobs

# Stats asked for (once a step) at most, while a memo answer's delay sample is held.
HOLD_STEPS = 32

# sha256 of the sources (see :func:`source_digest`) these functions reproduce.
KNOWN_SOURCES = frozenset(
    {
        "25b575efa77fcd15ff2507feb0f2625be9ba759f1c3aa3f2008dfd4afaa484c3",  # vLLM 0.32.0
    }
)


def _sources(cls: type) -> list[Any] | None:
    """vLLM's functions whose rules the admission path follows, for the scheduler class
    ``cls`` (vLLM's ``OffloadingConnectorScheduler`` or a subclass)."""
    module = sys.modules.get(cls.__module__)
    state_cls = getattr(module, "RequestOffloadState", None)
    context_cls = getattr(module, "ReqContext", None)
    found = [
        getattr(cls, "get_num_new_matched_tokens", None),
        getattr(cls, "_lookup", None),
        getattr(cls, "_lookup_complete_chunks", None),
        getattr(cls, "_maybe_observe_lookup_async_delay", None),
        getattr(cls, "update_state_after_alloc", None),
        getattr(cls, "_generate_job_id", None),
        getattr(state_cls, "update_offload_keys", None),
        getattr(state_cls, "update_num_hit_chunks", None),
        getattr(context_cls, "set_offload_key_position", None),
        getattr(module, "make_offload_key", None),
        getattr(module, "cdiv", None),
        getattr(module, "round_down", None),
    ]
    return None if any(f is None for f in found) else found


def source_digest(cls: type) -> str | None:
    """A digest of the source of vLLM's admission code for the scheduler class ``cls``,
    or None where it cannot be read."""
    return store_jobs.digest_of(_sources(cls))


def applies(scheduler: Any) -> bool:
    """Whether ``scheduler`` has one plain full-attention KV cache group, no partial
    tails, and vLLM's admission code this path reproduces."""
    config = getattr(scheduler, "config", None)
    groups = getattr(config, "kv_group_configs", None)
    if (
        not groups
        or len(groups) != 1
        or getattr(config, "supports_partial_tail", True) is not False
        or getattr(scheduler, "_sliding_window_groups", None) != ()
        or getattr(scheduler, "_mamba_align_size", 0) is not None
        or not store_jobs.plain_model(scheduler)
        or not isinstance(getattr(scheduler, "_chunks_being_loaded", 0), (set, type(None)))
    ):
        return False
    group = groups[0]
    if not all(
        isinstance(getattr(group, name, None), int)
        for name in ("group_idx", "tokens_per_block", "tokens_per_chunk", "hashes_per_chunk")
    ):
        return False
    if source_digest(type(scheduler)) not in KNOWN_SOURCES:
        return False
    # Keys are the block hash and the group index's four bytes (checked on a probe).
    make_key = sys.modules[type(scheduler).__module__].make_offload_key
    return bool(make_key(b"kvtier", group.group_idx) == b"kvtier" + _suffix(group.group_idx))


def _suffix(group_idx: int) -> bytes:
    return group_idx.to_bytes(4, "big", signed=False)


def install(scheduler: Any) -> bool:
    """Put kvtier's ``get_num_new_matched_tokens``, ``update_state_after_alloc`` and
    ``_lookup`` on ``scheduler`` where they apply (see the module); whether they were.
    Call it before anything wraps those methods, and call the installed
    :meth:`Admissions.release_held` (``scheduler._kvtier_admissions``) as the module
    says."""
    if not applies(scheduler):
        return False
    admit = Admissions(scheduler)
    scheduler._lookup = admit.lookup
    scheduler.get_num_new_matched_tokens = admit.matched
    scheduler.update_state_after_alloc = admit.allocated
    scheduler._kvtier_admissions = admit
    return True


class Admissions:
    """The admission calls of one scheduler (see the module)."""

    def __init__(self, scheduler: Any) -> None:
        module = sys.modules[type(scheduler).__module__]
        config = scheduler.config
        group = config.kv_group_configs[0]
        self.scheduler = scheduler
        self.group_config = group
        self.statuses: dict[str, Any] = scheduler._req_status
        self.tokens_per_chunk: int = group.tokens_per_chunk
        self.tokens_per_block: int = group.tokens_per_block
        self.hashes_per_chunk: int = group.hashes_per_chunk
        self.blocks_per_chunk: int = config.blocks_per_chunk
        self.group_idx: int = group.group_idx
        self.suffix = _suffix(group.group_idx)
        self.num_workers: int = config.num_workers
        self.vllm_logger: logging.Logger = module.logger
        self.sync_delay = module._ConnectorMetricName.LOOKUP_SYNC_DELAY
        self.async_delay = module._ConnectorMetricName.LOOKUP_ASYNC_DELAY
        self.chunk_level = module.OffloadPolicy.CHUNK_LEVEL
        self.job_status_cls = module.TransferJobStatus
        self.job_cls = module.TransferJob
        self.device_spec = module.GPULoadStoreSpec
        self.admitted = 0  # requests looked up here (for tests)
        # Called with the request id first thing in matched() and allocated(), where set
        # (kvtier-vllm-port's store planning: what may move a request's store index back).
        self.forget: Callable[[str], None] | None = None
        # Delay samples of memo answers not observed yet, and stats asked for since.
        self.held: list[float] = []
        self.held_steps = 0

    # -- get_num_new_matched_tokens ---------------------------------------------------

    def matched(
        self, request: Any, num_computed_tokens: int, max_num_new_tokens: int | None = None
    ) -> tuple[int | None, bool]:
        forget = self.forget
        if forget is not None:
            forget(request.request_id)
        scheduler = self.scheduler
        status = self.statuses[request.request_id]
        group = status.group_states[0]
        group.block_ids.clear()
        if status.transfer_jobs:
            self.vllm_logger.debug(
                "Delaying request %s since it still has in-flight transfers",
                request.request_id,
            )
            return None, False
        self.admitted += 1
        self.update_keys(status)
        status.num_locally_computed_tokens = num_computed_tokens
        hit: int | None
        if request.skip_reading_prefix_cache:
            hit = 0
        else:
            stats = scheduler._connector_stats
            repeated = getattr(scheduler, "kvtier_repeated_lookups", None)
            start = time.monotonic()
            hit = scheduler._lookup(status, max_num_new_tokens)
            delay = time.monotonic() - start
            if (
                repeated is not None
                and scheduler.kvtier_repeated_lookups != repeated
                and stats.is_empty()
            ):
                self.held.append(delay)  # a memo answer's, alone in the stats: held
            else:
                stats.observe_histogram(self.sync_delay, delay)
            if hit is None:
                if status.deferred_lookup_start_time is None:
                    status.deferred_lookup_start_time = start
            else:
                began = status.deferred_lookup_start_time
                if began is not None:
                    status.deferred_lookup_start_time = None
                    stats.observe_histogram(self.async_delay, time.monotonic() - began)
        group.num_hit_chunks = (num_computed_tokens + (hit or 0)) // self.tokens_per_chunk
        return hit, bool(hit)

    def release_held(self, now: bool = False) -> None:
        """Called before vLLM takes the scheduler's connector stats (once a step), and
        with ``now`` when a request finishes: observe the held delay samples (see the
        module) where the stats carry something already, ``HOLD_STEPS`` calls after
        the first was held, or ``now``."""
        if not self.held:
            return
        stats = self.scheduler._connector_stats
        self.held_steps += 1
        if now or self.held_steps >= HOLD_STEPS or not stats.is_empty():
            held, self.held, self.held_steps = self.held, [], 0
            for delay in held:
                stats.observe_histogram(self.sync_delay, delay)

    def update_keys(self, status: Any) -> None:
        """vLLM's ``RequestOffloadState.update_offload_keys`` of ``status``: a key for
        each chunk's last block hash not keyed yet, its end token placed in the
        request's context."""
        keys: list[Any] = status.group_states[0].offload_keys
        per = self.hashes_per_chunk
        count = len(keys)
        new = status.req.block_hashes[per * count + per - 1 :: per]
        if new:
            suffix, size = self.suffix, self.tokens_per_chunk
            added = [block_hash + suffix for block_hash in new]
            keys += added
            # (Together, not a call per key: each key's end token, chunk by chunk.)
            end = count * size
            status.req_context._offload_key_positions.update(
                zip(added, range(end + size, end + size * (len(added) + 1), size))
            )

    # -- _lookup ------------------------------------------------------------------------

    def lookup(self, status: Any, max_num_new_tokens: int | None = None) -> int | None:
        hit = self._complete_chunks(status, max_num_new_tokens)
        status.partial_tail_boundary = None
        return hit

    def _complete_chunks(self, status: Any, max_num_new_tokens: int | None) -> int | None:
        """vLLM's ``_lookup_complete_chunks`` for one full-attention group."""
        size = self.tokens_per_chunk
        computed = status.num_locally_computed_tokens
        req = status.req
        max_hit = num_tokens = req.num_tokens
        if max_num_new_tokens is not None:
            max_hit = min(max_hit, computed + max_num_new_tokens)
        max_load = status.max_load_tokens
        if max_load is not None:
            max_hit = min(max_hit, computed + max_load)
        keys = status.group_states[0].offload_keys
        assert len(keys) >= num_tokens // size
        max_hit = min(max_hit, len(keys) * size)
        if max_load is not None:
            max_hit = max_hit // size * size
        if max_hit - computed < size:
            return 0  # less than a chunk to load
        num_chunks = min(-(max_hit // -size), len(keys))
        first = computed // size
        found = self.scheduler._maximal_prefix_lookup(
            keys[first:num_chunks], status.req_context, req, self.group_config, first
        )
        if found == 0:
            return 0
        if found is not None:
            max_hit = min(max_hit, size * (first + found))
        hit = max_hit - computed
        if hit < size:
            return 0
        if found is None:
            self.vllm_logger.debug(
                "Offloading manager delayed request %s as backend requested", req.request_id
            )
            return None
        loading = self.scheduler._chunks_being_loaded
        if loading and not loading.isdisjoint(keys[first : -((computed + hit) // -size)]):
            self.vllm_logger.debug(
                "Delaying request %s since some of its chunks are already being loaded",
                req.request_id,
            )
            return None
        self.vllm_logger.debug(
            "Request %s hit %s offloaded tokens after %s GPU hit tokens",
            req.request_id,
            hit,
            computed,
        )
        return hit

    # -- update_state_after_alloc ---------------------------------------------------------

    def allocated(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        forget = self.forget
        if forget is not None:
            forget(request.request_id)
        if num_external_tokens == 0:
            return
        scheduler = self.scheduler
        req_id = request.request_id
        status = self.statuses[req_id]
        computed = status.num_locally_computed_tokens
        cached = computed + num_external_tokens
        # (vLLM clears the boundary after the load; without partial tails it is None.)
        assert status.partial_tail_boundary is None
        ranges: list[tuple[int, int, Any]] = status.load_key_ranges
        ranges.clear()
        group_blocks = blocks.blocks[self.group_idx]
        # (A comprehension, not a generator: one frame, not one resumption per block.)
        scheduler._current_batch_allocated_block_ids.update(
            [block.block_id for block in group_blocks if block.block_id != 0]
        )
        per_block, size = self.tokens_per_block, self.tokens_per_chunk
        num_gpu_blocks = -(cached // -per_block)
        assert len(group_blocks) >= num_gpu_blocks
        # The load starts at the first block of the hit that is not null and not hashed.
        load_start = num_gpu_blocks
        for i in range(-(computed // -per_block), num_gpu_blocks):
            block = group_blocks[i]
            if not block.is_null and block.block_hash is None:
                load_start = i
                break
        assert computed % per_block == 0
        pending = num_gpu_blocks - load_start
        num_chunks = -(cached // -size)
        group = status.group_states[0]
        keys_to_load: list[Any] = []
        if pending:
            first_chunk = load_start // self.blocks_per_chunk
            keys = group.offload_keys
            assert len(keys) >= num_chunks
            keys_to_load = keys[first_chunk:num_chunks]
            load_from = load_start * per_block
            end = first_chunk * size
            for key in keys_to_load:  # (comparisons, not max and min: per key)
                begin, end = end, end + size
                lo = load_from if load_from > begin else begin
                ranges.append((lo, cached if cached < end else end, key))
        dst_block_ids = [block.block_id for block in group_blocks[load_start:num_gpu_blocks]]
        if status.offloading_context.policy == self.chunk_level:
            group.next_stored_chunk_idx = num_chunks
        context = status.req_context
        src_spec = scheduler.manager.prepare_load(keys_to_load, context)
        dst_spec = self.device_spec(
            dst_block_ids, group_sizes=[pending], block_indices=[load_start]
        )
        job_id = scheduler._job_counter
        scheduler._job_counter = job_id + 1
        scheduler._current_batch_load_jobs[job_id] = self.job_cls(
            req_id=req_id, src_spec=src_spec, dst_spec=dst_spec
        )
        # a load can only be issued when no other jobs are pending (vLLM's invariant)
        assert not status.transfer_jobs
        status.transfer_jobs.add(job_id)
        scheduler._jobs[job_id] = self.job_status_cls(
            req_id=req_id,
            pending_count=self.num_workers,
            keys=set(keys_to_load),
            is_store=False,
        )
        loading = scheduler._chunks_being_loaded
        if loading is not None:
            loading.update(keys_to_load)


def admitted(scheduler: Any) -> int | None:
    """Requests looked up by kvtier's admission path on ``scheduler``; None where it is
    not installed (for tests)."""
    admit = getattr(scheduler, "_kvtier_admissions", None)
    return None if admit is None else admit.admitted


__all__ = [
    "HOLD_STEPS",
    "KNOWN_SOURCES",
    "Admissions",
    "admitted",
    "applies",
    "install",
    "source_digest",
]
