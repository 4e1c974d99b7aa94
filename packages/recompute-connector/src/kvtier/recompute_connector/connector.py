"""The vLLM adapter: ``RecomputeCPUOffloadConnector`` maps vLLM's KV connector interface
onto :class:`RecomputeOffloadScheduler` (scheduler process) and
:class:`RecomputeOffloadWorker` (each worker process). This is the only module of the
package, with its ``metrics``, that imports vLLM; vLLM's connector factory imports it
lazily. It reads the configuration and the engine's facts (kvtier-vllm-port's port) and
hands the work on: :class:`~kvtier.recompute_connector.scheduler_side.SchedulerSide`
turns vLLM's scheduler calls into the scheduler's plain values, ``layout.py`` gives the
KV cache groups, the host block's bytes and the workers' block views, and the fields of
vLLM's objects that differ between releases are read through
:mod:`kvtier.vllm_port.connector_reads`.

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

from kvtier.recompute_connector.config import RecomputeOffloadConfig
from kvtier.recompute_connector.layout import block_views, device_block_bytes, kv_groups
from kvtier.recompute_connector.metrics import (
    RecomputeOffloadPromMetrics,
    RecomputeOffloadStats,
    scheduler_stats,
    worker_stats,
)
from kvtier.recompute_connector.protocol import StepPlan, WorkerReport
from kvtier.recompute_connector.scheduler_side import SchedulerSide
from kvtier.recompute_connector.state import RecomputeOffloadScheduler
from kvtier.recompute_connector.worker import RecomputeOffloadWorker
from kvtier.vllm_port import connector_reads
from kvtier.vllm_port import port as vllm_port
from kvtier.vllm_port.facts import KVLayoutFacts

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# Under "vllm." so vLLM's logging configuration (handlers, level) applies.
logger = logging.getLogger("vllm.kvtier.recompute_connector")

CONNECTOR_NAME = "RecomputeCPUOffloadConnector"


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
    if not connector_reads.recompute_failed_loads(vllm_config):
        return
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
        self._layer_hooks_idle = connector_reads.layer_hooks_idle(type(self))
        ktc: Any = vllm_config.kv_transfer_config
        parallel: Any = vllm_config.parallel_config
        self.config = RecomputeOffloadConfig.from_settings(
            ktc.kv_connector_extra_config,
            world_size=int(parallel.world_size),
            kv_role=ktc.kv_role,
            additional_config=connector_reads.additional_config(vllm_config),
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
        self.scheduler_side: SchedulerSide | None = None
        self.worker: RecomputeOffloadWorker | None = None
        self._groups = kv_groups(facts.kv)
        self._stats_every_step = not port.binds_kv_cache_manager
        self._gauges_sent: dict[str, int] = {}  # host-block gauges as last reported
        # Several KV cache groups: a failed restore can only be reported as a failed
        # request, which vLLM accepts for restores it waits for (the port says where).
        several_groups = len(self._groups) > 1
        self._async_restores = several_groups and port.request_level_load_failures
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(
                self.config, facts, self._groups, self.block_bytes, self._async_restores, logger
            )
            self.scheduler = self.scheduler_side.scheduler
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

    def has_connector_metadata(self) -> bool:
        """vLLM asks this only around each attention layer, to decide whether to call
        ``wait_for_layer_load`` and ``save_kv_layer``, which do nothing here: False, so
        no layer calls them (two Python calls a layer and step fewer on the forward
        pass). This connector's own methods ask vLLM's base class."""
        if self._layer_hooks_idle:
            return False
        return bool(super().has_connector_metadata())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self.worker is None or not super().has_connector_metadata():
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
        if self.scheduler_side is None:
            return 0, False
        return self.scheduler_side.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # vLLM 0.32 (0.23 never calls it); vLLM's own binds its block pool too.
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        # Every release: free blocks are read from it.
        if self.scheduler_side is not None:
            self.scheduler_side.bind_gpu_block_pool(gpu_block_pool)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self.scheduler_side is None:
            return RecomputeConnectorMetadata(StepPlan())
        return RecomputeConnectorMetadata(self.scheduler_side.step_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_reads.worker_meta(connector_output)
        if self.scheduler is not None and isinstance(meta, RecomputeWorkerMetadata):
            self.scheduler.on_worker_report(meta.report)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is not None:
            self.scheduler_side.finished(request.request_id)
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
