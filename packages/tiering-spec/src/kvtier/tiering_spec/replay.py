"""Engine-free trace replay: kvtier's offloading manager and vLLM's, fed vLLM 0.32's calls.

Each request of a trace goes through an ``OffloadingManager`` as vLLM 0.32's
``OffloadingConnector`` scheduler drives it when the request is alone in the engine
and nothing else caches its prefix (no device prefix cache):

1. ``on_new_request(ctx)`` with a fresh ``ReqContext``; every key's end-token position
   is recorded in the context (``set_offload_key_position``), as the connector does;
2. ``lookup`` of the keys in prompt order up to the first miss; a ``HIT_PENDING`` (a
   block being promoted from the fs tier) or ``RETRY`` makes the connector ask again a
   scheduler step later (``on_schedule_end``, then the fs reads finish);
3. with hits: ``prepare_load(hits)``, ``on_schedule_end``, ``complete_load(hits)``;
4. ``on_schedule_end``, ``prepare_store(the keys after the hits)`` (the prompt is
   prefilled in one step; vLLM's chunk-level policy does not offer loaded chunks
   again), ``complete_store(keys_to_store)``;
5. ``on_schedule_end``, ``on_request_finished(ctx)``.

``touch`` is never called: vLLM 0.32's connector leaves recency to the manager's
``on_request_finished``.

A request is *served* the hits of step 2: its longest cached prefix. One key is one
512-token block id of the trace (``make_offload_key(id, group 0)``), one host chunk.
kvtier's manager is the class vLLM instantiates from ``CPUOffloadingSpec`` (host
tier) or ``TieringOffloadingSpec`` (host tier plus an fs tier of real files in a
temporary directory), built from vLLM's ``OffloadingConfig`` with a 4 KiB chunk: hit
ratios do not depend on block bytes, and the bytes a model would move are computed
from its shape. vLLM's ``CPUOffloadingManager`` gets the same calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.tiering_spec.tracefile import (
    BLOCK_TOKENS,
    ModelShape,
    Progress,
    TraceRequest,
    next_uses,
    optimum,
    reuse_oracle,
)

VLLM_POLICIES = ("vllm-lru", "vllm-arc")
# Bytes of one replayed chunk (the smallest the fs tier's O_DIRECT files take).
PAYLOAD_BYTES = 4096
# Scheduler steps a request waits for fs promotions before it takes what is loaded.
MAX_WAIT_STEPS = 64
PROGRESS_EVERY = 256  # requests between progress updates


def kvtier_policies() -> list[str]:
    """The eviction policies kvtier-blockpool registers, in registration order."""
    from kvtier.blockpool.policies import POLICIES

    return list(POLICIES)


def resolve_policies(text: str | None) -> list[str]:
    """The policy names of ``--policies`` (default: all of kvtier's, then vLLM's)."""
    known = kvtier_policies()
    if text is None:
        return [*known, *VLLM_POLICIES]
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known and n not in VLLM_POLICIES]
    if unknown or not names:
        raise SystemExit(
            f"error: unknown policy {', '.join(unknown) or '(none given)'}; "
            f"known: {', '.join([*known, *VLLM_POLICIES])}"
        )
    return list(dict.fromkeys(names))


@dataclass
class RunStats:
    """What one manager did over a trace at one capacity (counts of blocks)."""

    served_host: int = 0
    served_fs: int = 0
    host_written: int = 0  # device -> host stores and fs -> host promotions
    fs_written: int = 0
    fs_dropped: int = 0  # write-throughs dropped: too many host blocks waiting for writes
    store_refused: int = 0  # prepare_store returned None
    wait_steps: int = 0  # scheduler steps requests waited for fs promotions

    @property
    def served(self) -> int:
        return self.served_host + self.served_fs


def trace_keys(requests: Sequence[TraceRequest]) -> list[list[bytes]]:
    """Each request's offload keys, as vLLM builds them (block hash + group 0)."""
    from vllm.v1.kv_offload.base import make_offload_key

    cache: dict[int, bytes] = {}
    out = []
    for req in requests:
        keys = []
        for block in req.hash_ids:
            key = cache.get(block)
            if key is None:
                key = cache[block] = make_offload_key(block.to_bytes(8, "big"), 0)
            keys.append(key)
        out.append(keys)
    return out


# ---------------------------------------------------------------------------- managers


def _offloading_config(extra: dict[str, Any], engine_id: str) -> Any:
    """vLLM 0.32's ``OffloadingConfig`` of one KV cache group of 512-token blocks."""
    from kvtier.vllm_port.port import current

    if not current().spec_takes_offloading_config:
        raise SystemExit(
            "error: the trace replay drives vLLM 0.32's offloading interfaces "
            "(vllm.v1.kv_offload.config), which this vLLM lacks"
        )
    from vllm.v1.kv_offload import config as c

    def build(cls: type, **fields: Any) -> Any:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in names})

    return build(
        c.OffloadingConfig,
        groups=(
            build(
                c.OffloadingGroupConfig,
                tokens_per_block=BLOCK_TOKENS,
                layer_names=("model.layers.0.self_attn.attn",),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=PAYLOAD_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id,
        model=build(c.OffloadingModelConfig, name="trace-replay", dtype="bfloat16"),
        cache=build(c.OffloadingCacheConfig, tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
        parallel=build(
            c.OffloadingParallelConfig,
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
        replicated_layout=False,
    )


def _policy_settings(name: str) -> dict[str, Any]:
    """``kv_connector_extra_config`` keys choosing kvtier-blockpool's policy ``name``: by
    name where the spec's config knows it, else by its class path (any registered one)."""
    from kvtier.blockpool.policies import POLICIES
    from kvtier.tiering_spec.config import EVICTION_POLICIES

    if name in EVICTION_POLICIES:
        return {"eviction_policy": name}
    cls = POLICIES[name]
    return {"cache_policy_module_path": f"{cls.__module__}:{cls.__qualname__}"}


def _fs_policy_settings(name: str) -> dict[str, Any]:
    """The fs tier's ``eviction_policy`` key for ``name``, if the tier knows it."""
    from kvtier.tiering_spec.config import EVICTION_POLICIES

    return {"eviction_policy": name} if name in EVICTION_POLICIES else {}


@contextlib.contextmanager
def kvtier_manager(
    policy: str,
    capacity: int,
    fs_capacity: int | None = None,
    fs_dir: str | None = None,
    fs_policy: str | None = None,
) -> Iterator[Any]:
    """kvtier's ``OffloadingManager`` as vLLM gets it from kvtier's spec: the host tier
    of ``capacity`` chunks with ``policy``, plus an fs tier of ``fs_capacity`` chunks of
    real files under a temporary directory (removed afterwards) with ``fs_policy``
    (default: ``policy`` where the fs tier knows it by name, else the tier's default)."""
    from kvtier.blockpool import HostRegion
    from kvtier.tiering_spec import vllm_adapter
    from kvtier.tiering_spec.regions import region_name
    from kvtier.tiering_spec.tiers.fs.format import HEADER_SIZE

    extra: dict[str, Any] = {
        "cpu_bytes_to_use": capacity * PAYLOAD_BYTES,
        **_policy_settings(policy),
    }
    engine_id = f"trace-replay-{os.getpid()}-{policy}-{capacity}"
    root = None
    region = None
    log = logging.getLogger("kvtier.tiering_spec")
    level = log.level
    # Start-up lines and the fs tier's warning that a replay has no model to fingerprint.
    log.setLevel(logging.ERROR)
    try:
        if fs_capacity:
            root = tempfile.mkdtemp(prefix="kvtier-trace-", dir=fs_dir)
            extra["secondary_tiers"] = [
                {
                    "type": "fs",
                    "root_dir": os.path.join(root, "fs"),
                    "capacity_bytes": fs_capacity * (HEADER_SIZE + PAYLOAD_BYTES),
                    "n_read_threads": 4,
                    "n_write_threads": 4,
                    **_fs_policy_settings(fs_policy or policy),
                }
            ]
            spec = vllm_adapter.TieringOffloadingSpec(_offloading_config(extra, engine_id))
            # The worker's shared host region, which the fs tier reads and writes.
            region = HostRegion.create_shared(
                region_name(engine_id, 0), spec.num_chunks, spec.chunk_bytes
            )
        else:
            spec = vllm_adapter.CPUOffloadingSpec(_offloading_config(extra, engine_id))
        assert spec.num_chunks == capacity, (spec.num_chunks, capacity)
        manager = spec.get_manager()
        try:
            yield manager
        finally:
            manager.shutdown()
    finally:
        log.setLevel(level)
        if region is not None:
            region.close()
        if root is not None:
            shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def vllm_manager(policy: str, capacity: int) -> Iterator[Any]:
    """vLLM's own ``CPUOffloadingManager`` with its ``lru`` or ``arc`` policy."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=capacity, cache_policy=policy.removeprefix("vllm-"))
    try:
        yield manager
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------- replay


def _leading(results: Sequence[Any], hit: Any) -> int:
    """How many of ``results`` are ``hit`` before the first that is not."""
    n = 0
    for r in results:
        if r is not hit:
            break
        n += 1
    return n


def replay(
    manager: Any,
    keys: Sequence[Sequence[bytes]],
    *,
    on_progress: Callable[[int], None] | None = None,
) -> RunStats:
    """Feed every request's ``keys`` through ``manager`` as vLLM 0.32's connector does
    (see the module's docstring); what was served and written."""
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

    HIT, MISS = LookupResult.HIT, LookupResult.MISS
    core: Any = getattr(manager, "core", None)  # kvtier's TierManager, else vLLM's manager
    note_lora = getattr(manager, "note_lora", None)
    fs = bool(core is not None and core.secondary_tiers)
    counters = core.counters if core is not None else None
    stats = RunStats()
    lookup, end = manager.lookup, manager.on_schedule_end
    no_step = ScheduleEndContext(new_req_ids=[], preempted_req_ids=())
    for i, req_keys in enumerate(keys):
        req_id = f"req-{i}"
        ctx = ReqContext(req_id=req_id)
        manager.on_new_request(ctx)
        if note_lora is not None:  # kvtier's connector marks each request (LoRA or not)
            note_lora(ctx, False)
        position = ctx.set_offload_key_position
        for n, key in enumerate(req_keys, 1):
            position(key, n * BLOCK_TOKENS)
        first: list[Any] = []
        for key in req_keys:
            result = lookup(key, ctx)
            first.append(result)
            if result is MISS:
                break
        if fs and any(r is not HIT and r is not MISS for r in first):
            # Promotions started: the connector asks again at the next steps.
            for _ in range(MAX_WAIT_STEPS):
                end(no_step)
                stats.wait_steps += 1
                core.drain(30.0)
                again = [lookup(key, ctx) for key in req_keys[: len(first)]]
                if all(r is HIT or r is MISS for r in again):
                    break
            hits = _leading(again, HIT)
            from_host = _leading(first[:hits], HIT)
        else:
            # A RETRY, or pending without fs (a store in flight): not served this time.
            hits = from_host = _leading(first, HIT)
        stats.served_host += from_host
        stats.served_fs += hits - from_host
        end_ctx = ScheduleEndContext(new_req_ids=[req_id], preempted_req_ids=())
        if hits:
            loaded = req_keys[:hits]
            manager.prepare_load(loaded, ctx)
            end(end_ctx)
            manager.complete_load(loaded, ctx)
            end_ctx = no_step
        end(end_ctx)
        out = manager.prepare_store(req_keys[hits:], ctx)
        if out is None:
            stats.store_refused += 1
        elif out.keys_to_store:
            stored = list(out.keys_to_store)
            stats.host_written += len(stored)
            manager.complete_store(stored, ctx)
            if fs:
                core.drain(30.0)  # write-through finished: replays are deterministic
        end(no_step)
        manager.on_request_finished(ctx)
        if on_progress is not None and (i + 1) % PROGRESS_EVERY == 0:
            on_progress(PROGRESS_EVERY)
    if on_progress is not None:
        on_progress(len(keys) % PROGRESS_EVERY)
    if counters is not None:
        stats.host_written += counters.promotions
        stats.fs_written = counters.writes_submitted - counters.write_failures
        stats.fs_dropped = counters.writes_dropped
    return stats


def _advance(bar: Progress, label: str, n: int) -> None:
    bar.advance(n, label)


def run(
    requests: Sequence[TraceRequest],
    capacities: Sequence[int],
    policies: Sequence[str],
    *,
    shape: ModelShape | None = None,
    fs_capacity: int | None = None,
    fs_dir: str | None = None,
    fs_policy: str | None = None,
    trace_name: str = "trace",
    progress: bool = False,
) -> dict[str, Any]:
    """Replay ``requests`` at each capacity with each policy; the report ``--json`` writes."""
    shape = shape or ModelShape()
    block_bytes = shape.block_bytes
    keys = trace_keys(requests)
    ids = [r.hash_ids for r in requests]
    total = sum(len(k) for k in keys)
    # MIN and the reuse oracle cost about half a replay per capacity: so on the bar.
    min_work = max(1, len(requests) // 2)
    bar = Progress((len(requests) * len(policies) + min_work) * len(capacities), progress)
    uses = next_uses(ids)
    opts = []
    oracle = []
    for cap in capacities:
        opts.append(optimum(ids, cap, uses))
        oracle.append(reuse_oracle(ids, cap, uses))
        bar.advance(min_work, f"optimum and reuse oracle at {cap:,}")
    rows: dict[str, dict[str, list[Any]]] = {}
    kvtier_names = set(kvtier_policies())
    for name in policies:
        row: dict[str, list[Any]] = {
            k: []
            for k in (
                "served",
                "served_host",
                "served_fs",
                "host_written_per_served",
                "fs_written_per_served",
                "vs_optimum",
                "store_refused",
                "fs_writes_dropped",
            )
        }
        for cap in capacities:
            label = f"{name} at {cap:,}"
            if name in kvtier_names:
                ctx = kvtier_manager(name, cap, fs_capacity, fs_dir, fs_policy)
            else:
                ctx = vllm_manager(name, cap)
            with ctx as manager:
                st = replay(manager, keys, on_progress=functools.partial(_advance, bar, label))
            served = st.served
            row["served"].append(served / total if total else 0.0)
            row["served_host"].append(st.served_host / total if total else 0.0)
            row["served_fs"].append(st.served_fs / total if total else 0.0)
            row["host_written_per_served"].append(
                st.host_written * block_bytes / served if served else None
            )
            row["fs_written_per_served"].append(
                st.fs_written * block_bytes / served
                if served and fs_capacity and name in kvtier_names
                else None
            )
            opt = opts[len(row["vs_optimum"])].served
            row["vs_optimum"].append(served / opt if opt else None)
            row["store_refused"].append(st.store_refused)
            row["fs_writes_dropped"].append(st.fs_dropped)
        rows[name] = row
    return {
        "trace": trace_name,
        "requests": len(requests),
        "prompt_blocks": total,
        "distinct_blocks": len({b for r in ids for b in r}),
        "block_tokens": shape.tokens,
        "bytes_per_block": block_bytes,
        "model_shape": dataclasses.asdict(shape),
        "fs_capacity": fs_capacity,
        "fs_policy": fs_policy,
        "capacities": list(capacities),
        "optimum": [o.served / total if total else 0.0 for o in opts],
        "optimum_bound": [o.bound / total if total else 0.0 for o in opts],
        "reuse_oracle": [n / total if total else 0.0 for n in oracle],
        "policies": rows,
    }
