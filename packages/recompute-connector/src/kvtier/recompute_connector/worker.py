"""The worker side: host memory for one rank's KV shard, and the copies of each step.

:class:`RecomputeOffloadWorker` owns a private :class:`kvtier.blockpool.HostRegion`
sized from the rank's budget and a :class:`kvtier.npu_copy.TransferEngine` over the
engine's KV tensors. It runs what the scheduler's :class:`StepPlan` says and reports
every job's outcome back (:class:`WorkerReport`).

Order within one engine step (vLLM's model runner):

1. ``run_stores`` (from ``handle_preemptions``, before the runner updates its state,
   zeroes new blocks or runs the forward): each store is issued after everything already
   on the compute stream, and the compute stream is made to wait for it, so nothing
   later in the step (block zeroing, copy-on-write, the forward writing a reused block)
   can overwrite a preempted request's blocks before they are copied. No device-wide
   synchronize; on the CPU backend the wait blocks until the copy is done.
2. ``run_loads`` (from ``start_load_kv``, before the forward when the step has loads):
   the compute stream waits for each load before the forward reads the blocks.
3. ``take_report`` (from ``build_connector_worker_meta``, end of step): waits for the
   step's copies (already ordered before the forward, so this costs at most the copy
   itself) and reports them; ``load_errors`` gives the device blocks of failed loads
   so vLLM recomputes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier.blockpool import HostBudget, HostRegion
from kvtier.npu_copy import KVLayout, TransferEngine, TransferHandle
from kvtier.recompute_connector.config import STAGING_KEY, RecomputeOffloadConfig
from kvtier.recompute_connector.protocol import StepPlan, TransferJob, WorkerReport

logger = logging.getLogger("kvtier.recompute_connector")


@dataclass
class TransferStats:
    """Bytes, blocks and seconds moved per direction since the last ``take_stats``."""

    bytes: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    blocks: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"d2h": 0.0, "h2d": 0.0})
    failures: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})

    def is_empty(self) -> bool:
        return not any(self.blocks.values()) and not any(self.failures.values())


@dataclass
class _Pending:
    kind: str  # "store" | "load"
    job: TransferJob
    handle: TransferHandle | None  # None: failed before a copy was issued
    started: float


class RecomputeOffloadWorker:
    """One rank's host copy of preempted requests' KV.

    Args:
        config: validated settings.
        bytes_per_block: bytes of one device block over all KV tensors of this rank
            (the scheduler computes the same figure, so both get the same block count).
        rank: this worker's rank, for logs.
        log: logger for user-visible lines.
    """

    def __init__(
        self,
        config: RecomputeOffloadConfig,
        *,
        bytes_per_block: int,
        rank: int = 0,
        log: logging.Logger | None = None,
    ) -> None:
        self.config = config
        self.rank = rank
        self.log = log or logger
        self.budget: HostBudget = config.resolve_budget(bytes_per_block)
        self.region: HostRegion | None = None
        self.engine: TransferEngine | None = None
        self._pending: list[_Pending] = []
        self._report = WorkerReport()
        self._load_errors: set[int] = set()
        # Restores that fail as whole requests (set by the connector for models with
        # several KV cache groups, whose restores vLLM waits for asynchronously).
        self.request_level_loads = False
        self._loaded: set[str] = set()
        self._failed_loads: set[str] = set()
        self.stats = TransferStats()
        self._moved = False  # whether self.stats holds anything since take_stats
        self.unsupported = ""  # why the KV tensors could not be registered, if they could not

    @property
    def num_host_blocks(self) -> int:
        return self.budget.num_blocks

    def register_kv_caches(self, kv_caches: Any, num_blocks: int | None = None) -> None:
        """Describe the engine's KV tensors and allocate this rank's host region.

        KV tensors the copy engine cannot lay out as blocks (or whose block is larger
        than the host block the scheduler counted) do not stop the engine: one line
        says why, no host memory is taken, and every store fails, so vLLM recomputes
        every preempted request.
        """
        try:
            layout = KVLayout.from_kv_caches(kv_caches, num_blocks)
            if layout.block_bytes > self.budget.block_bytes:
                raise ValueError(
                    f"a device block holds {layout.block_bytes} bytes in the registered KV "
                    f"tensors but the KV cache config says {self.budget.block_bytes}"
                )
        except ValueError as exc:
            self.unsupported = str(exc)
            self.log.warning(
                "kvtier: RecomputeCPUOffloadConnector rank %d cannot copy this model's KV "
                "cache (%s); preempted requests will be recomputed",
                self.rank,
                exc,
            )
            return
        self.region = HostRegion.private(self.budget.num_blocks, self.budget.block_bytes)
        try:
            self.engine = TransferEngine(
                layout, self.region.blocks, staging_bytes=self.config.device_staging_bytes
            )
        except ValueError as exc:
            if "staging_bytes" in str(exc):
                raise ValueError(f"kv_connector_extra_config {STAGING_KEY}: {exc}") from exc
            raise
        self.log.info(
            "kvtier: RecomputeCPUOffloadConnector worker rank %d: %s; %d device blocks of "
            "%d bytes over %d KV segments, %s copies",
            self.rank,
            self.budget.describe(),
            layout.num_blocks,
            layout.block_bytes,
            len(layout.segments),
            self.engine.backend,
        )

    # ------------------------------------------------------------------ one step

    def run_stores(self, jobs: Sequence[TransferJob]) -> None:
        """Copy preempted requests' device blocks to host, ordered before the step's
        later work on the compute stream."""
        for job in jobs:
            self._submit("store", job)

    def run_loads(self, plan: StepPlan) -> None:
        """Copy resumed requests' host blocks to their new device blocks; the compute
        stream waits for them before the forward."""
        if self.request_level_loads:
            self._failed_loads.update(plan.unrestorable_requests)
        else:
            self._load_errors.update(plan.unrestorable_device_blocks)
        for job in plan.loads:
            self._submit("load", job)

    def _submit(self, kind: str, job: TransferJob) -> None:
        started = time.perf_counter()
        engine = self.engine
        handle: TransferHandle | None = None
        if engine is not None:
            try:
                if kind == "store":
                    handle = engine.store(job.device_block_ids, job.host_block_ids)
                else:
                    handle = engine.load(job.host_block_ids, job.device_block_ids)
                engine.make_compute_wait(handle)
            except Exception as exc:  # a bad plan must cost a recompute, not the engine
                self.log.error(
                    "kvtier: %s for request %s could not be issued: %s", kind, job.req_id, exc
                )
                handle = None
        self._pending.append(_Pending(kind, job, handle, started))

    def _collect(self) -> None:
        """Wait for this step's copies and record their outcomes."""
        if not self._pending:
            return  # no copy this step (most steps)
        self._moved = True
        pending, self._pending = self._pending, []
        block_bytes = self.engine.layout.block_bytes if self.engine is not None else 0
        for p in pending:
            ok = p.handle.wait() if p.handle is not None else False
            direction = "d2h" if p.kind == "store" else "h2d"
            self._report.record(p.kind, p.job.job_id, ok)
            if p.kind == "load" and self.request_level_loads:
                (self._loaded if ok else self._failed_loads).add(p.job.req_id)
            if ok:
                n = len(p.job.device_block_ids)
                self.stats.blocks[direction] += n
                self.stats.bytes[direction] += n * block_bytes
                self.stats.seconds[direction] += time.perf_counter() - p.started
            else:
                self.stats.failures[direction] += 1
                if p.kind == "load" and not self.request_level_loads:
                    self._load_errors.update(p.job.device_block_ids)
                error = (
                    p.handle.error
                    if p.handle is not None
                    else self.unsupported or "the copy could not be issued"
                )
                self.log.warning(
                    "kvtier: rank %d: %s of %d blocks for request %s failed (%s); "
                    "vLLM recomputes it",
                    self.rank,
                    p.kind,
                    len(p.job.device_block_ids),
                    p.job.req_id,
                    error,
                )

    def load_errors(self) -> set[int]:
        """Device blocks whose restore failed in this step (vLLM recomputes them)."""
        self._collect()
        if not self._load_errors:
            return set()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """With request-level loads: the requests whose restore finished since the last
        call, and those of them whose restore failed (vLLM recomputes them). Every copy
        of this rank has landed when this returns, so vLLM may reuse the blocks."""
        self._collect()
        failed, self._failed_loads = self._failed_loads, set()
        loaded, self._loaded = self._loaded, set()
        return loaded | failed, failed

    def take_report(self) -> WorkerReport | None:
        """Outcomes of every copy finished since the last call, or None."""
        self._collect()
        if self._report.is_empty():
            return None
        report, self._report = self._report, WorkerReport()
        return report

    def take_stats(self) -> TransferStats | None:
        if not self._moved:
            return None  # nothing copied since the last call
        self._moved = False
        stats, self.stats = self.stats, TransferStats()
        return None if stats.is_empty() else stats

    def close(self) -> None:
        """Finish copies in flight and release the host region."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
        if self.region is not None:
            self.region.close()
            self.region = None
