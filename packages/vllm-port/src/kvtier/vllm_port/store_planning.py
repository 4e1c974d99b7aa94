"""vLLM's offloading scheduler, doing per step only the work a request can need.

vLLM's ``OffloadingConnectorScheduler`` goes over every scheduled request in every
engine step, twice: ``_update_req_states`` adds the offload keys of chunks whose block
hashes appeared and records new device blocks, and ``_build_store_jobs`` plans stores.
That is about 10 µs of Python per running request per step on a CPU core, though a
decoding request gains one block hash in a block's worth of tokens and, with
``offload_prompt_only`` (vLLM's default), has nothing to store after its prompt. At 64
running requests it is most of the connector's scheduler-side cost, and on an NPU or
GPU that cost is paid on every step.

:func:`speed_up` changes two things, and nothing else:

* **Store planning sees only candidates.** A request goes through vLLM's
  ``_build_store_jobs`` only if it finished, or if the tokens it may offload after this
  step reach the end of the next chunk it has not stored, in some KV cache group. For
  any other request vLLM's planning finds no chunk past ``next_stored_chunk_idx`` (the
  storable chunk count is at most the offloadable tokens over the chunk size), stores
  nothing and leaves its state as it was; so the plans are the same, store for store and
  job id for job id. Where only prompts are offloaded (vLLM's default), a request whose
  whole prompt is stored is not looked at again until it finishes or vLLM moves its
  store index back (a lookup, an allocation, a cache reset), so a step of decoding
  requests costs a set difference instead of a pass over them.
* **Keys are updated only when a chunk's last hash is new.** ``_update_req_states`` is
  vLLM's loop (block tables, the step's newly allocated block ids) over the requests
  and flags its ``yield_req_data`` gives (whether a new request's block ids are its
  whole table is asked of it once), with ``update_offload_keys`` called only when its
  slice of block hashes is not empty; a request whose whole prompt is stored (where
  only prompts are offloaded) is not keyed while it decodes (its new blocks are still
  recorded), since nothing reads its keys until vLLM's lookup, allocation or
  ``request_finished``, each of which adds the keys it lacks first. Such a request
  that finishes is not handed to the store planning either: vLLM's would store
  nothing for it and leave its state as it is. This is used only without sliding-window
  groups, where vLLM 0.32's and 0.33's loops are the same; with them vLLM's own runs.

Where vLLM's scheduler lacks what these read, nothing changes. Under the candidate
filter, :mod:`kvtier.vllm_port.store_jobs` plans a plain model's stores in place of
vLLM's ``_build_store_jobs`` where it applies.

:func:`quiet_steps` builds the metadata of a step that admits, loads, preempts and
finishes nothing (most decode steps) without the parts of vLLM's step planning that
only such events feed: the request states are updated, the manager's step ended (where
vLLM ends it: first on 0.32, last on 0.33), re-allocated blocks' jobs flushed and the
candidates' stores planned, as vLLM's own method does; any other step is vLLM's. It is
installed only where vLLM's method reads exactly the names of 0.32's or 0.33's
(:data:`_META_SHAPES`), without sliding-window groups.

:func:`has_worker_news` tells a connector when vLLM's ``update_connector_output`` would
do nothing (no worker metadata: no job completed, no transfer stats), so it can skip it.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable
from typing import Any

from kvtier.vllm_port import store_jobs

logger = logging.getLogger("kvtier.vllm_port")


# vLLM's scheduler methods that may move a request's store index back (a restarted or
# resumed request's lookup and allocation) or reset every request's (``reset_cache``).
_STORE_INDEX_RESETS = ("get_num_new_matched_tokens", "update_state_after_alloc", "on_new_request")


def _fields(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def _has_shape(scheduler: Any) -> bool:
    """Whether ``scheduler`` keeps what :func:`speed_up` reads (vLLM 0.32 and 0.33 do)."""
    cls = type(scheduler)
    if not all(
        callable(getattr(cls, name, None))
        for name in (
            "_build_store_jobs",
            "_calc_num_offloadable_tokens",
            "_update_req_states",
            "reset_cache",
            *_STORE_INDEX_RESETS,
        )
    ):
        return False
    if not isinstance(getattr(scheduler, "_req_status", None), dict):
        return False
    config = getattr(scheduler, "config", None)
    groups = getattr(config, "kv_group_configs", None)
    if not groups or not isinstance(getattr(config, "offload_prompt_only", None), bool):
        return False
    if not all(
        isinstance(getattr(g, name, None), int)
        for g in groups
        for name in ("tokens_per_chunk", "hashes_per_chunk", "group_idx")
    ):
        return False
    module = sys.modules.get(cls.__module__)
    return (
        {"next_stored_chunk_idx", "offload_keys", "block_ids"}
        <= _fields(getattr(module, "RequestGroupState", None))
        and {"req", "group_states"} <= _fields(getattr(module, "RequestOffloadState", None))
        and callable(getattr(module, "yield_req_data", None))
        and callable(getattr(getattr(module, "RequestStatus", None), "is_finished", None))
    )


def speed_up(scheduler: Any) -> bool:
    """Apply both changes (see the module) to ``scheduler``, an
    ``OffloadingConnectorScheduler``, and :func:`quiet_steps` where it has their
    shape. Returns whether the two were applied."""
    if not _has_shape(scheduler):
        return False
    # Requests whose whole prompt is stored, where only prompts are offloaded (see
    # plan_stores_for_candidates): neither planned nor keyed while they decode.
    settled = _settled_requests(scheduler) if scheduler.config.offload_prompt_only else None
    if getattr(scheduler, "_sliding_window_groups", None) == ():
        try:
            update_keys_when_new(scheduler, settled)
        except Exception:  # vLLM's yield_req_data answered unlike 0.32 and 0.33
            logger.debug("kvtier: vLLM's request-state update kept", exc_info=True)
    store_jobs.install(scheduler)  # the candidate filter goes in front of it
    plan_stores_for_candidates(scheduler, settled)
    quiet_steps(scheduler)
    return True


# What vLLM's step planning reads (its method's global and attribute names), by the
# release that has it: the method :func:`quiet_steps` stands in front of, and whether
# that release ends the manager's step before planning stores (0.32) or after (0.33).
_STEP_NAMES = (
    "OffloadingConnectorMetadata ScheduleEndContext _block_id_to_pending_jobs "
    "_build_partial_tail_store_jobs _build_store_jobs _current_batch_allocated_block_ids "
    "_current_batch_jobs_to_flush _current_batch_load_jobs _jobs _req_status "
    "_update_req_states finished_req_ids finished_signaled get is_store isdisjoint iter "
    "keys manager next on_request_finished on_schedule_end preempted_req_ids req_context "
    "scheduled_new_reqs set transfer_jobs update"
)
_META_SHAPES: dict[frozenset[str], tuple[str, bool]] = {
    frozenset(_STEP_NAMES.split()): ("build_connector_meta", True),
    frozenset(
        (
            _STEP_NAMES + " _RESET_FENCE_WARN_S _current_batch_sync_load_bytes "
            "_current_batch_sync_loads _reset_fence _reset_fence_since is_sync_load len "
            "logger monotonic time warning_once"
        ).split()
    ): ("_build_connector_meta", False),
}


def _meta_shape(cls: type) -> tuple[str, bool] | None:
    """(method, whether the step ends first) where ``cls`` plans steps as 0.32 or 0.33."""
    for method in ("_build_connector_meta", "build_connector_meta"):
        code = getattr(getattr(cls, method, None), "__code__", None)
        shape = _META_SHAPES.get(frozenset(getattr(code, "co_names", ())))
        if shape is not None and shape[0] == method:
            return shape
    return None


def quiet_steps(scheduler: Any) -> bool:
    """Plan a quiet step's metadata without vLLM's event handling (see the module);
    whether it was put in front of ``scheduler``'s own method."""
    cls = type(scheduler)
    shape = _meta_shape(cls)
    module = sys.modules.get(cls.__module__)
    if shape is None or module is None or getattr(scheduler, "_sliding_window_groups", 1) != ():
        return False
    method, end_first = shape
    vllm_plan: Callable[[Any], Any] = getattr(scheduler, method)
    metadata, end_context = module.OffloadingConnectorMetadata, module.ScheduleEndContext
    manager = scheduler.manager
    sync_loads = hasattr(scheduler, "_current_batch_sync_loads")  # (0.33)

    def plan(scheduler_output: Any) -> Any:
        block_state = scheduler_output.kv_connector_block_state
        if (
            scheduler_output.scheduled_new_reqs
            or scheduler_output.preempted_req_ids
            or scheduler_output.finished_req_ids
            or scheduler._current_batch_load_jobs
            or scheduler._current_batch_jobs_to_flush
            or (block_state and block_state.boundary_state_offloads)
            or (
                sync_loads
                and (
                    scheduler._reset_fence
                    or scheduler._current_batch_sync_loads
                    or scheduler._current_batch_sync_load_bytes
                )
            )
        ):
            return vllm_plan(scheduler_output)
        scheduler.kvtier_quiet_steps += 1
        scheduler._update_req_states(scheduler_output)
        end = end_context(new_req_ids=[], preempted_req_ids=())
        if end_first:
            manager.on_schedule_end(end)
        allocated = scheduler._current_batch_allocated_block_ids
        pending = scheduler._block_id_to_pending_jobs
        flush = scheduler._current_batch_jobs_to_flush
        if pending and not pending.keys().isdisjoint(allocated):
            flush.update(jid for bid in allocated if bid in pending for jid in pending[bid])
        meta = metadata(
            load_jobs=scheduler._current_batch_load_jobs,
            store_jobs=scheduler._build_store_jobs(scheduler_output),
            jobs_to_flush=flush,
        )
        scheduler._current_batch_load_jobs = {}
        scheduler._current_batch_jobs_to_flush = set()
        scheduler._current_batch_allocated_block_ids = set()
        if not end_first:
            manager.on_schedule_end(end)
        return meta

    scheduler.kvtier_quiet_steps = 0  # steps planned here (for tests)
    setattr(scheduler, method, plan)
    return True


def update_keys_when_new(scheduler: Any, settled: set[str] | None = None) -> None:
    """vLLM's ``_update_req_states`` for a model without sliding-window groups, with
    ``update_offload_keys`` called only where a chunk's last block hash is new, and
    not at all for a running request of ``settled`` (see
    :func:`plan_stores_for_candidates`: its prompt is stored, and nothing plans its
    stores or reads its keys until it leaves the set or finishes; every method that
    takes it out of the set, and vLLM's ``request_finished``, adds the keys it lacks
    first, all of them in one call). Its new blocks are recorded as vLLM records
    them."""
    new_is_full = _new_requests_full_table(sys.modules[type(scheduler).__module__].yield_req_data)
    groups = scheduler.config.kv_group_configs
    group_ids = tuple(g.group_idx for g in groups)
    hashes_per_chunk = tuple(g.hashes_per_chunk for g in groups)
    single = hashes_per_chunk[0] if len(hashes_per_chunk) == 1 else None
    group_idx = group_ids[0]
    statuses: dict[str, Any] = scheduler._req_status

    def one(
        req_id: str, new_blocks: Any, full_table: bool, allocated: set[int], keyed: bool = True
    ) -> None:
        status = statuses[req_id]
        if keyed:
            # vLLM's reads the hashes from index hashes_per_chunk * (keys + 1) - 1 on.
            hashes = len(status.req.block_hashes)
            for per_chunk, group in zip(hashes_per_chunk, status.group_states):
                if hashes >= per_chunk * (len(group.offload_keys) + 1):
                    status.update_offload_keys()
                    break
        if full_table:  # the request's whole block table follows
            for group in status.group_states:
                group.block_ids.clear()
        if new_blocks:
            status.update_block_id_groups(new_blocks)
            for group_idx in group_ids:
                for block_id in new_blocks[group_idx]:
                    if block_id != 0:
                        allocated.add(block_id)

    def update(scheduler_output: Any) -> None:
        allocated: set[int] = scheduler._current_batch_allocated_block_ids
        # The requests and flags of vLLM's yield_req_data, without its generator.
        for new in scheduler_output.scheduled_new_reqs:
            one(new.req_id, new.block_ids, new_is_full, allocated)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        # (A step that hands boundary states over, hybrid models', plans with the keys.)
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        skip = settled if not getattr(block_state, "boundary_state_offloads", None) else None
        # (The null block is never among the allocated ids: one a settled request's
        # new blocks add is taken out after the loop.)
        null_held = 0 in allocated
        for req_id, new_blocks in zip(cached.req_ids, cached.new_block_ids):
            if new_blocks or resumed:
                full = req_id in resumed
                if not full and skip and req_id in skip:
                    # A settled request's blocks are recorded, its keys left for later.
                    if single is None or not new_blocks:
                        one(req_id, new_blocks, False, allocated, False)
                        continue
                    # One KV cache group (a decode step's block boundary: most running
                    # requests at once): what one() does, inline, the step's allocated
                    # ids added together.
                    blocks = new_blocks[group_idx]
                    statuses[req_id].group_states[0].block_ids.extend(blocks)
                    allocated.update(blocks)
                    continue
                one(req_id, new_blocks, full, allocated)
                continue
            # A running request with no new block (most of them, most steps).
            if skip and req_id in skip:
                continue  # its prompt is stored: no key is read before it leaves
            status = statuses[req_id]
            hashes = len(status.req.block_hashes)
            if single is not None:  # one KV cache group: no loop
                if hashes >= single * (len(status.group_states[0].offload_keys) + 1):
                    status.update_offload_keys()
                continue
            for per_chunk, group in zip(hashes_per_chunk, status.group_states):
                if hashes >= per_chunk * (len(group.offload_keys) + 1):
                    status.update_offload_keys()
                    break
        if not null_held:
            allocated.discard(0)
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            allocated.add(copy.dst_block_id)

    scheduler._update_req_states = update


def _new_requests_full_table(req_data: Callable[[Any], Any]) -> bool:
    """Whether vLLM's ``yield_req_data`` marks a new request's block ids as its whole
    table (vLLM 0.33: True; 0.32: False), asked of it with a one-request output."""

    class New:
        req_id = "kvtier-probe"
        block_ids: tuple[list[int], ...] = ([],)

    class Cached:
        req_ids: list[str] = []
        new_block_ids: list[Any] = []
        resumed_req_ids: set[str] = set()

    class Output:
        scheduled_new_reqs = [New()]
        scheduled_cached_reqs = Cached()

    return bool(next(iter(req_data(Output())))[2])


def _settled_requests(scheduler: Any) -> set[str]:
    """A set of request ids that each of vLLM's methods able to move a request's store
    index back (:data:`_STORE_INDEX_RESETS`, ``reset_cache``) forgets first."""
    settled: set[str] = set()

    def forgetting(method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            request = args[0] if args else kwargs.get("request")
            settled.discard(getattr(request, "request_id", None))
            return method(*args, **kwargs)

        return call

    def reset_cache(*args: Any, **kwargs: Any) -> Any:
        settled.clear()
        return vllm_reset(*args, **kwargs)

    admit = getattr(scheduler, "_kvtier_admissions", None)
    for name in _STORE_INDEX_RESETS:
        method = getattr(scheduler, name)
        if admit is not None and getattr(method, "__self__", None) is admit:
            # kvtier's own admission call forgets the request itself, first thing:
            # the same as this wrapper, without its frame on every admission.
            setattr(admit, "forget", settled.discard)  # noqa: B010
            continue
        setattr(scheduler, name, forgetting(method))
    vllm_reset = scheduler.reset_cache
    scheduler.reset_cache = reset_cache
    return settled


def plan_stores_for_candidates(scheduler: Any, settled: set[str] | None = None) -> None:
    """Put the candidate filter (see the module) in front of ``scheduler``'s store
    planning; ``settled``: the set :func:`_settled_requests` made for ``scheduler``,
    where only prompts are offloaded (made here when not given)."""
    plan: Callable[[Any], Any] = scheduler._build_store_jobs
    statuses: dict[str, Any] = scheduler._req_status
    chunk_tokens = tuple(g.tokens_per_chunk for g in scheduler.config.kv_group_configs)
    prompt_only: bool = scheduler.config.offload_prompt_only
    offloadable: Callable[[Any, int], int] = scheduler._calc_num_offloadable_tokens
    finished = store_jobs.finished_statuses(scheduler)
    failed = False
    # Requests whose whole prompt is stored, where only the prompt is offloaded: none
    # can store again until it finishes (finished requests are planned from vLLM's
    # finished_req_ids), unless its store index goes back, which only vLLM's lookup,
    # allocation and cache reset do (each forgets the request here).
    if settled is None and prompt_only:
        settled = _settled_requests(scheduler)

    def candidates(scheduled: dict[str, int]) -> dict[str, int]:
        keep: dict[str, int] = {}
        items: Any = scheduled.items()
        if settled:
            rest = scheduled.keys() - settled
            if not rest:
                return keep
            if len(rest) < len(scheduled):  # in vLLM's order: it numbers the jobs
                items = [(r, n) for r, n in items if r in rest]
        for req_id, num_new in items:
            status = statuses.get(req_id)
            if status is None:
                continue  # vLLM's planning skips it too
            req = status.req
            if req.status in finished:
                keep[req_id] = num_new
                continue
            after = req.num_computed_tokens + num_new
            # At most what vLLM may offload: `offloadable` caps it further.
            bound = after
            prompt = req.num_prompt_tokens
            if prompt_only and prompt < after:
                bound = prompt
            settles = settled is not None
            for size, group in zip(chunk_tokens, status.group_states):
                end = (group.next_stored_chunk_idx + 1) * size
                if bound >= end and offloadable(status, after) >= end:
                    keep[req_id] = num_new
                    settles = False
                    break
                if prompt >= end:  # a chunk of its prompt is left to store
                    settles = False
            if settles:
                settled.add(req_id)  # type: ignore[union-attr]
        return keep

    def planned(scheduler_output: Any) -> Any:
        nonlocal failed
        scheduled = scheduler_output.num_scheduled_tokens
        if failed or not scheduled:
            return plan(scheduler_output)
        finished = scheduler_output.finished_req_ids
        # Finished requests settled before this step: their whole prompt is stored, so
        # vLLM's planning stores nothing for them and leaves their index where it is.
        done = settled.intersection(finished) if settled and finished else None
        try:
            keep = candidates(scheduled)
        except Exception:  # never expected; vLLM's own planning is always right
            failed = True
            logger.warning(
                "kvtier: store planning filter off (vLLM's request state changed shape); "
                "vLLM plans every request",
                exc_info=True,
            )
            return plan(scheduler_output)
        if settled and finished:
            settled.difference_update(finished)
        if done:
            rest = [req_id for req_id in finished if req_id not in done]  # (vLLM's order)
            if not keep and not rest:
                return {}
            return plan(store_jobs.Reduced(scheduler_output, keep, rest))
        if len(keep) == len(scheduled):
            return plan(scheduler_output)
        if not keep and not finished:
            return {}  # what vLLM's returns for no request
        return plan(store_jobs.Reduced(scheduler_output, keep))

    scheduler._build_store_jobs = planned


def has_worker_news(scheduler: Any, connector_output: Any) -> bool:
    """Whether vLLM's ``update_connector_output`` on ``scheduler`` can change anything for
    ``connector_output``: not when the workers sent no metadata (vLLM then reads an empty
    one), unless vLLM 0.33's manager region was left open (its hook recovers it)."""
    if getattr(connector_output, "kv_connector_worker_meta", None) is not None:
        return True
    return getattr(scheduler, "_step_region", None) is not None


def worker_meta_waiting(connector_worker: Any) -> bool:
    """Whether vLLM's connector worker holds completed jobs its
    ``build_connector_worker_meta`` has not sent yet; True where it keeps no such
    record."""
    meta = getattr(connector_worker, "_connector_worker_meta", None)
    return bool(getattr(meta, "completed_jobs", True))


def plans_stores(metadata: Any) -> bool:
    """Whether a step's connector ``metadata`` plans stores (vLLM releases before 0.32
    queue them in the worker's ``get_finished``); True where it has no such field."""
    return bool(getattr(metadata, "store_jobs", True))


__all__ = [
    "has_worker_news",
    "plan_stores_for_candidates",
    "plans_stores",
    "quiet_steps",
    "speed_up",
    "update_keys_when_new",
    "worker_meta_waiting",
]
