"""Metric names, meanings and values of kvtier's specs (no vLLM import).

The host-tier names and meanings are vLLM's ``CPUOffloadingSpec`` ones; the tiering
names are vLLM's ``TieringOffloadingMetrics`` ones; kvtier adds ``kvtier:`` metrics
for what vLLM has no name for (tier faults, tier bytes held). Every name emitted by
:class:`~kvtier.tiering_spec.metrics_emitter.MetricsEmitter` is declared in
:func:`metric_table`, as vLLM requires.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from kvtier.blockpool import ALLOCATION_BUCKETS

CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
HOST_QUERIES = "vllm:kvtier_host_queries"
HOST_HITS = "vllm:kvtier_host_hits"
HOST_STORE_FAILURES = "vllm:kvtier_host_store_failures"
TRAFFIC_DROPPED = "vllm:kvtier_traffic_dropped"

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
    if extra_config.get("record_traffic_dir"):
        t[TRAFFIC_DROPPED] = MetricRow(
            "counter",
            "Requests the traffic record (record_traffic_dir) did not write: arrivals "
            "dropped while its writer was behind, and lines a failed write lost.",
            (),
            None,
        )
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
