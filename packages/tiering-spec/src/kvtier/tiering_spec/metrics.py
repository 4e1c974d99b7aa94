"""Metric names, meanings and values of kvtier's specs (no vLLM import).

The host-tier names and meanings are vLLM's ``CPUOffloadingSpec`` ones; the tiering
names are vLLM's ``TieringOffloadingMetrics`` ones; kvtier adds ``kvtier:`` metrics
for what vLLM has no name for (fs faults, fs bytes held). Every name emitted by
:class:`MetricsEmitter` is declared in :func:`metric_table`, as vLLM requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple, Protocol

from kvtier.blockpool import ALLOCATION_BUCKETS
from kvtier.tiering_spec.manager import TierManager
from kvtier.tiering_spec.tiers.base import FAULT_KINDS

CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
HOST_QUERIES = "vllm:kvtier_host_queries"
HOST_HITS = "vllm:kvtier_host_hits"
HOST_STORE_FAILURES = "vllm:kvtier_host_store_failures"

CHUNK_QUERIES = "vllm:kv_offload_tiering_chunk_queries"
CHUNK_HITS = "vllm:kv_offload_tiering_chunk_hits"
READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
READ_TIME = "vllm:kv_offload_tiering_read_time"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes"
WRITE_TIME = "vllm:kv_offload_tiering_write_time"
PROMOTION_JOB_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"
CASCADE_JOB_FAILURES = "vllm:kv_offload_tiering_cascade_job_failures"
PROMOTION_ALLOCATION_FAILURES = "vllm:kv_offload_tiering_promotion_allocation_failures"
ACTIVE_PROMOTION_JOBS = "vllm:kv_offload_tiering_active_promotion_jobs"
ACTIVE_CASCADE_JOBS = "vllm:kv_offload_tiering_active_cascade_jobs"
PRIMARY_WRITE_USAGE_PERC = "vllm:kv_offload_tiering_primary_write_usage_perc"
PRIMARY_READ_USAGE_PERC = "vllm:kv_offload_tiering_primary_read_usage_perc"
STORES_DROPPED = "vllm:kv_offload_tiering_backpressure_stores_dropped"
BLOCKS_DROPPED = "vllm:kv_offload_tiering_backpressure_blocks_dropped"
STORE_LATENCY_EMA = "vllm:kv_offload_tiering_backpressure_store_latency_ema"
LOOKUP_SYNC_DELAY = "vllm:kv_offload_tiering_lookup_sync_delay_seconds"
LOOKUP_ASYNC_DELAY = "vllm:kv_offload_tiering_lookup_async_delay_seconds"
# vLLM's buckets for the two lookup-delay histograms (seconds).
SYNC_DELAY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0)
ASYNC_DELAY_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0)
TIER_FAULTS = "vllm:kvtier_tier_faults"
# The tier label, and its value for the host tier (a secondary tier's is its name).
TIER_LABEL = "tier"
HOST_TIER = "CPU"
TIER_USED_BYTES = "vllm:kvtier_tier_used_bytes"
TIER_EVICTIONS = "vllm:kvtier_tier_evictions"
# The names above before they covered every secondary tier: emitted as well, with the
# same values, until the release after next (see the changelog).
FS_FAULTS = "vllm:kvtier_fs_faults"
FS_USED_BYTES = "vllm:kvtier_fs_used_bytes"
FS_EVICTIONS = "vllm:kvtier_fs_evictions"
DEPRECATED_ALIASES = {
    TIER_FAULTS: FS_FAULTS,
    TIER_USED_BYTES: FS_USED_BYTES,
    TIER_EVICTIONS: FS_EVICTIONS,
}


class MetricRow(NamedTuple):
    """One metric kvtier's spec declares to vLLM."""

    kind: str  # "counter", "gauge" or "histogram"
    documentation: str
    labels: tuple[str, ...] = ()  # label names besides vLLM's per-engine ones
    buckets: tuple[float, ...] | None = None  # histograms only


def metric_table(extra_config: Mapping[str, Any], *, tiering: bool) -> dict[str, MetricRow]:
    """name -> (kind, documentation, label names, histogram buckets)."""
    t: dict[str, MetricRow] = {
        CPU_CACHE_USAGE_PERC: MetricRow(
            "gauge",
            "Fraction of CPU KV-cache space currently pinned by active transfers (0.0 = idle, "
            "1.0 = saturated). Sustained high values indicate transfers (stores or promotions) "
            "may be dropped due to insufficient capacity.",
            (),
            None,
        ),
        CPU_CACHE_WRITE_USAGE_PERC: MetricRow(
            "gauge",
            "Fraction of CPU KV-cache space currently pinned by in-flight stores that have not "
            "yet completed (0.0 = idle, 1.0 = saturated).",
            (),
            None,
        ),
        CPU_CACHE_READ_USAGE_PERC: MetricRow(
            "gauge",
            "Fraction of CPU KV-cache space currently pinned by in-flight loads that have not "
            "yet completed (0.0 = idle, 1.0 = saturated).",
            (),
            None,
        ),
        CPU_ALLOCATION_SIZE: MetricRow(
            "histogram",
            "Histogram of the number of CPU blocks requested by each KV offload prepare_store "
            "call.",
            (),
            tuple(float(b) for b in ALLOCATION_BUCKETS),
        ),
        HOST_QUERIES: MetricRow(
            "counter",
            "Offloaded-block lookups answered by kvtier's host tier.",
            (),
            None,
        ),
        HOST_HITS: MetricRow(
            "counter",
            "Offloaded-block lookups that found the block readable in kvtier's host tier.",
            (),
            None,
        ),
        HOST_STORE_FAILURES: MetricRow(
            "counter",
            "Blocks of device-to-host stores that failed on a worker and were dropped.",
            (),
            None,
        ),
    }
    try:
        threshold = int(extra_config.get("store_threshold", 0) or 0)
    except (TypeError, ValueError):
        threshold = 0
    if threshold >= 2:
        t[STORES_SKIPPED] = MetricRow(
            "counter",
            "Number of KV offload stores skipped because the reuse threshold was not reached.",
            (),
            None,
        )
    if not tiering:
        return t
    tier = (TIER_LABEL,)
    t.update(
        {
            CHUNK_QUERIES: MetricRow(
                "counter",
                "Number of chunk lookup queries sent to a tier, labeled by tier.",
                tier,
                None,
            ),
            CHUNK_HITS: MetricRow(
                "counter",
                "Number of chunk lookup hits in a tier, labeled by tier.",
                tier,
                None,
            ),
            READ_BYTES: MetricRow(
                "counter",
                "Total bytes read from secondary tiers into the primary tier, labeled by tier.",
                tier,
                None,
            ),
            READ_TIME: MetricRow(
                "counter",
                "Total time spent reading from secondary tiers into the primary tier, in "
                "seconds, labeled by tier.",
                tier,
                None,
            ),
            WRITE_BYTES: MetricRow(
                "counter",
                "Total bytes written from the primary tier to secondary tiers, labeled by tier.",
                tier,
                None,
            ),
            WRITE_TIME: MetricRow(
                "counter",
                "Total time spent writing from the primary tier to secondary tiers, in seconds, "
                "labeled by tier.",
                tier,
                None,
            ),
            PROMOTION_JOB_FAILURES: MetricRow(
                "counter",
                "Number of failed secondary-tier promotion jobs, labeled by tier.",
                tier,
                None,
            ),
            CASCADE_JOB_FAILURES: MetricRow(
                "counter",
                "Number of failed secondary-tier cascade jobs, labeled by tier.",
                tier,
                None,
            ),
            PROMOTION_ALLOCATION_FAILURES: MetricRow(
                "counter",
                "Number of promotion attempts that failed because the primary tier could not "
                "allocate space.",
                (),
                None,
            ),
            ACTIVE_PROMOTION_JOBS: MetricRow(
                "gauge",
                "Number of active secondary-tier promotion jobs, labeled by tier.",
                tier,
                None,
            ),
            ACTIVE_CASCADE_JOBS: MetricRow(
                "gauge",
                "Number of active secondary-tier cascade jobs, labeled by tier.",
                tier,
                None,
            ),
            PRIMARY_WRITE_USAGE_PERC: MetricRow(
                "gauge",
                "Current fraction of primary-tier space used by writes from secondary tiers, "
                "labeled by tier.",
                tier,
                None,
            ),
            PRIMARY_READ_USAGE_PERC: MetricRow(
                "gauge",
                "Current fraction of primary-tier space used by reads to secondary tiers, "
                "labeled by tier.",
                tier,
                None,
            ),
            STORES_DROPPED: MetricRow(
                "counter",
                "Number of store operations dropped due to back-pressure on a secondary tier.",
                tier,
                None,
            ),
            BLOCKS_DROPPED: MetricRow(
                "counter",
                "Number of blocks dropped due to back-pressure on a secondary tier.",
                tier,
                None,
            ),
            STORE_LATENCY_EMA: MetricRow(
                "gauge",
                "Exponential moving average of store latency for back-pressure detection, "
                "in s/MiB.",
                tier,
                None,
            ),
            LOOKUP_SYNC_DELAY: MetricRow(
                "histogram",
                "Histogram of blocking time spent in a per-chunk tier lookup that resolved as "
                "a hit or miss, labeled by tier, in seconds.",
                tier,
                SYNC_DELAY_BUCKETS,
            ),
            LOOKUP_ASYNC_DELAY: MetricRow(
                "histogram",
                "Histogram of wall-clock time from a per-chunk tier lookup first returning "
                "retry until that same tier lookup resolves as a hit or miss, labeled by "
                "tier, in seconds.",
                tier,
                ASYNC_DELAY_BUCKETS,
            ),
            TIER_FAULTS: MetricRow(
                "counter",
                "Blocks of a secondary tier that failed to read or write (kind: corrupt, "
                "truncated, vanished, unreadable, disk_full, write_failed, timeout, "
                "unreachable, foreign: a file this engine did not write, unauthenticated: "
                "no valid MAC); each was treated as a miss and never loaded.",
                (TIER_LABEL, "kind"),
                None,
            ),
            TIER_USED_BYTES: MetricRow(
                "gauge",
                "Bytes a secondary tier holds for this engine.",
                tier,
                None,
            ),
            TIER_EVICTIONS: MetricRow(
                "counter",
                "Entries a secondary tier removed to stay within its capacity, labeled by tier.",
                tier,
                None,
            ),
        }
    )
    for name, old in DEPRECATED_ALIASES.items():
        if name in t:
            row = t[name]
            t[old] = row._replace(
                documentation=f"Deprecated: the same as {name}. " + row.documentation
            )
    return t


# Reported on every call, as vLLM's CPUOffloadingManager does (its stats are never None).
ALWAYS_GAUGES = (CPU_CACHE_USAGE_PERC, CPU_CACHE_WRITE_USAGE_PERC, CPU_CACHE_READ_USAGE_PERC)
# The leading fields of MetricsEmitter._signature that only the host tier's rows read.
_HOST_FIELDS = 7


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

    def __init__(self, core: TierManager, *, tiering: bool) -> None:
        self.core = core
        self.tiering = tiering
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


# -- stats payload for vLLM releases without offloading metric definitions ---------------
#
# vLLM 0.23 has no route for a spec's own metrics: kvtier then carries them (and vLLM's
# transfer records) in a connector stats payload of plain data, which survives the trip
# from the engine to the metrics process:
#
#     {"transfers": {"GPU_to_CPU": [[bytes, seconds], ...], ...},
#      "metrics": {name: [kind, {label key: value}]}}
#
# A label key is the label values joined by LABEL_SEP. Counters add up, gauges keep the
# latest value and histograms keep every observation.

LABEL_SEP = "\x1f"


def new_payload() -> dict[str, Any]:
    return {"transfers": {}, "metrics": {}}


def payload_is_empty(payload: Mapping[str, Any]) -> bool:
    return not payload.get("transfers") and not payload.get("metrics")


def add_transfer(payload: dict[str, Any], transfer_type: str, nbytes: int, seconds: float) -> None:
    payload["transfers"].setdefault(transfer_type, []).append([int(nbytes), float(seconds)])


def add_metric(
    payload: dict[str, Any], kind: str, name: str, value: Any, labels: tuple[str, ...]
) -> None:
    """Record ``value`` (a number, or a list of observations of a histogram)."""
    entry = payload["metrics"].setdefault(name, [kind, {}])
    values: dict[str, Any] = entry[1]
    key = LABEL_SEP.join(labels)
    if kind == "counter":
        values[key] = values.get(key, 0) + value
    elif kind == "gauge":
        values[key] = value
    else:
        values.setdefault(key, []).extend(value if isinstance(value, list) else [value])


def label_values(key: str) -> tuple[str, ...]:
    return tuple(key.split(LABEL_SEP)) if key else ()


def merge_payload(into: dict[str, Any], other: Mapping[str, Any]) -> dict[str, Any]:
    """Add ``other`` to ``into`` (which it returns)."""
    for transfer_type, ops in other.get("transfers", {}).items():
        into["transfers"].setdefault(transfer_type, []).extend(list(op) for op in ops)
    for name, (kind, values) in other.get("metrics", {}).items():
        for key, value in values.items():
            add_metric(
                into, kind, name, list(value) if kind == "histogram" else value, label_values(key)
            )
    return into


def reduce_payload(payload: Mapping[str, Any]) -> dict[str, int | float]:
    """One number per series, for vLLM's periodic log line."""
    out: dict[str, int | float] = {}
    for transfer_type, ops in payload.get("transfers", {}).items():
        out[f"{transfer_type}_total_bytes"] = sum(int(op[0]) for op in ops)
        out[f"{transfer_type}_total_time"] = sum(float(op[1]) for op in ops)
    for name, (kind, values) in payload.get("metrics", {}).items():
        for key, value in values.items():
            series = f"{name}:{','.join(label_values(key))}" if key else name
            if kind == "histogram":
                out[f"{series}_count"] = len(value)
                out[f"{series}_sum"] = sum(value)
            else:
                out[series] = value
    return out
