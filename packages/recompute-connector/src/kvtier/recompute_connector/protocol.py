"""What the scheduler side tells the workers each step, and what the workers report back.

Plain dataclasses (no vLLM, no torch) so they cross process boundaries with pickle or
msgpack and can be built in unit tests. Units: block ids are device or host block
indices; tokens are tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TransferJob:
    """One request's copy: ``device_block_ids[i]`` <-> ``host_block_ids[i]``.

    Attributes:
        job_id: unique per scheduler, so a late report can never be taken for another job.
        req_id: the request.
        device_block_ids: device blocks, null blocks already left out.
        host_block_ids: host blocks, pairwise with ``device_block_ids``.
        num_tokens: tokens of KV the job carries (for logs and stats).
        state_host_block_ids: the host blocks among ``host_block_ids`` that hold a
            recurrent state (linear attention, Mamba) rather than per-token KV.
    """

    job_id: int
    req_id: str
    device_block_ids: list[int]
    host_block_ids: list[int]
    num_tokens: int
    state_host_block_ids: list[int] = field(default_factory=list)


@dataclass
class StepPlan:
    """The scheduler's instructions for one engine step.

    Attributes:
        stores: device -> host copies of requests preempted this step; the worker runs
            them in ``handle_preemptions``, before anything in the step writes KV.
        loads: host -> device copies of requests resumed this step; the worker runs them
            in ``start_load_kv`` and makes the forward wait for them.
        unrestorable_device_blocks: device blocks the scheduler counted as restored but
            has no host copy for; the worker reports them as failed loads so vLLM
            recomputes them (never expected; a guard).
        unrestorable_requests: the requests those blocks belong to, for restores that
            fail as whole requests (models with several KV cache groups).
    """

    stores: list[TransferJob] = field(default_factory=list)
    loads: list[TransferJob] = field(default_factory=list)
    unrestorable_device_blocks: list[int] = field(default_factory=list)
    unrestorable_requests: list[str] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.stores or self.loads or self.unrestorable_device_blocks)


@dataclass
class WorkerReport:
    """Outcomes of finished jobs, summed over the ranks that report in one step.

    ``stores[job_id] == [ranks_ok, ranks_failed]``, same for ``loads``. The scheduler
    side counts a job done when ``ranks_ok + ranks_failed`` reaches the world size.
    """

    stores: dict[int, list[int]] = field(default_factory=dict)
    loads: dict[int, list[int]] = field(default_factory=dict)

    def record(self, kind: str, job_id: int, ok: bool) -> None:
        table = self.stores if kind == "store" else self.loads
        counts = table.setdefault(job_id, [0, 0])
        counts[0 if ok else 1] += 1

    def merge(self, other: WorkerReport) -> WorkerReport:
        """Add ``other``'s counts into this report (ranks of one step) and return it."""
        for mine, theirs in ((self.stores, other.stores), (self.loads, other.loads)):
            for job_id, (ok, failed) in theirs.items():
                counts = mine.setdefault(job_id, [0, 0])
                counts[0] += ok
                counts[1] += failed
        return self

    def is_empty(self) -> bool:
        return not (self.stores or self.loads)
