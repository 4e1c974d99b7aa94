"""The plan's computation: what a host tier of each capacity serves of a trace, and the
capacity, policy and fs tier that serve it (:mod:`kvtier.tiering_spec.plan` is its
command line and report).

LRU is computed exactly at every capacity in one pass (:mod:`.lru_curve`), the other
policies by replaying kvtier's manager (:mod:`.replay`) at each grid point, two
processes at a time; the optimum and the reuse oracle (:mod:`.tracefile`) are the
ceilings.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiering_spec import lru_curve, replay
from kvtier.tiering_spec.tiers.fs.format import HEADER_SIZE
from kvtier.tiering_spec.tracefile import (
    Progress,
    Trace,
    TraceError,
    TraceRequest,
    next_uses,
    optimum,
    reuse_oracle,
)

GIB = 1 << 30
DEFAULT_THRESHOLD = 50.0  # prompt tokens per second saved per GiB of host memory
FS_COST_RATIO = 10.0  # a GiB of disk costs about a tenth of a GiB of DRAM
DEFAULT_POLICIES = ("frecency", "arc")  # replayed beside LRU's exact curve
MIN_CAPACITY = 256
GRID_POINTS = 10
# Mooncake's traces stamp requests in milliseconds; kvtier's recordings say their unit.
MOONCAKE_TIMESTAMP_UNIT = "ms"


@dataclass(frozen=True)
class TraceFacts:
    """What the plan needs to know of a trace beyond its requests."""

    tokens_per_id: int
    bytes_per_id: int
    seconds: float  # from the first request's arrival to the last's
    world_size: int = 1
    device_ids: int | None = None
    model: str | None = None


def trace_facts(trace: Trace, source: str, flags: dict[str, Any]) -> TraceFacts:
    """The trace's facts from its header, where flags do not give them; a
    :class:`TraceError` naming what is missing otherwise."""
    head = trace.header or {}
    tokens = flags.get("tokens_per_id") or head.get("tokens_per_id")
    if not isinstance(tokens, int) or tokens < 1:
        raise TraceError(
            f"{source}:1: no kvtier_trace header says how many tokens an id stands for "
            "(a trace kvtier did not record, or from another block size); pass "
            "--tokens-per-id (512 for Mooncake's traces)"
        )
    nbytes = flags.get("bytes_per_id") or head.get("bytes_per_id")
    if not isinstance(nbytes, int) or nbytes < 1:
        raise TraceError(
            f"{source}:1: no kvtier_trace header says the host bytes of one id (the model's "
            "KV for --tokens-per-id tokens, every rank together); pass --bytes-per-id"
        )
    unit = head.get("timestamp_unit", MOONCAKE_TIMESTAMP_UNIT)
    scale = {"s": 1.0, "ms": 1e-3}.get(unit)
    if scale is None:
        raise TraceError(f"{source}:1: timestamp_unit must be 's' or 'ms', got {unit!r}")
    reqs = trace.requests
    seconds = (reqs[-1].timestamp - reqs[0].timestamp) * scale if reqs else 0.0
    if seconds <= 0:
        raise TraceError(
            f"{source}: the trace spans no time (one request, or every timestamp the "
            "same): the plan weighs capacity by prompt tokens saved per second"
        )
    device = flags.get("device_ids")
    if device is None:
        device = head.get("device_ids")
    return TraceFacts(
        tokens_per_id=tokens,
        bytes_per_id=nbytes,
        seconds=seconds,
        world_size=int(head.get("world_size") or 1),
        device_ids=device if isinstance(device, int) and device > 0 else None,
        model=head.get("model"),
    )


def grid(low: int, high: int, points: int = GRID_POINTS) -> list[int]:
    """About ``points`` capacities from ``low`` to ``high``, evenly spaced in log scale."""
    high = max(high, low)
    if points < 2 or high == low:
        return [high]
    ratio = (high / low) ** (1 / (points - 1))
    values = sorted({round(low * ratio**i) for i in range(points)} | {high})
    return values


def knee(
    capacities: Sequence[int],
    served: Sequence[float],
    *,
    tokens_per_id: int,
    bytes_per_id: int,
    seconds: float,
    threshold: float,
) -> int:
    """The index of the capacity past which growing pays less than ``threshold`` prompt
    tokens per second per GiB (``served``: blocks served at each capacity, in order).

    The walk follows the curve's upper hull: from a point, to the one beyond it whose
    chord is steepest (the furthest of equals), while that chord pays the threshold.
    So a flat stretch before a steep one (LRU's curves have cliffs) is crossed when the
    two together pay, and the knee is where no larger capacity does."""
    if not capacities:
        raise ValueError("no capacities")
    if seconds <= 0:
        raise ValueError("the trace spans no time: no rate to save tokens at")
    per_gib = _per_gib(tokens_per_id, bytes_per_id, seconds)
    at = 0
    while at < len(capacities) - 1:
        best, best_slope = at, -1.0
        for j in range(at + 1, len(capacities)):
            slope = (served[j] - served[at]) / (capacities[j] - capacities[at]) * per_gib
            if slope >= best_slope:
                best, best_slope = j, slope
        if best_slope < threshold:
            break
        at = best
    return at


def pays(capacity: int, served: float, *, tokens_per_id: int, bytes_per_id: int,
         seconds: float, threshold: float) -> bool:  # fmt: skip
    """Whether a host tier of ``capacity`` blocks, serving ``served`` of them, pays
    ``threshold`` prompt tokens per second per GiB against having none."""
    per_gib = _per_gib(tokens_per_id, bytes_per_id, max(seconds, 1e-9))
    return served / capacity * per_gib >= threshold


def _per_gib(tokens_per_id: int, bytes_per_id: int, seconds: float) -> float:
    """Prompt tokens per second per GiB that one block served per block held saves."""
    return tokens_per_id / seconds * GIB / bytes_per_id


_KEYS: list[list[bytes]] = []  # the trace's keys, in each replay process


def _hold_keys(keys: list[list[bytes]]) -> None:
    """A replay process's initializer: the keys, handed over once."""
    _KEYS[:] = keys


def _replay_point(
    policy: str, capacity: int, fs_ids: int | None = None, fs_dir: str | None = None
) -> tuple[str, int, replay.RunStats]:
    """One replay: (policy, capacity, what it served and wrote), with an fs tier of
    ``fs_ids`` blocks behind the host tier where given."""
    with replay.kvtier_manager(policy, capacity, fs_ids, fs_dir) as manager:
        stats = replay.replay(manager, _KEYS)
    return policy, capacity, stats


def curves(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    found: lru_curve.Depths | None = None,
    workers: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """Blocks served at each capacity: LRU exactly (``lru``), each of ``policies`` by
    replay (which needs vLLM), the optimum and the reuse oracle; and blocks written into
    the host tier (``written``). ``found``: the trace's stack depths, if known."""
    ids = [r.hash_ids for r in requests]
    replays = [(p, c) for p in dict.fromkeys(policies) if p != "lru" for c in capacities]
    bar = Progress(len(replays) + 2 * len(capacities) + 1, progress)
    if found is None:
        found = lru_curve.depths(ids)
    out: dict[str, Any] = {"lru": lru_curve.served_curve(found, capacities)}
    written: dict[str, list[int]] = {"lru": lru_curve.written_curve(found, capacities)}
    bar.advance(1, "LRU at every capacity")
    for p, _ in replays:
        out[p] = [0] * len(capacities)
        written[p] = [0] * len(capacities)
    index = {c: i for i, c in enumerate(capacities)}
    pool = None
    futures = []
    if replays:
        keys = replay.trace_keys(requests)
        pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=max(1, workers), initializer=_hold_keys, initargs=(keys,)
        )
        futures = [pool.submit(_replay_point, p, c) for p, c in replays]
    try:
        uses = next_uses(ids)
        out["optimum"], out["reuse_oracle"] = [], []
        for c in capacities:
            out["optimum"].append(optimum(ids, c, uses).served)
            bar.advance(1, f"optimum at {c:,}")
            out["reuse_oracle"].append(reuse_oracle(ids, c, uses))
            bar.advance(1, f"reuse oracle at {c:,}")
        for future in concurrent.futures.as_completed(futures):
            policy, cap, stats = future.result()
            out[policy][index[cap]] = stats.served
            written[policy][index[cap]] = stats.host_written
            bar.advance(1, f"{policy} at {cap:,}")
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    out["written"] = written
    return out


def fs_curves(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    policies: Sequence[str],
    fs_ids: int,
    *,
    fs_dir: str | None = None,
    workers: int = 2,
    progress: bool = True,
) -> dict[str, dict[str, list[int]]]:
    """Each policy (LRU too) replayed at each capacity with an fs tier of ``fs_ids``
    blocks behind the host tier (real files under ``fs_dir``): blocks served from either
    tier, and written into the host tier and into the fs tier."""
    runs = [(p, c) for p in dict.fromkeys(policies) for c in capacities]
    bar = Progress(len(runs), progress)
    got: dict[str, dict[str, list[int]]] = {
        k: {p: [0] * len(capacities) for p in dict.fromkeys(policies)}
        for k in ("served", "host_written", "fs_written")
    }
    index = {c: i for i, c in enumerate(capacities)}
    keys = replay.trace_keys(requests)
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=max(1, workers), initializer=_hold_keys, initargs=(keys,)
    ) as pool:
        futures = [pool.submit(_replay_point, p, c, fs_ids, fs_dir) for p, c in runs]
        for future in concurrent.futures.as_completed(futures):
            policy, cap, stats = future.result()
            i = index[cap]
            got["served"][policy][i] = stats.served
            got["host_written"][policy][i] = stats.host_written
            got["fs_written"][policy][i] = stats.fs_written
            bar.advance(1, f"{policy} at {cap:,} with the fs tier")
    return got


def plan(
    trace: Trace,
    facts: TraceFacts,
    *,
    policies: Sequence[str] = DEFAULT_POLICIES,
    threshold: float = DEFAULT_THRESHOLD,
    fs_threshold: float | None = None,
    fs_root: str = "/var/lib/kvtier",
    points: int = GRID_POINTS,
    capacities: Sequence[int] | None = None,
    fs_ids: int | None = None,
    fs_dir: str | None = None,
    workers: int = 2,
    progress: bool = True,
) -> dict[str, Any]:
    """The report: curves over a grid of capacities (or over ``capacities``) and the
    recommendation; with ``fs_ids``, the same policies with an fs tier of that many
    blocks behind the host tier (replayed with real files: slower)."""
    behind = fs_ids  # the fs tier to replay behind each capacity (not the recommended one)
    requests = trace.requests
    ids = [r.hash_ids for r in requests]
    total = sum(len(b) for b in ids)
    prompt_tokens = max(1, sum(r.input_length for r in requests))
    reused = lru_curve.reused_blocks(ids)
    found = lru_curve.depths(ids)
    # Up to where LRU serves every block it ever can (the deepest serving depth; the
    # optimum needs no more than the blocks used twice), from a few hundred blocks and
    # no fewer than the longest prompt: below that a prompt cannot be stored whole,
    # and LRU's one-pass curve is not the replay's.
    longest = max((len(b) for b in ids), default=1)
    high = max([1, reused, *(d for d in found.served if d != lru_curve.NEVER)])
    if capacities is None:
        capacities = grid(min(max(MIN_CAPACITY, longest), high), high, points)
    capacities = sorted(set(capacities))
    policies = ["lru", *[p for p in dict.fromkeys(policies) if p != "lru"]]
    got = curves(
        requests, capacities, policies[1:], found=found, workers=workers, progress=progress
    )
    written = got.pop("written")
    device = facts.device_ids
    device_served = lru_curve.served_curve(found, [device])[0] if device else 0
    # The best policy at each capacity: the knee is read off their upper envelope.
    best = [max(policies, key=lambda p: got[p][i]) for i in range(len(capacities))]
    envelope = [got[best[i]][i] for i in range(len(capacities))]
    tokens, seconds = facts.tokens_per_id, facts.seconds
    at = knee(
        capacities,
        envelope,
        tokens_per_id=tokens,
        bytes_per_id=facts.bytes_per_id,
        seconds=seconds,
        threshold=threshold,
    )
    host_ids, policy = capacities[at], best[at]
    worth_it = pays(
        host_ids,
        envelope[at],
        tokens_per_id=tokens,
        bytes_per_id=facts.bytes_per_id,
        seconds=seconds,
        threshold=threshold,
    )
    # The fs tier holds a copy of every stored block (write-through), so what it serves
    # is about what a host tier of its size would: sized on LRU's exact curve, each
    # block costing its file (a header per rank) on disk.
    fs_per_id = facts.bytes_per_id + HEADER_SIZE * facts.world_size
    fine = grid(host_ids, max(host_ids, high), 4 * points)
    fs_curve = lru_curve.served_curve(found, fine)
    fs_at = knee(
        fine,
        fs_curve,
        tokens_per_id=tokens,
        bytes_per_id=fs_per_id,
        seconds=seconds,
        threshold=threshold / FS_COST_RATIO if fs_threshold is None else fs_threshold,
    )
    fs_ids = fine[fs_at] if fine[fs_at] > host_ids else 0
    host_bytes = host_ids * facts.bytes_per_id
    fs_bytes = fs_ids * fs_per_id
    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec" if fs_ids else "CPUOffloadingSpec",
        "cpu_bytes_to_use": host_bytes,
        "eviction_policy": policy,
    }
    if fs_ids:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": fs_root, "capacity_bytes": fs_bytes}]
    share = {k: [n / total if total else 0.0 for n in v] for k, v in got.items()}
    with_fs: dict[str, Any] | None = None
    if behind:
        fs = fs_curves(
            requests, capacities, policies, behind, fs_dir=fs_dir, workers=workers,
            progress=progress,
        )  # fmt: skip

        def per_served(kind: str, p: str, i: int, unit: int) -> float | None:
            served = fs["served"][p][i]
            return fs[kind][p][i] * unit / served if served else None

        with_fs = {
            "fs_ids": behind,
            "served": {
                p: [n / total if total else 0.0 for n in v] for p, v in fs["served"].items()
            },
            "host_written_per_served": {
                p: [
                    per_served("host_written", p, i, facts.bytes_per_id)
                    for i in range(len(capacities))
                ]
                for p in fs["served"]
            },
            "fs_written_per_served": {
                p: [per_served("fs_written", p, i, fs_per_id) for i in range(len(capacities))]
                for p in fs["served"]
            },
        }
    return {
        "trace": {
            "requests": len(requests),
            "prompt_blocks": total,
            "distinct_blocks": len({b for r in ids for b in r}),
            "reused_blocks": reused,
            "seconds": facts.seconds,
            "request_rate": len(requests) / facts.seconds if facts.seconds > 0 else None,
            "tokens_per_id": tokens,
            "bytes_per_id": facts.bytes_per_id,
            "model": facts.model,
            "header": trace.header,
            "end": trace.end,
        },
        "capacities": capacities,
        # Below the longest prompt, LRU's one-pass figure may differ from the replay's.
        "lru_exact_from": longest,
        "gib": [c * facts.bytes_per_id / GIB for c in capacities],
        "policies": policies,
        "served": share,
        "with_fs": with_fs,
        "device_ids": device,
        "device_served": device_served / total if total else 0.0,
        "outside_device": {
            p: [max(0, n - device_served) / total if total else 0.0 for n in got[p]]
            for p in policies
        },
        # The same as a share of prompt tokens (what vLLM's prefix-cache metrics count).
        "outside_device_tokens": {
            p: [max(0, n - device_served) * tokens / prompt_tokens for n in got[p]]
            for p in policies
        },
        "written_per_served": {
            p: [
                written[p][i] * facts.bytes_per_id / got[p][i] if got[p][i] else None
                for i in range(len(capacities))
            ]
            for p in policies
        },
        "recommendation": {
            "host_ids": host_ids,
            "policy": policy,
            "fs_ids": fs_ids,
            "host_bytes": host_bytes,
            "fs_bytes": fs_bytes,
            "threshold": threshold,
            "pays": worth_it,
            "served": envelope[at] / total if total else 0.0,
            "with_fs": fs_curve[fs_at] / total if total and fs_ids else None,
            "kv_transfer_config": {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            },
        },
    }
