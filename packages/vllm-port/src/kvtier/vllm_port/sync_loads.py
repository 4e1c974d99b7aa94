"""Loads inside the step that needs them, for vLLM 0.32's offloading connector.

vLLM's ``OffloadingConnector`` loads offloaded KV asynchronously: the step that finds
a request's prefix in the host tier only starts the copy, the request waits in
``WAITING_FOR_REMOTE_KVS`` until the workers report the copy done, and it is scheduled
one engine step later. The restore then costs the request a whole step of other
requests' work, however few bytes it moves. vLLM 0.33 can instead load a hit
*synchronously*: the request is scheduled in the step that finds it, with the loaded
tokens counted as computed, and the workers finish the copy before that step's forward
pass. Its ``sync_load_budget_bytes`` (``kv_connector_extra_config``) caps the bytes
loaded that way per step; the rest stays asynchronous.

:func:`enable` gives vLLM 0.32's connector scheduler the same behaviour, by wrapping
three of its methods on the instance (nothing changes where vLLM has its own, or
where its scheduler lacks what this reads):

* ``get_num_new_matched_tokens`` answers "not asynchronous" for a hit that fits the
  step's budget and leaves at least one token to compute (vLLM 0.33's rule);
* ``update_state_after_alloc`` plans the load by block position (vLLM hashes the
  blocks of a synchronous hit at allocation, where its planner looks for blocks
  without a hash) and remembers the job as synchronous;
* ``build_connector_meta`` lets vLLM plan stores next to a pending synchronous load
  (vLLM 0.32 asserts that a request with a pending job has only stores; 0.33 allows
  a synchronous load there) and names the step's synchronous jobs in the metadata
  (``kvtier_sync_load_jobs``).

On the worker, :func:`start_sync_loads` submits the step's synchronous loads at the
start of the step (after vLLM's ``handle_preemptions``), so the copy overlaps the
preparation of the step's inputs, and keeps their requests out of
``finished_recving`` (they never waited for it); the worker waits for them before the
forward pass (:func:`wait_for_sync_loads` does both where the step began elsewhere).
:func:`hold_stores` and :func:`release_stores` let those loads go before the stores
vLLM deferred from the previous step, which would otherwise be copied first.

Only models with one full-attention KV cache group take this path: a failed
synchronous load is reported by device block id, which vLLM maps to requests only
with one group.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
from collections.abc import Callable
from typing import Any

from kvtier.vllm_port.store_planning import _fields

logger = logging.getLogger("kvtier.vllm_port")

META_FIELD = "kvtier_sync_load_jobs"


def native(scheduler: Any) -> bool:
    """Whether vLLM's own scheduler loads synchronously (vLLM 0.33 and later)."""
    module = sys.modules.get(type(scheduler).__module__)
    return "is_sync_load" in _fields(getattr(module, "TransferJobStatus", None))


def _has_shape(scheduler: Any) -> bool:
    """Whether ``scheduler`` is vLLM 0.32's, with one full-attention KV cache group."""
    cls = type(scheduler)
    if not all(
        callable(getattr(cls, name, None))
        for name in (
            "get_num_new_matched_tokens",
            "update_state_after_alloc",
            "build_connector_meta",
        )
    ):
        return False
    for name in ("_jobs", "_req_status", "_current_batch_load_jobs"):
        if not isinstance(getattr(scheduler, name, None), dict):
            return False
    groups = getattr(getattr(scheduler, "config", None), "kv_group_configs", None)
    if not groups or len(groups) != 1:
        return False
    group = groups[0]
    if getattr(group, "sliding_window_size_in_chunks", 0) is not None:
        return False
    if "Attention" not in type(getattr(group, "kv_cache_spec", None)).__name__:
        return False
    if not isinstance(getattr(group, "tokens_per_block", None), int):
        return False
    module = sys.modules.get(cls.__module__)
    return {"transfer_jobs", "num_locally_computed_tokens", "req"} <= _fields(
        getattr(module, "RequestOffloadState", None)
    ) and {"req_id", "keys", "is_store"} <= _fields(getattr(module, "TransferJobStatus", None))


class _Fresh:
    """A device block as vLLM's load planner must see it: allocated, not yet hashed."""

    __slots__ = ("block_id", "is_null")
    block_hash = None

    def __init__(self, block: Any) -> None:
        self.block_id = block.block_id
        self.is_null = block.is_null


class _Blocks:
    """``KVCacheBlocks`` with the start of a synchronous hit shown as not hashed."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[list[Any], ...]) -> None:
        self.blocks = blocks


_NO_JOBS: frozenset[int] = frozenset()


class SyncLoads:
    """The scheduler-side state of :func:`enable`: the step's budget and the
    synchronous load jobs vLLM has not yet seen completed."""

    def __init__(self, scheduler: Any, budget_bytes: int, bytes_per_block: int) -> None:
        group = scheduler.config.kv_group_configs[0]
        self.scheduler = scheduler
        self.budget = budget_bytes
        self.tokens_per_block: int = group.tokens_per_block
        self.bytes_per_token = bytes_per_block // self.tokens_per_block
        self.group_idx: int = getattr(group, "group_idx", 0)
        self.step_bytes = 0
        self.step_reqs: set[str] = set()  # requests answered "synchronous" this step
        self.jobs: set[int] = set()  # synchronous load jobs not completed yet
        self.loads = 0  # synchronous loads planned (for tests and logs)

    # -- wrappers ------------------------------------------------------------------

    def matched(
        self, lookup: Callable[..., tuple[int | None, bool]]
    ) -> Callable[..., tuple[int | None, bool]]:
        def get_num_new_matched_tokens(
            request: Any, num_computed_tokens: int, *args: Any, **kwargs: Any
        ) -> tuple[int | None, bool]:
            hit, load_async = lookup(request, num_computed_tokens, *args, **kwargs)
            req_id = request.request_id
            self.step_reqs.discard(req_id)
            if not hit or not load_async or num_computed_tokens + hit >= request.num_tokens:
                return hit, load_async
            status = self.scheduler._req_status.get(req_id)
            if status is None or getattr(status, "partial_tail_boundary", None) is not None:
                return hit, load_async
            nbytes = hit * self.bytes_per_token
            if self.step_bytes + nbytes > self.budget:
                return hit, load_async
            self.step_bytes += nbytes
            self.step_reqs.add(req_id)
            return hit, False

        return get_num_new_matched_tokens

    def allocated(self, after_alloc: Callable[..., Any]) -> Callable[..., Any]:
        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> Any:
            req_id = request.request_id
            if not num_external_tokens or req_id not in self.step_reqs:
                return after_alloc(request, blocks, num_external_tokens)
            status = self.scheduler._req_status[req_id]
            local = status.num_locally_computed_tokens
            size = self.tokens_per_block
            first, end = local // size, -(-(local + num_external_tokens) // size)
            shown = list(blocks.blocks)
            group = list(shown[self.group_idx])
            # vLLM's planner loads from the first block of the hit that is not null and
            # has no hash: only the blocks up to that one need to be shown unhashed.
            for i in range(first, min(end, len(group))):
                block = group[i]
                group[i] = _Fresh(block)
                if not block.is_null:
                    break
            shown[self.group_idx] = group
            jobs: dict[int, Any] = self.scheduler._current_batch_load_jobs
            count = len(jobs)
            result = after_alloc(request, _Blocks(tuple(shown)), num_external_tokens)
            # vLLM adds the request's load job to the step's (an insertion-ordered dict).
            added = len(jobs) - count
            if added > 0:
                self.jobs.update(itertools.islice(reversed(jobs), added))
                self.loads += added
            return result

        return update_state_after_alloc

    def _hide_jobs(self) -> list[tuple[int, str, Any]]:
        """Forget the synchronous load jobs vLLM saw completed, and take the others out
        of their requests' pending jobs: vLLM 0.32 plans stores (and flushes preempted
        requests' jobs) only for a request whose pending jobs are all stores, and a
        synchronous load is done before this step's forward pass. Returns (job, request,
        its state) of each job taken out, to put back once the step is planned."""
        jobs: dict[int, Any] = self.scheduler._jobs
        statuses: dict[str, Any] = self.scheduler._req_status
        self.jobs = {j for j in self.jobs if j in jobs}
        hidden: list[tuple[int, str, Any]] = []
        for job_id in self.jobs:
            req_id = jobs[job_id].req_id
            status = statuses.get(req_id)
            if status is not None and job_id in status.transfer_jobs:
                status.transfer_jobs.discard(job_id)
                hidden.append((job_id, req_id, status))
        return hidden

    def planned(self, build: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def build_connector_meta(scheduler_output: Any) -> Any:
            # (Most steps have no synchronous load pending: nothing to hide.)
            hidden = self._hide_jobs() if self.jobs else ()
            try:
                meta = build(scheduler_output)
            finally:
                for job_id, req_id, status in hidden:
                    status.transfer_jobs.add(job_id)
                    # vLLM forgets a finished request without jobs; this one has one.
                    self.scheduler._req_status.setdefault(req_id, status)
                self.step_bytes = 0
                self.step_reqs.clear()
            if not self.jobs:
                setattr(meta, META_FIELD, _NO_JOBS)
                return meta
            load_jobs = getattr(meta, "load_jobs", None) or {}
            setattr(meta, META_FIELD, frozenset(j for j in load_jobs if j in self.jobs))
            return meta

        return build_connector_meta


def enable(scheduler: Any, budget_bytes: int, bytes_per_block: int) -> SyncLoads | None:
    """Load hits of up to ``budget_bytes`` per step synchronously on ``scheduler``, an
    ``OffloadingConnectorScheduler`` of vLLM 0.32 (see the module); ``bytes_per_block``
    is a worker's KV bytes of one device block. Returns the state, or None where it does
    not apply (budget 0, vLLM's own support, another shape)."""
    if budget_bytes <= 0 or bytes_per_block <= 0 or native(scheduler):
        return None
    if not _has_shape(scheduler):
        logger.debug("kvtier: synchronous loads not available for this scheduler")
        return None
    state = SyncLoads(scheduler, budget_bytes, bytes_per_block)
    scheduler.get_num_new_matched_tokens = state.matched(scheduler.get_num_new_matched_tokens)
    scheduler.update_state_after_alloc = state.allocated(scheduler.update_state_after_alloc)
    scheduler.build_connector_meta = state.planned(scheduler.build_connector_meta)
    scheduler._kvtier_sync_loads = state
    return state


def _block_ids(spec: Any) -> set[int]:
    ids = getattr(spec, "block_ids", None)
    return set() if ids is None else {int(b) for b in ids}


def idle(connector_worker: Any, metadata: Any) -> bool:
    """Whether vLLM's ``handle_preemptions`` and ``start_load_kv`` on a worker have
    nothing to do for ``metadata`` (most steps): no store to flush or deferred from the
    last step, no load, no synchronous load. Where vLLM's metadata or worker lacks one
    of these, False (vLLM's own code then runs)."""
    return not (
        getattr(metadata, "jobs_to_flush", True)
        or getattr(metadata, "load_jobs", True)
        or getattr(metadata, META_FIELD, None)
        or getattr(connector_worker, "_unsubmitted_store_jobs", True)
    )


def hold_stores(connector_worker: Any, metadata: Any) -> list[Any]:
    """Before vLLM's ``handle_preemptions`` on a worker: take out the stores vLLM
    deferred from the previous step, to submit after this step's synchronous loads
    (:func:`release_stores`), so a restore does not wait behind them. Stores of
    preempted requests (``jobs_to_flush``) stay where vLLM puts them, and nothing is
    taken where a deferred store reads a device block a synchronous load writes."""
    job_ids = getattr(metadata, META_FIELD, None)
    deferred = getattr(connector_worker, "_unsubmitted_store_jobs", None)
    if not job_ids or not deferred:
        return []
    loads = getattr(metadata, "load_jobs", None) or {}
    written: set[int] = set()
    for job_id in job_ids:
        entry = loads.get(job_id)
        if entry is not None:
            written |= _block_ids(entry.dst_spec)
    if any(_block_ids(src) & written for _, src, _ in deferred):
        return []
    held = list(deferred)
    deferred.clear()
    return held


def release_stores(connector_worker: Any, held: list[Any]) -> None:
    """Submit the stores :func:`hold_stores` took out (as vLLM's worker would have)."""
    for job_id, src_spec, dst_spec in held:
        connector_worker.worker.submit_store(job_id, src_spec, dst_spec)


def start_sync_loads(connector_worker: Any, metadata: Any) -> frozenset[int]:
    """At the start of a worker's step (after vLLM's ``handle_preemptions``): submit the
    step's synchronous loads, so the copy runs while the worker prepares the step's
    inputs, and keep their requests out of ``finished_recving``. Returns the jobs
    submitted; :func:`without_jobs` keeps vLLM's ``start_load_kv`` from submitting them
    again, and the worker waits for them before the forward pass."""
    job_ids = getattr(metadata, META_FIELD, None)
    loads = getattr(metadata, "load_jobs", None)
    if not job_ids or not loads:
        return frozenset()
    started = []
    for job_id in sorted(job_ids):
        entry = loads.get(job_id)
        if entry is None:
            continue
        connector_worker._load_jobs[job_id] = None  # vLLM reports no request for None
        connector_worker.worker.submit_load(job_id, entry.src_spec, entry.dst_spec)
        started.append(job_id)
    return frozenset(started)


def without_jobs(metadata: Any, job_ids: frozenset[int]) -> Any:
    """``metadata`` without the load jobs ``job_ids`` (a copy; the original is kept)."""
    rest = {j: e for j, e in metadata.load_jobs.items() if j not in job_ids}
    return dataclasses.replace(metadata, load_jobs=rest)


def wait_for_sync_loads(connector_worker: Any, metadata: Any) -> None:
    """After vLLM's ``start_load_kv`` on a worker: wait for this step's synchronous load
    jobs (named in ``metadata`` by :func:`enable`'s scheduler side) and keep their
    requests out of ``finished_recving``, since they are already running."""
    job_ids = getattr(metadata, META_FIELD, None)
    if not job_ids:
        return
    loads: dict[int, Any] = connector_worker._load_jobs
    for job_id in job_ids:
        if job_id in loads:
            loads[job_id] = None  # vLLM's get_finished reports no request for None
    connector_worker.worker.wait(set(job_ids))


__all__ = [
    "META_FIELD",
    "SyncLoads",
    "enable",
    "hold_stores",
    "idle",
    "native",
    "release_stores",
    "start_sync_loads",
    "wait_for_sync_loads",
    "without_jobs",
]
