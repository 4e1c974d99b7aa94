"""vLLM's ``OffloadingWorker`` over kvtier's :class:`~kvtier.tiering_spec.worker.
OffloadTransferWorker`: vLLM's store and load jobs, and the failures it is told of."""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.kv_offload.base import (
    GPULoadStoreSpec,
    LoadStoreSpec,
)

from kvtier.tiering_spec import vllm_compat as compat
from kvtier.tiering_spec.worker import OffloadTransferWorker

logger = logging.getLogger("kvtier.tiering_spec")


class KvtierOffloadingWorker:
    """vLLM's ``OffloadingWorker`` over :class:`OffloadTransferWorker` (it counts as one:
    :func:`.vllm_compat.stand_in_for_vllms_worker`).

    vLLM asserts that every transfer succeeds. Under kvtier's connector
    (:mod:`kvtier.tiering_spec.connector`, which sets ``failures_reported``), a job
    that fails (a plan the copy engine refuses, a failed copy) is reported to vLLM as
    done and to the connector as failed: a failed load's device blocks are recomputed,
    a failed store's host blocks are never read. Without it, a failure reaches vLLM.
    """

    def __init__(self, core: OffloadTransferWorker, *, store: bool = True) -> None:
        self.core = core
        # False on ranks other than 0 of a replicated layout: vLLM 0.32 and 0.33 send
        # them no stores; a release that did would have them rewrite rank 0's copy.
        self.store = store
        self.failures_reported = False
        self._skipped: list[int] = []
        self._refused: list[int] = []
        self._load_blocks: dict[int, list[int]] = {}  # load job -> device block ids
        self._failed_loads: dict[int, list[int]] = {}  # failed load job -> device block ids
        self._failed_stores: list[int] = []
        self._logged: set[str] = set()

    def _refuse(self, job_id: int, what: str, exc: Exception) -> None:
        if not self.failures_reported:
            raise exc
        if what not in self._logged:
            self._logged.add(what)
            logger.error(
                "kvtier: a %s plan was refused by the copy engine (%s: %s); that transfer "
                "failed and is recomputed. Further refusals are only counted.",
                what,
                type(exc).__name__,
                exc,
            )
        self._refused.append(job_id)

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        if not self.store:
            # Acknowledged as done: the scheduler waits for every rank's report of a job.
            self._skipped.append(job_id)
            return True
        try:
            self.core.submit_store(
                job_id,
                src_spec.block_ids.tolist(),
                list(src_spec.group_sizes),
                list(src_spec.block_indices),
                dst_spec.block_ids.tolist(),  # type: ignore[attr-defined]
            )
        except Exception as exc:
            self._refuse(job_id, "store", exc)
        return True

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,  # vLLM 0.33: a load vLLM waits for at once; all start at once
    ) -> bool:
        device_ids = dst_spec.block_ids.tolist()
        self._load_blocks[job_id] = device_ids
        try:
            self.core.submit_load(
                job_id,
                src_spec.block_ids.tolist(),  # type: ignore[attr-defined]
                device_ids,
                list(dst_spec.group_sizes),
                list(dst_spec.block_indices),
            )
        except Exception as exc:
            self._refuse(job_id, "load", exc)
        return True

    def get_finished(self) -> list[Any]:
        if not (self._skipped or self._refused or self.core.busy):
            return []  # vLLM asks every step; most steps have no job in flight
        skipped, self._skipped = self._skipped, []
        refused, self._refused = self._refused, []
        done = [(j, True, 0, 0.0) for j in skipped] + [(j, False, 0, 0.0) for j in refused]
        done += [(j.job_id, j.ok, j.nbytes, j.seconds) for j in self.core.get_finished()]
        results = []
        for job_id, ok, nbytes, seconds in done:
            device_ids = self._load_blocks.pop(job_id, None)
            if not ok and self.failures_reported:
                ok = True  # for vLLM, which asserts; the connector learns the truth
                if device_ids is not None:
                    self._failed_loads[job_id] = device_ids
                else:
                    self._failed_stores.append(job_id)
            results.append(compat.PORT.transfer_result(job_id, ok, nbytes, seconds))
        return results

    @property
    def quiet(self) -> bool:
        """Whether there is nothing to report: no job in flight, none skipped, refused or
        failed and not yet taken (most steps). vLLM's ``get_finished`` then finds nothing."""
        return not (
            self.core.busy
            or self._skipped
            or self._refused
            or self._failed_loads
            or self._failed_stores
        )

    @property
    def has_failed_loads(self) -> bool:
        """Whether :meth:`take_failed_loads` has something to take."""
        return bool(self._failed_loads)

    def take_failed_loads(self) -> dict[int, list[int]]:
        """Load jobs that failed since the last call, with their device block ids: the
        connector reports the blocks, or the jobs' requests, for vLLM to recompute."""
        failed, self._failed_loads = self._failed_loads, {}
        return failed

    def take_failed_stores(self) -> list[int]:
        """Store jobs that failed since the last call (their host blocks hold no KV)."""
        failed, self._failed_stores = self._failed_stores, []
        return failed

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        self.core.shutdown()
