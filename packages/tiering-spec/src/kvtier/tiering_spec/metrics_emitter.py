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
# The leading fields of MetricsEmitter._signature that only the host tier's rows read;
# from _TIERS on, one field per secondary tier (what its rows alone read).
_HOST_FIELDS = 8
_TIERS = _HOST_FIELDS + 2
# Of the signature, the fields lookups move: the host tier's queries and hits (2, 3)
# and, in a secondary tier's part, its queries and hits (3, 4).
_HOST_LOOKUPS = (2, 4)
_TIER_LOOKUPS = (3, 5)
# Engine steps a change in lookups alone may wait before its rows are written.
MAX_DEFERRED_STEPS = 32


class StatsSink(Protocol):
    """Where :meth:`MetricsEmitter.write_changed` writes (vLLM's
    ``OffloadingConnectorStats`` has these three methods)."""

    def set_gauge(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...

    def increase_counter(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...

    def observe_histogram(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None: ...


class _Rows:
    """A sink that keeps what is written as (kind, name, value, label values) rows."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, Any, tuple[str, ...]]] = []

    def set_gauge(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None:
        self.rows.append(("gauge", name, value, labels))

    def increase_counter(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None:
        self.rows.append(("counter", name, value, labels))

    def observe_histogram(self, name: str, value: Any, labels: tuple[str, ...] = ()) -> None:
        self.rows.append(("histogram", name, value, labels))


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
        # The host tier's usage gauges as last written (what a quiet step reports).
        self._quiet_rows: tuple[tuple[str, Any], ...] = ()
        self._signed: tuple[Any, ...] | None = None
        self._pending: tuple[Any, ...] | None = None  # a signature quiet_gauges found new
        self._faults_seen: dict[str, int] = {}  # tier name -> its fault count at the last rows
        self._deferred = 0  # calls that left a change in lookups alone for later
        # The rows the last quiet_gauges call answered when it found nothing changed
        # and nothing waiting; None after any other answer.
        self.settled_rows: tuple[tuple[str, Any], ...] | None = None

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

    def quiet_gauges(self, *, defer: bool = False) -> tuple[tuple[str, Any], ...] | None:
        """When nothing changed since the last call (most engine steps): the gauges
        vLLM's manager reports every time, with their values, as :meth:`collect` would
        yield them (a zero counter adds nothing to vLLM's stats). Otherwise None, and
        :meth:`collect_changed` yields what changed.

        With ``defer``, a change in lookups alone (the tiers' query and hit counters and
        lookup delays: vLLM asks about a waiting request every step until it has room)
        is left for a later call, at most ``MAX_DEFERRED_STEPS`` calls and never past a
        call after :meth:`emit_next`: the gauges are the same, and the counters are
        written as totals' increments, so nothing is lost."""
        signature = self._signature()
        signed = self._signed
        same = signature == signed
        if same and not self._samples_waiting():
            self.settled_rows = self._quiet_rows
            return self._quiet_rows
        self.settled_rows = None
        if (
            defer
            and self._deferred < MAX_DEFERRED_STEPS
            and signed is not None
            and not self.core.counters.allocation_sizes
            and (same or _lookups_only(signature, signed))
        ):
            self._deferred += 1
            return self._quiet_rows
        self._pending = signature
        return None

    def emit_next(self) -> None:
        """Have the next :meth:`quiet_gauges` write whatever waits (a request finished:
        the engine may stop stepping soon)."""
        self._deferred = MAX_DEFERRED_STEPS

    def collect_changed(self) -> Iterator[tuple[str, str, Any, tuple[str, ...]]]:
        """:meth:`collect` after :meth:`quiet_gauges` returned None."""
        rows = _Rows()
        self._write(rows, zero_skips=True)
        return iter(rows.rows)

    def write_changed(self, sink: StatsSink) -> None:
        """:meth:`collect_changed` after :meth:`quiet_gauges` returned None, written into
        ``sink`` (counters that did not move left out)."""
        self._write(sink, zero_skips=False)

    def _write(self, sink: StatsSink, *, zero_skips: bool) -> None:
        """Write what changed into ``sink``: the host tier's rows every time; a secondary
        tier's rows only where the signature's part that they read moved (most steps
        that store or admit move the host tier's alone). ``zero_skips``: the
        stores-skipped counter even when it did not move (:meth:`collect`'s rows)."""
        signature, self._pending = self._pending, None
        self._deferred = 0
        if signature is None:
            signature = self._signature()
        signed, self._signed = self._signed, signature
        # (Fields 2 on of the host tier's part are its counters' totals.)
        counted = signed is None or signature[2:_HOST_FIELDS] != signed[2:_HOST_FIELDS]
        self._write_host(sink, zero_skips, counted)
        if not self.tiering:
            return
        core = self.core
        shared = signed is None or signature[_HOST_FIELDS:_TIERS] != signed[_HOST_FIELDS:_TIERS]
        for idx, (tier, flow) in enumerate(zip(core.secondary_tiers, core.flows)):
            at = _TIERS + idx
            now, then = signature[at], None if signed is None else signed[at]
            if shared or now != then or flow.has_delays:
                self._write_tier(sink, tier, flow, now, then, shared=shared)

    def _samples_waiting(self) -> bool:
        """Whether histogram samples wait to be emitted (taken as they are)."""
        core = self.core
        if core.counters.allocation_sizes:
            return True
        for flow in core.flows:  # noqa: SIM110 (no generator: asked every step)
            if flow.has_delays:
                return True
        return False

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
        fields of the signature move, in the order :meth:`_write_host` writes them."""
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

    def _write_host(self, sink: StatsSink, zero_skips: bool, counted: bool) -> None:
        """The host tier's rows: its usage gauges (every time), allocation sizes, and
        its counters that moved (none unless ``counted``: a total in the signature
        moved)."""
        gauges = self._gauges
        rows = self._quiet_rows = self._host_gauges()
        for name, value in rows:
            gauges[(name, ())] = value
            sink.set_gauge(name, value, ())
        for size in self.core.take_allocation_sizes():
            sink.observe_histogram(CPU_ALLOCATION_SIZE, size, ())
        if not counted:
            if zero_skips and self.core.admission is not None:
                sink.increase_counter(STORES_SKIPPED, 0, ())
            return
        for name, labels, total in self._host_totals():
            moved = self._counter(sink, name, labels, total)
            if not moved and zero_skips and name == STORES_SKIPPED:
                sink.increase_counter(name, 0, labels)

    def _counter(self, sink: StatsSink, name: str, labels: tuple[str, ...], total: float) -> float:
        """Write counter ``name``'s increment since the last call, if any; return it."""
        key = (name, labels)
        step = total - self._last.get(key, 0)
        if step:
            self._last[key] = total
            sink.increase_counter(name, step, labels)
        return step

    def _gauge(self, sink: StatsSink, name: str, labels: tuple[str, ...], value: Any) -> None:
        """Write gauge ``name`` if its value moved since the last call (or is new)."""
        key = (name, labels)
        gauges = self._gauges
        if key not in gauges or gauges[key] != value:
            gauges[key] = value
            sink.set_gauge(name, value, labels)

    def _write_tier(
        self,
        sink: StatsSink,
        tier: Any,
        flow: Any,
        now: tuple[Any, ...],
        then: tuple[Any, ...] | None,
        *,
        shared: bool,
    ) -> None:
        """One secondary tier's rows that moved (its counters, faults, lookup delays,
        usage gauges; each tier metric also under its deprecated fs name). ``now`` and
        ``then``: the tier's part of this call's signature and of the last (None: write
        every row that moved); only the rows whose fields differ are looked at.
        ``shared``: the host tier's blocks promoting or pinned moved."""

        def moved(i: int, j: int) -> bool:
            return then is None or now[i:j] != then[i:j]

        counter, gauge = self._counter, self._gauge
        lab = (tier.name,)
        s = tier.stats
        if moved(3, 5):
            counter(sink, CHUNK_QUERIES, lab, s.queries)
            counter(sink, CHUNK_HITS, lab, s.hits)
        if moved(5, 7):
            counter(sink, READ_BYTES, lab, s.read_bytes)
            counter(sink, READ_TIME, lab, s.read_seconds)
        if moved(7, 9):
            counter(sink, WRITE_BYTES, lab, s.write_bytes)
            counter(sink, WRITE_TIME, lab, s.write_seconds)
        # Fault counts only grow: with the same total, no kind moved (rows skipped).
        count = tier.fault_count
        if self._faults_seen.get(tier.name) != count:
            self._faults_seen[tier.name] = count
            faults = tier.faults()
            read_faults = sum(faults[k] for k in ("corrupt", "truncated", "vanished", "unreadable"))
            counter(sink, PROMOTION_JOB_FAILURES, lab, read_faults)
            counter(sink, CASCADE_JOB_FAILURES, lab, faults["disk_full"] + faults["write_failed"])
            for kind in FAULT_KINDS:
                fl = (tier.name, str(kind))
                failed = counter(sink, TIER_FAULTS, fl, faults[kind])
                if failed:
                    sink.increase_counter(FS_FAULTS, failed, fl)
        if flow.has_delays:
            sync, waited = flow.take_delays()
            for delay in sync:
                sink.observe_histogram(LOOKUP_SYNC_DELAY, delay, lab)
            for delay in waited:
                sink.observe_histogram(LOOKUP_ASYNC_DELAY, delay, lab)
        if moved(0, 2):
            counter(sink, STORES_DROPPED, lab, flow.stores_dropped)
            counter(sink, BLOCKS_DROPPED, lab, flow.blocks_dropped)
        if moved(2, 3):
            gauge(sink, STORE_LATENCY_EMA, lab, flow.store_latency_ema)
        if moved(9, 10):
            evicted = counter(sink, TIER_EVICTIONS, lab, s.evictions)
            if evicted:
                sink.increase_counter(FS_EVICTIONS, evicted, lab)
        if moved(10, 11):
            gauge(sink, TIER_USED_BYTES, lab, tier.used_bytes)
            gauge(sink, FS_USED_BYTES, lab, tier.used_bytes)
        if shared:
            core = self.core
            cap = core.pool.num_blocks or 1
            promoting, pinned = core.promoting_blocks, core.write_pinned_blocks
            gauge(sink, ACTIVE_PROMOTION_JOBS, lab, promoting)
            gauge(sink, ACTIVE_CASCADE_JOBS, lab, pinned)
            gauge(sink, PRIMARY_WRITE_USAGE_PERC, lab, promoting / cap)
            gauge(sink, PRIMARY_READ_USAGE_PERC, lab, pinned / cap)

    def _signature(self) -> tuple[Any, ...]:
        """Every value the rows read, read cheaply: equal signatures give equal
        rows (no counter moved, no gauge changed), histogram samples aside (allocation
        sizes and lookup delays: they are taken as they are emitted)."""
        core = self.core
        c, pool, admission = core.counters, core.pool, core.admission
        signature: tuple[Any, ...] = (
            # Read by the host tier's rows alone (_HOST_FIELDS of them): its gauges'
            # inputs, then the totals of its counters (_write reads them from 2 on) ...
            pool.num_storing,
            pool.num_read_pinned,
            c.host_queries,
            c.host_hits,
            c.store_failures,
            c.promotion_allocation_failures,
            None if admission is None else admission.stores_skipped,
            None if self.traffic is None else self.traffic.dropped,
            # ... and by the tiers' rows too (the host tier's capacity).
            pool.num_blocks,
        )
        if not self.tiering:
            return signature
        # ... then what every tier's rows read, and each tier's own.
        signature += ((core.promoting_blocks, core.write_pinned_blocks),)
        for tier, flow in zip(core.secondary_tiers, core.flows):
            s = tier.stats
            signature += (
                (  # (_write_tier reads these by position)
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
                ),
            )
        return signature


def _lookups_only(now: tuple[Any, ...], then: tuple[Any, ...]) -> bool:
    """Whether signature ``now`` differs from ``then`` in lookup fields alone."""
    a, b = _HOST_LOOKUPS
    if now[:a] != then[:a] or now[b:_TIERS] != then[b:_TIERS]:
        return False
    a, b = _TIER_LOOKUPS
    for tier_now, tier_then in zip(now[_TIERS:], then[_TIERS:]):
        if tier_now[:a] != tier_then[:a] or tier_now[b:] != tier_then[b:]:
            return False
    return True
