"""What the tier manager counts for the metrics (no vLLM import): its cumulative
counters (:class:`TierCounters`), and what vLLM's tiering metrics say of one secondary
tier beside the tier's own counters (:class:`TierFlow`): back-pressure (stores and
blocks dropped, the store latency EMA) and the delays of its lookups, kept until the
metrics take them.

The meanings are those of vLLM's ``TieringOffloadingMetrics``:

* a lookup's **sync delay**: the time the scheduler spent in one tier lookup that
  answered hit or miss;
* its **async delay**: for a lookup first answered "not known yet" (a store tier asking
  its store in the background), the time from that first answer to the hit or miss;
* a **dropped store**: one device store's write-through to this tier with at least one
  block not written (no room behind the write backlog, the tier full or down), and its
  **dropped blocks**;
* the **store latency EMA**: seconds per MiB of the tier's completed writes, averaged
  over the first ``EMA_WARMUP`` writes (0 until then), then moved by ``EMA_ALPHA`` per
  write, as vLLM's back-pressure detector keeps it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

EMA_ALPHA = 0.15
EMA_WARMUP = 10
MIB = 1 << 20
# Delays kept until the metrics take them (a manager run without metrics keeps no more).
MAX_DELAYS = 4096


@dataclass
class TierFlow:
    """Back-pressure and lookup delays of one secondary tier (cumulative counts; delays
    until :meth:`take_delays`)."""

    stores_dropped: int = 0
    blocks_dropped: int = 0
    store_latency_ema: float = 0.0
    writes_completed: int = 0
    sync_delays: list[float] = field(default_factory=list)
    async_delays: list[float] = field(default_factory=list)
    _warmup: list[float] = field(default_factory=list)
    lookups: int = 0  # lookups answered (hit or miss)
    last_sync: float = 0.0  # the last one's delay

    def dropped(self, blocks: int) -> None:
        """A store's write-through to this tier left ``blocks`` blocks unwritten."""
        if blocks > 0:
            self.stores_dropped += 1
            self.blocks_dropped += blocks

    def write_completed(self, seconds: float, nbytes: int) -> None:
        """A write of ``nbytes`` took ``seconds``: moves the EMA."""
        self.write_each_completed(((seconds, nbytes),))

    def write_each_completed(self, writes: Sequence[tuple[float, int]]) -> None:
        """:meth:`write_completed` of each (seconds, nbytes) of ``writes``, in order, in
        one call (a poll's writes). A write of no bytes moves nothing."""
        ema, done, warmup = self.store_latency_ema, self.writes_completed, self._warmup
        keep = 1 - EMA_ALPHA
        for seconds, nbytes in writes:
            if nbytes <= 0:
                continue
            per_mib = seconds / (nbytes / MIB)
            done += 1
            if done <= EMA_WARMUP:
                warmup.append(per_mib)
                if done == EMA_WARMUP:
                    ema = sum(warmup) / EMA_WARMUP
                    warmup = []
                continue
            ema = EMA_ALPHA * per_mib + keep * ema
        self.store_latency_ema, self.writes_completed, self._warmup = ema, done, warmup

    def looked_up(self, sync: float, since: float | None, now: float) -> None:
        """A lookup answered hit or miss after ``sync`` seconds; ``since``: when the same
        lookup was first answered "not known yet" (None if it was not)."""
        self.lookups += 1
        self.last_sync = sync
        if len(self.sync_delays) < MAX_DELAYS:
            self.sync_delays.append(sync)
        if since is not None and len(self.async_delays) < MAX_DELAYS:
            self.async_delays.append(now - since)

    @property
    def has_delays(self) -> bool:
        return bool(self.sync_delays or self.async_delays)

    def take_delays(self) -> tuple[list[float], list[float]]:
        """The sync and async delays since the last call."""
        taken = self.sync_delays, self.async_delays
        self.sync_delays, self.async_delays = [], []
        return taken


@dataclass
class TierCounters:
    """Cumulative counters of the manager (blocks unless named otherwise)."""

    host_queries: int = 0
    host_hits: int = 0
    store_failures: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    promotion_allocation_failures: int = 0
    promotions_deferred: int = 0
    promoted_ahead: int = 0  # promotions for requests vLLM has not admitted yet
    writes_submitted: int = 0
    writes_dropped: int = 0
    write_failures: int = 0
    jobs_submitted: int = 0
    allocation_sizes: list[int] = field(default_factory=list)
