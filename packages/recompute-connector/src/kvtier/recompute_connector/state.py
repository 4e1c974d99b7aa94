"""The scheduler side: which requests' KV sits in host DRAM, and what to copy each step.

:class:`RecomputeOffloadScheduler` is a state machine fed by the vLLM adapter (see
``connector.py`` and ``scheduler_side.py``) with plain values, so it is tested without
an engine. It owns the host block bookkeeping (a
:class:`kvtier.blockpool.HostBlockPool`); the workers own the host memory and copy what
the step plans say. Its records live in :mod:`.state_types`, the block maps of each
copy are planned by :mod:`.planner`, and :mod:`.invariants` checks the bookkeeping for
tests.

A preempted request's life::

    running --preempted--> STORING --all ranks stored--> RESTORABLE --resumed--> LOADING
       ^                      |                              |                      |
       |                 store failed                  nothing to load        ranks loaded
       |                      v                              v                      v
       +------------------ (dropped: vLLM recomputes) <------+-------------- (freed)

Tokens and blocks:

* While a request runs, each step records its device block ids (one list per KV cache
  group, logical order, null blocks included) and ``kv_tokens``: the tokens whose KV
  the steps scheduled so far write (``num_computed_tokens`` before the step plus the
  tokens scheduled in it). That is an upper bound of the valid KV: speculative tokens
  may be rejected later.
* On preemption, the blocks covering ``kv_tokens`` are stored (lookahead blocks past
  them are clipped; null blocks of sliding-window groups keep their logical position
  and are not copied).
* On resumption, at most ``num_tokens - 1`` tokens are restorable: every token but the
  last has had its KV computed by a forward whose output was accepted (the last one's
  KV is computed by the next forward), so rejected speculative tokens never count.
  The device prefix cache's hit is subtracted.

Prefix sharing (``enable_offload_prefix_caching``): a full block whose KV is valid and
that has a prefix-cache hash is kept on host once per (KV cache group, hash), in a
:class:`SharedBlock` that every preempted request holding it references. A request
preempted while its full blocks are already on host (stored for another request) adds
references instead of copying them, and becomes restorable once every block it
references is stored. Partial and unhashed blocks stay private to their request. A
shared block is freed with its last reference; if its store fails, every request
referencing it is recomputed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence

from kvtier.blockpool import HostBlockPool
from kvtier.recompute_connector import invariants, planner
from kvtier.recompute_connector.protocol import StepPlan, TransferJob, WorkerReport
from kvtier.recompute_connector.state_types import (
    Fallback,
    KVGroup,
    Phase,
    PreemptedRequestState,
    RunningRequest,
    SchedulerStats,
    SharedBlock,
    SlotKind,
)

logger = logging.getLogger("kvtier.recompute_connector")

# A store the workers have not reported after this many steps is given up on (the
# request is recomputed); its host blocks stay reserved until the report comes.
STORE_REPORT_TIMEOUT_STEPS = 1000


class RecomputeOffloadScheduler:
    """Scheduler-side bookkeeping of preempted requests' host copies.

    Args:
        num_host_blocks: host blocks per rank (every rank has the same count).
        groups: the KV cache groups, in vLLM's order.
        world_size: ranks that copy and report each job.
        null_block_id: vLLM's null block (sliding-window placeholders), never copied.
        log: logger for the user-visible lines (the adapter passes one under ``vllm``).
        share_prefix: keep full hashed blocks once per hash, shared by reference
            (``enable_offload_prefix_caching``).
    """

    def __init__(
        self,
        *,
        num_host_blocks: int,
        groups: Sequence[KVGroup],
        world_size: int = 1,
        null_block_id: int = 0,
        log: logging.Logger | None = None,
        share_prefix: bool = False,
    ) -> None:
        if not groups:
            raise ValueError("at least one KV cache group is needed")
        # Preempted requests' blocks, shared by reference: recency is what matters here.
        self.pool = HostBlockPool(num_host_blocks, eviction_policy="lru")
        self.groups = tuple(groups)
        self.world_size = world_size
        self.null_block_id = null_block_id
        self.log = log or logger
        self.supported = all(g.supported for g in self.groups)
        self.has_state = any(g.state for g in self.groups)
        self.running: dict[str, RunningRequest] = {}
        self.preempted: dict[str, PreemptedRequestState] = {}
        self._jobs = itertools.count(1)
        # Jobs the workers have not fully reported yet -> their state (dropped states too:
        # their host blocks stay reserved until the copy has ended on every rank).
        self._in_flight: dict[int, PreemptedRequestState] = {}
        self._plan = StepPlan()
        self._steps = 0  # build_step_plan calls so far
        self.stats = SchedulerStats()
        self.share_prefix = share_prefix
        self.shared: dict[tuple[int, bytes], SharedBlock] = {}
        self._shared_ids = itertools.count(1)

    # ------------------------------------------------------------------ running requests

    def observe_scheduled(
        self,
        req_id: str,
        block_ids: Sequence[Sequence[int]],
        num_computed_tokens: int,
        num_scheduled_tokens: int,
    ) -> None:
        """A request runs this step: ``block_ids`` are its device blocks now (per group),
        ``num_computed_tokens`` its computed tokens before the step, and the step
        schedules ``num_scheduled_tokens`` more."""
        self.running[req_id] = RunningRequest(
            tuple(list(b) for b in block_ids), num_computed_tokens + num_scheduled_tokens
        )

    # ------------------------------------------------------------------ preemption

    def on_preempted(
        self,
        req_id: str,
        block_hashes: Sequence[Sequence[bytes]] | None = None,
        num_tokens: int | None = None,
    ) -> TransferJob | None:
        """The request was preempted (its device blocks are free now, and may be
        reused by this very step). Plan the store of its KV, or fall back.

        ``block_hashes`` (per group, per block position; prefix sharing only) are the
        hashes of the request's full blocks, and ``num_tokens`` its tokens now: a block
        is shared only if its KV is valid (all its tokens but the request's last)."""
        run = self.running.pop(req_id, None)
        self._drop(req_id)  # an older state of the same request is stale now
        if run is None or run.kv_tokens <= 0:
            return None  # never ran: nothing to keep
        if not self.supported:
            self._fallback(req_id, Fallback.UNSUPPORTED, "its KV cache is not paged attention")
            return None
        valid = run.kv_tokens if num_tokens is None else min(run.kv_tokens, num_tokens - 1)
        planned = planner.plan_slots(
            self.groups,
            run,
            block_hashes,
            valid,
            shared=self.shared,
            share_prefix=self.share_prefix,
            null_block_id=self.null_block_id,
        )
        if isinstance(planned, tuple):
            self._fallback(req_id, *planned)
            return None
        needed = planner.blocks_needed(planned)
        if needed > self.pool.num_free:
            self._fallback(
                req_id,
                Fallback.CAPACITY,
                f"CPU cache free blocks are insufficient ({needed} needed, "
                f"{self.pool.num_free} free of {self.pool.num_blocks})",
            )
            return None
        # Private host blocks are owned by the store job, so a request's copies never mix.
        owner = next(self._jobs)
        device, host, entries, host_layout = planner.take_host_blocks(
            self.pool, planned, owner, self.shared, self._shared_ids
        )
        n_new = sum(s.kind is SlotKind.NEW for row in planned for s in row)
        state = PreemptedRequestState(
            req_id,
            Phase.STORING,
            run.kv_tokens,
            tuple(host_layout),
            0,
            owner,
            shared=entries,
            planned_step=self._steps,
        )
        self.preempted[req_id] = state
        if not device:
            # Every block is on host already (stored for other requests): no copy.
            state.stored = True
            self._settle(state)
            return None
        job = TransferJob(owner, req_id, device, host, run.kv_tokens)
        self.pool.pin(host, write=True)
        state.job_id, state.pinned = job.job_id, list(host)
        self._in_flight[job.job_id] = state
        self._plan.stores.append(job)
        self.log.info(
            "Recompute preemption offload enabled for request %s: storing %d tokens "
            "(%d device blocks%s) to host (%d of %d host blocks in use)",
            req_id,
            run.kv_tokens,
            len(device),
            f", {len(entries) - n_new} more shared with other requests"
            if len(entries) > n_new
            else "",
            self.host_blocks_in_use,
            self.pool.num_blocks,
        )
        return job

    def _settle(self, state: PreemptedRequestState) -> None:
        """A stored state becomes restorable once every block it shares is stored."""
        if state.phase != Phase.STORING or not state.stored:
            return
        if not all(e.ready for e in state.shared):
            return
        state.phase = Phase.RESTORABLE
        state.ranks_ok = state.ranks_failed = 0
        self.stats.preemptions_offloaded += 1
        self.stats.tokens_stored += state.num_tokens
        self.log.info(
            "Created recompute offload state for request %s: %d tokens in %d host "
            "blocks (%d shared), restorable on resume",
            state.req_id,
            state.num_tokens,
            len(state.all_host_blocks),
            len(state.shared),
        )

    # ------------------------------------------------------------------ resumption

    def restorable_tokens(
        self, req_id: str, num_tokens: int, num_local_computed_tokens: int
    ) -> int | None:
        """Tokens beyond ``num_local_computed_tokens`` (the device prefix-cache hit,
        block aligned) that a restore would provide for a request of ``num_tokens``
        tokens. ``None`` while its store is still unconfirmed (ask again next step)."""
        state = self.preempted.get(req_id)
        if state is None:
            return 0
        if state.phase == Phase.STORING:
            if self._steps - state.planned_step >= STORE_REPORT_TIMEOUT_STEPS:
                if not state.timed_out:
                    state.timed_out = True
                    self._count_fallback(req_id, Fallback.STORE_TIMEOUT, "no store report")
                return 0
            return None
        if state.phase != Phase.RESTORABLE:
            return 0
        tokens = min(state.num_tokens, num_tokens - 1)
        if tokens <= num_local_computed_tokens:
            return 0
        if self.has_state:
            detail = planner.state_unrestorable(tokens, state.num_tokens)
            if detail:
                self._fallback(req_id, Fallback.STATE_POSITION, detail)
                return 0
        if not planner.covers(self.groups, state.host_blocks, num_local_computed_tokens, tokens):
            self._fallback(req_id, Fallback.WINDOW_GAP, "a block inside the window was not kept")
            return 0
        return tokens - num_local_computed_tokens

    def uncounted_state_blocks(self, tokens: int, num_tokens: int) -> int:
        """Device blocks that vLLM (0.32, ``mamba_cache_mode="align"``) allocates without
        counting them first when a request of ``num_tokens`` tokens resumes with
        ``tokens`` restored: one per state group whose remaining tokens reach past the
        block of the restored state (it allocates that block and the block of the
        step's last token, but counts one)."""
        return planner.uncounted_state_blocks(self.groups, tokens, num_tokens)

    def on_allocated(
        self,
        req_id: str,
        block_ids: Sequence[Sequence[int]],
        num_local_computed_tokens: int,
        num_external_tokens: int,
    ) -> TransferJob | None:
        """vLLM allocated ``block_ids`` (per group, the request's whole table) for a
        request it admits with ``num_external_tokens`` tokens to restore after its
        ``num_local_computed_tokens`` prefix-cache hit. Plan the load."""
        state = self.preempted.get(req_id)
        if state is None:
            return None
        if num_external_tokens <= 0 or state.phase != Phase.RESTORABLE:
            # Nothing to load (the prefix cache held it, another connector loads it, or
            # the store was given up on): the host copy is not needed any more.
            self._drop(req_id)
            return None
        end = num_local_computed_tokens + num_external_tokens
        copies = planner.map_load(
            self.groups,
            block_ids,
            state.host_blocks,
            num_local_computed_tokens,
            end,
            self.null_block_id,
        )
        device, host = copies.device, copies.host
        self._plan.unrestorable_device_blocks.extend(copies.unrestorable_blocks)
        if copies.unrestorable:
            self._plan.unrestorable_requests.append(req_id)
        job = TransferJob(
            next(self._jobs), req_id, device, host, num_external_tokens, copies.state_hosts
        )
        state.phase = Phase.LOADING
        state.job_id = job.job_id
        state.ranks_ok = state.ranks_failed = 0
        state.load_tokens = num_external_tokens
        self.pool.pin(host, write=False)
        state.pinned = list(host)
        self._in_flight[job.job_id] = state
        self._plan.loads.append(job)
        self.log.info(
            "Prepared recompute offload H2D load for request %s: %d tokens (%d blocks) "
            "after %d tokens from the device prefix cache",
            req_id,
            num_external_tokens,
            len(device),
            num_local_computed_tokens,
        )
        return job

    def refuse_restore(self, req_id: str, reason: Fallback, detail: str) -> None:
        """A restore checked before it was claimed cannot be done: recompute the request."""
        self._fallback(req_id, reason, detail)

    # ------------------------------------------------------------------ finish, abort

    def on_finished(self, req_id: str) -> None:
        """The request finished or was aborted (maybe while preempted): free its host
        blocks now, or as soon as a copy in flight on them ends."""
        self.running.pop(req_id, None)
        self._drop(req_id)

    # ------------------------------------------------------------------ steps

    def build_step_plan(self) -> StepPlan:
        """The copies planned since the last call (one call per engine step)."""
        self._steps += 1  # (a store's wait is counted from it: no pass over the requests)
        plan, self._plan = self._plan, StepPlan()
        return plan

    def on_worker_report(self, report: WorkerReport) -> None:
        """Outcomes of copies, summed over the ranks that reported this step."""
        for job_id, (ok, failed) in report.stores.items():
            self._on_job_report(job_id, ok, failed, "store")
        for job_id, (ok, failed) in report.loads.items():
            self._on_job_report(job_id, ok, failed, "load")

    def _on_job_report(self, job_id: int, ok: int, failed: int, kind: str) -> None:
        state = self._in_flight.get(job_id)
        if state is None:
            return
        state.ranks_ok += ok
        state.ranks_failed += failed
        if state.ranks_ok + state.ranks_failed < self.world_size:
            return  # other ranks still copying
        failed_any = state.ranks_failed > 0
        if kind == "store":
            written = [e for e in state.shared if e.writer == job_id]
            for entry in written:
                entry.writer = 0
                if failed_any:
                    entry.failed = True
                    if self.shared.get(entry.key) is entry:
                        del self.shared[entry.key]
                else:
                    entry.ready = True
            if state.free_when_done or failed_any or state.timed_out:
                if failed_any:
                    self._count_fallback(
                        state.req_id, Fallback.STORE_FAILED, "a rank's copy failed"
                    )
                self._release(state)
            else:
                del self._in_flight[job_id]
                self.pool.unpin(state.pinned, write=True)
                state.pinned = []
                state.stored = True
                self._settle(state)
            if written:
                # Requests sharing these blocks: restorable now, or recomputed.
                for other in list(self.preempted.values()):
                    if other.phase == Phase.STORING and any(e.failed for e in other.shared):
                        self._fallback(
                            other.req_id,
                            Fallback.STORE_FAILED,
                            "the copy of a block it shares with another request failed",
                        )
                    else:
                        self._settle(other)
            return
        # A load: the host copy has served (or failed: the workers reported the device
        # blocks as failed loads and vLLM recomputes them). Either way it is done.
        if failed_any:
            self._count_fallback(state.req_id, Fallback.LOAD_FAILED, "a rank's copy failed")
        else:
            self.stats.restores += 1
            self.stats.tokens_restored += state.load_tokens
        self._release(state)

    # ------------------------------------------------------------------ internals

    def _release(self, state: PreemptedRequestState) -> None:
        """Forget ``state`` and free its host blocks (its copy in flight has ended);
        a shared block goes with its last reference."""
        if state.pinned:
            self.pool.unpin(state.pinned, write=state.phase == Phase.STORING)
            state.pinned = []
        if self.preempted.get(state.req_id) is state:
            del self.preempted[state.req_id]
        self._in_flight.pop(state.job_id, None)
        self.pool.free_owned(state.owner)
        for entry in state.shared:
            entry.refs -= 1
            if entry.refs == 0:
                if self.shared.get(entry.key) is entry:
                    del self.shared[entry.key]
                self.pool.free_owned(entry.owner)
        state.shared = []

    def _drop(self, req_id: str) -> None:
        """Drop a request's state now, or once its copy in flight ends."""
        state = self.preempted.pop(req_id, None)
        if state is None:
            return
        if state.job_id and state.job_id in self._in_flight:
            state.free_when_done = True  # freed by the workers' report
        else:
            self._release(state)

    def _fallback(self, req_id: str, reason: Fallback, detail: str) -> None:
        self._drop(req_id)
        self._count_fallback(req_id, reason, detail)

    def _count_fallback(self, req_id: str, reason: Fallback, detail: str) -> None:
        self.stats.fallbacks[reason.value] += 1
        if reason == Fallback.UNSUPPORTED:
            # Said once at start-up; counted per preemption.
            self.log.debug("Recompute offload skipped for request %s: %s", req_id, detail)
        elif reason == Fallback.CAPACITY:
            self.log.warning(
                "Recompute offload skipped for request %s: %s; it will be recomputed. "
                "Raise cpu_bytes_to_use_per_rank if this repeats.",
                req_id,
                detail,
            )
        else:
            self.log.warning(
                "Recompute offload fallback (%s) for request %s: %s; it will be recomputed",
                reason.value,
                req_id,
                detail,
            )

    # ------------------------------------------------------------------ introspection

    @property
    def host_blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def take_stats(self) -> SchedulerStats:
        """Counters since the last call."""
        stats, self.stats = self.stats, SchedulerStats()
        return stats

    def phase_of(self, req_id: str) -> Phase | None:
        state = self.preempted.get(req_id)
        return state.phase if state is not None else None

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the bookkeeping is inconsistent (for tests)."""
        invariants.check(self.pool, self.preempted, self._in_flight, self.shared)

    @property
    def num_in_flight(self) -> int:
        """Copies planned and not yet reported by every rank."""
        return len(self._in_flight)


__all__ = [
    "STORE_REPORT_TIMEOUT_STEPS",
    "Fallback",
    "KVGroup",
    "Phase",
    "PreemptedRequestState",
    "RecomputeOffloadScheduler",
    "RunningRequest",
    "SchedulerStats",
    "SharedBlock",
]
