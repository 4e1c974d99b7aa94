"""kvtier's metric values: a :class:`TierManager`'s cumulative counters turned into the
per-interval rows vLLM's connector stats carry (no vLLM import). The names are
:mod:`kvtier.tiering_spec.metrics`'."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.metrics import (
    ACTIVE_CASCADE_JOBS,
    ACTIVE_PROMOTION_JOBS,
    BLOCKS_DROPPED,
    CASCADE_JOB_FAILURES,
    CHUNK_HITS,
    CHUNK_QUERIES,
    CPU_ALLOCATION_SIZE,
    CPU_CACHE_READ_USAGE_PERC,
    CPU_CACHE_USAGE_PERC,
    CPU_CACHE_WRITE_USAGE_PERC,
    FS_EVICTIONS,
    FS_FAULTS,
    FS_USED_BYTES,
    HOST_HITS,
    HOST_QUERIES,
    HOST_STORE_FAILURES,
    HOST_TIER,
    LOOKUP_ASYNC_DELAY,
    LOOKUP_SYNC_DELAY,
    PRIMARY_READ_USAGE_PERC,
    PRIMARY_WRITE_USAGE_PERC,
    PROMOTION_ALLOCATION_FAILURES,
    PROMOTION_JOB_FAILURES,
    READ_BYTES,
    READ_TIME,
    STORE_LATENCY_EMA,
    STORES_DROPPED,
    STORES_SKIPPED,
    TIER_EVICTIONS,
    TIER_FAULTS,
    TIER_USED_BYTES,
    TRAFFIC_DROPPED,
    WRITE_BYTES,
    WRITE_TIME,
)
from kvtier.tiering_spec.tiers.base import FAULT_KINDS

# Reported on every call, as vLLM's CPUOffloadingManager does (its stats are never None).
ALWAYS_GAUGES = (CPU_CACHE_USAGE_PERC, CPU_CACHE_WRITE_USAGE_PERC, CPU_CACHE_READ_USAGE_PERC)
# The leading fields of MetricsEmitter._signature that only the host tier's rows read.
_HOST_FIELDS = 8


class StatsSink(Protocol):
    """Where :meth:`MetricsEmitter.write_changed` writes (vLLM's
    ``OffloadingConnectorStats`` has these three methods)."""

    def set_gauge(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...

    def increase_counter(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...

    def observe_histogram(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...


def write_rows(rows: Iterable[tuple[str, str, Any, tuple[str, ...]]], sink: StatsSink) -> None:
    """Write (kind, name, value, label values) rows into ``sink``; counters that did
    not move are left out."""
    for kind, name, value, labels in rows:
        if kind == "counter":
            if value:
                sink.increase_counter(name, value, labels)
        elif kind == "gauge":
            sink.set_gauge(name, value, labels)
        else:
            sink.observe_histogram(name, value, labels)


class MetricsEmitter:
    """Turns a :class:`TierManager`'s cumulative counters into per-interval values."""

    def __init__(self, core: TierManager, *, tiering: bool, traffic: Any = None) -> None:
        self.core = core
        self.tiering = tiering
        self.traffic = traffic  # the TrafficRecorder, if the traffic is recorded
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}
        self._gauges: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._signed: tuple[Any, ...] | None = None
        self._pending: tuple[Any, ...] | None = None  # a signature quiet_gauges found new
        self._faults_seen: dict[str, int] = {}  # tier name -> its fault count at the last rows

    def _delta(self, name: str, labels: tuple[str, ...], total: float) -> float:
        key = (name, labels)
        prev = self._last.get(key, 0)
        self._last[key] = total
        return total - prev

    def collect(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        """(kind, name, value, label values) of what changed since the last call: counters
        as increments (none that stayed), gauges whose value moved (each once at first);
        the host tier's usage gauges and its stores-skipped counter every time, as vLLM's
        own manager reports them.

        vLLM asks for them every engine step; on most steps nothing changed, and then
        there is nothing for vLLM to aggregate and export."""
        quiet = self.quiet_gauges()
        if quiet is None:
            yield from self.collect_changed()
            return
        for name, value in quiet:
            yield "gauge", name, value, ()
        if self.core.admission is not None:
            yield "counter", STORES_SKIPPED, 0, ()

    def quiet_gauges(self) -> list[tuple[str, Any]] | None:
        """When nothing changed since the last call (most engine steps): the gauges
        vLLM's manager reports every time, with their values, as :meth:`collect` would
        yield them (a zero counter adds nothing to vLLM's stats). Otherwise None, and
        :meth:`collect_changed` yields what changed."""
        signature = self._signature()
        if signature != self._signed or self._samples_waiting():
            self._pending = signature
            return None
        gauges = self._gauges
        return [(name, gauges[(name, ())]) for name in ALWAYS_GAUGES]

    def collect_changed(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        """:meth:`collect` after :meth:`quiet_gauges` returned None."""
        signature, self._pending = self._pending, None
        return self._changed(self._signature() if signature is None else signature)

    def write_changed(self, sink: StatsSink) -> None:
        """:meth:`collect_changed` after :meth:`quiet_gauges` returned None, written into
        ``sink`` (counters that did not move left out). Where only the host tier's
        counters and gauges moved (most steps that store or admit), its rows are written
        directly, without building rows for the tiers."""
        signature, self._pending = self._pending, None
        if signature is None:
            signature = self._signature()
        signed = self._signed
        if (
            signed is None
            or signature[_HOST_FIELDS:] != signed[_HOST_FIELDS:]
            or any(flow.has_delays for flow in self.core.flows)
        ):
            write_rows(self._changed(signature), sink)
            return
        self._signed = signature
        gauges, last = self._gauges, self._last
        for name, value in self._host_gauges():
            gauges[(name, ())] = value
            sink.set_gauge(name, value, ())
        for size in self.core.take_allocation_sizes():
            sink.observe_histogram(CPU_ALLOCATION_SIZE, size, ())
        for name, labels, total in self._host_totals():
            key = (name, labels)
            step = total - last.get(key, 0)
            if step:
                last[key] = total
                sink.increase_counter(name, step, labels)

    def _samples_waiting(self) -> bool:
        """Whether histogram samples wait to be emitted (taken as they are)."""
        core = self.core
        return bool(core.counters.allocation_sizes) or any(f.has_delays for f in core.flows)

    def _host_gauges(self) -> tuple[tuple[str, float], ...]:
        """The host tier's usage gauges (name, value), as vLLM's manager computes them."""
        pool = self.core.pool
        capacity = pool.num_blocks
        cap = capacity or 1
        write = pool.num_storing / cap
        read = min(pool.num_read_pinned, capacity) / cap
        return (
            (CPU_CACHE_USAGE_PERC, min(1.0, write + read)),
            (CPU_CACHE_WRITE_USAGE_PERC, write),
            (CPU_CACHE_READ_USAGE_PERC, read),
        )

    def _host_totals(self) -> list[tuple[str, tuple[str, ...], float]]:
        """(name, label values, cumulative total) of the counters the host tier's
        fields of the signature move, in the order :meth:`_rows` emits them."""
        core = self.core
        c = core.counters
        totals: list[tuple[str, tuple[str, ...], float]] = [
            (HOST_QUERIES, (), c.host_queries),
            (HOST_HITS, (), c.host_hits),
            (HOST_STORE_FAILURES, (), c.store_failures),
        ]
        if self.traffic is not None:
            totals.append((TRAFFIC_DROPPED, (), self.traffic.dropped))
        if core.admission is not None:
            totals.append((STORES_SKIPPED, (), core.admission.stores_skipped))
        if self.tiering:
            totals.append((PROMOTION_ALLOCATION_FAILURES, (), c.promotion_allocation_failures))
            totals.append((CHUNK_QUERIES, (HOST_TIER,), c.host_queries))
            totals.append((CHUNK_HITS, (HOST_TIER,), c.host_hits))
        return totals

    def _changed(
        self, signature: tuple[Any, ...]
    ) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        self._signed = signature
        gauges = self._gauges
        for row in self._rows():
            kind, name, value, labels = row
            if name in ALWAYS_GAUGES or name == STORES_SKIPPED:
                if kind == "gauge":
                    gauges[(name, labels)] = value
            elif kind == "counter":
                if not value:
                    continue
            elif kind == "gauge":
                key = (name, labels)
                if key in gauges and gauges[key] == value:
                    continue
                gauges[key] = value
            yield row

    def _signature(self) -> tuple[Any, ...]:
        """Every value :meth:`_rows` reads, read cheaply: equal signatures give equal
        rows (no counter moved, no gauge changed), histogram samples aside (allocation
        sizes and lookup delays: they are taken as they are emitted)."""
        core = self.core
        c, pool, admission = core.counters, core.pool, core.admission
        signature: tuple[Any, ...] = (
            # Read by the host tier's rows alone (_HOST_FIELDS of them) ...
            pool.num_storing,
            pool.num_read_pinned,
            c.host_queries,
            c.host_hits,
            c.store_failures,
            c.promotion_allocation_failures,
            None if admission is None else admission.stores_skipped,
            None if self.traffic is None else self.traffic.dropped,
            # ... and by the tiers' rows.
            pool.num_blocks,
        )
        if not self.tiering:
            return signature
        signature += (core.promoting_blocks, core.write_pinned_blocks)
        for tier, flow in zip(core.secondary_tiers, core.flows):
            s = tier.stats
            signature += (
                flow.stores_dropped,
                flow.blocks_dropped,
                flow.store_latency_ema,
                s.queries,
                s.hits,
                s.read_bytes,
                s.read_seconds,
                s.write_bytes,
                s.write_seconds,
                s.evictions,
                tier.used_bytes,
                tier.fault_count,
            )
        return signature

    def _rows(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        core = self.core
        for name, value in self._host_gauges():
            yield "gauge", name, value, ()
        for size in core.take_allocation_sizes():
            yield "histogram", CPU_ALLOCATION_SIZE, size, ()
        for name, labels, total in self._host_totals():
            yield "counter", name, self._delta(name, labels, total), labels
        if not self.tiering:
            return
        cap = core.pool.num_blocks or 1
        faults_seen = self._faults_seen
        for tier, flow in zip(core.secondary_tiers, core.flows):
            lab = (tier.name,)
            s = tier.stats
            # Fault counts only grow: with the same total, no kind moved (rows skipped).
            count = tier.fault_count
            faults = tier.faults() if faults_seen.get(tier.name) != count else None
            faults_seen[tier.name] = count
            yield "counter", CHUNK_QUERIES, self._delta(CHUNK_QUERIES, lab, s.queries), lab
            yield "counter", CHUNK_HITS, self._delta(CHUNK_HITS, lab, s.hits), lab
            yield "counter", READ_BYTES, self._delta(READ_BYTES, lab, s.read_bytes), lab
            yield "counter", READ_TIME, self._delta(READ_TIME, lab, s.read_seconds), lab
            yield "counter", WRITE_BYTES, self._delta(WRITE_BYTES, lab, s.write_bytes), lab
            yield "counter", WRITE_TIME, self._delta(WRITE_TIME, lab, s.write_seconds), lab
            if faults is not None:
                read_faults = sum(
                    faults[k] for k in ("corrupt", "truncated", "vanished", "unreadable")
                )
                write_faults = faults["disk_full"] + faults["write_failed"]
                yield (
                    "counter",
                    PROMOTION_JOB_FAILURES,
                    self._delta(PROMOTION_JOB_FAILURES, lab, read_faults),
                    lab,
                )
                yield (
                    "counter",
                    CASCADE_JOB_FAILURES,
                    self._delta(CASCADE_JOB_FAILURES, lab, write_faults),
                    lab,
                )
            if flow.has_delays:
                sync, waited = flow.take_delays()
                for delay in sync:
                    yield "histogram", LOOKUP_SYNC_DELAY, delay, lab
                for delay in waited:
                    yield "histogram", LOOKUP_ASYNC_DELAY, delay, lab
            yield (
                "counter",
                STORES_DROPPED,
                self._delta(STORES_DROPPED, lab, flow.stores_dropped),
                lab,
            )
            yield (
                "counter",
                BLOCKS_DROPPED,
                self._delta(BLOCKS_DROPPED, lab, flow.blocks_dropped),
                lab,
            )
            yield "gauge", STORE_LATENCY_EMA, flow.store_latency_ema, lab
            evicted = self._delta(TIER_EVICTIONS, lab, s.evictions)
            yield "counter", TIER_EVICTIONS, evicted, lab
            yield "counter", FS_EVICTIONS, evicted, lab
            if faults is not None:
                for kind in FAULT_KINDS:
                    fl = (tier.name, str(kind))
                    failed = self._delta(TIER_FAULTS, fl, faults[kind])
                    yield "counter", TIER_FAULTS, failed, fl
                    yield "counter", FS_FAULTS, failed, fl
            yield "gauge", TIER_USED_BYTES, tier.used_bytes, lab
            yield "gauge", FS_USED_BYTES, tier.used_bytes, lab
            yield "gauge", ACTIVE_PROMOTION_JOBS, core.promoting_blocks, lab
            yield "gauge", ACTIVE_CASCADE_JOBS, core.write_pinned_blocks, lab
            yield "gauge", PRIMARY_WRITE_USAGE_PERC, core.promoting_blocks / cap, lab
            yield "gauge", PRIMARY_READ_USAGE_PERC, core.write_pinned_blocks / cap, lab
