"""The vLLM adapter: ``RecomputeCPUOffloadConnector`` maps vLLM's KV connector interface
onto :class:`RecomputeOffloadScheduler` (scheduler process) and
:class:`RecomputeOffloadWorker` (each worker process). This is the only module of the
package, with its ``metrics``, that imports vLLM; vLLM's connector factory imports it
lazily.

The scheduler/worker protocol, and why it is correct under vLLM's step order:

* Step N, scheduler: ``schedule()`` preempts request R (its device blocks go back to the
  free pool and may be handed to a running request in this same step). vLLM never calls
  the connector at preemption; ``build_connector_meta`` sees R in
  ``preempted_req_ids``, reserves host blocks for the blocks R held at its last scheduled
  step, and puts a store job in the step's metadata. No waiting request is admitted in a
  step that preempts, so no restore shares a step with a store.
* Step N, every worker: ``handle_preemptions`` is the first thing ``execute_model``
  does, before block zeroing, copy-on-write copies and the forward. The store is issued
  after the work already on the compute stream (the KV of steps < N) and the compute
  stream waits for it, so no later work of the step can overwrite R's blocks first.
  At the end of the step each worker reports the job's outcome in its worker metadata.
* Scheduler, ``update_connector_output``: the reports of all ranks are summed; R becomes
  restorable only when every rank's store succeeded. Until then
  ``get_num_new_matched_tokens`` answers ``None`` (ask again next step), which only
  happens with asynchronous scheduling, where step N+1 is scheduled before step N's
  output is processed.
* Step M > N, scheduler: R is admitted again. ``get_num_new_matched_tokens`` reports the
  restorable tokens beyond the device prefix-cache hit (synchronous load: ``False``);
  ``update_state_after_alloc`` maps host blocks onto the new device blocks and queues a
  load job. vLLM flags the step ``has_sync_kv_loads``, so the worker's ``start_load_kv``
  runs before the forward, and the compute stream waits for the load.
* A model with several KV cache groups is restored asynchronously instead (``True``;
  vLLM 0.32): the request waits for the load, which the worker reports finished in
  ``get_transfer_results`` of the same step, or failed (``failed_recving``): vLLM then
  recomputes it from the start, as it refuses block-level failures for such a model.
* A failed load is reported from ``get_block_ids_with_load_errors`` in the same step;
  vLLM then recomputes from the first failed block (``kv_load_failure_policy``
  ``"recompute"``, which the connector sets on its configuration standing alone; inside
  ``MultiConnector`` the top-level configuration's policy governs). The host blocks
  are freed once every rank reported the load, or at once when R finishes or is
  aborted while restorable.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.recompute_connector.block_tables import BlockTableMirror
from kvtier.recompute_connector.config import RecomputeOffloadConfig
from kvtier.recompute_connector.metrics import (
    RecomputeOffloadPromMetrics,
    RecomputeOffloadStats,
    scheduler_stats,
    worker_stats,
)
from kvtier.recompute_connector.protocol import StepPlan, WorkerReport
from kvtier.recompute_connector.state import Fallback, KVGroup, RecomputeOffloadScheduler
from kvtier.recompute_connector.worker import RecomputeOffloadWorker
from kvtier.vllm_port import port as vllm_port
from kvtier.vllm_port.facts import KVLayoutFacts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under "vllm." so vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvtier.recompute_connector")

CONNECTOR_NAME = "RecomputeCPUOffloadConnector"
# Steps a resumed hybrid request may wait for device room for its state blocks before
# it is recomputed instead.
ROOM_WAIT_STEPS = 1000


class RecomputeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: the copies of one step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class RecomputeWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: outcomes of copies, summed over ranks by ``aggregate``."""

    def __init__(self, report: WorkerReport) -> None:
        self.report = report

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, RecomputeWorkerMetadata):
            merged = WorkerReport().merge(self.report).merge(other.report)
            return RecomputeWorkerMetadata(merged)
        return self


# ---------------------------------------------------------------------- helpers


def block_placements(kv: KVLayoutFacts) -> list[tuple[str, int, int, int]] | None:
    """Where each layer's blocks lie in vLLM's KV cache allocation, in bytes: per layer
    ``(name, offset of block 0, distance between blocks, bytes of one block)``.

    vLLM releases whose ``KVCacheTensor`` has a ``layer_stride`` place every tensor in
    one allocation, and KV cache groups overlay each other there (a block id belongs to
    one group at a time): a hybrid model's linear-attention layers get that whole
    allocation as their KV cache, so their blocks can only be found from here. ``None``
    on releases where each ``KVCacheTensor`` is an allocation of its own.
    """
    tensors = kv.device_tensors()
    if not tensors or any(t.placement is None for t in tensors):
        return None
    pages: dict[str, int | None] = {}  # a layer's page: its (first) group's
    for g in kv.groups:
        for layer, page in g.page_bytes.items():
            pages.setdefault(layer, page)
    out = []
    for t in tensors:
        placed = t.placement
        assert placed is not None
        layer_stride, block_stride = placed.layer_stride, placed.block_stride
        for i, layer in enumerate(t.layers):
            page = pages.get(layer)
            if page is None:
                page = min(s for s in (layer_stride, block_stride) if s > 0)
            out.append((layer, placed.offset + i * layer_stride, block_stride, page))
    return out


def device_block_bytes(kv: KVLayoutFacts) -> int:
    """Bytes of one device block over every KV tensor of a rank (one host block)."""
    placements = block_placements(kv)
    if placements is not None and kv.num_blocks > 0:
        # Overlaid groups share their bytes: count the union of block 0's runs.
        total, end = 0, -1
        for start, stop in sorted((p[1], p[1] + p[3]) for p in placements):
            total += max(0, stop - max(start, end))
            end = max(end, stop)
        return total
    tensors = kv.device_tensors()
    if not tensors or kv.num_blocks <= 0:
        raise ValueError("the KV cache config has no device KV tensors to offload")
    return sum(t.size for t in tensors) // kv.num_blocks


def block_views(kv_caches: dict[str, Any], kv: KVLayoutFacts) -> dict[str, Any]:
    """The KV tensors to register with the copy engine: per layer a ``[num_blocks,
    page bytes]`` uint8 view placed as :func:`block_placements` says, or ``kv_caches``
    as vLLM gave them on releases without placements."""
    placements = block_placements(kv)
    if placements is None:
        return kv_caches
    views: dict[str, Any] = {}
    for name, start, stride, page in placements:
        entry = kv_caches.get(name)
        if isinstance(entry, (list, tuple)):
            entry = entry[0] if entry else None
        if not isinstance(entry, torch.Tensor):
            continue
        # Every layer's tensor is a view of the one allocation, which starts its storage.
        storage = entry.untyped_storage()
        flat = torch.empty(0, dtype=torch.uint8, device=entry.device)
        flat.set_(storage, 0, (storage.nbytes(),), (1,))
        views[name] = flat.as_strided((kv.num_blocks, page), (stride, 1), start)
    return views


def kv_groups(kv: KVLayoutFacts) -> list[KVGroup]:
    """The KV cache groups as the scheduler side sees them.

    A Mamba group (linear attention's convolution and recurrent state) is kept only in
    vLLM's ``mamba_cache_mode`` ``"align"`` without speculative blocks: there the state
    after a request's last computed token is the block of that token, so one block
    per request restores it. Other modes keep it elsewhere: recomputed.
    """
    groups = []
    for g in kv.groups:
        if "Mamba" in g.kind:
            state = (
                g.mamba_cache_mode == "align"
                and not g.speculative_blocks
                and not g.prefill_checkpoint_blocks
            )
            groups.append(KVGroup(g.block_size, None, state, state=state))
            continue
        supported = g.kind in ("FullAttentionSpec", "SlidingWindowSpec") or g.has_heads
        mirrorable = bool(g.lineage & {"FullAttentionSpec", "SlidingWindowSpec"}) and not (
            g.lineage & {"ChunkedLocalAttentionSpec"}
        )
        groups.append(KVGroup(g.block_size, g.sliding_window, supported, mirrorable=mirrorable))
    return groups


# ---------------------------------------------------------------------- the connector


def _recompute_failed_restores(vllm_config: Any) -> None:
    """A failed restore must fall back to recompute, never fail the request.

    vLLM's scheduler reads ``kv_load_failure_policy`` from its configuration right after
    it builds the connector, so a connector standing alone may still set it there.
    Inside ``MultiConnector`` a child is handed a private copy of the configuration: the
    top-level ``kv-transfer-config`` governs every child's failed loads, so the policy
    is set there by the operator (as the guide says for the P/D connector), and what is
    set here changes nothing. Nothing wrong is loaded either way: under ``fail``, vLLM
    ends a request whose restore failed with an error instead of recomputing it.
    """
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or getattr(ktc, "kv_load_failure_policy", None) == "recompute":
        return
    ktc.kv_load_failure_policy = "recompute"
    logger.info(
        "kvtier: kv_load_failure_policy set to 'recompute': a failed restore is recomputed "
        "like any preempted request (inside MultiConnector the top-level "
        'kv-transfer-config\'s policy governs: set "kv_load_failure_policy": '
        '"recompute" there)'
    )


class RecomputeCPUOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    """Keeps preempted requests' KV in host DRAM and restores it when they resume.

    Configured through ``kv_connector_extra_config`` (see the package README);
    works standalone and as a child of ``MultiConnector``, with ``kv_role``
    ``kv_consumer`` or ``kv_both``.
    """

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc: Any = vllm_config.kv_transfer_config
        parallel: Any = vllm_config.parallel_config
        self.config = RecomputeOffloadConfig.from_settings(
            ktc.kv_connector_extra_config,
            world_size=int(parallel.world_size),
            kv_role=ktc.kv_role,
            additional_config=getattr(vllm_config, "additional_config", None),
        )
        if kv_cache_config is None:
            raise ValueError("RecomputeCPUOffloadConnector needs vLLM's kv_cache_config")
        port = vllm_port.current()
        facts = port.engine_facts(vllm_config, kv_cache_config)
        assert facts is not None and facts.kv is not None
        self._port = port
        self._kv: KVLayoutFacts = facts.kv
        self.block_bytes = device_block_bytes(facts.kv)
        self.scheduler: RecomputeOffloadScheduler | None = None
        self.worker: RecomputeOffloadWorker | None = None
        self._local_hits: dict[str, int] = {}
        self._room_waits: dict[str, int] = {}  # request -> steps waited for device room
        # Prefix sharing: the requests the scheduler admitted (for their block hashes).
        self._requests: dict[str, Any] = {}
        self._hash_block_size = 0
        self._groups = kv_groups(facts.kv)
        self._stats_every_step = not port.binds_kv_cache_manager
        self._gauges_sent: dict[str, int] = {}  # host-block gauges as last reported
        # Several KV cache groups: a failed restore can only be reported as a failed
        # request, which vLLM accepts for restores it waits for (the port says where).
        several_groups = len(self._groups) > 1
        self._async_restores = several_groups and port.request_level_load_failures
        # Sliding-window and state groups retire blocks while a request runs.
        self._refresh_every_step = any(g.sliding_window or g.state for g in self._groups)
        # vLLM 0.32 hands the scheduler side its KV cache manager to read block tables
        # from; where it does not (0.23), the tables are rebuilt from its outputs.
        # (The mirror is dropped once a manager is bound, and kept up only until then.)
        self._kv_cache_manager: Any = None
        self._gpu_block_pool: Any = None
        self._mirror: BlockTableMirror | None = BlockTableMirror(self._groups)
        if role == KVConnectorRole.SCHEDULER:
            budget = self.config.resolve_budget(self.block_bytes)
            self.scheduler = RecomputeOffloadScheduler(
                num_host_blocks=budget.num_blocks,
                groups=self._groups,
                world_size=self.config.world_size,
                log=logger,
                share_prefix=self.config.enable_offload_prefix_caching,
            )
            logger.info(
                "kvtier: RecomputeCPUOffloadConnector scheduler (kv_role %s, "
                "recompute_scheduler_enable=%s accepted; vLLM's own scheduler is used): "
                "per rank %s",
                self.config.kv_role,
                self.config.scheduler_flag,
                budget.describe(),
            )
            if not self.scheduler.supported:
                kinds = sorted(
                    {g.kind for g, kv in zip(facts.kv.groups, self._groups) if not kv.supported}
                )
                logger.warning(
                    "kvtier: this model has KV cache groups kvtier cannot keep (%s: a "
                    "linear-attention or Mamba state outside vLLM's mamba_cache_mode "
                    "'align', or with speculative blocks), so vLLM recomputes every "
                    "preempted request",
                    ", ".join(kinds),
                )
            if self.config.enable_offload_prefix_caching:
                self._hash_block_size = facts.kv.hash_block_size
                hashed = facts.block_hash.prefix_caching
                logger.info(
                    "kvtier: enable_offload_prefix_caching: full blocks with the same "
                    "prefix-cache hash are kept on host once, shared between preempted "
                    "requests%s",
                    ""
                    if hashed
                    else " (but vLLM's prefix caching is off, so blocks carry no hash and "
                    "nothing is shared: set enable_prefix_caching)",
                )
            if several_groups and not self._async_restores and self.scheduler.supported:
                self.scheduler.supported = False
                logger.warning(
                    "kvtier: this vLLM cannot recompute a failed restore of a model with "
                    "several KV cache groups (it reports failures per block only), so "
                    "vLLM recomputes every preempted request of this model"
                )
            _recompute_failed_restores(vllm_config)
        else:
            self.worker = RecomputeOffloadWorker(
                self.config, bytes_per_block=self.block_bytes, rank=facts.parallel.rank, log=logger
            )
            self.worker.request_level_loads = self._async_restores

    # A best-effort cache: a preempted request with a pending copy is never
    # "delivered" elsewhere, so vLLM must not drop its in-flight output for us.
    @property
    def requires_kv_delivery(self) -> bool:
        return False

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            views = block_views(kv_caches, self._kv)
            self.worker.register_kv_caches(views, self._kv.num_blocks)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if self.worker is not None and isinstance(
            kv_connector_metadata, RecomputeConnectorMetadata
        ):
            self.worker.run_stores(kv_connector_metadata.plan.stores)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, RecomputeConnectorMetadata):
            self.worker.run_loads(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are whole-request and ordered before the forward

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # nothing is saved during the forward: stores happen at preemption

    def wait_for_save(self) -> None:
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.worker is None:
            return set()
        # With request-level restores a failure is a failed request (below), never blocks.
        return self.worker.load_errors()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """The restores that finished this step; a failed one is also a failed receive,
        which vLLM recomputes from the start (models with several KV cache groups)."""
        finished: set[str] = set()
        failed: set[str] = set()
        if self.worker is not None and self._async_restores:
            finished, failed = self.worker.finished_loads()
        return self._port.transfer_results(finished, failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self.worker is None:
            return None
        report = self.worker.take_report()
        return RecomputeWorkerMetadata(report) if report is not None else None

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler is None:
            return 0, False
        self._local_hits[request.request_id] = num_computed_tokens
        if self._hash_block_size:
            self._requests[request.request_id] = request
        tokens = self.scheduler.restorable_tokens(
            request.request_id, request.num_tokens, num_computed_tokens
        )
        if not tokens:
            return tokens, False
        req_id = request.request_id
        extra = self.scheduler.uncounted_state_blocks(
            num_computed_tokens + tokens, request.num_tokens
        )
        if extra:
            room = self._room_for(num_computed_tokens, request.num_tokens, extra)
            waited = self._room_waits.get(req_id, 0) + 1
            if room is None or (not room and waited > ROOM_WAIT_STEPS):
                self._room_waits.pop(req_id, None)
                self.scheduler.refuse_restore(
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
        if need >= int(getattr(pool, "num_gpu_blocks", need + 1)):
            return None  # one block is vLLM's null block
        return int(pool.get_num_free_blocks()) >= need

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler is None:
            return
        req_id = request.request_id
        local = self._local_hits.pop(req_id, 0)
        if num_external_tokens <= 0 and req_id not in self.scheduler.preempted:
            return
        self.scheduler.on_allocated(req_id, blocks.get_block_ids(), local, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM 0.32 (0.23 never calls it): the manager answers block tables, so the
        # mirror of the scheduler's outputs is not needed.
        super().bind_kv_cache_manager(kv_cache_manager)
        self._mirror = None

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # Every release: free blocks are read here (_room_for).
        self._gpu_block_pool = gpu_block_pool

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        sched = self.scheduler
        if sched is None:
            return RecomputeConnectorMetadata(StepPlan())
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
            self._observe(sched, new.req_id, new.num_computed_tokens, num_scheduled, True)
        cached = scheduler_output.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if mirror is not None:
                if req_id in resumed:
                    mirror.replace(req_id, new_blocks or ())
                elif not mirror.append(req_id, new_blocks):
                    mirror.forget(req_id)
            changed = req_id in resumed or bool(new_blocks and any(new_blocks))
            self._observe(sched, req_id, cached.num_computed_tokens[i], num_scheduled, changed)
        return RecomputeConnectorMetadata(sched.build_step_plan())

    def _block_hashes(self, req_id: str) -> tuple[list[list[bytes]] | None, int | None]:
        """Per KV cache group, the prefix-cache hash of each full block of the request,
        and its number of tokens (prefix sharing only)."""
        request = self._requests.get(req_id)
        if request is None:
            return None, None
        hashes = list(getattr(request, "block_hashes", ()) or ())
        per_group: list[list[bytes]] = []
        for group in self._groups:
            factor = max(1, group.block_size // self._hash_block_size)
            # A block's hash is the chained hash of its last hash-sized piece.
            per_group.append(hashes[factor - 1 :: factor])
        return per_group, int(request.num_tokens)

    def _observe(
        self,
        sched: RecomputeOffloadScheduler,
        req_id: str,
        num_computed: int,
        num_scheduled: dict[str, int],
        changed: bool,
    ) -> None:
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

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self.scheduler is not None and isinstance(meta, RecomputeWorkerMetadata):
            self.scheduler.on_worker_report(meta.report)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            self._local_hits.pop(request.request_id, None)
            self._room_waits.pop(request.request_id, None)
            self._requests.pop(request.request_id, None)
            if self._mirror is not None:
                self._mirror.forget(request.request_id)
            self.scheduler.on_finished(request.request_id)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, [])

    # ------------------------------------------------------------------ stats

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.scheduler is not None:
            stats = scheduler_stats(self.scheduler, self._gauges_sent)
        elif self.worker is not None:
            transfers = self.worker.take_stats()
            if self._stats_every_step:
                # Older vLLM polls the scheduler side only when a worker reports stats.
                return worker_stats(transfers)
            if transfers is None:
                return None  # no copy this step (most steps)
            stats = worker_stats(transfers)
        else:
            return None
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return RecomputeOffloadStats(data=data) if data is not None else RecomputeOffloadStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return RecomputeOffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    def reset_cache(self) -> bool | None:
        return True  # host copies belong to preempted requests, not to the prefix cache
