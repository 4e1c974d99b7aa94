"""The secondary tiers' jobs, as the tier manager runs them: write-throughs held for
each tier, one job per tier, operation and request submitted at the end of a pass or
step, and the tiers' results applied to the host tier. No vLLM import.

:class:`TierJobs` is a part of :class:`~kvtier.tiering_spec.manager.TierManager`, on the
manager's own state (declared below).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvtier.blockpool import Hold, HostBlockPool
from kvtier.tiering_spec.tier_flow import TierCounters, TierFlow
from kvtier.tiering_spec.tiers.base import SecondaryTier, TierFault, TierJob, TierResult


class TierJobs:
    """Submitting the secondary tiers' jobs and applying their results."""

    # The manager's state these methods use (see TierManager.__init__).
    pool: HostBlockPool
    secondary_tiers: list[SecondaryTier]
    max_write_backlog: int
    counters: TierCounters
    flows: list[TierFlow]
    _queued: dict[tuple[int, str, str], list[tuple[bytes, bytes, int]]]
    _write_drops: dict[tuple[int, str], int]
    _stores: int
    _job_ids: Iterator[int]
    _promoting: dict[bytes, int]
    _load_sources: OrderedDict[bytes, str]
    _refused: OrderedDict[bytes, int]
    _fresh: OrderedDict[bytes, int]
    _step: int

    def _digest_all(self, keys: Sequence[bytes]) -> list[bytes]:
        raise NotImplementedError

    def _leave_room(self, key: bytes) -> None:
        raise NotImplementedError

    def _write_through(self, keys: Sequence[bytes]) -> None:
        """Hold the new blocks for each tier's write now; submit them as one job per
        tier at the end of the step."""
        pool = self.pool
        self._stores += 1
        store = f"store-{self._stores}"
        contains = pool.contains
        cached = [key for key in keys if contains(key)]
        present = list(zip(cached, self._digest_all(cached)))
        for idx, tier in enumerate(self.secondary_tiers):
            has = tier.has
            wanted = [(key, digest) for key, digest in present if not has(digest)]
            room = max(0, self.max_write_backlog - pool.held(Hold.TIER_WRITE))
            dropped = max(0, len(wanted) - room)
            if dropped:
                self.counters.writes_dropped += dropped
                del wanted[room:]
            if wanted:
                blocks = pool.hold([key for key, _ in wanted], Hold.TIER_WRITE)
                self._queued[(idx, "write", store)] = [
                    (key, digest, block) for (key, digest), block in zip(wanted, blocks)
                ]
                if dropped:  # counted with what the tier drops of the job (flush)
                    self._write_drops[(idx, store)] = dropped
            else:
                self.flows[idx].dropped(dropped)

    def flush(self) -> None:
        """Submit what waits: one job per tier, operation and request (or device store).
        A read a tier refuses gives its reserved block back and its key a MISS for
        ``FRESH_STEPS`` steps; a refused write releases its hold."""
        if not self._queued:
            return
        queued, self._queued = self._queued, {}
        pool = self.pool
        jobs = [
            (idx, TierJob(next(self._job_ids), op, request, items))
            for (idx, op, request), items in queued.items()
        ]
        together = self._submit_writes_together(jobs) if len(jobs) > 1 else {}
        for idx, job in jobs:
            op, request, items = job.op, job.request, job.items
            tier = self.secondary_tiers[idx]
            refused_before = tier.stats.writes_dropped
            started = together.get(job.id)
            if started is None:
                started = tier.submit(job)
            self.counters.jobs_submitted += 1
            if op == "write":
                drops = self._write_drops.pop((idx, request), 0) if self._write_drops else 0
                self.flows[idx].dropped(drops + tier.stats.writes_dropped - refused_before)
            n_started = sum(map(bool, started))
            if op == "read":
                self.counters.promotions += n_started
            else:
                self.counters.writes_submitted += n_started
            if n_started == len(items):
                continue  # (most jobs: every item started)
            for (key, _digest, _block), ok in zip(items, started):
                if ok:
                    continue
                if op == "read":
                    if self._promoting.pop(key, None) is not None:
                        pool.complete_store([key], success=False)
                        self._leave_room(key)
                    self._load_sources.pop(key, None)
                    self._refused[key] = self._step
                else:
                    pool.release([key], Hold.TIER_WRITE)

    def _submit_writes_together(self, jobs: list[tuple[int, TierJob]]) -> dict[int, list[bool]]:
        """Each tier's write jobs of ``jobs``, where it has several, submitted together
        (``SecondaryTier.submit_all``): the started flags by job id of those it took.
        Each job is still its own: its id, items, results and counters."""
        writes: dict[int, list[TierJob]] = {}
        for idx, job in jobs:
            if job.op == "write":
                writes.setdefault(idx, []).append(job)
        out: dict[int, list[bool]] = {}
        for idx, group in writes.items():
            # (A tier of another package that has no submit_all takes them one by one.)
            submit_all = getattr(self.secondary_tiers[idx], "submit_all", None)
            if len(group) > 1 and submit_all is not None:
                started = submit_all(group)
                if started is not None:
                    out.update(zip((job.id for job in group), started))
        return out

    # ------------------------------------------------------------------ completion

    def poll(self) -> bool:
        """Apply the secondary tiers' finished reads and writes to the host tier (each
        result labelled with its job; a job whose items are all back is over, the tier's
        to count). Every tier with news is polled, jobs in flight or not: a poll also
        takes in what the tier found on its own (a start-up scan, files other engines
        wrote, probe answers). Whether some tier had news."""
        pool = self.pool
        news = False
        for idx, tier in enumerate(self.secondary_tiers):
            if not getattr(tier, "has_news", True):
                continue  # (most steps: nothing finished, nothing found)
            news = True
            results = tier.results()
            written: dict[bytes, int] = {}  # write holds to end, ended together below
            try:
                self._apply(results, written, self.flows[idx])
            finally:
                if written:
                    pool.release(
                        [key for key, n in written.items() for _ in range(n)], Hold.TIER_WRITE
                    )
        return news

    def _apply(self, results: list[TierResult], written: dict[bytes, int], flow: TierFlow) -> None:
        """Apply one tier's ``results`` (see :meth:`poll`); the write holds to end are
        counted into ``written``, completed writes into the tier's ``flow``. Promotions
        that landed are applied together, in their order, before any other result."""
        pool = self.pool
        if results and all(res.op == "write" and res.ok for res in results):
            self._writes_applied(results, written, flow)  # (most polls: writes alone)
            return
        landed: list[bytes] = []  # promotions read back, not applied yet
        for res in results:
            op, key = res.op, res.key
            if op == "write":
                # (A write of the pool before a reset holds nothing in this one.)
                ended = written.get(key, 0)
                if pool.holds(key, Hold.TIER_WRITE) > ended:
                    written[key] = ended + 1
                if not res.ok:
                    self.counters.write_failures += 1
                else:
                    flow.write_completed(res.seconds, res.nbytes)
                continue
            if op == "read" and res.ok and res.fault is None:
                if self._promoting.pop(key, None) is not None:
                    landed.append(key)
                continue
            if landed:
                self._landed(landed)
                landed = []
            if op == "release":  # a timed-out read's late call is over
                if pool.holds(key, Hold.LATE_READ):
                    pool.release([key], Hold.LATE_READ)
                    pool.complete_store([key], success=False)
                continue
            if op == "read":
                if self._promoting.pop(key, None) is None:
                    continue
                if not res.ok:
                    self._leave_room(key)
                if res.fault == TierFault.TIMEOUT:
                    # The call may still write into the block: keep it reserved
                    # until the tier releases it; the lookup misses meanwhile.
                    if pool.is_storing(key):
                        pool.hold([key], Hold.LATE_READ)
                    self.counters.promotion_failures += 1
                    self._load_sources.pop(key, None)
                    continue
                if res.ok:  # (with a fault that did not fail it)
                    self._landed([key])
                    continue
                pool.complete_store([key], success=False)
                self.counters.promotion_failures += 1
                self._load_sources.pop(key, None)
        if landed:
            self._landed(landed)

    def _writes_applied(
        self, results: list[TierResult], written: dict[bytes, int], flow: TierFlow
    ) -> None:
        """:meth:`_apply` of writes that all succeeded, in one pass: the same holds to
        end and the same EMA as one result at a time (nothing else moves the write holds
        while a poll's results are applied)."""
        keys = [res.key for res in results]
        get = written.get
        for key, held in zip(keys, self.pool.holds_each(keys, Hold.TIER_WRITE)):
            ended = get(key, 0)
            if held > ended:
                written[key] = ended + 1
        flow.write_each_completed([(res.seconds, res.nbytes) for res in results])

    def _landed(self, keys: list[bytes]) -> None:
        """Promotions of ``keys`` (in the order they landed, their blocks read) are
        readable: what applying them one by one does. A promotion is a use (a request
        asked for the key), for every policy: one that scores by use keeps it above keys
        nobody asked for lately, so promotions do not evict each other. Each is held
        (Hold.PROMOTION) until vLLM loads it."""
        pool = self.pool
        pool.complete_store(keys)
        # (touch makes its first key the most recently used: the last one landed.)
        pool.touch(keys[::-1])
        fresh, step = self._fresh, self._step
        new = [key for key in keys if key not in fresh]
        if new:
            pool.hold(new, Hold.PROMOTION)
            for key in new:
                fresh[key] = step

    # ------------------------------------------------------------------ in flight

    def has_pending_work(self) -> bool:
        """Whether tier jobs wait or are in flight (the engine must keep stepping)."""
        return bool(self._queued) or any(t.in_flight for t in self.secondary_tiers)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every fs job (at most ``timeout`` seconds in all); False if some
        are still running (counted as ``timeout`` faults of their tiers)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.flush()
        done = True
        for tier in self.secondary_tiers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done = tier.drain(left) and done
        self.poll()
        return done
