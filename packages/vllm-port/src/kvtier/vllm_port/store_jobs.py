"""kvtier's own store planner for vLLM's offloading scheduler, on plain models.

vLLM's ``OffloadingConnectorScheduler._build_store_jobs`` plans the stores of a step:
for each request that may store, the chunks past its ``next_stored_chunk_idx``, asked
of the manager (``prepare_store``), then the device blocks of the chunks the manager
takes, as one transfer job. It is written for every model vLLM serves (sliding-window
and Mamba groups with their reachability masks, EAGLE groups, sparse retention,
copy-on-write sources), and pays for that on every model: three Python loops a chunk
and a mask function called per group, about 2 µs a chunk on a CPU core, on the
scheduler's thread, for every request whose prompt it stores.

:func:`install` puts a planner of kvtier's own in its place where none of that
generality can apply: every KV cache group is full attention (vLLM's base
``reachable_block_mask``: every block reachable, whatever the retention interval),
and none is an EAGLE group or takes its source from copy-on-write. For such a model it
plans what vLLM's code plans, request for request and job id for job id: the same
keys asked of the manager, the same jobs with the same blocks, the same request and
job state, counters, events and log lines. A request with a null block (id 0) where
it would store is handed to vLLM's own code (the releases differ on which null blocks
drop a chunk), so the fast path only sees requests whose blocks are all real.

The manager is asked once a step where it can answer several requests
(``prepare_store_many``, which must answer as ``prepare_store`` of each in turn:
kvtier's manager, whose host tier reserves a step's new prompts in one pass): the
requests' new keys are read first, changing nothing, then asked for together, then the
jobs are built in vLLM's order. A manager without it is asked request by request. (So
a manager's own log lines about a request may come before the debug lines of the jobs
of the requests before it.)

It is installed only where vLLM's code is one this planner was written against and
checked with (:data:`KNOWN_SOURCES`: digests of the source of ``_build_store_jobs``
and of the helpers whose rules it inlines, for vLLM 0.32.0 and 0.33.0); with any
other source, vLLM's planner runs unchanged.

One thing it does otherwise, on purpose: a store the manager refuses for lack of room
(vLLM tries it again at the next step) is logged by vLLM's planner as a warning, for
every request, every time. Under write-back pressure (host blocks held until a
secondary tier has written them) that is most requests of a burst, each warning
costing the scheduler's thread more than the planning. Here the first refusal is
vLLM's warning, followed by a line saying where the others go: the debug level, vLLM's
``vllm:kv_offload_allocation_failure`` counter (counted as vLLM counts it) and, at
most once every ``REFUSALS_LOG_INTERVAL_S`` seconds, a warning with their number
(:class:`Refusals`).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
import time
from collections.abc import Callable, Collection
from itertools import chain
from typing import Any

logger = logging.getLogger("kvtier.vllm_port")

# sha256 of the sources (see :func:`source_digest`) this planner reproduces.
KNOWN_SOURCES = frozenset(
    {
        "16e6284129c3aa9329a798cb6d86402189be0247459e6d630315f95ad34182db",  # vLLM 0.32.0
        "7a31335222b3d46c358a147f108675a66e2c9cfb4e9fdecb95597dacffc7e23f",  # vLLM 0.33.0
    }
)


# At most one warning in this many seconds sums up the stores refused for lack of room.
REFUSALS_LOG_INTERVAL_S = 60.0


class Refusals:
    """The log lines of stores a manager refused for lack of room (see the module)."""

    __slots__ = ("_since", "_vllm_logger", "count")

    def __init__(self, vllm_logger: logging.Logger) -> None:
        self._vllm_logger = vllm_logger
        self._since: float | None = None  # when the last warning was logged
        self.count = 0  # refusals since then

    def refused(self, req_id: str) -> None:
        now = time.monotonic()
        if self._since is None:
            self._since = now
            self._vllm_logger.warning("Request %s: cannot store chunks", req_id)
            # (No argument: a lone one is checked against Mapping, slowly the first time.)
            logger.warning(
                "kvtier: stores the offloading manager refuses for lack of room are tried "
                "again at the next step; further refusals are logged at debug level, "
                "counted in vllm:kv_offload_allocation_failure and summed up here at most "
                f"once every {REFUSALS_LOG_INTERVAL_S:.0f} s"
            )
            return
        self.count += 1
        self._vllm_logger.debug("Request %s: cannot store chunks", req_id)
        if now - self._since >= REFUSALS_LOG_INTERVAL_S:
            logger.warning(
                "kvtier: %d stores refused for lack of room in the offloading manager in "
                "the last %.0f s (each tried again at the next step)",
                self.count,
                now - self._since,
            )
            self._since, self.count = now, 0


def _sources(cls: type) -> list[Any] | None:
    """vLLM's functions whose rules the planner follows, for the scheduler class
    ``cls`` (vLLM's ``OffloadingConnectorScheduler`` or a subclass)."""
    module = sys.modules.get(cls.__module__)
    state_cls = getattr(module, "RequestOffloadState", None)
    base = getattr(module, "SingleTypeKVCacheManager", None)
    tracker = getattr(module, "OffloadingEventsTracker", None)
    found = [
        getattr(cls, "_build_store_jobs", None),
        getattr(state_cls, "storable_chunks", None),
        getattr(state_cls, "advance_stored_idx", None),
        getattr(base, "reachable_block_mask", None),
        getattr(tracker, "record_store", None),
    ]
    return None if any(f is None for f in found) else found


def source_digest(cls: type) -> str | None:
    """A digest of the source of vLLM's store planning for the scheduler class ``cls``,
    or None where it cannot be read."""
    return digest_of(_sources(cls))


def digest_of(functions: list[Any] | None) -> str | None:
    """The sha256 of the sources of ``functions``, in order; None where one cannot be
    read (or ``functions`` is None)."""
    if functions is None:
        return None
    h = hashlib.sha256()
    try:
        for fn in functions:
            h.update(inspect.getsource(fn).encode())
    except (OSError, TypeError):
        return None
    return h.hexdigest()


def plain_model(scheduler: Any) -> bool:
    """Whether every KV cache group of ``scheduler`` is plain full attention, with
    neither EAGLE nor copy-on-write sources (see the module). A retention interval
    only narrows vLLM's masks of sliding-window and Mamba groups: full attention keeps
    every block either way."""
    module = sys.modules.get(type(scheduler).__module__)
    base = getattr(module, "SingleTypeKVCacheManager", None)
    config = getattr(scheduler, "config", None)
    groups = getattr(config, "kv_group_configs", None)
    if base is None or not groups:
        return False
    base_mask = getattr(base.reachable_block_mask, "__func__", None)
    for group in groups:
        manager_cls = getattr(group, "manager_cls", None)
        mask = getattr(getattr(manager_cls, "reachable_block_mask", None), "__func__", None)
        if (
            mask is None
            or mask is not base_mask
            or getattr(group, "sliding_window_size_in_chunks", 0) is not None
            or getattr(group, "is_eagle_group", True)
            or getattr(group, "requires_cow_source", True)
        ):
            return False
    return isinstance(getattr(config, "blocks_per_chunk", None), int)


class Reduced:
    """A scheduler output whose scheduled requests are only ``scheduled`` (and, where
    ``finished`` is given, whose finished requests are only those), for vLLM's planner;
    everything else is the output's own."""

    __slots__ = ("_output", "finished_req_ids", "num_scheduled_tokens")

    def __init__(
        self, output: Any, scheduled: dict[str, int], finished: Collection[str] | None = None
    ) -> None:
        self._output = output
        self.num_scheduled_tokens = scheduled
        if finished is not None:  # unset, the slot falls through to __getattr__
            self.finished_req_ids = finished

    def __getattr__(self, name: str) -> Any:
        return getattr(self._output, name)


def finished_statuses(scheduler: Any) -> frozenset[Any]:
    """vLLM's request statuses that ``Request.is_finished`` says are finished (its
    ``RequestStatus``, as the scheduler's module imports it)."""
    statuses = sys.modules[type(scheduler).__module__].RequestStatus
    return frozenset(s for s in statuses if statuses.is_finished(s))


def install(scheduler: Any) -> bool:
    """Put the planner in place of ``scheduler._build_store_jobs`` where it applies
    (see the module). Returns whether it did."""
    if not plain_model(scheduler) or source_digest(type(scheduler)) not in KNOWN_SOURCES:
        return False
    scheduler._build_store_jobs = planner(scheduler)
    return True


def planner(scheduler: Any) -> Callable[[Any], dict[int, Any]]:
    """The planner for ``scheduler`` (see the module); :func:`install` checks that it
    applies."""
    module = sys.modules[type(scheduler).__module__]
    vllm_plan = type(scheduler)._build_store_jobs.__get__(scheduler)
    job_status_cls = module.TransferJobStatus
    job_cls = module.TransferJob
    device_spec = module.GPULoadStoreSpec
    aborted = module.RequestStatus.FINISHED_ABORTED
    finished = finished_statuses(scheduler)
    allocation_failure = module._ConnectorMetricName.ALLOCATION_FAILURE
    vllm_logger = module.logger
    config = scheduler.config
    groups = tuple(config.kv_group_configs)
    chunk_tokens = tuple(g.tokens_per_chunk for g in groups)
    per_chunk: int = config.blocks_per_chunk
    statuses: dict[str, Any] = scheduler._req_status
    jobs: dict[int, Any] = scheduler._jobs
    pending: dict[int, set[int]] = scheduler._block_id_to_pending_jobs
    offloadable = scheduler._calc_num_offloadable_tokens
    tracker = scheduler._events_tracker
    record = tracker.record_store
    # vLLM's record_store returns at once unless self-describing events are on.
    describing = bool(getattr(tracker, "self_describing_enabled", True))
    manager = scheduler.manager
    refusals = Refusals(vllm_logger)

    def plan(scheduler_output: Any) -> dict[int, Any]:
        store_jobs: dict[int, Any] = {}
        scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
        finished_ids = scheduler_output.finished_req_ids or ()
        # What each request would store, read without changing anything (vLLM's
        # order: scheduled requests, then finished ones; it numbers the jobs).
        asks: list[tuple[Any, int, list[tuple[int, int]], list[Any]]] = []
        for position, req_id in enumerate(chain(scheduled, finished_ids)):
            status = statuses.get(req_id)
            if status is None:
                continue
            if position >= len(scheduled) and req_id in scheduled:
                store_jobs.update(settle(asks))  # listed twice: it reads what it planned
            req = status.req
            state = req.status
            if state is aborted:
                after = req.num_computed_tokens
            elif state in finished:
                after = max(req.num_prompt_tokens, req.num_tokens - 1)
            else:
                after = req.num_computed_tokens + scheduled[req_id]
            num_offloadable = offloadable(status, after)
            ranges: list[tuple[int, int]] = []
            new_keys: list[Any] = []
            null = False
            for size, group in zip(chunk_tokens, status.group_states):
                keys = group.offload_keys
                blocks = group.block_ids
                end = min(num_offloadable // size, len(blocks) // per_chunk, len(keys))
                start = group.next_stored_chunk_idx
                ranges.append((start, end))
                if end <= start:
                    continue
                if 0 in blocks[start * per_chunk : end * per_chunk]:
                    null = True
                    break
                new_keys += keys[start:end]
            if null:  # vLLM's own rules for null blocks (they ask the manager themselves)
                store_jobs.update(settle(asks))
                one = (
                    Reduced(scheduler_output, {req_id: scheduled[req_id]}, set())
                    if position < len(scheduled)
                    else Reduced(scheduler_output, {}, {req_id})
                )
                store_jobs.update(vllm_plan(one))
                continue
            asks.append((status, num_offloadable, ranges, new_keys))
        store_jobs.update(settle(asks))
        return store_jobs

    def settle(asks: list[tuple[Any, int, list[tuple[int, int]], list[Any]]]) -> dict[int, Any]:
        """The jobs of ``asks`` (requests in order: what each would store), the manager
        asked for all of them in turn, in one call where it can (``prepare_store_many``);
        ``asks`` is emptied."""
        store_jobs: dict[int, Any] = {}
        if not asks:
            return store_jobs
        storing = [(new_keys, status.req_context) for status, _, _, new_keys in asks if new_keys]
        # A manager that answers a step's requests together (kvtier's), else one by one.
        prepare_many = getattr(manager, "prepare_store_many", None)
        if prepare_many is not None and len(storing) > 1:
            answers = iter(prepare_many(storing))
        else:
            answers = iter([manager.prepare_store(keys, ctx) for keys, ctx in storing])
        for status, num_offloadable, ranges, new_keys in asks:
            if not new_keys:
                status.advance_stored_idx(num_offloadable)
                continue
            build(store_jobs, status, num_offloadable, ranges, new_keys, next(answers))
        asks.clear()
        return store_jobs

    def build(
        store_jobs: dict[int, Any],
        status: Any,
        num_offloadable: int,
        ranges: list[tuple[int, int]],
        new_keys: list[Any],
        store_output: Any,
    ) -> None:
        """The store job of a request that asked to store ``new_keys`` (chunks
        ``ranges`` of each group) and got ``store_output``, into ``store_jobs``."""
        req = status.req
        req_id = req.request_id
        if store_output is None:
            scheduler._connector_stats.increase_counter(allocation_failure)
            refusals.refused(req_id)
            return
        if not store_output.keys_to_store:
            status.advance_stored_idx(num_offloadable)
            return
        to_store = set(store_output.keys_to_store)
        whole = len(to_store) == len(new_keys) and to_store.issuperset(new_keys)
        group_sizes: list[int] = []
        block_indices: list[int] = []
        sources: list[int] = []
        for group_config, group, (start, end) in zip(groups, status.group_states, ranges):
            blocks = group.block_ids
            count = 0
            first: int | None = None
            if end > start and whole and not describing:
                # Every chunk is stored: its blocks are one slice of the table.
                first = start * per_chunk
                sources += blocks[first : end * per_chunk]
                count = (end - start) * per_chunk
            elif end > start:
                keys = group.offload_keys
                for chunk in range(start, end):
                    key = keys[chunk]
                    if not whole and key not in to_store:
                        continue
                    record(req, group_config, chunk, key)
                    at = chunk * per_chunk
                    if first is None:
                        first = at
                    sources += blocks[at : at + per_chunk]
                    count += per_chunk
            group_sizes.append(count)
            block_indices.append(first or 0)
            if end > group.next_stored_chunk_idx:
                group.next_stored_chunk_idx = end
        job_id = scheduler._generate_job_id()
        transfer_jobs = status.transfer_jobs
        if transfer_jobs:  # vLLM's invariant: only stores (0.33: or a sync load)
            other = jobs[next(iter(transfer_jobs))]
            assert other.is_store or getattr(other, "is_sync_load", False)
        transfer_jobs.add(job_id)
        # Full attention only: every source block is fenced once the request ends.
        deferred = list(sources)
        jobs[job_id] = job_status_cls(
            req_id=req_id,
            pending_count=config.num_workers,
            keys=to_store,
            is_store=True,
            deferred_fence_block_ids=deferred,
            fenced_block_ids=None,
        )
        store_jobs[job_id] = job_cls(
            req_id=req_id,
            src_spec=device_spec(sources, group_sizes=group_sizes, block_indices=block_indices),
            dst_spec=store_output.store_spec,
        )
        vllm_logger.debug(
            "Request %s offloading %s chunks upto %d tokens (job %d)",
            req_id,
            len(to_store),
            num_offloadable,
            job_id,
        )
        if req.status in finished:
            allocated = scheduler._current_batch_allocated_block_ids
            for block_id in deferred:
                pending.setdefault(block_id, set()).add(job_id)
                if block_id in allocated:
                    scheduler._current_batch_jobs_to_flush.add(job_id)

    return plan


__all__ = [
    "KNOWN_SOURCES",
    "REFUSALS_LOG_INTERVAL_S",
    "Reduced",
    "Refusals",
    "digest_of",
    "finished_statuses",
    "install",
    "plain_model",
    "planner",
    "source_digest",
]
