"""The connector's scheduler side: vLLM's scheduler calls turned into the plain values
:class:`~kvtier.recompute_connector.state.RecomputeOffloadScheduler` takes.

:class:`SchedulerSide` is what ``RecomputeCPUOffloadConnector`` (``connector.py``) does
in vLLM's scheduler process: it builds the scheduler for the host budget, reads each
step's scheduler output (preempted, new, resumed and running requests, their block
tables from vLLM's KV cache manager or, where vLLM binds none, from
:class:`~kvtier.recompute_connector.block_tables.BlockTableMirror`), answers how many
tokens a resumed request restores (waiting for device room for a hybrid model's state
blocks), and forgets finished requests. vLLM's objects are read through
:mod:`kvtier.vllm_port.connector_reads` where releases differ; vLLM is not imported.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.recompute_connector.block_tables import BlockTableMirror
from kvtier.recompute_connector.config import RecomputeOffloadConfig
from kvtier.recompute_connector.protocol import StepPlan
from kvtier.recompute_connector.state import Fallback, KVGroup, RecomputeOffloadScheduler
from kvtier.vllm_port import connector_reads
from kvtier.vllm_port.facts import EngineFacts

# Steps a resumed hybrid request may wait for device room for its state blocks before
# it is recomputed instead.
ROOM_WAIT_STEPS = 1000


class SchedulerSide:
    """The scheduler process's part of the connector (see the module).

    Args:
        config: the connector's configuration.
        facts: the engine's facts (its KV layout included), as the port read them.
        groups: the KV cache groups (``layout.kv_groups``).
        block_bytes: bytes of one host block.
        async_restores: restores are asynchronous (several KV cache groups, where vLLM
            takes a failed restore as a failed request).
        log: the logger of the user-visible lines.
    """

    def __init__(
        self,
        config: RecomputeOffloadConfig,
        facts: EngineFacts,
        groups: list[KVGroup],
        block_bytes: int,
        async_restores: bool,
        log: logging.Logger,
    ) -> None:
        assert facts.kv is not None
        self._groups = groups
        self._async_restores = async_restores
        self._local_hits: dict[str, int] = {}
        self._room_waits: dict[str, int] = {}  # request -> steps waited for device room
        # Prefix sharing: the requests the scheduler admitted (for their block hashes).
        self._requests: dict[str, Any] = {}
        self._hash_block_size = 0
        # Sliding-window and state groups retire blocks while a request runs.
        self._refresh_every_step = any(g.sliding_window or g.state for g in groups)
        # vLLM 0.32 hands the scheduler side its KV cache manager to read block tables
        # from; where it does not (0.23), the tables are rebuilt from its outputs.
        # (The mirror is dropped once a manager is bound, and kept up only until then.)
        self._kv_cache_manager: Any = None
        self._gpu_block_pool: Any = None
        self._mirror: BlockTableMirror | None = BlockTableMirror(groups)
        budget = config.resolve_budget(block_bytes)
        self.scheduler = RecomputeOffloadScheduler(
            num_host_blocks=budget.num_blocks,
            groups=groups,
            world_size=config.world_size,
            log=log,
            share_prefix=config.enable_offload_prefix_caching,
        )
        log.info(
            "kvtier: RecomputeCPUOffloadConnector scheduler (kv_role %s, "
            "recompute_scheduler_enable=%s accepted; vLLM's own scheduler is used): "
            "per rank %s",
            config.kv_role,
            config.scheduler_flag,
            budget.describe(),
        )
        if not self.scheduler.supported:
            kinds = sorted({g.kind for g, kv in zip(facts.kv.groups, groups) if not kv.supported})
            log.warning(
                "kvtier: this model has KV cache groups kvtier cannot keep (%s: a "
                "linear-attention or Mamba state outside vLLM's mamba_cache_mode "
                "'align', or with speculative blocks), so vLLM recomputes every "
                "preempted request",
                ", ".join(kinds),
            )
        if config.enable_offload_prefix_caching:
            self._hash_block_size = facts.kv.hash_block_size
            hashed = facts.block_hash.prefix_caching
            log.info(
                "kvtier: enable_offload_prefix_caching: full blocks with the same "
                "prefix-cache hash are kept on host once, shared between preempted "
                "requests%s",
                ""
                if hashed
                else " (but vLLM's prefix caching is off, so blocks carry no hash and "
                "nothing is shared: set enable_prefix_caching)",
            )
        if len(groups) > 1 and not async_restores and self.scheduler.supported:
            self.scheduler.supported = False
            log.warning(
                "kvtier: this vLLM cannot recompute a failed restore of a model with "
                "several KV cache groups (it reports failures per block only), so "
                "vLLM recomputes every preempted request of this model"
            )

    # ------------------------------------------------------------------ resumption

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the tokens a restore adds to the request's
        ``num_computed_tokens`` prefix-cache hit (None: ask again next step), and
        whether the restore is asynchronous."""
        sched = self.scheduler
        self._local_hits[request.request_id] = num_computed_tokens
        if self._hash_block_size:
            self._requests[request.request_id] = request
        tokens = sched.restorable_tokens(
            request.request_id, request.num_tokens, num_computed_tokens
        )
        if not tokens:
            return tokens, False
        req_id = request.request_id
        extra = sched.uncounted_state_blocks(num_computed_tokens + tokens, request.num_tokens)
        if extra:
            room = self._room_for(num_computed_tokens, request.num_tokens, extra)
            waited = self._room_waits.get(req_id, 0) + 1
            if room is None or (not room and waited > ROOM_WAIT_STEPS):
                self._room_waits.pop(req_id, None)
                sched.refuse_restore(
                    req_id, Fallback.CAPACITY, "no device room for its state blocks"
                )
                return 0, False
            if not room:
                self._room_waits[req_id] = waited
                return None, False  # ask again next step
        self._room_waits.pop(req_id, None)
        # Asynchronous where a failed restore must reach vLLM as a failed request.
        return tokens, self._async_restores

    def _room_for(self, local_tokens: int, num_tokens: int, extra: int) -> bool | None:
        """Whether vLLM's free device blocks cover what a resume of ``num_tokens``
        tokens after a ``local_tokens`` prefix-cache hit allocates, ``extra`` state
        blocks it does not count included (blocks of every group); None when that is
        unknown or more than the device has."""
        pool = self._gpu_block_pool  # also bound by bind_kv_cache_manager
        if pool is None:
            return None
        need = extra
        for group in self._groups:
            if group.state:
                need += 1
            else:
                need += -(-num_tokens // group.block_size) - local_tokens // group.block_size
        device_blocks = connector_reads.num_gpu_blocks(pool)
        if device_blocks is not None and need >= device_blocks:
            return None  # one block is vLLM's null block
        return int(pool.get_num_free_blocks()) >= need

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: plan the load onto the request's ``blocks``
        (vLLM's ``KVCacheBlocks``)."""
        req_id = request.request_id
        local = self._local_hits.pop(req_id, 0)
        if num_external_tokens <= 0 and req_id not in self.scheduler.preempted:
            return
        self.scheduler.on_allocated(req_id, blocks.get_block_ids(), local, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """vLLM 0.32 (0.23 never binds one): the manager answers block tables, so the
        mirror of the scheduler's outputs is not needed."""
        self._kv_cache_manager = kv_cache_manager
        self._mirror = None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """Every release: free device blocks are read here (:meth:`_room_for`)."""
        self._gpu_block_pool = gpu_block_pool

    # ------------------------------------------------------------------ steps

    def step_plan(self, scheduler_output: Any) -> StepPlan:
        """``build_connector_meta``: what this step's scheduler output changes, and the
        copies planned for the step."""
        sched = self.scheduler
        num_scheduled = scheduler_output.num_scheduled_tokens
        mirror = self._mirror
        for req_id in sorted(scheduler_output.preempted_req_ids or ()):
            if req_id in num_scheduled:
                # Preempted outside schedule() (a prefix-cache reset) and admitted again
                # in this step, from scratch: its old blocks are gone, nothing to keep.
                sched.running.pop(req_id, None)
            else:
                sched.on_preempted(req_id, *self._block_hashes(req_id))
            if mirror is not None:
                mirror.forget(req_id)
        for new in scheduler_output.scheduled_new_reqs:
            if mirror is not None:
                mirror.replace(new.req_id, new.block_ids)
            self._observe(new.req_id, new.num_computed_tokens, num_scheduled, True)
        cached = scheduler_output.scheduled_cached_reqs
        resumed = connector_reads.resumed_req_ids(cached)
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if mirror is not None:
                if req_id in resumed:
                    mirror.replace(req_id, new_blocks or ())
                elif not mirror.append(req_id, new_blocks):
                    mirror.forget(req_id)
            changed = req_id in resumed or bool(new_blocks and any(new_blocks))
            self._observe(req_id, cached.num_computed_tokens[i], num_scheduled, changed)
        return sched.build_step_plan()

    def _block_hashes(self, req_id: str) -> tuple[list[list[bytes]] | None, int | None]:
        """Per KV cache group, the prefix-cache hash of each full block of the request,
        and its number of tokens (prefix sharing only)."""
        request = self._requests.get(req_id)
        if request is None:
            return None, None
        hashes = connector_reads.block_hashes(request)
        per_group: list[list[bytes]] = []
        for group in self._groups:
            factor = max(1, group.block_size // self._hash_block_size)
            # A block's hash is the chained hash of its last hash-sized piece.
            per_group.append(hashes[factor - 1 :: factor])
        return per_group, int(request.num_tokens)

    def _observe(
        self, req_id: str, num_computed: int, num_scheduled: dict[str, int], changed: bool
    ) -> None:
        sched = self.scheduler
        n = num_scheduled.get(req_id, 0)
        known = sched.running.get(req_id)
        if known is not None and not changed and not self._refresh_every_step:
            known.kv_tokens = num_computed + n
            return
        block_ids: Any = None
        if self._kv_cache_manager is not None:
            block_ids = self._kv_cache_manager.get_block_ids(req_id)
        elif self._mirror is not None and self._mirror.supported:
            block_ids = self._mirror.table(req_id, num_computed + n)
        if block_ids is None:
            # Its block table changed and cannot be read: a copy would miss blocks, so
            # the request is no longer tracked and a preemption recomputes it.
            sched.running.pop(req_id, None)
            return
        sched.observe_scheduled(req_id, block_ids, num_computed, n)

    def finished(self, req_id: str) -> None:
        """``request_finished``: forget the request, and free its host blocks."""
        self._local_hits.pop(req_id, None)
        self._room_waits.pop(req_id, None)
        self._requests.pop(req_id, None)
        if self._mirror is not None:
            self._mirror.forget(req_id)
        self.scheduler.on_finished(req_id)


__all__ = ["ROOM_WAIT_STEPS", "SchedulerSide"]
