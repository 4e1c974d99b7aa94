"""kvtier's ``OffloadingConnector``: vLLM's, with failed transfers recomputed.

vLLM's offloading connector asserts that every transfer succeeds, so one bad plan or
failed copy takes the engine down. With a kvtier spec, this connector (registered
under vLLM's name ``OffloadingConnector``) turns a failure into recompute instead:

* a failed **load**: its device blocks are reported through
  ``get_block_ids_with_load_errors``, and the scheduler recomputes them
  (``kv_load_failure_policy`` is set to ``recompute``, with a log line). A model with
  several KV cache groups (a hybrid model) has block ids that are unique only within
  a group, and vLLM 0.32 stops the engine on a block-level failure there: its failed
  loads are reported as failed requests (``failed_recving``), which vLLM recomputes
  from the start;
* a failed **store**: the job id travels to the scheduler in the worker metadata,
  and the manager drops the job's host blocks before vLLM completes the job, so
  they are never loaded.

It also tells a kvtier manager which requests run with a LoRA adapter (only the
connector sees vLLM's ``Request``): those keep to the host tier; and, with secondary
tiers, each arriving request's offload keys, so that its prefix is promoted from them
while it waits in vLLM's queue.

With any other spec it is vLLM's connector unchanged. On releases without spec
metrics (vLLM 0.23) it reports kvtier's metrics itself
(:mod:`kvtier.tiering_spec.vllm_legacy_metrics`).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
    OffloadingConnector as _Base,
)

from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.vllm_adapter import _KvtierSpec
from kvtier.tiering_spec.vllm_manager import KvtierOffloadingManager
from kvtier.vllm_port import (
    admissions,
    connector_reads,
    lookup_memo,
    lookups,
    store_planning,
    sync_loads,
)

logger = logging.getLogger("kvtier.tiering_spec")


# Whether vLLM's connector reports no load errors of its own (vLLM 0.32 and 0.33 keep
# the base class's empty set): kvtier's failed loads are then the only ones.
_NO_BASE_LOAD_ERRORS = next(
    (c for c in _Base.__mro__ if "get_block_ids_with_load_errors" in vars(c)), object
).__module__.endswith("kv_connector.v1.base")

# The base constructor's parameters (vllm_config, role, kv_cache_config), to name the
# arguments vLLM passes, by position or by keyword.
_BASE_INIT = inspect.signature(_Base.__init__)


@dataclasses.dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker metadata plus the store jobs that failed on some rank."""

    failed_store_jobs: set[int] = dataclasses.field(default_factory=set)

    @classmethod
    def of(cls, meta: Any, failed: set[int]) -> KvtierWorkerMetadata:
        fields = {
            f.name: getattr(meta, f.name)
            for f in dataclasses.fields(meta)
            if f.name != "failed_store_jobs"
        }
        return cls(**fields, failed_store_jobs=set(failed))

    def aggregate(self, other: Any) -> Any:
        merged = super().aggregate(other)
        return KvtierWorkerMetadata.of(
            merged, self.failed_store_jobs | set(getattr(other, "failed_store_jobs", ()))
        )


class OffloadingConnector(_Base):  # type: ignore[misc]
    """vLLM's ``OffloadingConnector``; with a kvtier spec, failed transfers are
    recomputed instead of failing vLLM's assertion."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's constructor, run by the port, which hands a kvtier spec the engine's facts.
        bound = _BASE_INIT.bind(self, *args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        compat.PORT.init_offloading_connector(
            self, _Base, given["vllm_config"], given["role"], given["kv_cache_config"]
        )
        self._kvtier_worker_spec: _KvtierSpec | None = None
        self._kvtier_manager: KvtierOffloadingManager | None = None
        self._kvtier_admissions: admissions.Admissions | None = None
        self._chunk_hashes = 1  # block hashes per offloaded chunk (the traffic record)
        self._kvtier_events = True
        self._store_failure_logged = False
        # Failed loads as failed requests, where block ids name no single request.
        groups = getattr(given.get("kv_cache_config"), "kv_cache_groups", None) or ()
        self._fail_requests = len(groups) > 1 and compat.REQUEST_LEVEL_LOAD_FAILURES
        self._failed_recving: set[str] = set()
        self._held_stores: list[Any] = []  # stores to submit after the synchronous loads
        self._sync_started: frozenset[int] = frozenset()  # synchronous loads under way
        # This step's metadata moves nothing and nothing waits (bind_connector_metadata):
        # handle_preemptions and start_load_kv have nothing to do.
        self._idle_step = False
        # ... and this worker has nothing in flight or to report: the step's
        # wait_for_save, get_finished, get_transfer_results, build_connector_worker_meta
        # and get_block_ids_with_load_errors answer as vLLM's would, at once.
        self._quiet_step = False
        # What handle_preemptions (vLLM's first call of a step) found of the step's
        # metadata, (metadata, idle, quiet), for bind_connector_metadata to take.
        self._checked: tuple[Any, bool, bool] | None = None
        self._results_type: Any = None  # vLLM's KVConnectorTransferResults, once seen
        self._layer_hooks_idle = connector_reads.layer_hooks_idle(type(self))
        worker = getattr(self, "connector_worker", None)
        # Whether vLLM's worker reads the requests that finished in a step (releases
        # before 0.32 report them as finished sending once their stores are done).
        self._reads_finished_reqs = worker is None or connector_reads.reads_argument(
            getattr(type(worker), "get_finished", None), "finished_req_ids"
        )
        spec = getattr(worker, "spec", None)
        if isinstance(spec, _KvtierSpec):
            spec.failures_reported = True
            self._kvtier_worker_spec = spec
        scheduler = getattr(self, "connector_scheduler", None)
        manager = getattr(scheduler, "manager", None)
        if isinstance(manager, KvtierOffloadingManager):
            self._kvtier_manager = manager
            # vLLM's admission calls are written for every model; a plain one is
            # admitted by kvtier's own (before the changes below wrap them).
            admissions.install(scheduler)
            self._kvtier_admissions = getattr(scheduler, "_kvtier_admissions", None)
            # vLLM updates keys and plans stores for every scheduled request each
            # step; only requests with a new chunk need it.
            store_planning.speed_up(scheduler)
            # vLLM looks an arriving request's prefix up, and its hit's tiers, key by
            # key; kvtier's manager answers a prefix in one call.
            lookups.speed_up(scheduler)
            lookups.sliding_window_scans(scheduler)  # (hybrid models' window groups)
            # vLLM asks about the head of its waiting queue every step until it fits;
            # what nothing changed for is answered again from the last answer.
            lookup_memo.install(scheduler)
            # Hits within the step's budget load before its forward pass (vLLM 0.33
            # does it itself; this is the same for 0.32).
            offload = manager.side.offload
            sync_loads.enable(
                scheduler,
                offload.settings.sync_load_budget_bytes,
                offload.facts.worker_kv_bytes_per_block,
            )
            self._kvtier_events = offload.facts.kv_events
            self._chunk_hashes = offload.chunk_hashes()
            was = connector_reads.kv_load_failure_policy(self._vllm_config)
            if was is not None and connector_reads.recompute_failed_loads(self._vllm_config):
                logger.info(
                    "kvtier: kv_load_failure_policy set to 'recompute' (was %r): a "
                    "transfer kvtier cannot complete is recomputed, never an error",
                    was,
                )

    # -- worker side ----------------------------------------------------------------

    def _kvtier_worker(self) -> Any:
        spec = self._kvtier_worker_spec
        return None if spec is None else spec._worker

    def _quiet(self, finished_req_ids: set[str]) -> bool:
        """Whether this worker has nothing to submit or report (most steps): vLLM's
        ``get_finished`` would then find no finished job and report nothing. Not on a
        step that finished requests where vLLM's worker reads them (releases before 0.32
        report those as finished sending once their stores are done), nor on one that
        planned stores (releases before 0.32 queue them in ``get_finished``). Known at
        bind on a quiet step."""
        if finished_req_ids and self._reads_finished_reqs:
            return False
        if self._quiet_step:
            return True
        worker = self._kvtier_worker()
        return (
            not store_planning.plans_stores(getattr(self, "_connector_metadata", None))
            and worker is not None
            and worker.quiet
            and not self._held_stores
            and not self._failed_recving
        )

    def has_connector_metadata(self) -> bool:
        """vLLM asks this only around each attention layer, to decide whether to call
        ``wait_for_layer_load`` and ``save_kv_layer``; an offloading connector's do
        nothing (checked on this class), so with a kvtier spec it answers False and no
        layer calls them: two Python calls a layer and step fewer on the forward pass.
        This connector's own methods read the metadata itself."""
        if self._kvtier_worker_spec is not None and self._layer_hooks_idle:
            return False
        return bool(super().has_connector_metadata())

    def _check(self, metadata: Any) -> tuple[Any, bool, bool]:
        """(``metadata``, idle, quiet) for a step: idle, its metadata moves nothing and
        nothing waits (handle_preemptions and start_load_kv have nothing to do); quiet,
        idle and this worker has nothing in flight or to report. An idle step submits
        nothing, so a worker with nothing in flight has nothing to report until the
        metadata is cleared."""
        spec = self._kvtier_worker_spec
        if spec is None or self._held_stores or self._sync_started:
            return metadata, False, False
        connector_worker = self.connector_worker
        if not sync_loads.idle(connector_worker, metadata):
            return metadata, False, False
        worker = spec._worker
        quiet = (
            worker is not None
            and _NO_BASE_LOAD_ERRORS
            and not self._failed_recving
            and worker.quiet
            and not store_planning.plans_stores(metadata)
            and not store_planning.worker_meta_waiting(connector_worker)
        )
        return metadata, True, quiet

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        super().bind_connector_metadata(connector_metadata)
        checked, self._checked = self._checked, None
        if checked is None or checked[0] is not connector_metadata:
            checked = self._check(connector_metadata)
        _, self._idle_step, self._quiet_step = checked

    def clear_connector_metadata(self) -> None:
        self._idle_step = self._quiet_step = False
        super().clear_connector_metadata()

    def wait_for_save(self) -> None:
        if self._quiet_step:
            return  # the metadata plans no store: vLLM's would defer none
        super().wait_for_save()

    def handle_preemptions(self, *args: Any, **kwargs: Any) -> None:
        if self._idle_step:
            return  # (the metadata handed here is the one bound this step)
        meta = args[0] if args else kwargs.get("kv_connector_metadata")
        if self._kvtier_worker_spec is None or meta is None:
            super().handle_preemptions(*args, **kwargs)
            return
        # (vLLM binds the same metadata next: what is found here holds there, as no
        # connector call comes between.)
        checked = self._checked = self._check(meta)
        if checked[1]:
            return  # nothing to flush, submit or start (most steps)
        # The step's synchronous loads (see kvtier.vllm_port.sync_loads) start now, while
        # the worker prepares the step, ahead of the stores deferred from the last step.
        self._held_stores = sync_loads.hold_stores(self.connector_worker, meta)
        super().handle_preemptions(*args, **kwargs)
        self._sync_started = sync_loads.start_sync_loads(self.connector_worker, meta)

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        if self._idle_step:
            return  # no load to start and no store to submit (most steps)
        if self._kvtier_worker_spec is None:
            super().start_load_kv(*args, **kwargs)
            return
        started, self._sync_started = self._sync_started, frozenset()
        meta = getattr(self, "_connector_metadata", None)
        if not started and not self._held_stores and sync_loads.idle(self.connector_worker, meta):
            return  # no load to start and no store to submit (most steps)
        if started and meta is not None:
            self._connector_metadata = sync_loads.without_jobs(meta, started)
            try:
                super().start_load_kv(*args, **kwargs)
            finally:
                self._connector_metadata = meta
            # They end here, before the forward pass that reads them.
            self.connector_worker.worker.wait(set(started))
        else:
            super().start_load_kv(*args, **kwargs)
            sync_loads.wait_for_sync_loads(self.connector_worker, meta)
        held, self._held_stores = self._held_stores, []
        if held:
            sync_loads.release_stores(self.connector_worker, held)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._quiet_step:
            return set()  # no load ran: what vLLM's offloading connector reports
        worker = self._kvtier_worker()
        if worker is not None and _NO_BASE_LOAD_ERRORS and not worker.has_failed_loads:
            return set()  # what vLLM's offloading connector reports
        errors = super().get_block_ids_with_load_errors()
        if worker is not None and not self._fail_requests and worker.has_failed_loads:
            errors = set(errors)
            # (With request-level failures get_finished takes them as requests.)
            for device_ids in worker.take_failed_loads().values():
                errors.update(device_ids)
        return errors

    def get_finished(self, finished_req_ids: set[str]) -> Any:
        if self._quiet(finished_req_ids):
            return set(), set()  # vLLM's, with no finished job (asked every step)
        if self._held_stores:  # a step that ran no start_load_kv: submit them now
            held, self._held_stores = self._held_stores, []
            sync_loads.release_stores(self.connector_worker, held)
        worker = self._kvtier_worker()
        if worker is None or not self._fail_requests:
            return super().get_finished(finished_req_ids)
        # vLLM forgets a load job's request once it reports the job finished.
        requests = dict(compat.PORT.load_job_requests(self))
        finished = super().get_finished(finished_req_ids)
        for job_id in worker.take_failed_loads():
            req_id = requests.get(job_id)
            if req_id is not None:
                self._failed_recving.add(req_id)
            else:  # never expected: vLLM registers every load job before it runs
                logger.error("kvtier: load job %d failed but vLLM names no request for it", job_id)
        return finished

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        empty = self._results_type
        if empty is not None and self._quiet(finished_req_ids):
            return empty()  # nothing finished: vLLM's empty results (asked every step)
        results = super().get_transfer_results(finished_req_ids)
        if self._kvtier_worker_spec is not None:
            self._results_type = type(results)
        if self._failed_recving:
            # A failed receive is also a finished one: the request leaves its wait.
            results.failed_recving |= self._failed_recving
            results.finished_recving |= self._failed_recving
            self._failed_recving = set()
        return results

    def build_connector_worker_meta(self) -> Any:
        if self._quiet_step:
            return None  # no job completed: vLLM's has no metadata to send
        meta = super().build_connector_worker_meta()
        worker = self._kvtier_worker()
        if worker is None or meta is None:
            return meta
        # Every rank's metadata is of this type, so aggregation keeps the failures.
        return KvtierWorkerMetadata.of(meta, set(worker.take_failed_stores()))

    # -- metrics --------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Any:  # (asked on both sides every step)
        admit = self._kvtier_admissions
        if admit is not None and admit.held:
            admit.release_held()  # (delay samples of memo answers, see admissions)
        if compat.SPEC_METRICS:
            return super().get_kv_connector_stats()
        # Before vLLM 0.24: kvtier reports its metrics itself.
        return compat.legacy_metrics().connector_stats(self, super().get_kv_connector_stats)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        if compat.SPEC_METRICS:
            return super().build_kv_connector_stats(data)
        return compat.legacy_metrics().build_stats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        if compat.SPEC_METRICS:
            return super().build_prom_metrics(
                vllm_config, metric_types, labelnames, per_engine_labelvalues
            )
        return compat.legacy_metrics().KvtierOffloadPromMetrics(
            vllm_config, metric_types, labelnames, per_engine_labelvalues
        )

    # -- scheduler side -------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        # Only the connector sees vLLM's Request: tell kvtier's manager, on the context
        # vLLM just made for the request, whether it runs with a LoRA adapter (where
        # vLLM keeps no context the manager treats the request as it may carry one).
        scheduler = getattr(self, "connector_scheduler", None)
        manager = getattr(scheduler, "manager", None)
        if isinstance(manager, KvtierOffloadingManager):
            traffic = manager.side.traffic
            if traffic is not None:
                per_chunk = self._chunk_hashes
                traffic.arrive(
                    request.request_id,
                    request.num_prompt_tokens,
                    connector_reads.chunk_hashes(request, per_chunk),
                )
            # (With the host tier alone every request may use every tier: nothing to note.)
            context = (
                compat.PORT.request_context(scheduler, request.request_id)
                if manager.core.secondary_tiers
                else None
            )
            if context is not None:
                manager.note_lora(context, getattr(request, "lora_request", None) is not None)
                if not getattr(request, "skip_reading_prefix_cache", False):
                    # What only the fs or store tier holds of its prefix is promoted
                    # while it waits for its turn.
                    keys = lookups.arrival_keys(scheduler, request.request_id)
                    if keys:
                        manager.promote_ahead(keys, context)

    def _finished(self, request: Any) -> None:
        admit = self._kvtier_admissions
        if admit is not None and admit.held:
            admit.release_held(now=True)  # the engine may stop stepping soon
        manager = self._kvtier_manager
        if manager is not None:
            manager.emit_metrics_next()
            if manager.side.traffic is not None:
                manager.side.traffic.finish(request.request_id, request.num_output_tokens)

    # vLLM calls one of the two (the second for a connector that supports hybrid models).
    def request_finished(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._finished(request)
        return super().request_finished(request, *args, **kwargs)

    def request_finished_all_groups(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._finished(request)
        return super().request_finished_all_groups(request, *args, **kwargs)

    def update_state_after_alloc(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        manager = self._kvtier_manager
        if manager is not None and manager.core.secondary_tiers:
            # Admitted (vLLM may admit it without asking the manager, its prompt all
            # on the device): it no longer waits, nothing is promoted ahead for it
            # (only secondary tiers promote ahead).
            manager.forget_ahead(request.request_id)
        return super().update_state_after_alloc(request, *args, **kwargs)

    def take_events(self) -> Any:
        if self._kvtier_manager is not None and not self._kvtier_events:
            return ()  # neither vLLM's tracker nor kvtier's tiers record any
        return super().take_events()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._kvtier_manager is not None and not store_planning.has_worker_news(
            self.connector_scheduler, connector_output
        ):
            return  # vLLM's would read an empty worker metadata and change nothing
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        failed = getattr(meta, "failed_store_jobs", None)
        if failed and self._kvtier_manager is not None:
            for job_id in failed:
                keys = compat.PORT.store_job_keys(self, job_id)
                if keys is not None:
                    # Dropped now; vLLM's completion of the job then finds nothing stored.
                    self._kvtier_manager.fail_store(keys)
                    if not self._store_failure_logged:
                        self._store_failure_logged = True
                        logger.warning(
                            "kvtier: a store to the host tier failed on a worker; its blocks "
                            "are dropped, never loaded (further failures are counted in "
                            "vllm:kvtier_host_store_failures)"
                        )
        super().update_connector_output(connector_output)
